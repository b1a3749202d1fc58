"""The completion ledger: durable outcomes, so Redis losing a result never re-runs a finished job.

The ledger is a second journal (same format, same crash safety) in ``<journal>/ledger/``. The
forwarder appends what workers report, with fsync, before it deletes the events from Redis
(docs/reliability.md rule 13); :func:`requeue` appends from any process. Records are JSON objects with
a kind ``t``:

* ``done`` -- the job at ``loc`` reached a terminal outcome (``succeeded``, ``failed`` out of
  attempts, or ``invalid``: a record that is not a job); ``dup`` marks a delivery that found the
  outcome already stored under its idempotency key and did not run the task.
* ``retry`` -- attempt ``attempt`` failed; the forwarder delivers attempt + 1 at ``run_at``. With
  ``lt`` (the job's RetryLaters so far) and ``ls`` (when the first was said), the run said
  ``RetryLater`` instead, or came after one: ``attempt`` numbers runs, and the job's own attempt
  is ``attempt - lt`` (a RetryLater uses none). ``done`` and ``retry`` entries name the worker
  process that ran the attempt (``w``, ``host/pid``), when it started (``st``) and the epoch
  generation its delivery was pushed under (``g``, left out while 0), where the event said
  (older records lack them).
* ``lost`` -- the worker running attempt ``attempt`` vanished (lease expired); delivered again.
* ``requeued`` -- a failed job was accepted again (under a new loc); it leaves the failed list.
* ``key`` -- the forwarder pushed (or held) the job at ``loc``, which has an explicit idempotency
  key ``k`` (its hash): the job owns the key, so a later job with the key is not pushed
  (docs/enqueue.md, "Enqueue-if-absent"). When the ledger segment holding it goes, the entry
  moves, with its outcome and the end of its window (``until``), to the **key store**
  (``<journal>/keys/``, the same format), which only the forwarder reads, when it starts.
* ``duplicate`` -- the job at ``loc`` has a key that a pending or finished job owns: never pushed.
  Once the owner is terminal, a ``done`` entry with ``dup_of`` (the owner's job id) settles it
  with the owner's outcome.
* ``cancel`` -- a cancel was asked for the job at ``loc`` (:mod:`hybridq.cancels`): it is never
  delivered again; a ``done`` entry with the outcome ``cancelled`` settles it (or the outcome its
  run reported, if it was running). Outcomes of one job rank ``succeeded`` > ``failed`` >
  ``cancelled``, whatever order they are read in: what a run really did beats the cancel.

Replaying the records in any order gives the same :class:`LedgerIndex` (a terminal outcome beats
everything, the highest attempt wins), because records of several chains have no global order.

Counters of compacted segments live in ``compaction.state`` (:class:`Compacted`), written before
any segment is deleted, so ``status`` totals survive compaction.

This module must not import redis or rq.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hybridq.errors import JournalCorruption, StateFileCorrupt
from hybridq.journal import JournalReader, JournalWriter, Record, RecordType
from hybridq.journal.paths import ensure_journal_dir
from hybridq.journal.reader import list_chains
from hybridq.journal.records import Loc
from hybridq.journal.statefile import read_state, write_state
from hybridq.limits import finite
from hybridq.protocol import CompletionEvent, EntryKind

__all__ = [
    "COMPACTION_NAME",
    "LEDGER_DIR",
    "AcceptedCounter",
    "Compacted",
    "Entry",
    "LedgerIndex",
    "consistent",
    "keys_dir",
    "ledger_dir",
    "load_compacted",
    "load_index",
    "open_keys_writer",
    "open_ledger_writer",
    "parse_event",
    "read_keys",
    "read_ledger",
    "save_compacted",
]

#: The ledger's directory, inside the journal directory.
LEDGER_DIR = "ledger"
#: The state file holding the counters of compacted segments.
COMPACTION_NAME = "compaction"
#: Ledger segments are small so that compaction frees space soon.
LEDGER_SEGMENT_BYTES = 4 << 20
#: The key store's directory, inside the journal directory, and its segment size.
KEYS_DIR = "keys"
KEYS_SEGMENT_BYTES = 1 << 20

Seg = tuple[str, int]
#: Which outcome of one job wins when several are recorded (see the module docstring).
_RANK = {"cancelled": 1, "failed": 2, "succeeded": 3}
_encode = json.JSONEncoder(separators=(",", ":")).encode
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Entry:
    """One ledger record."""

    kind: str  # an EntryKind: "done" | "retry" | "lost" | "requeued" | "key" | "duplicate" | "cancel"
    job_id: str
    loc: Loc
    outcome: str | None = None
    attempt: int = 1
    dup: bool = False
    error: str | None = None
    run_at: float | None = None
    at: float = 0.0
    queue: str | None = None
    #: The harvested event's id (a re-harvest after a crash is not counted twice).
    event_id: str | None = None
    #: The envelope of a job that failed for good, so it can be requeued after compaction.
    job: Mapping[str, Any] | None = None
    #: The job's RetryLaters so far (its runs that used no attempt), and when the first was said.
    later: int = 0
    later_since: float | None = None
    #: ``key`` and ``duplicate`` entries: the hash of the job's idempotency key (Envelope.key_id).
    key: str | None = None
    #: ``duplicate`` entries, and ``done`` entries settling one: the job id of the key's owner.
    dup_of: str | None = None
    #: ``key`` entries of a job whose segment is compacted: when the key may be forgotten.
    until: float | None = None
    #: ``done`` entries of a success: its return value, if the event carried it (``result_kept``),
    #: or the size of a result too large to carry (``result_bytes``); when the run started.
    result: Any = None
    result_kept: bool = False
    result_bytes: int | None = None
    started: float | None = None
    #: ``done`` and ``retry`` entries: the worker process that ran (or reported) the attempt
    #: (``host/pid``), if its event said (``w``; older records have none).
    worker: str | None = None
    #: ``done`` and ``retry`` entries: the epoch generation the run's delivery was pushed under
    #: (``g``, left out while 0): a higher one than an earlier run's means Redis lost its state.
    gen: int = 0

    def to_bytes(self) -> bytes:
        """Compact JSON, ``None`` fields left out."""
        # Field by field, with one encoder built once: the forwarder encodes one entry per
        # completion event (``json.dumps`` with options builds a new encoder per call).
        body: dict[str, Any] = {"t": self.kind, "id": self.job_id, "loc": list(self.loc), "n": self.attempt}
        if self.outcome is not None:
            body["o"] = self.outcome
        if self.error is not None:
            body["err"] = self.error
        if self.run_at is not None:
            body["run_at"] = self.run_at
        if self.queue is not None:
            body["q"] = self.queue
        if self.event_id is not None:
            body["ev"] = self.event_id
        if self.job is not None:
            body["job"] = self.job
        if self.key is not None:
            body["k"] = self.key
        if self.dup_of is not None:
            body["of"] = self.dup_of
        if self.until is not None:
            body["until"] = self.until
        if self.dup:
            body["dup"] = True
        if self.later:
            body["lt"] = self.later
            body["ls"] = self.later_since
        if self.result_kept:
            body["r"] = self.result
        if self.result_bytes is not None:
            body["rb"] = self.result_bytes
        if self.started is not None:
            body["st"] = self.started
        if self.worker is not None:
            body["w"] = self.worker
        if self.gen:
            body["g"] = self.gen
        body["at"] = self.at
        return _encode(body).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Entry:
        """Decode; raises ``ValueError`` (or ``KeyError``/``TypeError``) if it is not an entry."""
        body = json.loads(raw)
        writer, segment, offset = body["loc"]
        return cls(
            kind=str(body["t"]),
            job_id=str(body["id"]),
            loc=(str(writer), int(segment), int(offset)),
            outcome=body.get("o"),
            attempt=int(body.get("n", 1)),
            dup=bool(body.get("dup", False)),
            error=body.get("err"),
            run_at=body.get("run_at"),
            at=float(body.get("at", 0.0)),
            queue=body.get("q"),
            event_id=body.get("ev"),
            job=body.get("job"),
            later=int(body.get("lt", 0)),
            later_since=body.get("ls"),
            key=body.get("k"),
            dup_of=body.get("of"),
            until=body.get("until"),
            result=body.get("r"),
            result_kept="r" in body,
            result_bytes=body.get("rb"),
            started=body.get("st"),
            worker=body.get("w"),
            gen=int(body.get("g", 0)),
        )


def parse_event(event_id: str, body: Mapping[str, Any] | None, clock: Callable[[], float]) -> Entry:
    """The ledger entry a completion event stands for (``done`` or ``retry``).

    Raises:
        ValueError, TypeError, KeyError: the event is garbled (see :meth:`CompletionEvent.from_json`).
    """
    event = CompletionEvent.from_json(body)
    terminal = event.terminal
    return Entry(
        EntryKind.DONE if terminal else EntryKind.RETRY,
        event.id,
        event.loc,
        outcome=event.outcome if terminal else None,
        attempt=event.attempt,
        dup=event.dup,
        error=event.error,
        run_at=None if terminal else clock() + finite("retry_delay", event.retry_delay or 0.0),
        at=clock() if event.at is None else event.at,
        queue=event.queue,
        event_id=event_id,
        later=event.later,
        later_since=event.later_since,
        result=event.result if terminal else None,
        result_kept=event.result_kept and terminal,
        result_bytes=event.result_bytes if terminal else None,
        started=event.started,
        worker=event.worker,
        gen=event.gen,
    )


@dataclass
class LedgerIndex:
    """What the ledger says, in memory: which jobs are terminal, retries due, failures to list."""

    #: Per journal segment, offset -> terminal outcome of the job recorded there.
    terminal: dict[Seg, dict[int, str]] = field(default_factory=dict)
    #: Suppressed duplicate deliveries, per journal segment of the job they delivered.
    dups: dict[Seg, int] = field(default_factory=dict)
    #: Non-terminal jobs with a failed attempt: loc -> (run_at, attempt that failed).
    retries: dict[Loc, tuple[float, int]] = field(default_factory=dict)
    #: Non-terminal jobs whose worker vanished: loc -> (highest attempt lost, times lost).
    lost: dict[Loc, tuple[int, int]] = field(default_factory=dict)
    #: Non-terminal jobs that said RetryLater: loc -> (how many times, when first). A delivery
    #: carries them: the job's attempt is the run's minus them, the deadline counts from then.
    later: dict[Loc, tuple[int, float]] = field(default_factory=dict)
    #: Jobs that failed for good: loc -> their ``done`` entry (with the envelope).
    failed: dict[Loc, Entry] = field(default_factory=dict)
    requeued: set[Loc] = field(default_factory=set)
    #: Explicit idempotency keys (hashes) -> the ``key`` entry of the job that owns each.
    keys: dict[str, Entry] = field(default_factory=dict)
    #: Duplicates not settled yet (their key's owner is not terminal): loc -> ``duplicate`` entry.
    duplicates: dict[Loc, Entry] = field(default_factory=dict)
    #: The keys in :attr:`keys` whose window has an end (``until``), roughly oldest first.
    _windowed: dict[str, float] = field(default_factory=dict)
    #: Jobs in :attr:`terminal` (kept as a number so the forwarder can publish it cheaply).
    terminal_count: int = 0
    #: Running totals over :attr:`terminal` and :attr:`dups` (for metrics: no scan on a scrape).
    totals: dict[str, int] = field(
        default_factory=lambda: {"succeeded": 0, "failed": 0, "invalid": 0, "dups": 0, "cancelled": 0}
    )
    #: Ids of the events behind :attr:`dups`, per journal segment (a re-harvest after a crash
    #: must not count a duplicate twice; everything else in the index is idempotent already).
    _dup_events: dict[Seg, set[str]] = field(default_factory=dict)
    #: Jobs a cancel was asked for that are not terminal yet: loc -> their ``cancel`` entry.
    cancels: dict[Loc, Entry] = field(default_factory=dict)

    def is_terminal(self, loc: Loc) -> bool:
        """Whether the job at ``loc`` reached a terminal outcome."""
        done = self.terminal.get((loc[0], loc[1]))
        return done is not None and loc[2] in done

    def attempts(self, loc: Loc) -> int:
        """The highest attempt known to have started for the job at ``loc`` (0 if none)."""
        return max(self.retries.get(loc, (0.0, 0))[1], self.lost.get(loc, (0, 0))[0])

    def apply(self, entry: Entry) -> bool:
        """Fold one entry in; returns ``False`` if it changed nothing (a replayed event)."""
        loc, seg = entry.loc, (entry.loc[0], entry.loc[1])
        if entry.dup and entry.event_id is not None:
            seen = self._dup_events.setdefault(seg, set())
            if entry.event_id in seen:
                return False
            seen.add(entry.event_id)
        if entry.kind == EntryKind.REQUEUED:
            self.requeued.add(loc)
            self.failed.pop(loc, None)
            return True
        if entry.kind == EntryKind.KEY:
            return self._own_key(entry)
        if entry.kind == EntryKind.DUPLICATE:
            if self.is_terminal(loc):
                return False
            self.duplicates[loc] = entry
            return True
        if entry.kind == EntryKind.CANCEL:
            if self.is_terminal(loc) or loc in self.cancels:
                return False
            self.cancels[loc] = entry
            return True
        if entry.dup:
            self.dups[seg] = self.dups.get(seg, 0) + 1
            self.totals["dups"] += 1
        if entry.kind == EntryKind.DONE:
            done = self.terminal.setdefault(seg, {})
            if loc[2] in done:
                old, new = done[loc[2]], entry.outcome or "failed"
                if _RANK.get(new, 0) > _RANK.get(old, 0) > 0:
                    # A success beats a failure whatever the order the two were read in (the
                    # forwarder gave up on a lost worker that then reported after all), and
                    # what a run reported beats a cancel the forwarder settled meanwhile.
                    done[loc[2]] = new
                    self.totals[old] -= 1
                    self.totals[new] += 1
                    self.failed.pop(loc, None)
                    if new == "failed" and loc not in self.requeued and entry.dup_of is None:
                        self.failed[loc] = entry
                    return True
                return entry.dup
            done[loc[2]] = outcome = entry.outcome or "failed"
            self.terminal_count += 1
            if outcome in self.totals:
                self.totals[outcome] += 1
            self.retries.pop(loc, None)
            self.lost.pop(loc, None)
            self.later.pop(loc, None)
            self.duplicates.pop(loc, None)
            self.cancels.pop(loc, None)
            # A settled duplicate is not listed: its owner is (requeue that one).
            if entry.outcome == "failed" and loc not in self.requeued and entry.dup_of is None:
                self.failed[loc] = entry
            return True
        if self.is_terminal(loc):
            return False
        if entry.kind == EntryKind.RETRY:
            known = self.retries.get(loc)
            if known is None or entry.attempt > known[1]:
                self.retries[loc] = (float(entry.run_at or 0.0), entry.attempt)
            if entry.later:  # counts only grow, the first time only goes back: any order folds alike
                count, since = self.later.get(loc, (0, float(entry.later_since or 0.0)))
                self.later[loc] = (max(count, entry.later), min(since, float(entry.later_since or since)))
            return True
        if entry.kind == EntryKind.LOST:
            attempt, times = self.lost.get(loc, (0, 0))
            self.lost[loc] = (max(attempt, entry.attempt), times + 1)
            return True
        return False

    def _own_key(self, entry: Entry) -> bool:
        """Make the job of a ``key`` entry its key's owner if it is the newest (any replay order).

        Newest by admission time: a job admitted after the key was forgotten, or a requeue, takes
        the key over. The same job's entry re-appended by compaction (with ``until``) replaces it.
        """
        if entry.key is None:
            return False
        known = self.keys.get(entry.key)
        if known is not None and (known.at, known.loc, known.until or 0.0) >= (
            entry.at,
            entry.loc,
            entry.until or 0.0,
        ):
            return False
        self.keys[entry.key] = entry
        self._windowed.pop(entry.key, None)
        if entry.until is not None:
            self._windowed[entry.key] = entry.until
        return True

    def owner_outcome(self, owner: Entry, gone: Callable[[Loc], bool]) -> str | None:
        """The outcome of the job owning a key (``owner``: its ``key`` entry); ``None`` if pending.

        ``gone(loc)``: whether the journal segment of ``loc`` was compacted (its jobs all terminal,
        their outcomes forgotten but for listed failures).
        """
        loc = owner.loc
        done = self.terminal.get((loc[0], loc[1]), {}).get(loc[2])
        if done is not None:
            return done
        if owner.outcome is not None:
            return owner.outcome
        if gone(loc):
            return "failed" if loc in self.failed else "succeeded"
        return None

    def forget_keys(self, now: float, most: int | None = None) -> int:
        """Forget keys whose window ended before ``now``; beyond ``most`` keys left, the oldest.

        Only keys with a window count (those of pending jobs, or of jobs whose segment is still
        in the journal, have none). Returns how many were forgotten.
        """
        expired = [k for k, until in self._windowed.items() if until < now]
        if most is not None and len(self._windowed) - len(expired) > most:
            gone = set(expired)
            excess = len(self._windowed) - len(expired) - most
            expired += [k for k in self._windowed if k not in gone][:excess]
        for k in expired:
            self.forget_key(k)
        return len(expired)

    def forget_key(self, key: str) -> None:
        """Forget who owns ``key``."""
        self.keys.pop(key, None)
        self._windowed.pop(key, None)

    def forget_segment(self, seg: Seg) -> None:
        """Drop what is known about a compacted journal segment (its counts moved to Compacted)."""
        for outcome in self.terminal.get(seg, {}).values():
            if outcome in self.totals:
                self.totals[outcome] -= 1
        self.totals["dups"] -= self.dups.get(seg, 0)
        self.terminal_count -= len(self.terminal.pop(seg, {}))
        self.dups.pop(seg, None)
        self._dup_events.pop(seg, None)

    def counts(self, live: Iterable[Seg]) -> dict[str, int]:
        """``succeeded``, ``failed``, ``invalid``, ``dups`` and ``cancelled`` over the given segments."""
        out = {"succeeded": 0, "failed": 0, "invalid": 0, "dups": 0, "cancelled": 0}
        for seg in live:
            for outcome in self.terminal.get(seg, {}).values():
                if outcome in out:
                    out[outcome] += 1
            out["dups"] += self.dups.get(seg, 0)
        return out


@dataclass
class Compacted:
    """Totals of compacted journal segments, and how far each chain has been compacted."""

    #: Per writer id, the highest segment index deleted (all lower ones are gone too).
    through: dict[str, int] = field(default_factory=dict)
    accepted: int = 0
    succeeded: int = 0
    failed: int = 0
    invalid: int = 0
    dups: int = 0
    cancelled: int = 0

    @property
    def terminal(self) -> int:
        """Jobs of compacted segments that were terminal (all of them: only those are deleted)."""
        return self.succeeded + self.failed + self.invalid + self.cancelled

    def is_compacted(self, seg: Seg) -> bool:
        """Whether journal segment ``seg`` is (being) deleted."""
        through = self.through.get(seg[0])
        return through is not None and seg[1] <= through

    def to_bytes(self) -> bytes:
        """JSON."""
        body = {
            "v": 1,
            "through": self.through,
            "accepted": self.accepted,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "invalid": self.invalid,
            "dups": self.dups,
        }
        if self.cancelled:  # left out while 0: an older version reads the state unchanged
            body["cancelled"] = self.cancelled
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, path: str) -> Compacted:
        """Decode; a malformed body raises :class:`StateFileCorrupt`."""
        try:
            body = json.loads(raw)
            return cls(
                through={str(w): int(i) for w, i in body["through"].items()},
                **{name: int(body[name]) for name in ("accepted", "succeeded", "failed", "invalid", "dups")},
                cancelled=int(body.get("cancelled", 0)),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StateFileCorrupt(path, f"malformed compaction state: {exc!r}") from exc


def ledger_dir(journal: str) -> str:
    """The ledger directory of a journal directory."""
    return os.path.join(journal, LEDGER_DIR)


def open_ledger_writer(journal: str) -> JournalWriter:
    """A writer for this process's chain in the ledger (created 0700 when missing)."""
    path = ensure_journal_dir(ledger_dir(journal))
    return JournalWriter(path, max_segment_bytes=LEDGER_SEGMENT_BYTES)


def keys_dir(journal: str) -> str:
    """The key store directory of a journal directory (keys of finished jobs, in their window)."""
    return os.path.join(journal, KEYS_DIR)


def open_keys_writer(journal: str) -> JournalWriter:
    """A writer for this process's chain in the key store (created 0700 when missing)."""
    return JournalWriter(ensure_journal_dir(keys_dir(journal)), max_segment_bytes=KEYS_SEGMENT_BYTES)


def read_keys(journal: str) -> Iterator[tuple[Record, Entry]]:
    """Every entry of the key store (none if it does not exist yet)."""
    return _read_entries(keys_dir(journal))


def read_ledger(journal: str) -> Iterator[tuple[Record, Entry]]:
    """Every entry of the ledger (none if it does not exist yet). Garbled JSON is skipped."""
    return _read_entries(ledger_dir(journal))


def _read_entries(path: str) -> Iterator[tuple[Record, Entry]]:
    if not os.path.isdir(path):
        return
    for record in JournalReader(path).records():
        if record.rtype != RecordType.DATA:
            continue
        try:
            entry = Entry.from_bytes(record.payload)
        except (ValueError, KeyError, TypeError):
            continue  # passed its checksum, so a bug: never a reason to stop counting the rest
        yield record, entry


def load_index(journal: str, compacted: Compacted) -> LedgerIndex:
    """The index of the whole ledger; of compacted journal segments, only failures still listed."""
    index = LedgerIndex()
    first = {writer: indices[0] for writer, indices in list_chains(journal).items()}
    for _, entry in read_ledger(journal):
        # A chain that is gone was compacted away whole (and may have been forgotten since); a
        # segment below its chain's first one was compacted too, even when the chain was
        # forgotten and then grew again (its writer sealed its last segment while compaction
        # ran, then rotated into a new one): its entries are counted in Compacted already.
        if compacted.is_compacted((entry.loc[0], entry.loc[1])) or entry.loc[1] < first.get(
            entry.loc[0], sys.maxsize
        ):
            # Counted in Compacted already; only a failure still listed matters.
            if entry.kind == EntryKind.DONE and entry.outcome == "failed" and entry.dup_of is None:
                index.failed.setdefault(entry.loc, entry)
            elif entry.kind == EntryKind.REQUEUED:
                index.requeued.add(entry.loc)
            elif entry.kind == EntryKind.KEY:
                index.apply(entry)  # a finished job's key outlives its segment (its window)
            continue
        index.apply(entry)
    for loc in index.requeued:
        index.failed.pop(loc, None)
    return index


def consistent(journal: str, read: Callable[[Compacted], T], *, tries: int = 5) -> T:
    """``read(compaction state)``, again if a compaction ran meanwhile and got in its way.

    Readers list a directory, then open the files: the forwarder may delete one in between (a
    ``FileNotFoundError``, or a chain's head reading as missing), and totals read before and
    after a deletion do not add up. The answer is kept only if the compaction state did not
    change while it was computed.
    """
    for attempt in range(tries):
        before = load_compacted(journal)
        try:
            value = read(before)
        except (FileNotFoundError, JournalCorruption):
            if attempt == tries - 1 or (load_compacted(journal) == before and not _vanished()):
                raise
            continue
        if load_compacted(journal) == before or attempt == tries - 1:
            return value
    raise AssertionError("unreachable")  # pragma: no cover


def _vanished() -> bool:
    """Whether the exception being handled is a file that vanished (only deletion does that)."""
    return isinstance(sys.exc_info()[1], FileNotFoundError)


class AcceptedCounter:
    """Every job ever accepted into a journal (compacted ones included), counted incrementally.

    Each :meth:`count` reads only the records added since the last one. When compaction deleted
    the segment the reader stood in (it reads as a missing segment), it counts afresh: the
    journal first, then the compaction state, so a compaction in between counts a segment
    twice (the safe side for a capacity check), never not at all. Not thread-safe.
    """

    def __init__(self, journal: str) -> None:
        self.journal = journal
        self._reader: JournalReader | None = None
        self._accepted = 0

    def count(self) -> int:
        """The number of jobs accepted so far; real corruption raises."""
        if self._reader is not None:
            try:
                self._accepted += self._reader.check()
            except (JournalCorruption, FileNotFoundError):
                self._reader = None  # compacted under it: count afresh (real damage raises below)
        if self._reader is None:
            self._reader = JournalReader(self.journal)
            live = self._reader.check()
            self._accepted = live + load_compacted(self.journal).accepted
        return self._accepted


def load_compacted(journal: str) -> Compacted:
    """The compaction state (empty if nothing was ever compacted)."""
    raw = read_state(journal, COMPACTION_NAME)
    if raw is None:
        return Compacted()
    return Compacted.from_bytes(raw, os.path.join(journal, f"{COMPACTION_NAME}.state"))


def save_compacted(journal: str, compacted: Compacted) -> None:
    """Durably replace the compaction state."""
    write_state(journal, COMPACTION_NAME, compacted.to_bytes())
