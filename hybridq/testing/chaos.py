"""``hybridq chaos``: the fault-injection harness that checks hybridq's guarantees end to end.

Why it is over 450 lines: the run, the verdict and the command read the same effects, acks and
fault files and change together; the processes it drives are in :mod:`hybridq.testing.topology`.

It runs a real topology on this machine, from one temporary directory: a private
``redis-server`` with no persistence, ``hybridq forward``, N workers (``hybridq worker`` and
plain ``rq worker`` processes, alternating, both forking a work-horse per job) and M producer
processes that enqueue jobs at a steady rate. While they run, a seeded schedule injects the
faults of docs/reliability.md, one at a time:

====  ==================  ======================================================================
S1    producer-kill       SIGKILL a producer; it is restarted
S2    producer-crash      restart a producer armed to SIGKILL itself at a named journal step
S8    forwarder-kill      SIGKILL the forwarder; restarted after up to a second
S9    worker-kill         SIGKILL a worker and its work-horse; restarted (a supervisor's job)
S9    horse-kill          SIGKILL only a work-horse, mid-job
S10   redis-restart       SIGKILL redis-server and start it again, empty
S11   flushall            ``FLUSHALL``
S11   evict               ``maxmemory`` at the current usage with ``allkeys-lru``, for seconds
S12   redis-outage        stop redis-server for seconds; it comes back empty
S12   redis-sigstop       SIGSTOP redis-server for seconds, then SIGCONT
S12   client-pause        ``CLIENT PAUSE`` for seconds
NET   net-latency         20-200 ms each way between the clients and Redis, for seconds
NET   net-reset           reset every connection between the clients and Redis
NET   net-blackhole       move no bytes between the clients and Redis for 1-6 s
NET   net-cut             let Redis run a few commands but cut the connection before the reply
====  ==================  ======================================================================

The forwarder and the workers reach Redis through :class:`hybridq.testing.faultproxy.FaultProxy` when
a ``net-*`` fault is selected; the harness itself talks to Redis directly.

Every job runs :func:`task`, which appends a line to an effects file at its start and at its
end (``B``/``E``, with the attempt, pid and time); producers append every job they got an
acknowledgement for to an acks file. The verdict is computed from those two files and the fault
log, not from hybridq's counts:

- **lost**: acknowledged, and no ``E`` line at the end (after a drain period);
- **dup_execution**: the task started again after a run of the same attempt had ended, and no
  fault can excuse it. Excused are: a run whose process was killed (its outcome was never
  stored), and a run that ended at most ``window`` seconds before Redis lost its data (the
  outcome was in Redis and not yet in the forwarder's ledger: the documented window of
  docs/guarantees.md). A job that was finished longer before the data loss must not run again;
- **dup_delivery**: runs beyond the first per attempt, plus the duplicate deliveries the workers
  suppressed (from ``hybridq status``);
- **max_redelivery_s**: from a fault to the re-run of a job it interrupted.

The command exits 1 on any loss or unexcused re-execution, and prints the seed to replay it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridq.context import current_job
from hybridq.envelope.model import Retry
from hybridq.testing.chaos_check import (
    FAULTS,
    ChaosResult,
    failed_for_good,
    read_acks,
    read_runs,
    verdict,
)
from hybridq.testing.topology import QUEUE, Fault, Topology, children_of

__all__ = [
    "FAULTS",
    "ChaosConfig",
    "ChaosResult",
    "children_of",
    "run_chaos",
    "task",
]


class PlannedFailure(Exception):
    """Raised by :func:`task` on the first attempt of a job planned to fail once."""


def task(effects: str, token: str, fail_first: bool = False, sleep_s: float = 0.0) -> str:
    """The chaos job: note its start and end in ``effects`` (one ``O_APPEND`` write each)."""
    job = current_job()
    attempt = job.attempt if job is not None else 0
    _note(effects, "B", token, attempt)
    if sleep_s > 0:
        time.sleep(sleep_s)
    if fail_first and attempt <= 1:
        _note(effects, "F", token, attempt)
        raise PlannedFailure(f"{token}: planned failure on the first attempt")
    _note(effects, "E", token, attempt)
    return token


def _note(path: str, kind: str, token: str, attempt: int) -> None:
    line = f"{kind} {token} {attempt} {os.getpid()} {time.time():.6f}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line)  # one write under PIPE_BUF on an O_APPEND file: lines never interleave
    finally:
        os.close(fd)


# -- producer processes --------------------------------------------------------------------------


def produce_main(argv: Sequence[str]) -> None:
    """A producer process: ``journal acks effects name rate seed``; runs until killed."""
    from hybridq.producer.queue import Queue  # noqa: PLC0415 - only producer processes need it

    journal, acks, effects, name, rate, seed = argv
    rng = random.Random(seed)  # noqa: S311 - a test schedule, not a secret
    queue = Queue(QUEUE, journal)
    period = 1.0 / float(rate)
    n = 0
    next_at = time.monotonic()
    while True:
        batch = rng.randint(2, 8) if rng.random() < 0.1 else 1
        tokens = [f"{name}.{n + i}" for i in range(batch)]
        n += batch
        calls = []
        for token in tokens:
            fail_first = rng.random() < 0.05
            options: dict[str, Any] = {"retry": Retry(3, backoff_s=0.5)} if fail_first else {}
            if rng.random() < 0.05:
                options["delay"] = rng.uniform(0.2, 2.0)
            calls.append((token, fail_first, round(rng.uniform(0.0, 0.03), 3), options))
        if batch == 1:
            token, fail_first, sleep_s, options = calls[0]
            queue.enqueue(task, effects, token, fail_first, sleep_s, **options)
        else:
            queue.enqueue_many([queue.prepare(task, (effects, t, f, s), **o) for t, f, s, o in calls])
        fd = os.open(acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, "".join(f"{t} {time.time():.6f}\n" for t in tokens).encode())
        finally:
            os.close(fd)
        next_at += period * batch
        time.sleep(max(0.0, next_at - time.monotonic()))


# -- configuration and result --------------------------------------------------------------------


@dataclass(frozen=True)
class ChaosConfig:
    """What to run (``hybridq chaos --help`` documents each)."""

    duration_s: float = 60.0
    seed: int = 0
    faults: tuple[str, ...] = tuple(FAULTS)
    producers: int = 2
    workers: int = 3
    #: Jobs per second per producer.
    rate: float = 10.0
    #: Seconds between the end of one fault and the next one (drawn from [gap/2, gap*3/2]).
    gap_s: float = 3.0
    #: The forwarder's lease (``hybridq forward --lease``).
    lease_s: float = 2.0
    #: After the last fault, how long the drain may go without one more job finishing before the
    #: jobs still unfinished are declared lost (a slow machine only drains more slowly).
    drain_s: float = 120.0
    #: A run that ended at most this long before Redis lost its data may run again (its outcome
    #: was in Redis, not yet in the ledger: the forwarder harvests many times a second).
    window_s: float = 3.0
    directory: str | None = None


# -- the run -------------------------------------------------------------------------------------


def run_chaos(cfg: ChaosConfig, *, say: Callable[[str], None] = print) -> ChaosResult:
    """Run the harness described in the module docstring and return its verdict."""
    unknown = sorted(set(cfg.faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    started = time.monotonic()
    root = cfg.directory or tempfile.mkdtemp(prefix="hybridq-chaos-")
    os.makedirs(root, exist_ok=True)
    rng = random.Random(cfg.seed)  # noqa: S311 - a replayable schedule, not a secret
    topo = Topology(cfg, root, say)
    faults: list[Fault] = []
    schedule: list[str] = []
    status: dict[str, Any] = {}
    try:
        topo.start()
        say(f"chaos directory: {root}")
        end = time.monotonic() + cfg.duration_s
        next_fault = time.monotonic() + rng.uniform(cfg.gap_s / 2, cfg.gap_s * 1.5)
        while time.monotonic() < end:
            topo.keep_alive()
            if cfg.faults and time.monotonic() >= next_fault:
                if not schedule:  # rounds of every fault in a seeded order: each class is covered
                    schedule = rng.sample(cfg.faults, len(cfg.faults))
                name = schedule.pop()
                fault = topo.inject(name, rng)
                faults.append(fault)
                _log_fault(root, fault)
                say(
                    f"[{time.monotonic() - started:6.1f}s] {FAULTS[name]} {name}"
                    + (f" (pids {', '.join(map(str, fault.pids))})" if fault.pids else "")
                    + (f" {fault.end - fault.at:.1f}s" if fault.end - fault.at >= 0.5 else "")
                )
                next_fault = time.monotonic() + rng.uniform(cfg.gap_s / 2, cfg.gap_s * 1.5)
            time.sleep(0.05)
        topo.stop_producers()
        acked = read_acks(topo.acks_dir)
        say(
            f"faults over: {len(acked)} jobs acknowledged; draining (until none is left, or "
            f"{cfg.drain_s:.0f} s pass without one finishing)"
        )
        status = _drain(topo, acked, cfg.drain_s)
        time.sleep(cfg.lease_s * 2)  # long enough for a late duplicate to show itself
        failed = failed_for_good(topo.journal)
        runs = read_runs(topo.effects)
        return verdict(cfg, acked, runs, faults, status, failed, root, time.monotonic() - started)
    finally:
        topo.close()


def _drain(topo: Topology, acked: dict[str, float], timeout_s: float) -> dict[str, Any]:
    from hybridq.ops.status import collect_status  # noqa: PLC0415 - reads the journal

    deadline = time.monotonic() + timeout_s
    done = -1
    while True:
        topo.keep_alive(producers=False)
        finished = {
            token for token, runs in read_runs(topo.effects).items() if any(r.kind == "E" for r in runs)
        }
        if finished.issuperset(acked):  # only then is the journal worth a scan
            status = collect_status(topo.journal)
            if status["pending"] == 0:
                return status
        if len(finished) > done:  # progress: the backlog is still draining
            done, deadline = len(finished), time.monotonic() + timeout_s
        elif time.monotonic() > deadline:
            return collect_status(topo.journal)
        time.sleep(0.5)


def _log_fault(root: str, fault: Fault) -> None:
    """Append ``fault`` to ``faults.jsonl`` in the run's directory (for a post-mortem)."""
    with open(os.path.join(root, "faults.jsonl"), "a", encoding="utf-8") as f:
        f.write(
            json.dumps({"fault": fault.name, "at": fault.at, "end": fault.end, "pids": fault.pids}) + "\n"
        )


# -- the command ---------------------------------------------------------------------------------


def main(
    cfg: ChaosConfig, *, echo: Callable[[str], None], report: str | None = None, keep: bool = False
) -> int:
    """Run, print the figure lines, and return the exit code (0 ok, 1 a guarantee broken)."""
    replay = (
        f"hybridq chaos --seed {cfg.seed} --duration {cfg.duration_s:g} --producers {cfg.producers} "
        f"--workers {cfg.workers} --rate {cfg.rate:g} --gap {cfg.gap_s:g} --lease {cfg.lease_s:g} "
        f"--faults {','.join(cfg.faults)}"
    )
    echo(f"hybridq chaos: seed={cfg.seed} (replay: {replay})")
    result = run_chaos(cfg, say=echo)
    for stats in result.per_fault.values():
        echo(stats.line())
    p50, p99, worst = result.wait_s
    echo(
        f"from acknowledgement to a worker starting the job: p50={p50:.2f} s p99={p99:.2f} s "
        f"max={worst:.2f} s (the backlog; a re-delivered job waits behind it too)"
    )
    echo(
        f"status (hybridq's own counts): succeeded={result.status.get('succeeded')} "
        f"failed={result.status.get('failed')} pending={result.status.get('pending')} "
        f"duplicates_suppressed={result.duplicates_suppressed}; re-runs after Redis lost an outcome "
        f"had ended at most {result.max_outcome_age_s:.2f} s before the loss; "
        f"jobs that ran without an acknowledgement (producer killed after the fsync)="
        f"{result.unacknowledged_ran}; runs cut off by no injected fault={result.unexplained_interruptions}"
    )
    echo(result.total_line())
    for violation in result.violations[:20]:
        echo(f"VIOLATION {violation}")
    for token, error in list(result.failed.items())[:20]:
        echo(f"FAILED-FOR-GOOD {token}: {error.strip().splitlines()[-1] if error.strip() else error}")
    if result.lost_tokens:
        echo(f"LOST {' '.join(result.lost_tokens[:20])}{' ...' if len(result.lost_tokens) > 20 else ''}")
    if report is not None:
        with open(report, "w", encoding="utf-8") as f:
            json.dump(result.to_json(), f, indent=2)
    if result.ok:
        echo(f"OK seed={cfg.seed}: nothing lost, no finished job ran again ({result.seconds:.0f} s)")
        if not keep and cfg.directory is None:
            shutil.rmtree(result.directory, ignore_errors=True)
        return 0
    echo(f"FAILED seed={cfg.seed}: replay with `{replay}`; processes' logs in {result.directory}")
    return 1
