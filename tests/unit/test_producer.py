"""The enqueue API: what it writes, what it refuses (writing nothing), backpressure, task."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import hybridq
import pytest
from hybridq import EnvelopeError, NotSerializable, Queue, QueueFull, RecordTooLarge, Retry, task
from hybridq.errors import ConfigError
from hybridq.journal import JournalReader

from tests import tasks


def records(journal: Path) -> list[dict]:
    return [json.loads(r.payload) for r in JournalReader(journal).records()]


def test_enqueue_commits_one_envelope_and_returns_a_job(journal_dir: Path) -> None:
    queue = Queue("emails", journal_dir)
    job = queue.enqueue(tasks.add, 1, 2, job_timeout=30, description="sum")
    (rec,) = records(journal_dir)
    assert rec["id"] == job.id
    assert rec["func"] == "tests.tasks.add"
    assert rec["args"] == [1, 2]
    assert rec["queue"] == job.queue == "emails"
    assert rec["key"] == job.idempotency_key == job.id  # default key: derived from the job id
    assert rec["timeout"] == 30
    assert rec["description"] == "sum"
    assert job.get_status() == "accepted"


def test_a_given_idempotency_key_is_kept_verbatim(journal_dir: Path) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2, idempotency_key="order 42 ☃")
    assert job.idempotency_key == "order 42 ☃"
    assert records(journal_dir)[0]["key"] == "order 42 ☃"


def test_enqueue_call_keeps_option_names_for_the_function(journal_dir: Path) -> None:
    Queue(journal=journal_dir).enqueue_call(tasks.add, args=[1], kwargs={"description": "x", "b": 2})
    assert records(journal_dir)[0]["kwargs"] == {"description": "x", "b": 2}


def test_enqueue_many_is_one_batch(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    jobs = queue.enqueue_many([queue.prepare(tasks.add, (i, i)) for i in range(100)])
    assert [r["args"] for r in records(journal_dir)] == [[i, i] for i in range(100)]
    assert len({j.id for j in jobs}) == 100


def test_delay_and_run_at_become_an_absolute_time(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    before = dt.datetime.now(dt.UTC).timestamp()
    queue.enqueue(tasks.add, 1, 1, delay=60)
    queue.enqueue(tasks.add, 1, 1, delay=dt.timedelta(minutes=2))
    at = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    queue.enqueue(tasks.add, 1, 1, run_at=at)
    # The last two are in the process's delayed chain (docs/journal.md): read in run_at order.
    first, second, third = sorted(records(journal_dir), key=lambda r: r["run_at"])
    assert before + 59 < first["run_at"] < before + 70
    assert before + 119 < second["run_at"] < before + 130
    assert third["run_at"] == at.timestamp()


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda q: q.enqueue(tasks.add, object()), NotSerializable),
        (lambda q: q.enqueue(tasks.add, 1j), TypeError),  # a set is a tagged value now (docs/api.md)
        (lambda q: q.enqueue(lambda: None), EnvelopeError),
        (lambda q: q.enqueue("no_dots"), ValueError),
        (lambda q: q.enqueue(tasks.add, job_id="bad id"), EnvelopeError),
        (lambda q: q.enqueue(tasks.add, job_timeout=-1), EnvelopeError),
        (lambda q: q.enqueue(tasks.add, delay=5, run_at=9), EnvelopeError),
        (lambda q: q.enqueue(tasks.add, run_at=dt.datetime(2030, 1, 1)), EnvelopeError),  # noqa: DTZ001 - naive on purpose  # noqa: DTZ001
        (lambda q: q.enqueue(tasks.add, retry=3), EnvelopeError),
        (lambda q: q.enqueue(tasks.add, delay=10**400), EnvelopeError),  # was OverflowError
        (lambda q: q.enqueue(tasks.add, run_at=10**400), EnvelopeError),
        (lambda q: q.enqueue(tasks.add, job_timeout=10**400), EnvelopeError),
        (lambda q: q.enqueue(tasks.add, idempotency_key=""), EnvelopeError),
        (lambda q: q.enqueue(tasks.add, "x" * (2 << 20)), RecordTooLarge),
        (lambda q: q.enqueue_many([q.prepare(tasks.add, (1,)), ("not", "an envelope")]), TypeError),
    ],
)
def test_bad_input_raises_and_writes_nothing(journal_dir: Path, call, error) -> None:
    queue = Queue(journal=journal_dir)
    with pytest.raises(error):
        call(queue)
    assert list(journal_dir.iterdir()) == []  # not even a segment file


@pytest.mark.parametrize("name", ["", "has space", "../up", "-x"])
def test_invalid_queue_names_are_refused(journal_dir: Path, name: str) -> None:
    with pytest.raises(EnvelopeError):
        Queue(name, journal_dir)


def test_the_journal_defaults_to_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDQ_JOURNAL", str(tmp_path / "from-env"))
    assert Queue().journal == str(tmp_path / "from-env")
    monkeypatch.delenv("HYBRIDQ_JOURNAL")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="no journal configured"):  # none in the cwd (issue 17)
        _ = Queue().journal
    assert not (tmp_path / "hybridq-journal").exists()


def test_over_capacity_enqueue_raises_queue_full_and_writes_nothing(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir, capacity=5)
    for i in range(5):
        queue.enqueue(tasks.add, i, i)
    with pytest.raises(QueueFull) as info:
        queue.enqueue(tasks.add, 9, 9)
    assert (info.value.pending, info.value.capacity) == (5, 5)
    with pytest.raises(QueueFull):
        queue.enqueue_many([queue.prepare(tasks.add, (1, 1))])
    assert len(records(journal_dir)) == 5


def test_capacity_counts_other_processes_jobs_too(journal_dir: Path) -> None:
    other = Queue(journal=journal_dir)
    for _ in range(3):
        other.enqueue(tasks.add, 1, 1)
    limited = Queue(journal=journal_dir, capacity=4)
    limited.enqueue(tasks.add, 1, 1)
    with pytest.raises(QueueFull):
        limited.enqueue(tasks.add, 1, 1)


@task(queue="reports", job_timeout=60, retry=Retry(max_attempts=2))
def build_report(n: int) -> int:
    return n * 2


def test_task_decorator_calls_directly_and_delays(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDQ_JOURNAL", str(journal_dir))
    assert build_report(21) == 42  # a plain call runs here and now
    build_report._queue = None  # resolve the journal from the environment set above
    job = build_report.delay(5)
    (rec,) = records(journal_dir)
    assert rec["func"] == "tests.unit.test_producer.build_report"
    assert rec["queue"] == job.queue == "reports"
    assert rec["timeout"] == 60
    assert rec["retry"]["max_attempts"] == 2
    keyed = build_report.enqueue_call([6], idempotency_key="report-6")
    assert keyed.idempotency_key == "report-6"


def test_the_public_api_is_pinned() -> None:
    assert set(hybridq.__all__) >= {
        "Queue",
        "Job",
        "task",
        "Retry",
        "HybridqError",
        "QueueFull",
        "EnvelopeError",
        "NotSerializable",
        "JournalCorruption",
        "TransportError",
        "Durability",
    }


def test_a_journal_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    from hybridq import JournalPathError

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(JournalPathError, match="cannot create"):
        Queue(journal=blocker / "journal")


def test_capacity_is_exact_under_concurrent_enqueues(journal_dir: Path) -> None:
    import threading

    queue = Queue(journal=journal_dir, capacity=20)
    accepted = refused = 0
    lock = threading.Lock()

    def work() -> None:
        nonlocal accepted, refused
        for _ in range(5):
            try:
                queue.enqueue(tasks.add, 1, 1)
                with lock:
                    accepted += 1
            except QueueFull:
                with lock:
                    refused += 1

    threads = [threading.Thread(target=work) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (accepted, refused) == (20, 60)
    assert len(records(journal_dir)) == 20


@pytest.mark.parametrize("option", ["ttl", "failure_ttl", "at_front", "depends_on", "on_success"])
def test_rq_options_hybridq_does_not_support_are_refused_not_passed_on(
    journal_dir: Path, option: str
) -> None:
    with pytest.raises(EnvelopeError, match=option):
        Queue(journal=journal_dir).enqueue(tasks.add, 1, **{option: 1})
    assert list(journal_dir.iterdir()) == []


def test_rq_style_explicit_args_and_kwargs(journal_dir: Path) -> None:
    Queue(journal=journal_dir).enqueue(tasks.add, args=(1,), kwargs={"b": 2}, job_timeout=5)
    (rec,) = records(journal_dir)
    assert (rec["args"], rec["kwargs"], rec["timeout"]) == ([1], {"b": 2}, 5)
    with pytest.raises(EnvelopeError, match="explicit"):
        Queue(journal=journal_dir).enqueue(tasks.add, 1, args=(2,))


def test_the_hybridq_meta_key_is_reserved(journal_dir: Path) -> None:
    with pytest.raises(EnvelopeError, match="reserved"):
        Queue(journal=journal_dir).enqueue(tasks.add, 1, 2, meta={"hybridq": 1})
