"""The chaos harness's checker: what the effects file, the producers' acks and the ledger say.

:mod:`hybridq.testing.chaos` runs the system under faults; this module reads what happened (each
run's start and end from the file the jobs write, each acknowledged job from the producers'
files, the jobs failed for good from the ledger) and judges it against the guarantees: an
acknowledged job never lost, a finished job never run again unless a fault of the documented
kind explains it (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridq.testing.topology import Fault

if TYPE_CHECKING:
    from hybridq.testing.chaos import ChaosConfig

#: Fault name -> the docs/reliability.md scenario it belongs to.
FAULTS: dict[str, str] = {
    "producer-kill": "S1",
    "producer-crash": "S2",
    "forwarder-kill": "S8",
    "worker-kill": "S9",
    "horse-kill": "S9",
    "redis-restart": "S10",
    "flushall": "S11",
    "evict": "S11",
    "redis-outage": "S12",
    "redis-sigstop": "S12",
    "client-pause": "S12",
    "net-latency": "NET",
    "net-reset": "NET",
    "net-blackhole": "NET",
    "net-cut": "NET",
}
#: Faults after which Redis no longer holds what it held: stored outcomes may be gone.
DATA_LOSS = frozenset({"redis-restart", "flushall", "evict", "redis-outage"})
#: Faults during which the workers cannot reach Redis: a run that ends meanwhile cannot store its
#: outcome until they can, and may be delivered again first (after its lease lapsed).
UNREACHABLE = frozenset({"redis-sigstop", "client-pause", "net-blackhole"})
#: A run that ended this long after such a fault may still have been waiting to store its outcome.
UNREACHABLE_SLACK_S = 3.0
#: Faults that kill processes running jobs.
KILLS = frozenset({"worker-kill", "horse-kill"})
#: A process killed this soon after its task returned may not have stored the outcome yet.
KILL_WINDOW_S = 1.0


@dataclass
class FaultStats:
    """Figures for one fault class."""

    name: str
    injected: int = 0
    accepted: int = 0
    lost: int = 0
    reruns: int = 0
    dup_execution: int = 0
    max_redelivery_s: float = 0.0

    def line(self) -> str:
        """The figure line."""
        return (
            f"{FAULTS.get(self.name, '--'):<3} {self.name:<15} injected={self.injected} "
            f"accepted={self.accepted} lost={self.lost} dup_delivery={self.reruns} "
            f"dup_execution={self.dup_execution} max_redelivery_s={self.max_redelivery_s:.2f}"
        )


@dataclass
class ChaosResult:
    """The verdict of one run."""

    seed: int
    accepted: int
    lost: int
    dup_delivery: int
    dup_execution: int
    max_redelivery_s: float
    #: Acknowledgement to first start, p50 / p99 / max (the backlog the workers had to catch up).
    wait_s: tuple[float, float, float]
    #: Of the runs repeated because Redis lost their stored outcome: how long before the loss
    #: the oldest of them had ended (how far behind the ledger was).
    max_outcome_age_s: float
    duplicates_suppressed: int
    unacknowledged_ran: int
    #: Runs cut off mid-task in a process no fault killed (and run again): should be 0.
    unexplained_interruptions: int
    per_fault: dict[str, FaultStats]
    lost_tokens: list[str]
    #: Jobs hybridq reports failed for good (token -> error): none of the harness's jobs should.
    failed: dict[str, str]
    violations: list[str]
    seconds: float
    directory: str
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No loss, no unexcused re-execution, no job failed for good."""
        return self.lost == 0 and self.dup_execution == 0 and not self.failed

    def total_line(self) -> str:
        """The total figure line."""
        return (
            f"TOTAL accepted={self.accepted} lost={self.lost} failed={len(self.failed)} "
            f"dup_delivery={self.dup_delivery} "
            f"dup_execution={self.dup_execution} max_redelivery_s={self.max_redelivery_s:.2f}"
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON report (``--report``)."""
        return {
            "seed": self.seed,
            "ok": self.ok,
            "accepted": self.accepted,
            "lost": self.lost,
            "dup_delivery": self.dup_delivery,
            "dup_execution": self.dup_execution,
            "max_redelivery_s": round(self.max_redelivery_s, 3),
            "max_outcome_age_s": round(self.max_outcome_age_s, 3),
            "wait_s": {
                "p50": round(self.wait_s[0], 3),
                "p99": round(self.wait_s[1], 3),
                "max": round(self.wait_s[2], 3),
            },
            "duplicates_suppressed": self.duplicates_suppressed,
            "unacknowledged_ran": self.unacknowledged_ran,
            "unexplained_interruptions": self.unexplained_interruptions,
            "faults": {
                name: {k: v for k, v in vars(s).items() if k != "name"} for name, s in self.per_fault.items()
            },
            "lost_tokens": self.lost_tokens[:100],
            "failed": dict(list(self.failed.items())[:100]),
            "violations": self.violations[:100],
            "seconds": round(self.seconds, 1),
            "directory": self.directory,
            "status": self.status,
        }


@dataclass(frozen=True, slots=True)
class Run:
    """One line of the effects file: a run of a job started, ended or failed as planned."""

    kind: str  # B (started), E (ended), F (failed as planned)
    attempt: int
    pid: int
    at: float


def read_runs(path: str) -> dict[str, list[Run]]:
    """Every job's runs in the effects file at ``path``, by token (none if it does not exist)."""
    out: dict[str, list[Run]] = defaultdict(list)
    with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 5:
                out[parts[1]].append(Run(parts[0], int(parts[2]), int(parts[3]), float(parts[4])))
    return out


def percentiles(values: list[float]) -> tuple[float, float, float]:
    """p50, p99 and max of ``values`` (zeros if empty)."""
    if not values:
        return (0.0, 0.0, 0.0)
    ordered = sorted(values)
    return (ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)], ordered[-1])


def failed_for_good(journal: str) -> dict[str, str]:
    """Jobs the ledger says failed for good: token -> error (a chaos job should never fail)."""
    from hybridq.ops.failures import failed_jobs  # noqa: PLC0415 - reads the journal

    out = {}
    for job in failed_jobs(journal):
        args = job.envelope.args if job.envelope is not None else ()
        token = str(args[1]) if len(args) > 1 else job.id
        out[token] = job.error or "?"
    return out


def read_acks(directory: str) -> dict[str, float]:
    """Every acknowledged token and when, from the producers' files in ``directory``."""
    out: dict[str, float] = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2:  # a producer killed mid-write leaves at most a torn last line
                    out[parts[0]] = float(parts[1])
    return out


def verdict(
    cfg: ChaosConfig,
    acked: dict[str, float],
    runs: dict[str, list[Run]],
    faults: list[Fault],
    status: dict[str, Any],
    failed: dict[str, str],
    root: str,
    seconds: float,
) -> ChaosResult:
    """The run's figures per fault class, and every loss or unexcused re-run it finds."""
    per = {name: FaultStats(name) for name in (*cfg.faults, "none")}
    for fault in faults:
        per[fault.name].injected += 1

    def latest_before(t: float) -> str:
        name = "none"
        for fault in faults:
            if fault.at > t:
                break
            name = fault.name
        return name

    killed = {pid: fault for fault in faults for pid in fault.pids if fault.name in KILLS}
    losses = [f for f in faults if f.name in DATA_LOSS]
    outages = [f for f in faults if f.name in UNREACHABLE]
    violations: list[str] = []
    lost_tokens = []
    reruns = dup_execution = unexplained = 0
    max_redelivery = max_age = 0.0
    for token, at in acked.items():
        stats = per[latest_before(at)]
        stats.accepted += 1
        if not any(r.kind == "E" for r in runs.get(token, ())) and token not in failed:
            stats.lost += 1
            lost_tokens.append(token)
    for token, token_runs in runs.items():
        starts = sorted((r for r in token_runs if r.kind == "B"), key=lambda r: r.at)
        ends = [r for r in token_runs if r.kind in "EF"]
        for prev, run in itertools.pairwise(starts):
            prev_end = next(
                (e for e in ends if e.pid == prev.pid and e.attempt == prev.attempt and e.at >= prev.at), None
            )
            if prev_end is not None and prev_end.kind == "F" and run.attempt > prev.attempt:
                continue  # the retry of a planned failure
            reruns += 1
            cause: Fault | None
            if prev_end is None:
                # Interrupted mid-task: it never finished, so running it again is the guarantee at work.
                cause = killed.get(prev.pid)
                if cause is None:
                    unexplained += 1
            else:
                cause = excuse(prev, prev_end, run, killed, losses, outages, cfg.window_s)
                if cause is None:
                    dup_execution += 1
                    per[latest_before(run.at)].dup_execution += 1
                    violations.append(
                        f"{token} attempt {run.attempt} ran again at {run.at:.3f} (pid {run.pid}) after "
                        f"attempt {prev.attempt} ended at {prev_end.at:.3f} (pid {prev.pid})"
                    )
                    continue
                if cause.name in DATA_LOSS:
                    max_age = max(max_age, cause.at - prev_end.at)
            stats = per[cause.name if cause is not None else latest_before(run.at)]
            stats.reruns += 1
            if cause is not None:
                delay = run.at - cause.at
                stats.max_redelivery_s = max(stats.max_redelivery_s, delay)
                max_redelivery = max(max_redelivery, delay)
    suppressed = int(status.get("duplicates_suppressed", 0))
    return ChaosResult(
        seed=cfg.seed,
        accepted=len(acked),
        lost=len(lost_tokens),
        dup_delivery=reruns + suppressed,
        dup_execution=dup_execution,
        max_redelivery_s=max_redelivery,
        max_outcome_age_s=max_age,
        wait_s=percentiles(
            [min(r.at for r in runs[t] if r.kind == "B") - at for t, at in acked.items() if runs.get(t)]
        ),
        duplicates_suppressed=suppressed,
        unacknowledged_ran=len(set(runs) - set(acked)),
        unexplained_interruptions=unexplained,
        per_fault={k: v for k, v in per.items() if v.injected or v.accepted or k != "none"},
        lost_tokens=sorted(lost_tokens),
        failed={token: failed[token] for token in sorted(failed)},
        violations=violations,
        seconds=seconds,
        directory=root,
        status={
            k: status.get(k) for k in ("accepted", "succeeded", "failed", "pending", "duplicates_suppressed")
        },
    )


def excuse(
    prev: Run,
    prev_end: Run | None,
    run: Run,
    killed: dict[int, Fault],
    losses: list[Fault],
    outages: list[Fault],
    window_s: float,
) -> Fault | None:
    """The fault that explains ``run`` starting again after ``prev``, or ``None``."""
    kill = killed.get(prev.pid)
    if (
        kill is not None
        and kill.at >= prev.at
        and (prev_end is None or kill.at - prev_end.at < KILL_WINDOW_S)
    ):
        return kill  # killed mid-run, or after the task returned and before its outcome was stored
    ended = prev_end.at if prev_end is not None else prev.at
    for loss in losses:
        # Redis lost the stored outcome before the forwarder's ledger had it.
        if ended - 1.0 <= loss.end and loss.at - ended <= window_s and loss.at <= run.at:
            return loss
    for outage in outages:
        # It ended while the workers could not reach Redis: its outcome waited to be stored, and
        # its lease lapsed meanwhile (the documented window of a Redis outage).
        if outage.at - 0.5 <= ended <= outage.end + UNREACHABLE_SLACK_S and outage.at <= run.at:
            return outage
    return None
