"""A job cancelled while the forwarder is behind its journal (not read yet) is indexed cancelled.

The cancel's ledger entry reached the lookup index before the job's record did: it updated no
row, and the row made later said the job was waiting, for good (fails before).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hybridq
import pytest
from hybridq import Queue
from hybridq.forwarder import delivery

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
