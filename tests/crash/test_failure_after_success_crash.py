"""The harvest's marks under SIGKILL: a succeeded job is never listed failed again.

docs/reliability.md, "A success outranks a failure". Two crash points of the harvest (x1's
review, L7): a success reported after its failed job's journal segment was compacted (the late
path: the mark appended, fsync'd, then the child killed before the failures table delists it
and before the event is acknowledged), and a batch holding a job's success then a final failure
of it (killed right after the ledger append, before the index applied it: the failure's record
carries ``under``). The parent then lists the failures as ``failed list`` does, and as a fresh
forwarder does (from its saved index, then without one), compacts, and lists again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridq.journal import Record
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.store import read_ledger

from tests.crash.test_outranked_failure_crash import never_listed_again, run_killed_child
from tests.support.started import open_state
from tests.unit.test_outranked_failure import (
    fail_and_compact,
    job_five,
    listed_ids,
    loc_of,
)

CHILD = """
import os, signal, sys
from pathlib import Path
from types import SimpleNamespace
from hybridq.forwarder.harvest import Harvester
from hybridq.ledger.failtable import FailureTable
from tests.support.harvested import Events
from tests.unit.test_failure_after_success import outcome_event
from tests.support.started import open_state

journal, point, writer, segment, offset, payload = sys.argv[1:]
journal = Path(journal)  # x's record by its location: its segment may be compacted
x = SimpleNamespace(writer_id=writer, segment_index=int(segment), offset=int(offset), payload=bytes.fromhex(payload))
state = open_state(journal, x.writer_id)
if point == "late_success_before_row":
    FailureTable.outrank = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    events = [outcome_event(x, "succeeded", 3.0)]
else:
    state.index.apply = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    events = [outcome_event(x, "succeeded", 3.0), outcome_event(x, "failed", 3.1)]
Harvester(state, Events(events)).harvest()
print("not killed")
"""


def _run_child(journal: Path, point: str, x: Record, env: dict[str, str]) -> None:
    where = [x.writer_id, str(x.segment_index), str(x.offset), x.payload.hex()]
    run_killed_child(CHILD, [str(journal), point, *where], env)


@pytest.mark.parametrize("point", ["late_success_before_row", "success_then_failure_appended"])
def test_a_killed_harvest_never_lists_the_succeeded_job_again(
    journal_dir: Path, subprocess_env: dict[str, str], point: str
) -> None:
    writer, seg0, x = job_five(journal_dir)
    first = open_state(journal_dir, writer)
    if point == "late_success_before_row":
        fail_and_compact(first, seg0, x)
        assert load_compacted(str(journal_dir)).is_compacted((writer, 0))
        assert loc_of(x) in first.index.failed
    first.close()  # saved: the failure listed (late), or nothing of x yet
    _run_child(journal_dir, point, x, subprocess_env)
    written = [e for _, e in read_ledger(str(journal_dir)) if e.loc == loc_of(x)]
    if point == "late_success_before_row":
        assert [e.over for e in written if e.outcome == "succeeded"] == ["failed"]  # durable before the row
    else:
        assert [(e.outcome, e.under) for e in written] == [("succeeded", None), ("failed", "succeeded")]
    assert listed_ids(journal_dir) == []
    never_listed_again(journal_dir, writer, x, finish=[r for r in seg0 if r is not x])
