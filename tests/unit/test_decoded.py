"""The envelopes of the rows the forwarder spilled, kept for the refill (forwarder/decoded.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hybridq.envelope.model import Envelope
from hybridq.forwarder import Forwarder, records
from hybridq.forwarder import decoded as decoded_module
from hybridq.forwarder.decoded import Decoded

from tests.unit.test_window import WindowedTransport, enqueue, forwarder, one_step_then_stop


def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many records a refill read back from the journal and decoded."""
    calls: list[int] = []
    real = records.decode_job

    def counting(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(records, "decode_job", counting)
    return calls


def drain(f: Forwarder, transport: WindowedTransport, steps: int) -> None:
    """``steps`` forwarder steps, each after the workers took what was queued."""
    for _ in range(steps):
        transport.work("default")
        f.step()


def test_the_refill_pushes_the_envelopes_it_read_without_reading_them_again(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails before: the 900 rows spilled were each read back and decoded by the refill."""
    ids = enqueue(journal_dir, 1000)
    transport = WindowedTransport()
    f = forwarder(journal_dir, transport, window_min=100, window_max=100)
    try:
        f.step()
        assert f.state.runs.waiting("default") == 900
        reads = count_reads(monkeypatch)
        drain(f, transport, 30)
        assert transport.executions == dict.fromkeys(ids, 1)
        assert transport.pushed_ids == ids  # in journal order, each once
        assert reads == []
        assert len(f.state.decoded) == 0
    finally:
        f.close()


def test_a_restart_reads_the_rows_back_from_the_journal(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids, transport = one_step_then_stop(journal_dir, 300)
    reads = count_reads(monkeypatch)
    f = forwarder(journal_dir, transport, window_min=100, window_max=100)
    try:
        drain(f, transport, 10)
        assert transport.executions == dict.fromkeys(ids, 1)
        assert len(reads) == 200  # nothing kept across a restart: each row read back once
    finally:
        f.close()


def envelope(n: int) -> Envelope:
    env = Envelope.from_bytes(
        b'{"v": 1, "id": "%032x", "func": "tests.tasks.add", "queue": "q", "key": "%032x", "created_at": 1}'
        % (n, n)
    )
    assert env.source is not None
    return env


def test_the_cache_is_bounded_and_keeps_the_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decoded_module, "KEPT_JOBS", 3)
    now = [0.0]
    cache = Decoded(clock=lambda: now[0])
    for n in range(5):
        cache.keep(("w", 0, n), envelope(n))
    assert len(cache) == 3  # full: the newest are not kept (the oldest are pushed first)
    assert cache.take(("w", 0, 4)) is None
    assert cache.take(("w", 0, 0)) == envelope(0)
    assert cache.take(("w", 0, 0)) is None  # taken once
    now[0] = decoded_module.KEPT_S + 1
    cache.keep(("w", 0, 5), envelope(5))
    cache.keep(("w", 0, 6), envelope(6))
    cache.keep(("w", 0, 7), envelope(7))  # full again: those kept over KEPT_S ago went
    assert [cache.take(("w", 0, n)) is not None for n in (1, 2, 5, 6, 7)] == [False, False, True, True, True]
    built = Envelope.from_dict(
        {"v": 1, "id": "a" * 32, "func": "tests.tasks.add", "queue": "q", "key": "a", "created_at": 1}
    )
    cache.keep(("w", 1, 0), built)  # not decoded from a record: nothing to bound it by, not kept
    assert len(cache) == 0


def test_a_record_kept_twice_counts_once_and_its_memory_counts_its_containers() -> None:
    """A re-read (the delivery's rollback) keeps the same location again: counted once. A record
    of many small containers decodes to far more than its bytes: its estimate says so."""
    from hybridq.forwarder.decoded import memory_of

    cache = Decoded()
    env = envelope(0)
    cache.keep(("w" * 16, 0, 64), env)
    once = cache._bytes
    cache.keep(("w" * 16, 0, 64), env)
    assert cache._bytes == once
    assert cache.take(("w" * 16, 0, 64)) is env
    assert cache._bytes == 0
    nested = b'{"args": [' + b",".join([b"{}"] * 200) + b"]}"
    assert memory_of(nested) > 15 * len(nested)


def test_keeping_into_a_full_cache_does_not_copy_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every keep into a full cache looks for expired entries: that look copied the whole cache,
    and a million-job drain ran at a third of its rate (the forwarder's time went there)."""

    def no_copy(items: object) -> list[object]:
        raise AssertionError("the cache was copied")

    monkeypatch.setattr(decoded_module, "KEPT_JOBS", 3)
    cache = Decoded(clock=lambda: 0.0)
    for n in range(3):
        cache.keep(("w", 0, n), envelope(n))
    monkeypatch.setattr(decoded_module, "list", no_copy, raising=False)
    cache.keep(("w", 0, 3), envelope(3))  # full, nothing expired: not kept, nothing scanned
    assert len(cache) == 3
