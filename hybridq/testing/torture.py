"""The pool worker's torture tier (issue 26): faults aimed at claims taken ahead, judged from outside.

``python -m hybridq.testing.torture`` (``scripts/torture``; a short seeded run is
``tests/integration/test_torture.py``, in the default test run) runs, on this machine:

* a Redis master with a replica that lags (its link goes through a fault proxy adding latency);
* ``hybridq forward`` and two pools (``hybridq worker``, one process each; pool A imports
  :mod:`hybridq.testing.ahead`, so it takes jobs ahead of its threads whatever runs), each
  reaching Redis through a fault proxy of its own;
* a producer enqueueing jobs at a steady rate: quick ones, 20-200 ms of I/O, 1-4 s ones, and
  tasks that hold the GIL for one to three leases (a C call through ``ctypes.PyDLL``).

While they run, a seeded schedule injects, one at a time:

================  ======================================================================
snapshot-restart  ``SAVE``, then SIGKILL the master and start it from that dump (older state)
cut-off           one pool's proxy moves no bytes for 1.5-3 leases (its host cut off)
warm-stop         a burst of quick jobs, then SIGTERM to a pool (restarted once it exits)
hard-stop         a burst, then SIGKILL to a pool and its processes (restarted)
burst             hundreds of quick jobs at once (take-ahead backlogs)
promote           SIGKILL the master; the lagging replica is promoted, every client moved to it
================  ======================================================================

:mod:`hybridq.testing.torture_check` judges the run from the tasks' effects file, the
acknowledgements and the ledger alone: a run that started after the ledger held its job
finished, an accepted job never run, or a stall fails it. Every repeated run is explained.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridq.testing.faultproxy import FaultProxy
from hybridq.testing.torture_check import LedgerWatch, Progress, Verdict, judge, read_runs
from hybridq.testing.torture_stack import HarnessError, Stack, post_mortem, task

__all__ = ["FAULTS", "TortureConfig", "TortureResult", "main", "run_torture", "task"]  # task: the job

FAULTS = ("snapshot-restart", "cut-off", "warm-stop", "hard-stop", "burst", "promote")


@dataclass(frozen=True)
class TortureConfig:
    """What to run (``python -m hybridq.testing.torture --help``)."""

    duration_s: float = 60.0
    seed: int = 0
    faults: tuple[str, ...] = FAULTS
    #: The forwarder's lease (seconds).
    lease_s: float = 2.0
    #: Jobs per second from the producer (bursts come on top).
    rate: float = 6.0
    threads: int = 4
    #: Seconds between the end of one fault and the next (drawn from [gap/2, gap*3/2]).
    gap_s: float = 5.0
    #: After the faults, how long the drain may go without a job ending.
    drain_s: float = 120.0
    #: (c): jobs waiting and none ending for this long fails the run.
    stall_s: float = 60.0
    directory: str | None = None


@dataclass
class TortureResult:
    """The verdict and the figures of one run."""

    seed: int
    verdict: Verdict
    faults: dict[str, int]
    seconds: float
    directory: str
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """What the checker says."""
        return self.verdict.ok

    def lines(self) -> list[str]:
        """The figure lines."""
        v = self.verdict
        repeats = sum(v.repeats.values())
        out = [
            "faults: " + " ".join(f"{name}={n}" for name, n in self.faults.items()),
            (
                f"accepted={v.accepted} runs={v.runs} repeated_runs={repeats} "
                f"after_finished={len(v.after_finished)} never_ran={len(v.never_ran)} "
                f"stalls={len(v.stalls)}"
            ),
        ]
        out += [f"repeated ({n}): {why}" for why, n in sorted(v.repeats.items())]
        out += [f"VIOLATION (a) {x}" for x in v.after_finished[:20]]
        out += [f"VIOLATION (b) job {x} never ran to its end" for x in v.never_ran[:20]]
        out += [f"VIOLATION (c) {x}" for x in v.stalls[:20]]
        return out

    def to_json(self) -> dict[str, Any]:
        """The JSON report."""
        v = self.verdict
        return {
            "seed": self.seed,
            "ok": self.ok,
            "seconds": round(self.seconds, 1),
            "faults": self.faults,
            "accepted": v.accepted,
            "runs": v.runs,
            "repeats": v.repeats,
            "after_finished": v.after_finished[:100],
            "never_ran": v.never_ran[:100],
            "stalls": v.stalls,
            "directory": self.directory,
        }


def run_torture(cfg: TortureConfig, *, say: Callable[[str], None] = print) -> TortureResult:
    """Run the tier (module docstring); its verdict."""
    unknown = sorted(set(cfg.faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    started = time.monotonic()
    root = cfg.directory or tempfile.mkdtemp(prefix="hybridq-torture-")
    os.makedirs(root, exist_ok=True)
    rng = random.Random(cfg.seed)  # noqa: S311 - a replayable schedule
    stack = Stack(cfg, root, say)
    watch = LedgerWatch(stack.journal)
    progress = Progress(cfg.stall_s)
    counts = dict.fromkeys(cfg.faults, 0)
    try:
        stack.start()
        watch.start()
        say(f"torture directory: {root}")
        _serve(stack, cfg, rng, counts, progress, started, say)
        say(f"faults over: {len(stack.acked)} jobs acknowledged; draining")
        _drain(stack, cfg, progress)
        time.sleep(cfg.lease_s * 2)  # a late repeat shows itself
        post_mortem(stack)
    finally:
        watch.stop()
        stack.close()
    runs = read_runs(stack.effects)
    verdict = judge(stack.acked, runs, watch.finished)
    verdict.stalls = progress.stalls
    result = TortureResult(cfg.seed, verdict, counts, time.monotonic() - started, root)
    with open(os.path.join(root, "faults.json"), "w", encoding="utf-8") as f:
        json.dump(counts, f)
    return result


def _serve(
    stack: Stack,
    cfg: TortureConfig,
    rng: random.Random,
    counts: dict[str, int],
    progress: Progress,
    started: float,
    say: Callable[[str], None],
) -> None:
    end = time.monotonic() + cfg.duration_s
    next_job = time.monotonic()
    next_fault = time.monotonic() + rng.uniform(cfg.gap_s / 2, cfg.gap_s * 1.5)
    schedule: list[str] = []
    cut: tuple[FaultProxy, float] | None = None
    while time.monotonic() < end:
        now = time.monotonic()
        stack.keep_alive()
        _check(stack, progress)
        if now >= next_job:
            stack.enqueue(rng)
            next_job += rng.expovariate(cfg.rate)
        if cut is not None and now >= cut[1]:
            cut[0].blackhole(on=False)
            cut[0].reset()
            cut = None
            next_fault = now + rng.uniform(cfg.gap_s / 2, cfg.gap_s * 1.5)
        if cut is None and cfg.faults and now >= next_fault:
            if not schedule:
                schedule = rng.sample(cfg.faults, len(cfg.faults))
            name = schedule.pop()
            counts[name] += 1
            say(f"[{now - started:6.1f}s] {name}")
            cut = _inject(stack, cfg, name, rng)
            next_fault = time.monotonic() + rng.uniform(cfg.gap_s / 2, cfg.gap_s * 1.5)
        time.sleep(0.02)
    if cut is not None:
        cut[0].blackhole(on=False)
        cut[0].reset()


def _inject(
    stack: Stack, cfg: TortureConfig, name: str, rng: random.Random
) -> tuple[FaultProxy, float] | None:
    """Inject ``name``; a cut-off returns its proxy and when to lift it."""
    pool = rng.randrange(len(stack.pools))
    if name == "snapshot-restart":
        stack.snapshot_restart(rng)
    elif name == "promote":
        stack.promote()
    elif name == "cut-off":
        proxy = stack.proxies[1 + pool]
        proxy.blackhole()
        return proxy, time.monotonic() + rng.uniform(1.5, 3.0) * cfg.lease_s
    elif name in ("warm-stop", "hard-stop"):
        stack.enqueue(rng, rng.randint(30, 120), quick=True)
        time.sleep(rng.uniform(0.1, 0.8))
        stack.stop_pool(pool, hard=name == "hard-stop")
    elif name == "burst":
        stack.enqueue(rng, rng.randint(100, 400), quick=True)
    return None


def _check(stack: Stack, progress: Progress) -> None:
    """(c), about once a second: the effects file read incrementally (the proxies share this GIL)."""
    now = time.monotonic()
    if now < stack.next_check:
        return
    stack.next_check = now + 1.0
    finished = stack.tail.poll()
    with stack.lock:
        waiting = sum(1 for job in stack.acked if job not in finished)
    progress.check(len(finished), waiting)


def _drain(stack: Stack, cfg: TortureConfig, progress: Progress) -> None:
    deadline = time.monotonic() + cfg.drain_s
    done = -1
    while time.monotonic() < deadline:
        stack.keep_alive()
        ended = stack.tail.poll()
        finished = sum(1 for job in stack.acked if job in ended)
        progress.check(finished, len(stack.acked) - finished)
        if finished == len(stack.acked):
            return
        if finished > done:
            done, deadline = finished, time.monotonic() + cfg.drain_s
        time.sleep(0.5)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """``python -m hybridq.testing.torture``: run, print the figure lines; exit 1 on a violation.

    Exit 2 if the harness could not set up a fault (:class:`HarnessError`): no verdict.
    """
    parser = argparse.ArgumentParser(
        prog="python -m hybridq.testing.torture", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of faults (default 60)")
    parser.add_argument(
        "--seed", type=int, default=None, help="the schedule's seed (default: random, printed)"
    )
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated (default: all)")
    parser.add_argument("--rate", type=float, default=6.0, help="jobs per second, bursts aside (default 6)")
    parser.add_argument("--report", default=None, help="write the JSON report here")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory when it passes")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    cfg = TortureConfig(
        duration_s=args.duration,
        seed=seed,
        faults=tuple(f for f in args.faults.split(",") if f),
        rate=args.rate,
    )
    _say(f"torture: seed={seed} (replay: --seed {seed} --duration {args.duration:g})")
    try:
        result = run_torture(cfg, say=_say)
    except HarnessError as exc:
        _say(f"HARNESS FAILURE seed={seed}: {exc} (no verdict on hybridq: run it again)")
        return 2
    for line in result.lines():
        _say(line)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(result.to_json(), f, indent=2)
    if result.ok:
        _say(
            f"OK seed={seed}: no run after the ledger's finish, none lost, no stall ({result.seconds:.0f} s)"
        )
        if not args.keep:
            shutil.rmtree(result.directory, ignore_errors=True)
        return 0
    _say(f"FAILED seed={seed}: the run's files are in {result.directory}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
