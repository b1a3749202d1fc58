"""Requeueing a failed job is atomic: two requeues at once accept it again once (review H1)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import hybridq
import pytest
from hybridq.errors import JobNotFailed
from hybridq.journal import JournalReader, RecordType
from hybridq.ops import failures
from hybridq.testing import fake_stack


@hybridq.task(queue="mail", retry=hybridq.Retry(max_attempts=1))
def doomed(note: str) -> None:
    raise ValueError(f"bad {note}")


def test_two_requeues_at_once_accept_the_job_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = str(tmp_path / "journal")
    with fake_stack(journal, queues=["mail"]) as stack:
        bad = doomed.delay("x")
        stack.run()
        assert [j.id for j in hybridq.failed_jobs(journal)] == [bad.id]
        read = failures.failed_jobs

        def slow_read(path: str | None = None) -> list[failures.FailedJob]:
            out = read(path)
            time.sleep(0.3)  # both racers read the list before either writes (without the lock)
            return out

        monkeypatch.setattr(failures, "failed_jobs", slow_read)
        barrier = threading.Barrier(2)
        results: list[object] = []

        def go() -> None:
            barrier.wait()
            try:
                results.append([j.id for j in failures.requeue([bad.id], journal)])
            except JobNotFailed as exc:
                results.append(exc)

        threads = [threading.Thread(target=go) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(map(type, results), key=str) == sorted([list, JobNotFailed], key=str)
        data = [r for r in JournalReader(journal).records() if r.rtype == RecordType.DATA]
        assert len(data) == 2  # the first acceptance and one requeue, not two
        monkeypatch.setattr(failures, "failed_jobs", read)
        assert hybridq.failed_jobs(journal) == []
