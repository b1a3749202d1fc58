"""Issue 29: what a process's delayed chain must not change -- the order its jobs are known in.

The forwarder reads a process's main and delayed chains one after the other, in no set order
(sorted by their random writer ids), and at most ``INDEX_BUDGET`` jobs a step. A job read from
one chain may name a job of the other that is not read yet (docs/journal.md, "Chains"):

- ``depends_on=[a delayed job]``: the dependent waited as "unknown" while the backlog was read,
  and was cancelled after ``UNKNOWN_DEP_S`` (fails before the forwarder's fix);
- a delayed and an immediate job with the same idempotency key (or ``job_id``): the one in the
  chain read first owned the key, so the immediate job could run an hour early as the "first"
  one (fails before keyed calls stayed in the main chain).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.envelope.model import new_job_id
from hybridq.forwarder import delivery, flow_steps, flows
from hybridq.forwarder.loop import Forwarder
from hybridq.job import Job
from hybridq.journal.reader import list_chains
from hybridq.security.signing import ENV_KEY, ENV_KEY_FILE
from hybridq.transport import MemoryTransport

from tests import tasks
from tests.unit.test_completions import make_forwarder
from tests.unit.test_lookup_build import add
from tests.unit.test_refill_pushed import LengthsTransport


def _main_chain_read_first(tmp_path: Path) -> tuple[Path, Job, Job]:
    """A journal where ``b`` (main chain) depends on ``a`` (delayed chain), the main chain read first."""
    for attempt in range(64):  # each journal gets writers with new random ids: 1 in 2 fits
        journal = tmp_path / f"j{attempt}"
        queue = Queue(journal=journal)
        a = queue.enqueue(tasks.add, 1, 1, delay=3600)
        b = queue.enqueue(tasks.add, 2, 2, depends_on=[a])
        if (
            a.record.writer_id != b.record.writer_id
            and next(iter(list_chains(str(journal)))) == b.record.writer_id
        ):
            queue.enqueue_many(queue.prepare(tasks.add, (i, i)) for i in range(200))  # the backlog
            return journal, a, b
    raise AssertionError("the delayed job never went to a chain of its own read after the main one")


def test_a_dependency_in_the_delayed_chain_is_waited_for_while_the_forwarder_is_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # UNKNOWN_DEP_S = 0 stands for "reading the backlog took over 30 s" (as test_workflows does).
    monkeypatch.setattr(flow_steps, "UNKNOWN_DEP_S", 0.0)
    monkeypatch.setattr(delivery, "INDEX_BUDGET", 20)
    journal, a, b = _main_chain_read_first(tmp_path)
    now = [time.time()]
    transport = LengthsTransport()
    forwarder = make_forwarder(
        journal, transport, batch_size=5, window_max=5, window_min=5, clock=lambda: now[0],
        reconcile_interval_s=3600.0,
    )  # fmt: skip
    try:
        forwarder.step()
        assert forwarder.delivery.behind
        assert b.get_status() != "cancelled"
        for _ in range(120):  # the backlog read and run: a is found, scheduled
            forwarder.step()
            transport.work(func=add)
            forwarder.step()
        assert a.get_status() == "scheduled"
        assert b.get_status() != "cancelled"  # waits for a
        now[0] += 3601
        for _ in range(20):
            forwarder.step()
            transport.work(func=add)
            forwarder.step()
        assert (a.get_status(), b.get_status()) == ("finished", "finished")
        assert transport.executions.get(b.id) == 1
    finally:
        forwarder.close()


@pytest.mark.parametrize("same", ["idempotency_key", "job_id"])
def test_a_delayed_and_an_immediate_job_with_one_key_keep_the_order_of_their_calls(
    journal_dir: Path, same: str
) -> None:
    queue = Queue(journal=journal_dir)
    queue.enqueue(tasks.add, 0, 0)
    transport = MemoryTransport()
    forwarder = Forwarder(journal_dir, transport, reconcile_interval_s=3600.0)
    forwarder.open()
    try:
        forwarder.step()
        transport.work()
        forwarder.step()  # running: the two calls below come between two of its reads
        later = queue.enqueue(tasks.add, 1, 1, delay=3600, **{same: "K"})
        now = queue.enqueue(tasks.add, 2, 2, **{same: "K"})
        assert later.record.writer_id == now.record.writer_id  # one chain: read in this order
        for _ in range(5):
            forwarder.step()
            transport.work()
            forwarder.step()
        if same == "idempotency_key":  # (two jobs with one job_id: both handles name that id)
            assert later.get_status() == "scheduled"  # the delayed job owns the key: nothing ran now
            assert now.id not in transport.executions
            assert (later.duplicate_of, now.duplicate_of) == (None, later.id)
    finally:
        forwarder.close()


def test_an_unkeyed_delayed_job_still_goes_to_the_delayed_chain(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    later = queue.enqueue(tasks.add, 1, 1, delay=3600)
    now = queue.enqueue(tasks.add, 2, 2)
    assert later.record.writer_id != now.record.writer_id


def test_a_dependency_no_job_has_is_cancelled_under_a_steady_load_that_keeps_the_forwarder_behind(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Review 2 M2: each step behind reset every clock, so a producer adding more than a step
    # reads at least once per UNKNOWN_DEP_S kept the dependent waiting as long as the load lasted.
    # Fails before the clocks were paused instead of reset (still "forwarded" after 30 s).
    monkeypatch.setattr(flow_steps, "UNKNOWN_DEP_S", 0.5)
    monkeypatch.setattr(flows, "LOOK_EVERY_S", 0.2)
    monkeypatch.setattr(delivery, "INDEX_BUDGET", 20)
    queue = Queue(journal=journal_dir)
    b = queue.enqueue(tasks.add, 2, 2, depends_on=["0" * 32])
    transport = LengthsTransport()
    forwarder = make_forwarder(
        journal_dir, transport, batch_size=5, window_max=5, window_min=5, reconcile_interval_s=3600.0
    )
    try:
        forwarder.step()  # every chain read to its end: b's dependency's clock starts
        behind = 0
        deadline = time.monotonic() + 30.0
        while b.get_status() != "cancelled" and time.monotonic() < deadline:
            queue.enqueue_many(queue.prepare(tasks.add, (i, i)) for i in range(30))  # window full
            forwarder.step()
            behind += forwarder.delivery.behind
            time.sleep(0.05)
        assert behind > 0  # the load kept it behind meanwhile
        assert b.get_status() == "cancelled"
    finally:
        forwarder.close()


def test_a_job_id_the_caller_made_with_new_job_id_stays_in_the_main_chain(journal_dir: Path) -> None:
    # Review 2 L1: the id's shape (new_job_id, same millisecond) read it as prepare's own, so a
    # caller's id that it may reuse as a key went to the delayed chain. Fails before the fresh mark.
    queue = Queue(journal=journal_dir)
    now = queue.enqueue(tasks.add, 2, 2)
    later = queue.enqueue(tasks.add, 1, 1, delay=3600, job_id=new_job_id())
    assert later.record.writer_id == now.record.writer_id


def test_a_signed_unkeyed_delayed_job_still_goes_to_the_delayed_chain(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Signing decodes the record again: the fresh mark (never written) must survive it.
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    monkeypatch.setenv(ENV_KEY, "k" * 40)
    queue = Queue(journal=journal_dir)
    later = queue.enqueue(tasks.add, 1, 1, delay=3600)
    now = queue.enqueue(tasks.add, 2, 2)
    assert later.envelope.signature is not None
    assert later.record.writer_id != now.record.writer_id
