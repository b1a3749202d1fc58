"""The lookup index's catch-up skips reading the ledger only when nothing is past its marks.

A forwarder's own ledger entries reach the index as it appends them; other writers' chains are
read from the files. A catch-up that finds every chain ending at its mark (its last segment,
and for another writer's chain its size) builds no reader (docs/benchmarks.md, "Fewer writes
per job"); an entry another writer appends, to a new chain or to one the index read already,
is indexed at the next catch-up all the same.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.cancels import cancel
from hybridq.forwarder import Forwarder
from hybridq.journal import JournalWriter
from hybridq.ledger.entries import Entry
from hybridq.ledger.store import ledger_dir
from hybridq.lookup import store as store_module
from hybridq.lookup.reads import find

from tests import tasks
from tests.unit.test_completions import make_forwarder
from tests.unit.test_refill_pushed import LengthsTransport


def _done(journal: Path, job_id: str) -> Entry:
    row = find(str(journal), job_id)
    assert row is not None
    return Entry("done", job_id, (row.writer, row.seg, row.off), outcome="succeeded", at=time.time())


def _built(forwarder: Forwarder) -> None:
    """Step until the lookup index's first build is done (at most 10 s)."""
    deadline = time.monotonic() + 10.0
    while forwarder.lookup.building and time.monotonic() < deadline:
        forwarder.step()
        forwarder.lookup.catch_up()


def test_another_writers_entries_are_indexed_whether_its_chain_is_new_or_read(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    ids = [queue.enqueue(tasks.add, i, i).id for i in range(3)]
    forwarder = make_forwarder(journal_dir, LengthsTransport())
    try:
        _built(forwarder)
        forwarder.lookup.catch_up()
        assert [find(str(journal_dir), i).state for i in ids] == [None, None, None]  # type: ignore[union-attr]
        with JournalWriter(ledger_dir(str(journal_dir))) as other:
            other.append(_done(journal_dir, ids[0]).to_bytes())  # a chain the index never read
            forwarder.lookup.catch_up()
            assert find(str(journal_dir), ids[0]).outcome == "succeeded"  # type: ignore[union-attr]
            forwarder.lookup.catch_up()  # read to its end: nothing past the marks
            other.append(_done(journal_dir, ids[1]).to_bytes())  # the same chain, grown
            forwarder.lookup.catch_up()
            assert find(str(journal_dir), ids[1]).outcome == "succeeded"  # type: ignore[union-attr]
        assert find(str(journal_dir), ids[2]).state is None  # type: ignore[union-attr]
    finally:
        forwarder.close()


def _tails_built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths every reader the index builds from now on reads (a ledger read is its directory)."""
    tails: list[str] = []
    real = store_module._Tail.__init__

    def counted(self: store_module._Tail, path: str, *args: object) -> None:
        tails.append(path)
        real(self, path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(store_module._Tail, "__init__", counted)
    return tails


def test_a_quiet_ledger_is_not_read(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    queue = Queue(journal=journal_dir)
    queue.enqueue(tasks.add, 1, 1)
    forwarder = make_forwarder(journal_dir, LengthsTransport())
    try:
        _built(forwarder)
        forwarder.lookup.catch_up()
        tails = _tails_built(monkeypatch)
        forwarder.lookup.catch_up()
        assert ledger_dir(str(journal_dir)) not in tails
    finally:
        forwarder.close()


def _settle(forwarder: Forwarder) -> None:
    _built(forwarder)
    forwarder.step()
    forwarder.lookup.catch_up()
    forwarder.lookup.catch_up()


def test_a_quiet_ledger_is_not_read_after_a_restart(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger chain a stopped forwarder left is sealed and read to its end (the mark at the
    next segment's header): a quiet step after the restart still reads no ledger."""
    queue = Queue(journal=journal_dir)
    first = make_forwarder(journal_dir, LengthsTransport())
    try:
        job = queue.enqueue(tasks.add, 1, 1)
        _settle(first)
        cancel([job.id], journal_dir)  # an entry in the first forwarder's ledger chain
        _settle(first)
    finally:
        first.close()
    queue.enqueue(tasks.add, 2, 2)
    forwarder = make_forwarder(journal_dir, LengthsTransport())
    try:
        _settle(forwarder)
        tails = _tails_built(monkeypatch)
        for _ in range(3):
            forwarder.lookup.catch_up()
        assert ledger_dir(str(journal_dir)) not in tails
    finally:
        forwarder.close()
