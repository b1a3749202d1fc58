"""Lone surrogates through the forwarder's lookup index (issue 26, item 4).

``os.fsdecode`` of a file name that is not UTF-8 gives text with a lone surrogate; JSON carries
it, and so do an idempotency key, a result and an error. sqlite3 encodes text as strict UTF-8:
the index's update raised ``UnicodeEncodeError`` and the forwarder exited, at every start. The
result keeps the user's value exactly (the index holds its JSON); a key or an error is kept with
the surrogate escaped (``\\udcff``, as docs/guarantees.md says).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hybridq import JobFailed, Queue, fetch_job
from hybridq.envelope.model import Envelope
from hybridq.transport import MemoryTransport

from tests import tasks
from tests.unit.test_completions import make_forwarder

NAME = os.fsdecode(b"report-\xff.csv")


def task(env: Envelope, _attempt: int) -> Any:
    """Returns the file name, or (for 3 + 4) fails naming it."""
    if env.args == (3, 4):
        raise ValueError(f"cannot read {NAME}")
    return NAME


def test_a_result_an_error_and_a_key_with_a_lone_surrogate_are_indexed(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    ok = queue.enqueue(tasks.add, 1, 2, idempotency_key=f"upload:{NAME}")
    bad = queue.enqueue(tasks.add, 3, 4)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    try:
        forwarder.step()  # the key: the index's update raised here, and the forwarder with it
        assert transport.work(func=task) == 2
        forwarder.step()
    finally:
        forwarder.close()
    assert ok.wait(timeout=1.0) == NAME  # the user's value, exactly
    with pytest.raises(JobFailed) as failed:
        bad.wait(timeout=1.0)
    assert failed.value.exc_info == "ValueError: cannot read report-\\udcff.csv"
    found = fetch_job(ok.id, journal=journal_dir)
    assert found is not None
    assert found.result == NAME
    assert found.envelope.idempotency_key == f"upload:{NAME}"  # from the journal, exactly
