"""A settle that fails (a full disk at its ledger append) leaves what it took to the retried step.

The forwarder's loop retries a failed step without reopening anything unless the key table is
poisoned (a ledger error does not poison it), so a settle that dropped the endings it noted, the
owners it added or the start's look before its append would strand those duplicates until a
restart: shown "forwarded", ``wait`` hanging, the segment never compacted.
Three ways a settle learns of an owner's end: a noted ending, a duplicate added after its owner
ended, a start's look at every owner.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from hybridq.envelope.model import Envelope
from hybridq.errors import JournalIOError
from hybridq.forwarder.admission import Admission
from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from hybridq.ledger.entries import Entry

from tests.unit import test_ledger_replay


def _env(job_id: str, key: str) -> Envelope:
    return Envelope(id=job_id, func="m.f", queue="q", idempotency_key=key, created_at=0.0)


def _full_once(state: ForwarderState) -> None:
    """The state's next ledger append fails with ENOSPC; the ones after it write."""
    writer = state._writer
    assert writer is not None
    real, calls = writer.append_many, []

    def full(payloads: Iterable[bytes], *args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise JournalIOError("ledger", "ledger append", OSError(errno.ENOSPC, "No space left"))
        return real(payloads, *args)

    writer.append_many = full  # type: ignore[method-assign, assignment]


@pytest.mark.parametrize("how", ["noted", "added", "start"])
def test_a_full_disk_at_the_settle_does_not_strand_the_duplicate(tmp_path: Path, how: str) -> None:
    """Fails before: the retried settles found nothing to do (D stayed pending)."""
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    adm = Admission(state)
    assert adm.admit(_env("A", "k"), (writer, 0, 32))
    adm.flush()
    if how == "added":  # A finished before D was read
        state.append([Entry("done", "A", (writer, 0, 32), outcome="succeeded", at=1.0)])
        assert not adm.admit(_env("D", "k"), (writer, 1, 32))
        state.append(adm._entries)
        adm.reset()
    else:
        assert not adm.admit(_env("D", "k"), (writer, 1, 32))
        adm.flush()
        state.append([Entry("done", "A", (writer, 0, 32), outcome="succeeded", at=1.0)])  # the harvest
    if how == "start":  # killed before the settle: the restart's first settle meets the full disk
        state.close()
        state = ForwarderState(journal, ForwarderConfig())
        state.load()
        adm = Admission(state)
        state.append(
            [Entry("done", "other", (writer, 2, 32), outcome="succeeded", at=1.5)]
        )  # opens the writer
    _full_once(state)
    try:
        with pytest.raises(JournalIOError):
            adm.settle()
        assert not state.index.keys.failed  # so the loop retries the step without a reopen
        adm.settle()
        assert state.index.outcome((writer, 1, 32)) == "succeeded"
        assert (writer, 1, 32) not in state.index.duplicates
    finally:
        state.close()
