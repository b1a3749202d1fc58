"""Envelope fields checked for type and range (issue 13.2), numbers capped before RQ (13.10).

``prepare`` refuses what a worker or Redis could not take, with one clear error and nothing
written; ``Envelope.from_dict`` refuses a record that could not be delivered (the forwarder then
records it as invalid) but tolerates big timeouts an older version wrote (the transport caps
them). The forwarder's handling of both, end to end, is in tests/integration/test_poison_redis.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
from hybridq import Queue, Retry
from hybridq.envelope.limits import MAX_SECONDS, MAX_TIMESTAMP
from hybridq.envelope.model import Envelope
from hybridq.errors import EnvelopeError, HybridqError, UnencodableJobs
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.transport import MemoryTransport
from hybridq.transport.base import Delivery, PushResult

from tests import tasks

VALID = {"v": 1, "id": "j", "func": "tasks.add", "queue": "q", "key": "k", "created_at": 17}


def decode(**fields: object) -> Envelope:
    return Envelope.from_bytes(json.dumps({**VALID, **fields}).encode())


@pytest.mark.parametrize(
    "options",
    [
        {"description": {"a": 1}},
        {"description": 5},
        {"meta": [("a", 1)]},
        {"job_timeout": 1e300},
        {"job_timeout": math.inf},
        {"job_timeout": math.nan},
        {"job_timeout": True},
        {"result_ttl": 1e300},
        {"result_ttl": MAX_SECONDS + 1},
        {"delay": 1e300},
        {"delay": math.nan},
        {"delay": math.inf},
        {"run_at": math.inf},
        {"run_at": 1e18},
        {"run_at": -1.0},
    ],
    ids=lambda o: "-".join(f"{k}={v!r}" for k, v in o.items())[:40],
)
def test_prepare_refuses_a_field_of_the_wrong_type_or_range(journal_dir: Path, options: dict) -> None:
    queue = Queue(journal=journal_dir)
    with pytest.raises(EnvelopeError) as caught:
        queue.prepare(tasks.add, (1, 2), **options)
    assert "\n" not in str(caught.value)
    with pytest.raises(EnvelopeError):
        queue.enqueue(tasks.add, 1, 2, **options)
    assert not list(journal_dir.glob("*.wal")) or all(
        p.stat().st_size < 200 for p in journal_dir.glob("*.wal")
    )


@pytest.mark.parametrize(
    "options", [{"default_timeout": 1e300}, {"default_result_ttl": -1}, {"default_retry": 3}]
)
def test_queue_defaults_out_of_range_are_refused_at_once(journal_dir: Path, options: dict) -> None:
    with pytest.raises(EnvelopeError):
        Queue(journal=journal_dir, **options)


def test_prepare_refuses_kwargs_whose_names_are_not_strings(journal_dir: Path) -> None:
    with pytest.raises(EnvelopeError, match="kwargs"):
        Queue(journal=journal_dir).prepare(tasks.add, (), {1: 2})


def test_the_caps_themselves_are_accepted(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    env = queue.prepare(tasks.add, (1, 2), job_timeout=MAX_SECONDS, result_ttl=MAX_SECONDS, delay=MAX_SECONDS)
    assert env.timeout_s == env.result_ttl_s == MAX_SECONDS
    assert queue.prepare(tasks.add, (1, 2), run_at=MAX_TIMESTAMP).run_at == MAX_TIMESTAMP


def test_a_retry_policy_out_of_range_is_refused(journal_dir: Path) -> None:
    with pytest.raises(EnvelopeError):
        Retry(max_attempts=10**6)
    with pytest.raises(EnvelopeError):
        Retry(jitter="no")  # type: ignore[arg-type]
    with pytest.raises(EnvelopeError, match="backoff"):
        Queue(journal=journal_dir).prepare(tasks.add, (1, 2), retry=Retry(backoff_s=1e300))
    # A delay never overflows, whatever the attempt number.
    assert Retry(max_attempts=1000, backoff_s=1.0, jitter=False).delay_s(5000) == 300.0


@pytest.mark.parametrize(
    "fields",
    [
        {"description": {"a": 1}},
        {"description": 5},
        {"args": "abc"},
        {"args": {"a": 1}},
        {"kwargs": [["a", 1]]},
        {"meta": [["a", 1]]},
        {"key": {"a": 1}},
        {"key": 5},
        {"created_at": 1e18},
        {"created_at": -1.0},
        {"created_at": "17"},
        {"created_at": True},
        {"requeue": 10**30},
        {"requeue": -1},
        {"requeue": 1.5},
        {"requeue": "2"},
        {"timeout": "30"},
        {"timeout": -1},
        {"run_at": "1"},
        {"retry": {"max_attempts": 10**30}},
        {"retry": {"max_attempts": "3"}},
        {"retry": {"jitter": "no"}},
        {"id": 5},
    ],
    ids=lambda f: "-".join(f"{k}={v!r}" for k, v in f.items())[:40],
)
def test_a_record_with_a_field_of_the_wrong_type_or_range_is_refused(fields: dict) -> None:
    with pytest.raises(EnvelopeError):
        decode(**fields)


def test_a_record_with_a_huge_timeout_from_an_older_version_still_decodes() -> None:
    """Tolerated: it was accepted when it was written; the transport caps what reaches RQ."""
    env = decode(timeout=1e300, result_ttl=1e300, run_at=1e300, retry={"backoff": 1e300})
    assert env.timeout_s == 1e300
    assert Envelope.from_bytes(env.to_bytes()).to_dict() == env.to_dict()


class RefusingTransport(MemoryTransport):
    """Refuses jobs whose description is not text, as the RQ transport does."""

    def push(self, jobs: Sequence[Delivery]) -> PushResult:
        bad = [(d, "not text") for d in jobs if not isinstance(d.envelope.description, str | None)]
        if bad:
            raise UnencodableJobs(bad)
        return super().push(jobs)


def test_a_job_the_transport_cannot_encode_is_recorded_invalid_not_an_outage(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    before = queue.enqueue(tasks.add, 1, 1)
    transport = RefusingTransport()
    forwarder = Forwarder(journal_dir, transport, backoff_initial_s=0.001, backoff_max_s=0.002)
    forwarder.open()
    try:
        real = Envelope.from_bytes
        try:  # a record that passes the envelope's checks and still cannot be encoded
            Envelope.from_bytes = classmethod(  # type: ignore[method-assign,assignment]
                lambda cls, raw: _with_bad_description(real(raw))
            )
            forwarder.step()
        finally:
            Envelope.from_bytes = real  # type: ignore[method-assign]
        after = queue.enqueue(tasks.add, 2, 2)
        forwarder.step()
    finally:
        forwarder.close()
    assert list(transport.queues["default"]) == [after.id]
    assert forwarder.stats.transport_failures == 0
    assert forwarder.checkpoint.invalid == 1
    assert before.get_status() == "failed"  # terminal (invalid), so its segment can be compacted


def _with_bad_description(env: Envelope) -> Envelope:
    env.description = {"a": 1}  # type: ignore[assignment]
    return env


def test_a_forwarder_restart_after_an_unencodable_job_does_not_push_it_again(journal_dir: Path) -> None:
    with JournalWriter(journal_dir) as writer:
        writer.append(json.dumps({**VALID, "queue": "default", "description": {"a": 1}}).encode())
    transport = MemoryTransport()
    for _ in range(2):
        with Forwarder(journal_dir, transport) as forwarder:
            forwarder.step()
            assert forwarder.stats.transport_failures == 0
    assert transport.queues.get("default", []) == []


def test_a_dropped_event_is_counted_in_the_metrics(journal_dir: Path) -> None:
    from hybridq.ops.metrics import ForwarderMetrics
    from hybridq.transport.base import Event

    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    transport = MemoryTransport()
    with Forwarder(journal_dir, transport) as forwarder:
        forwarder.step()
        loc = [job.record.writer_id, job.record.segment, job.record.offset]
        bodies = [{"id": job.id, "loc": loc, "outcome": "succeeded", "at": 10**400}, None]
        transport.events[forwarder.checkpoint.owner] = [Event(f"1-{i}", b) for i, b in enumerate(bodies)]
        forwarder.step()
        values = {m.name: m.samples[0].value for m in ForwarderMetrics(forwarder).collect()}
    assert values["hybridq_events_dropped"] == 2
    assert transport.events[forwarder.checkpoint.owner] == []
    assert job.get_status() == "forwarded"


def test_a_held_job_a_newer_version_refuses_is_recorded_invalid(journal_dir: Path) -> None:
    """Held (delayed) by a version that accepted it, refused when due: terminal, not pending forever."""
    clock = [1_000_000.0]
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 1, run_at=clock[0] + 60)
    transport = MemoryTransport()
    with Forwarder(journal_dir, transport, clock=lambda: clock[0]) as forwarder:
        forwarder.step()
        assert len(forwarder.checkpoint.held) == 1
        clock[0] += 120
        real = Envelope.from_bytes
        try:
            Envelope.from_bytes = classmethod(  # type: ignore[method-assign,assignment]
                lambda cls, raw: (_ for _ in ()).throw(EnvelopeError("refused by a newer version"))
            )
            forwarder.step()
        finally:
            Envelope.from_bytes = real  # type: ignore[method-assign]
        assert forwarder.checkpoint.held == []
        assert forwarder.checkpoint.invalid == 1
    assert transport.queues.get("default", []) == []
    assert job.get_status() == "failed"


def test_status_counts_a_pending_record_whose_time_overflows_a_float(journal_dir: Path) -> None:
    """A planted record the forwarder has not read yet must not crash ``hybridq status``."""
    from hybridq.ops.status import collect_status

    with JournalWriter(journal_dir) as writer:
        writer.append(json.dumps({**VALID, "queue": "default", "created_at": 10**400}).encode())
    assert collect_status(str(journal_dir))["accepted"] == 1


def test_failed_list_shows_a_ledger_entry_a_stricter_decoder_refuses(journal_dir: Path) -> None:
    """A failure recorded by an older version whose envelope is now out of range is still listed."""
    from hybridq.ledger.entries import Entry
    from hybridq.ledger.store import open_ledger_writer
    from hybridq.ops.failures import failed_jobs, requeue

    job = {**VALID, "queue": "default", "retry": {"max_attempts": 10**6}}
    with open_ledger_writer(str(journal_dir)) as ledger:
        ledger.append(Entry("done", job["id"], ("w", 0, 0), outcome="failed", job=job).to_bytes())
    [failed] = failed_jobs(str(journal_dir))
    assert (failed.id, failed.func, failed.envelope) == (job["id"], job["func"], None)
    with pytest.raises(HybridqError):
        requeue([job["id"]], str(journal_dir))
