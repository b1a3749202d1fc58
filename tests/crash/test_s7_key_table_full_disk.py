"""S7 on a real full disk: the key table's write fails on a small tmpfs, the forwarder pauses.

A tmpfs of a few MB holds the journal; keyed jobs are forwarded; the disk is filled right
after the ledger append of the next keyed jobs' ``key`` entries, so the key table's next commit
meets SQLITE_FULL (``COMMIT_ROWS`` is 1 here: a commit per row, as a large backlog's commits
every 20,000 rows). The forwarder must pause (one log line, ``disk_full_retries``), stay up,
open again as a start does once space is back (the ledger replayed into the poisoned table),
and then run every job once, a duplicate of any key never (docs/operations.md "Disk full",
docs/reliability.md "The key table"). Failed on main: the forwarder stopped (EIO).

Needs root (``mount -t tmpfs``): skipped, with the reason, where mounting is refused.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.forwarder import disk_full
from hybridq.forwarder.loop import Forwarder
from hybridq.ledger import tablefile
from hybridq.producer.queue import _close_writers
from hybridq.testing.memory import MemoryTransport

from tests import tasks


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB tmpfs, unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a real full disk) needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs refused: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory: Path) -> Path:
    """Write a file until the disk has not one byte left; return it."""
    path = directory / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        size = 1 << 20
        while size:
            try:
                os.write(fd, b"\0" * size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                size //= 2
    finally:
        os.close(fd)
    return path


def wait_for(what: str, condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def quick_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_full, "DISK_FULL_BACKOFF_S", (0.02, 0.1))
    monkeypatch.setattr(tablefile, "COMMIT_ROWS", 1)


def test_a_full_disk_under_the_key_table_pauses_then_every_keyed_job_runs_once(
    small_disk: Path, quick_pause: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="hybridq.forwarder")
    journal = small_disk / "journal"
    queue = Queue(journal=journal)
    transport = MemoryTransport()
    forwarder = Forwarder(journal, transport, idle_timeout_s=0.05)
    forwarder.open()
    runner = threading.Thread(target=forwarder.run, daemon=True)
    runner.start()
    filler: list[Path] = []
    try:
        first = [queue.enqueue(tasks.add, i, i, idempotency_key=f"k{i}").id for i in range(5)]
        wait_for("the first keyed jobs", lambda: len(transport.queues.get("default", [])) == 5)

        appended = forwarder.state.on_append
        assert appended is not None

        def then_fill(entries, chain, end) -> None:  # after the ledger append, before the rows
            if not filler and any(e.key for e in entries):
                filler.append(fill(small_disk))
            appended(entries, chain, end)

        forwarder.state.on_append = then_fill
        second = [queue.enqueue(tasks.add, i, i, idempotency_key=f"k{i}").id for i in range(5, 10)]
        _close_writers()
        wait_for("the pause", lambda: forwarder.stats.disk_full_retries >= 3)
        assert filler, "the disk was never filled"
        assert runner.is_alive(), "the forwarder stopped on a full disk under the key table"
        paused = [r.getMessage() for r in caplog.records if "forwarding paused" in r.getMessage()]
        # One pause, the key table's: a reopen that writes nothing and a step that follows it do
        # not end it (the next write would meet the full disk again: a second line, a flap).
        assert len(paused) == 1, paused
        assert "the key table" in paused[0]
        assert forwarder.checkpoint.forwarded >= 5  # what /metrics reads while paused: not zeros

        filler[0].unlink()  # space is back: it opens again, as a start does, and goes on
        wait_for("the second keyed jobs", lambda: len(transport.queues.get("default", [])) == 10)
        again = [queue.enqueue(tasks.add, i, i, idempotency_key=f"k{i}").id for i in (0, 7)]
        _close_writers()
        wait_for("the duplicates recorded", lambda: forwarder.admission.suppressed == 2)
        assert runner.is_alive()
        # At the end of the step after the reopen's (a reopen may write nothing: no proof of space).
        wait_for("the pause's end", lambda: any("writing again" in r.getMessage() for r in caplog.records))
        paused = [r.getMessage() for r in caplog.records if "forwarding paused" in r.getMessage()]
        assert len(paused) == 1, paused
    finally:
        forwarder.stop()
        runner.join(timeout=10)
        forwarder.close()
    assert not runner.is_alive()
    transport.work()
    assert {job: transport.executions.get(job) for job in first + second} == dict.fromkeys(first + second, 1)
    assert [transport.executions.get(job) for job in again] == [None, None], "a duplicate key ran"
    # Nothing left held: another forwarder takes the journal at once.
    with Forwarder(journal, MemoryTransport()):
        pass


def test_stop_during_a_key_table_pause_returns_promptly_and_holds_nothing(
    small_disk: Path, quick_pause: None
) -> None:
    """The disk stays full: each try to open again fails, the pause goes on, stop() ends it."""
    journal = small_disk / "journal"
    queue = Queue(journal=journal)
    transport = MemoryTransport()
    forwarder = Forwarder(journal, transport, idle_timeout_s=0.05)
    forwarder.open()
    appended = forwarder.state.on_append
    assert appended is not None

    def then_fill(entries, chain, end) -> None:
        if not (small_disk / "filler").exists():
            fill(small_disk)
        appended(entries, chain, end)

    forwarder.state.on_append = then_fill
    [queue.enqueue(tasks.add, i, i, idempotency_key=f"k{i}") for i in range(3)]
    _close_writers()
    runner = threading.Thread(target=forwarder.run, daemon=True)
    runner.start()
    try:
        wait_for("tries to open again", lambda: forwarder.stats.disk_full_retries >= 5)
        assert runner.is_alive()
    finally:
        asked = time.monotonic()
        forwarder.stop()
        runner.join(timeout=10)
        forwarder.close()
    assert not runner.is_alive()
    assert time.monotonic() - asked < 2.0
    (small_disk / "filler").unlink()
    with Forwarder(journal, transport) as again:  # the lock was released; the jobs are all there
        again.step()
    assert len(transport.queues.get("default", [])) == 3
