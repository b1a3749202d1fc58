"""The torture tier's independent checker: the tasks' effects file and the ledger, nothing else.

:mod:`hybridq.testing.torture` drives the processes and the faults; this module judges the run
without asking hybridq anything. Its inputs:

* the **effects file**: every run of a job appends ``B`` when the task starts and ``E`` when it
  returns (job id, token, attempt, pid, time), one ``O_APPEND`` write each;
* the **acknowledgements**: the jobs whose ``enqueue()`` returned (job id, token, time);
* the **ledger**, read as the forwarder writes it (:class:`LedgerWatch` polls it a few times a
  second and notes when it first saw each job finished: no earlier than the forwarder wrote it).

It fails the run on:

a. a run that **started after the ledger held its job finished** (a ``B`` later than the time
   the watch first saw the job's ``done`` entry): the promise of docs/guarantees.md;
b. an **accepted job never run** to its end (no ``E`` line once the run has drained);
c. a pool that **stopped making progress**: jobs waiting and no ``E`` line for ``stall_s``.

Every repeated run is explained: *running when its lease was lost* (the repeat started before
the earlier run ended, or the earlier run never ended: its process was killed, or cut off);
*finished, not yet in the ledger* (the earlier run ended, and the ledger did not hold the job
finished when the repeat started: Redis lost the outcome before the forwarder harvested it).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from hybridq.journal import ChainPosition, JournalReader, RecordType
from hybridq.ledger.entries import Entry
from hybridq.ledger.store import ledger_dir
from hybridq.protocol import EntryKind

__all__ = ["EffectsTail", "LedgerWatch", "Progress", "Run", "Verdict", "judge", "read_runs"]

#: How often the watch reads the ledger (seconds).
WATCH_S = 0.2


@dataclass(frozen=True, slots=True)
class Run:
    """One line of the effects file."""

    kind: str  # B (started), E (ended)
    job: str
    token: str
    attempt: int
    pid: int
    at: float


def read_runs(path: str) -> dict[str, list[Run]]:
    """The effects file's lines by job id, in file order."""
    out: dict[str, list[Run]] = defaultdict(list)
    with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 6:
                kind, job, token, attempt, pid, at = parts
                out[job].append(Run(kind, job, token, int(attempt), int(pid), float(at)))
    return out


class LedgerWatch:
    """Polls the ledger from a thread; :attr:`finished` says when each job was first seen done."""

    def __init__(self, journal: str) -> None:
        self.path = ledger_dir(journal)
        self.finished: dict[str, float] = {}
        self._since: dict[str, ChainPosition] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torture-ledger-watch", daemon=True)

    def start(self) -> None:
        """Start polling."""
        self._thread.start()

    def stop(self) -> None:
        """Poll once more, then stop."""
        self._stop.set()
        self._thread.join()
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(WATCH_S):
            self.poll()

    def poll(self) -> None:
        """Read what the ledger gained since the last poll (all of it, after a compaction)."""
        if not os.path.isdir(self.path):
            return
        reader = JournalReader(self.path)
        done: list[str] = []
        try:
            for record in reader.records(since=self._since):
                if record.rtype != RecordType.DATA:
                    continue
                entry = Entry.from_bytes(record.payload)
                if entry.kind == EntryKind.DONE:
                    done.append(entry.job_id)
            self._since = dict(reader.position)
        except Exception:  # a segment compacted away under the reader: read it all again next time
            self._since = None
        seen = time.time()  # after the read: every entry read was written before now
        for job in done:
            self.finished.setdefault(job, seen)


@dataclass
class Verdict:
    """The checker's findings."""

    accepted: int = 0
    runs: int = 0
    #: Runs beyond the first of a job, by the reason that explains them.
    repeats: dict[str, int] = field(default_factory=dict)
    #: (a) Runs that started after the ledger held their job finished.
    after_finished: list[str] = field(default_factory=list)
    #: (b) Accepted jobs that never ran to their end.
    never_ran: list[str] = field(default_factory=list)
    #: (c) Stretches with jobs waiting and no run ending.
    stalls: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No run after the ledger's finish, no job never run, no stall."""
        return not (self.after_finished or self.never_ran or self.stalls)


def judge(acked: Iterable[str], runs: dict[str, list[Run]], finished: dict[str, float]) -> Verdict:
    """The verdict on a drained run (stalls are noted while it runs: :class:`Progress`)."""
    verdict = Verdict()
    acked = list(acked)
    verdict.accepted = len(acked)
    for job in acked:
        if not any(r.kind == "E" for r in runs.get(job, ())):
            verdict.never_ran.append(job)
    repeats: dict[str, int] = defaultdict(int)
    for job, lines in runs.items():
        starts = sorted((r for r in lines if r.kind == "B"), key=lambda r: r.at)
        ends = [r for r in lines if r.kind == "E"]
        verdict.runs += len(starts)
        seen_done = finished.get(job)
        for start in starts:
            if seen_done is not None and start.at > seen_done:
                verdict.after_finished.append(
                    f"job {job} ({start.token}) started at {start.at:.3f} in pid {start.pid}, after the "
                    f"ledger held it finished (seen at {seen_done:.3f})"
                )
        for prev, start in itertools.pairwise(starts):
            prev_end = next((e for e in ends if e.pid == prev.pid and prev.at <= e.at), None)
            if prev_end is None or prev_end.at > start.at:
                repeats["running when its lease was lost (or its process killed)"] += 1
            else:
                repeats["finished, not yet in the ledger when Redis lost its outcome"] += 1
    verdict.repeats = dict(repeats)
    return verdict


class EffectsTail:
    """The jobs the effects file says ended, read incrementally (the harness asks every second)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.ended: set[str] = set()
        self._offset = 0

    def poll(self) -> set[str]:
        """Read the lines written since the last poll; the jobs ended so far."""
        with contextlib.suppress(FileNotFoundError), open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
            whole = data.rfind(b"\n") + 1  # a line being written is read next time
            self._offset += whole
            for line in data[:whole].split(b"\n"):
                if line.startswith(b"E "):
                    self.ended.add(line.split()[1].decode())
        return self.ended


class Progress:
    """(c): notes a stall when jobs wait and no run ends for ``stall_s`` (checked while running)."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.ended = 0
        self.last = time.monotonic()
        self.stalls: list[str] = []
        self._in_stall = False

    def check(self, ended: int, waiting: int) -> None:
        """``ended``: E lines so far; ``waiting``: accepted jobs without one."""
        now = time.monotonic()
        if ended > self.ended or waiting == 0:
            self.ended, self.last, self._in_stall = ended, now, False
            return
        if now - self.last > self.stall_s and not self._in_stall:
            self._in_stall = True
            self.stalls.append(f"{waiting} job(s) waiting and none ended for {now - self.last:.0f} s")
