"""One workflow moved on: its released steps' outcomes, the steps released next, its end.

The base of :class:`hybridq.forwarder.flows.Flows` (docs/workflows.md), which reads the journal
into the workflows' file and picks, at each pass, the workflows an outcome concerns; here, for
one of them (:meth:`FlowDriver._advance`): its released steps' outcomes read from the lookup
index, the steps whose dependencies all succeeded appended to the journal (their own chain,
fsync'd, signed when a key is set) and marked ``released``, and its end -- a failed step cancels
what has not started and releases ``on_error`` once -- with the anchor's ``done`` entry in the
ledger (fsync'd) before its row: a crash in between repeats it, never loses it.

This module must not import redis or rq.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from typing import Any

from hybridq import crashpoints
from hybridq.envelope.model import Envelope
from hybridq.errors import EnvelopeError, RecordTooLarge
from hybridq.forwarder.flow_steps import (
    StepFailed,
    cancel_started,
    ended_as,
    ledger_end,
    step_envelope,
    step_result,
)
from hybridq.forwarder.state import ForwarderState
from hybridq.journal import JournalWriter
from hybridq.ledger.entries import Entry
from hybridq.lookup import reads
from hybridq.security.signing import keyring
from hybridq.transport.base import Loc
from hybridq.workflows.canvas import PASS_ONE, step_id, step_prefix

__all__ = ["STEP_SEGMENT_BYTES", "FlowDriver"]

log = logging.getLogger("hybridq.forwarder")

#: The released steps' own journal chain: small segments, so finished ones are compacted soon.
STEP_SEGMENT_BYTES = 1 << 20


class FlowDriver:
    """Moves one workflow on (module docstring); :class:`~hybridq.forwarder.flows.Flows` picks which."""

    def __init__(self, state: ForwarderState) -> None:
        self.state = state
        self.journal = state.journal
        self._db: sqlite3.Connection | None = None
        self._writer: JournalWriter | None = None
        #: Anchors of live workflows and jobs waiting for their dependencies: never pushed.
        self.held: set[Loc] = set()
        #: Live workflows' graphs, parsed once (a targeted pass would parse the whole graph again).
        self._graphs: dict[str, dict[str, Any]] = {}
        #: Live workflows whose steps' ids start with a hash of their id (a long one): hash -> id.
        self._hashed: dict[str, str] = {}
        #: Workflows and dependent jobs ended since start.
        self.ended = 0

    @property
    def db(self) -> sqlite3.Connection:
        """The workflows' file, open (inside a transaction :meth:`Flows.commit` ends)."""
        if self._db is None:
            raise RuntimeError("the workflows' file is not open")
        return self._db

    def _advance(
        self, fid: str, anchor: Loc, queue: str, graph: dict[str, Any], news: set[str] | None
    ) -> int:
        """Move workflow ``fid`` on; ``news``: only these released steps may have ended (None: any)."""
        steps: list[dict[str, Any]] = graph["steps"]
        states = dict(self.db.execute("SELECT n, state FROM steps WHERE flow = ?", (fid,)).fetchall())
        rows = {
            n: reads.find(self.journal, step_id(fid, n))
            for n, s in states.items()
            if s == "released" and (news is None or step_id(fid, n) in news)
        }
        for n, row in rows.items():
            if row is not None and row.state == "done":
                states[n] = ended_as(row.outcome)
                self.db.execute("UPDATE steps SET state = ? WHERE flow = ? AND n = ?", (states[n], fid, n))
        if anchor in self.state.index.cancels or self.state.index.is_terminal(anchor):
            return self._stop(fid, anchor, queue, graph, states, *ledger_end(self.state, fid, anchor))
        failed = next((n for n, s in states.items() if s in ("failed", "cancelled")), None)
        if failed is not None:
            row = rows.get(failed)
            error = (row.error if row is not None else None) or ""
            why = f"step {failed} ({step_id(fid, failed)}) {states[failed]}: {error}"
            return self._stop(fid, anchor, queue, graph, states, "failed", why.rstrip(": "))
        try:
            ready = [
                (n, step_envelope(self.journal, fid, n, steps[n]))
                for n, s in sorted(states.items())
                if s == "waiting" and all(states.get(d) == "succeeded" for d in steps[n]["deps"])
            ]
            if not ready and all(s == "succeeded" for s in states.values()):
                outs = [step_result(self.journal, fid, n, stored=True) for n in graph["out"]]
                self._end(fid, anchor, queue, "succeeded", result=outs if graph["list"] else outs[0])
                return 0
            self._append([env for _, env in ready])
        except StepFailed as exc:
            return self._stop(fid, anchor, queue, graph, states, "failed", str(exc))
        except (RecordTooLarge, EnvelopeError) as exc:
            # Results each under the cap, too large together for one record (a chord's callback,
            # a group's end), or nested too deep: nothing was written; failing is the only way
            # on (raised out of the step, it would stop the forwarder at every start).
            why = f"results too large to pass together: {exc}"
            return self._stop(fid, anchor, queue, graph, states, "failed", why)
        self.db.executemany(
            "UPDATE steps SET state = 'released' WHERE flow = ? AND n = ?", [(fid, n) for n, _ in ready]
        )
        return len(ready)

    def _stop(
        self,
        fid: str,
        anchor: Loc,
        queue: str,
        graph: dict[str, Any],
        states: dict[int, str],
        end: str,
        why: str,
    ) -> int:
        """End workflow ``fid`` as ``end``: cancel what has not started, run ``on_error`` once."""
        waiting = [(fid, n) for n, s in states.items() if s == "waiting"]
        self.db.executemany("UPDATE steps SET state = 'cancelled' WHERE flow = ? AND n = ?", waiting)
        cancel_started(self.journal, [step_id(fid, n) for n, s in states.items() if s == "released"])
        released = 0
        err = graph.get("err")
        if end == "failed" and err is not None and not self.state.index.is_terminal(anchor):
            lead = (fid, why) if err["pass"] == PASS_ONE else ()
            self._append([step_envelope(self.journal, fid, -1, {**err, "pass": "lead"}, lead)])
            released = 1
        self._end(fid, anchor, queue, end, error=None if end == "succeeded" else why)
        log.log(logging.INFO if end == "succeeded" else logging.WARNING, "workflow %s %s: %s", fid, end, why)
        return released

    def _end(
        self, fid: str, anchor: Loc, queue: str, end: str, *, result: Any = None, error: str | None = None
    ) -> None:
        """The anchor's ``done`` entry (ledger, fsync), then its row: a crash in between repeats it."""
        if not self.state.index.is_terminal(anchor):
            entry = Entry(
                "done",
                fid,
                anchor,
                outcome=end,
                error=error,
                at=time.time(),
                queue=queue,
                result=result,
                result_kept=end == "succeeded",
            )
            self.state.append([entry])
            crashpoints.reached("flows_after_end")
        self.db.execute("UPDATE flows SET state = ?, error = ? WHERE id = ?", (end, error, fid))
        self.held.discard(anchor)
        self._hashed.pop(step_prefix(fid), None)
        self._graphs.pop(fid, None)
        self.ended += 1

    def _append(self, envs: list[Envelope]) -> None:
        """Append released steps to the journal (their own chain), fsync'd, signed when a key is set."""
        if not envs:
            return
        ring = keyring()
        if ring is not None:
            envs = [ring.sign(env) for env in envs]
        if self._writer is None or self._writer.closed:
            self._writer = JournalWriter(self.journal, max_segment_bytes=STEP_SEGMENT_BYTES)
        self._writer.append_many([env.to_bytes() for env in envs])
        crashpoints.reached("flows_after_release")
