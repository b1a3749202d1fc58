"""The dashboard's done / min counts as status does: a late success's mark is not a success.

A success reported after its failed job's segment was compacted is appended as a mark (docs/reliability.md,
"A success outranks a failure"); status keeps the job failed, and so does the dashboard (docs/dashboard.md).
"""

from __future__ import annotations

from pathlib import Path

from hybridq.envelope.model import Envelope
from hybridq.forwarder.harvest import Harvester
from hybridq.http.dashboard.ledger_view import LedgerView
from hybridq.ops import status
from hybridq.protocol import CompletionEvent

from tests.support.harvested import Events
from tests.support.started import open_state
from tests.unit.test_outranked_failure import (
    fail_and_compact,
    job_five,
    loc_of,
)


def test_a_late_successs_mark_is_not_counted_done_per_minute(journal_dir: Path) -> None:
    writer, seg0, x = job_five(journal_dir)
    state = open_state(journal_dir, writer)
    fail_and_compact(state, seg0, x)
    job_id = Envelope.from_bytes(x.payload).id
    now = 5000.0
    view = LedgerView(str(journal_dir), window_s=300.0)
    before = view.recent(now=now)
    st_before = status.collect_status(str(journal_dir))
    event = CompletionEvent(
        id=job_id, loc=loc_of(x), queue="q", outcome="succeeded", final=True, retry_delay=None,
        attempt=1, dup=False, error=None, at=now - 1,
    )  # fmt: skip
    harvester = Harvester(state, Events([event.to_json()]))  # type: ignore[arg-type]
    assert harvester.harvest() == 1
    state.close()
    after = LedgerView(str(journal_dir), window_s=300.0).recent(now=now)
    st_after = status.collect_status(str(journal_dir))
    assert st_after.get("succeeded") == st_before.get("succeeded")
    assert after.get("q", {}).get("succeeded", 0) == before.get("q", {}).get("succeeded", 0)
