"""A producer SIGKILLed mid group commit, its calls mixing delayed and immediate jobs (issue 29).

A group commit of ``enqueue_many_async`` calls is two appends when some calls are delayed past
``DELAYED_CHAIN_S`` (the process's delayed chain) and others are not (its main chain). The child
reports each call's job ids only after the call returned (acknowledged); the parent kills it at a
random moment, several times. Between two kills a forwarder runs the immediate jobs (so it
checkpoints and compacts while delayed jobs wait); at the end one runs with its clock two hours
ahead: every acknowledged job runs exactly once, and nothing runs twice.
"""

from __future__ import annotations

import os
import random
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from hybridq.forwarder.loop import Forwarder
from hybridq.ops.status import collect_status
from hybridq.transport import MemoryTransport

from tests.conftest import PYTHON
from tests.support.processes import kill_when_ready

CYCLES = 6

CHILD = textwrap.dedent(
    """
    import asyncio, os, random, sys
    from hybridq import Queue
    from hybridq.producer import writers

    writers.DEFAULT_MAX_SEGMENT_BYTES = 64 << 10  # the main chain's segments sealed, then compacted
    journal, seed, kinds = sys.argv[1:4]
    queue = Queue(journal=journal)
    rng = random.Random(seed)

    async def produce(t):
        k = 0
        while True:
            kind, n = rng.choice(kinds.split(",")), rng.choice((1, 1, 3))
            envs = [
                queue.prepare("tests.tasks.add", (t, k + i), delay=3600 if kind == "later" or (kind == "mixed" and i % 2) else None)
                for i in range(n)
            ]
            k += n
            jobs = await queue.enqueue_many_async(envs)
            os.write(1, "".join(f"{job.id}\\n" for job in jobs).encode())  # acknowledged

    async def main():
        tasks = [asyncio.create_task(produce(t)) for t in range(8)]
        os.write(2, b"ready\\n")
        await asyncio.gather(*tasks)

    asyncio.run(main())
    """
)


def run_cycle(journal: Path, env: dict[str, str], rng: random.Random, cycle: int, logs: Path) -> set[str]:
    # Every other child without mixed calls: its main chain's segments pinned by no delayed job.
    kinds = "now,later,mixed" if cycle % 2 else "now,later"
    argv = [PYTHON, "-c", CHILD, str(journal), str(rng.random()), kinds]
    text = kill_when_ready(argv, env, logs, cycle, rng.uniform(0.05, 0.4))
    return set(text.split("\n")[:-1])  # a line cut by the kill has no newline


def drain(
    journal: Path, transport: MemoryTransport, clock: Callable[[], float], seed: int, *, leave_held: bool
) -> None:
    """Run a forwarder until nothing is pending (``leave_held``: but the delayed jobs it holds)."""
    with Forwarder(journal, transport, reconcile_interval_s=3600.0, clock=clock) as forwarder:
        completions = forwarder.completions
        assert completions is not None
        deadline = time.monotonic() + 300
        while (status := collect_status(str(journal)))["pending"] > status["delayed_held"] * leave_held:
            assert time.monotonic() < deadline, f"seed={seed}: jobs left pending"
            forwarder.step()
            transport.work()
            completions.hurry(reconcile=False)
            completions.compactor.hurry()
            forwarder.step()


def test_every_acknowledged_job_runs_once_after_kills_mid_group_commit(
    tmp_path: Path, subprocess_env: dict[str, str], figures
) -> None:
    seed = int(os.environ.get("HYBRIDQ_DCHAIN_SEED") or int.from_bytes(os.urandom(4), "little"))
    rng = random.Random(seed)
    journal, logs = tmp_path / "journal", tmp_path / "logs"
    logs.mkdir()
    acked: set[str] = set()
    transport = MemoryTransport()  # one Redis for every forwarder below
    deleted = 0  # journal segments compacted between kills
    for cycle in range(CYCLES):
        acked |= run_cycle(journal, subprocess_env, rng, cycle, logs)
        # Between two kills, a forwarder at the real time: the immediate jobs run, and their
        # finished segments are checkpointed past and compacted while the delayed ones wait.
        before = collect_status(str(journal))["journal"]["segments"]
        drain(journal, transport, time.time, seed, leave_held=True)
        deleted += max(0, before - collect_status(str(journal))["journal"]["segments"])
    assert acked, f"seed={seed}: nothing acknowledged"
    # The point of draining between kills: compaction ran mid-test (review 2 L4).
    assert deleted, f"seed={seed}: no journal segment was compacted between kills"
    later = time.time() + 7200.0
    drain(journal, transport, lambda: later, seed, leave_held=False)
    missing = acked - set(transport.executions)
    assert not missing, f"seed={seed}: {len(missing)} acknowledged jobs never ran"
    twice = {job: n for job, n in transport.executions.items() if n != 1}
    assert not twice, f"seed={seed}: ran more than once: {twice}"
    figures(
        f"dchain kill seed={seed} cycles={CYCLES} acked={len(acked)} ran={len(transport.executions)}"
        f" segments_compacted_between_kills={deleted}"
    )
