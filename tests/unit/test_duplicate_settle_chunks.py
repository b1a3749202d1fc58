"""A settle in chunks (SETTLE_CHUNK) whose k-th ledger append fails (a full disk), then the step
retried or the forwarder restarted: every duplicate settles once, none twice (docs/reliability.md,
the key table: a failed settle leaves everything to the next look)."""

from __future__ import annotations

import errno
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hybridq.errors import JournalIOError
from hybridq.forwarder import admission as admission_module
from hybridq.forwarder.admission import Admission
from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from hybridq.ledger.entries import Entry
from hybridq.ledger.store import read_ledger

from tests.unit.test_duplicate_table import _env, _state_with_duplicates


def _fail_nth(state: ForwarderState, n: int) -> None:
    writer = state._writer
    assert writer is not None
    real, calls = writer.append_many, []

    def f(payloads: Any, *a: Any) -> Any:
        calls.append(1)
        if len(calls) == n:
            raise JournalIOError("ledger", "ledger append", OSError(errno.ENOSPC, "full"))
        return real(payloads, *a)

    writer.append_many = f


@pytest.mark.parametrize("nth", [1, 2, 3])
@pytest.mark.parametrize("then", ["retry", "restart"])
def test_a_settle_failing_after_some_chunks_settles_each_duplicate_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nth: int, then: str
) -> None:
    monkeypatch.setattr(admission_module, "SETTLE_CHUNK", 10)
    journal, writer, state, adm = _state_with_duplicates(tmp_path, 25)
    # a second owner with 3 duplicates, so check_all has two owners to look at
    assert adm.admit(_env("owner2", "k2"), (writer, 0, 64))
    adm.flush()
    for i in range(3):
        assert not adm.admit(_env(f"d2-{i}", "k2"), (writer, 2, 32 + 100 * i))
    adm.flush()
    state.append(
        [
            Entry("done", "owner", (writer, 0, 32), outcome="failed", at=1.0),
            Entry("done", "owner2", (writer, 0, 64), outcome="succeeded", at=1.0),
        ]
    )
    _fail_nth(state, nth)
    with pytest.raises(JournalIOError):
        adm.settle()
    if then == "retry":
        adm.settle()
        adm.settle()
    else:
        state.close()
        state = ForwarderState(journal, ForwarderConfig())
        state.load()
        adm = Admission(state)
        adm.settle()
        adm.settle()
    try:
        pend = len(state.index.duplicates)
        outs = Counter(state.index.outcome((writer, 1, 32 + 200 * i)) for i in range(25))
    finally:
        state.close()
    c = Counter(e.job_id for _, e in read_ledger(journal) if e.kind == "done" and e.dup)
    assert pend == 0
    assert len(c) == 28
    assert max(c.values()) == 1
    assert outs == Counter({"failed": 25})
