"""A job cancelled while the forwarder is behind its journal (not read yet) is indexed cancelled.

The cancel's ledger entry reached the lookup index before the job's record did: it updated no
row, and the row made later said the job was waiting, for good (fails before).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import hybridq
import pytest
from hybridq import Queue
from hybridq.forwarder import delivery
from hybridq.journal import JournalWriter

from tests import tasks
from tests.unit.test_completions import make_forwarder
from tests.unit.test_lookup_build import add, states
from tests.unit.test_refill_pushed import LengthsTransport


def test_a_job_cancelled_past_the_reader_of_a_running_forwarder_is_indexed_cancelled(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(delivery, "INDEX_BUDGET", 2)
    queue = Queue(journal=journal_dir)
    first = queue.enqueue(tasks.add, 0, 0).id
    transport = LengthsTransport()
    forwarder = make_forwarder(journal_dir, transport, batch_size=1, window_max=2, window_min=2)
    forwarder.step()  # the index built and fed
    ids = [queue.enqueue(tasks.add, i, i).id for i in range(12)]
    real, cancelled = forwarder.lookup.catch_up, []

    def cancel_while_behind(*args: Any) -> int:
        if forwarder.delivery.behind and not cancelled:
            # Between two reads of the backlog: the index reads the cancel's ledger entry
            # before the forwarder reads the job's record.
            cancelled.append(hybridq.cancel([ids[-1]], journal=journal_dir))
        return real(*args)

    monkeypatch.setattr(forwarder.lookup, "catch_up", cancel_while_behind)
    for _ in range(40):
        forwarder.step()
        transport.work(func=add)
    forwarder.step()
    forwarder.close()
    assert cancelled
    assert states(journal_dir, [first, *ids]) == [("done", "succeeded")] * 12 + [("done", "cancelled")]


@pytest.mark.parametrize("rebuilt", [False, True])
def test_an_invalid_record_with_an_id_is_found_failed_not_waiting(journal_dir: Path, rebuilt: bool) -> None:
    """The ledger's ``invalid`` entry named no job id: the index's row said the job waited (fails before)."""
    waiting = Queue(journal=journal_dir).prepare(tasks.add, [1, 1])  # keeps the segment
    with JournalWriter(journal_dir) as writer:  # a job without its function: never runnable
        writer.append(json.dumps({"v": 1, "id": "bad-one", "queue": "default"}).encode())
        writer.append(waiting.to_bytes())
    transport = LengthsTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    forwarder.step()
    forwarder.close()
    if rebuilt:  # the index read from the files: the journal, then the ledger
        shutil.rmtree(journal_dir / "lookup")
        forwarder = make_forwarder(journal_dir, transport)
        deadline = time.monotonic() + 10.0
        while forwarder.lookup.building and time.monotonic() < deadline:
            forwarder.step()
            forwarder.lookup.catch_up()
        forwarder.close()
    assert states(journal_dir, ["bad-one"]) == [("done", "invalid")]
    job = hybridq.fetch_job("bad-one", journal_dir)
    assert job is not None
    assert job.status == "failed"
