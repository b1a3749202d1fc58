"""Enqueue-if-absent: the forwarder pushes one job per explicit idempotency key.

A job enqueued with ``idempotency_key=`` whose key a **pending** job (accepted, not terminal) or
a **finished** job already owns is never pushed: the forwarder records it in the ledger as a
``duplicate`` of the owner, and once the owner is terminal, settles it with the owner's outcome
(a ``done`` entry with ``dup_of``), counted like any suppressed duplicate. The first job with a
key gets a ``key`` entry: that is what the forwarder remembers, across restarts, and for the key
window after the job's segment is compacted (``ForwarderConfig.key_window_s``).

Jobs without an explicit key (the key is the job id) are not looked at: equal job ids are
already one job (docs/enqueue.md, "Job ids"). A requeued job (``hybridq failed requeue``) takes
its key over, whoever has it now (the failure it replaces, or a job that took the key once the
failure's window ended): a requeue always runs again.

Entries are durable (:meth:`Admission.flush`, one fsync) before the forwarder's checkpoint moves
past their records; a crash before that reads the records again and decides the same way.

This module must not import redis or rq.
"""

from __future__ import annotations

import logging
import sys

from hybridq.envelope.model import Envelope
from hybridq.forwarder.state import ForwarderState
from hybridq.journal.reader import list_chains
from hybridq.ledger.entries import Entry
from hybridq.protocol import EntryKind
from hybridq.transport.base import Loc

__all__ = ["SETTLE_CHUNK", "Admission"]

#: Settling entries per ledger append: one owner's many duplicates are written a chunk at a
#: time, not held (entries and payloads) all at once.
SETTLE_CHUNK = 3_000

log = logging.getLogger("hybridq.forwarder")


class Admission:
    """Decides, record by record, whether the forwarder pushes a job (see module docstring).

    Args:
        state: the forwarder's state (its ledger index knows the keys and the duplicates).
    """

    def __init__(self, state: ForwarderState) -> None:
        self.state = state
        #: Jobs recorded as duplicates (never pushed) by this process.
        self.suppressed = 0
        self._entries: list[Entry] = []
        #: Keys taken by records read since the last flush (not in the index yet).
        self._taken: dict[str, Entry] = {}

    @property
    def waiting(self) -> int:
        """Entries not written yet (the forwarder flushes before its checkpoint moves)."""
        return len(self._entries)

    def admit(self, env: Envelope, loc: Loc) -> bool:
        """Whether to push (or hold) the job at ``loc``; ``False``: recorded as a duplicate."""
        if env.idempotency_key == env.id:
            return True
        key = env.key_id
        owner = self._taken.get(key) or self.state.index.keys.get(key)
        if owner is not None and owner.loc == loc:
            return True  # read again (a retried step, a lost checkpoint): it owns the key already
        if owner is not None and env.requeue == 0:
            if loc in self.state.index.duplicates:
                # Read again (a crash before the checkpoint passed it): recorded once, against
                # the owner of its first read, even if a requeue took the key over since: a
                # second entry made the outcome depend on the replay's order
                # (docs/reliability.md, "Duplicates"). A backstop: the delivery skips a pending
                # duplicate before asking.
                return False
            self._entries.append(
                Entry(
                    EntryKind.DUPLICATE,
                    env.id,
                    loc,
                    key=key,
                    dup_of=owner.job_id,
                    owner_loc=owner.loc,
                    at=self.state.config.clock(),
                    queue=env.queue,
                )
            )
            self.suppressed += 1
            log.info("job %s: its idempotency key is job %s's: recorded as a duplicate", env.id, owner.job_id)
            return False
        entry = Entry(EntryKind.KEY, env.id, loc, key=key, at=self.state.config.clock(), queue=env.queue)
        self._taken[key] = entry
        self._entries.append(entry)
        return True

    def flush(self) -> None:
        """Write the entries of the records admitted so far (one fsync), then settle duplicates."""
        entries, self._entries, self._taken = self._entries, [], {}
        self.state.append(entries)
        self.settle()

    def reset(self) -> None:
        """Drop unwritten entries (their records are read again)."""
        self._entries, self._taken = [], {}

    def settle(self) -> None:
        """Settle the duplicates whose owner is terminal now, with its outcome.

        Driven by owners turning terminal (issue 29): the index notes every job that turns
        terminal while pending duplicates exist (the ones that may own some), and this asks the
        duplicates table, in one query, for the ones waiting for those; the owner of a duplicate
        added since the last settle is looked up once (it may have finished already); a
        duplicate whose entry has no owner's position (written before it was recorded) gets the
        key's owner now; a start looks once at every distinct owner. Nothing at all while none
        is pending. A duplicate follows the owner it was recorded against, even once a requeue
        took the key over (docs/enqueue.md).
        """
        dups = self.state.index.duplicates
        if not dups.pending:
            dups.take_ended()
            dups.take_added()
            return
        first: dict[str, int] | None = None

        def gone(loc: Loc) -> bool:
            nonlocal first
            if self.state.compacted.is_compacted((loc[0], loc[1])):
                return True
            if first is None:
                first = {w: indices[0] for w, indices in list_chains(self.state.journal).items()}
            return loc[1] < first.get(loc[0], sys.maxsize)

        index, now = self.state.index, self.state.config.clock()

        def outcome_of(owner: Loc, key: str | None = None) -> str | None:
            """The owner's outcome; a compacted one's from its key entry, if it still owns the key."""
            done = index.outcome(owner)
            if done is not None or not gone(owner):
                return done
            key = key or dups.key_of(owner)
            entry = None if key is None else index.keys.get(key)
            known = None if entry is None or entry.loc != owner else entry.outcome
            return index.outcome_at(owner, gone, known)

        done: dict[Loc, Entry] = {}

        def settled(loc: Loc, dup: Entry, outcome: str) -> None:
            done[loc] = Entry(
                EntryKind.DONE,
                dup.job_id,
                loc,
                outcome=outcome,
                dup=True,
                dup_of=dup.dup_of,
                at=now,
                queue=dup.queue,
            )
            if len(done) >= SETTLE_CHUNK:
                self.state.append(list(done.values()))
                done.clear()

        try:
            looked: dict[Loc, str | None] = {}  # owners' outcomes, each looked up once
            if dups.check_all:
                dups.take_ended()
                looked = {owner: outcome_of(owner) for owner in dups.owners()}
                ended = [owner for owner, outcome in looked.items() if outcome is not None]
            else:
                ended = dups.take_ended()  # terminal
                for owner, key in dups.take_added():  # may have finished before its duplicate came
                    if owner not in looked and (outcome := outcome_of(owner, key)) is not None:
                        looked[owner] = outcome
                        ended.append(owner)
            for loc, dup, waits_for in dups.of_owners(ended) if ended else ():
                if waits_for is None:
                    continue
                if waits_for not in looked:
                    looked[waits_for] = outcome_of(waits_for, dup.key)
                if (outcome := looked[waits_for]) is not None:
                    settled(loc, dup, outcome)
            if dups.unresolved:
                for key in dups.unresolved_keys():
                    key_owner = index.keys.get(key)
                    # No owner cannot happen: a key is forgotten only a window after its job
                    # finished, and its duplicates are settled the step it finishes.
                    outcome = "succeeded" if key_owner is None else index.owner_outcome(key_owner, gone)
                    if outcome is None and key_owner is not None:
                        dups.resolve(key, key_owner.loc)  # waits for it: found by of_owners then
                        continue
                    for loc, dup in dups.unresolved_of(key):
                        settled(loc, dup, outcome or "succeeded")
            self.state.append(list(done.values()))
        except BaseException:
            # What this took (noted endings, added owners, the start's look, the unresolved
            # flag) is gone from the table object, and the loop retries a failed append without
            # a reopen: the retried settle looks at every owner once instead
            # (docs/reliability.md, "Duplicates").
            dups.check_all = dups.unresolved = True
            raise
