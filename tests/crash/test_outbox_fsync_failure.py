"""The relay never deletes a row whose only journal copy is not durable (issue 26, item 5).

The journal's rule (docs/reliability.md rule 9): a failed fsync is fatal for its segment, and
records written but never synced are not durable. The relay's crash check finds the rows a
relay marked in the journal; a record it finds there may never have been synced (its fsync
failed, or its relay was killed before the fsync ended), while the page cache still shows it.
Deleting the row on such a sighting made a power loss lose the job.

The journal's I/O goes through :class:`tests.support.powerloss.PowerLossFileOps`, which knows
what a disk would still hold after the power went out; one ``fdatasync`` of it fails with EIO
(or "kills" the relay). Then the power goes out, and every committed row must be in the journal
or still in the outbox: lost=0.
"""

from __future__ import annotations

import errno
import os
import random
import sqlite3
from pathlib import Path

import pytest
from hybridq.envelope.model import Envelope
from hybridq.errors import JournalIOError
from hybridq.journal import JournalReader
from hybridq.outbox import Outbox
from hybridq.outbox.relay import Relay

from tests.support.powerloss import PowerLossFileOps

TASK = "tests.tasks.add"
ROWS = 3


class Killed(BaseException):
    """The relay's process dies here (a SIGKILL, the OOM killer): nothing after it runs."""


class FailingSync(PowerLossFileOps):
    """Power loss simulated, and the ``nth`` ``fdatasync`` raising ``error`` (not made durable)."""

    def __init__(self, nth: int, error: BaseException) -> None:
        super().__init__()
        self.nth, self.error, self.syncs = nth, error, 0

    def fdatasync(self, fd: int) -> None:
        self.syncs += 1
        if self.syncs == self.nth:
            raise self.error
        super().fdatasync(fd)


@pytest.fixture
def outbox_db(tmp_path: Path) -> tuple[str, list[str]]:
    """An SQLite outbox holding ROWS committed rows; its DSN and their job ids."""
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        Outbox().create_table(conn)
        ids = [Outbox().enqueue(conn, TASK, i, 0) for i in range(ROWS)]
    return f"sqlite:///{path}", ids


def opened(dsn: str, journal: Path, ops: PowerLossFileOps) -> Relay:
    relay = Relay(dsn, str(journal), fileops=ops)
    relay.open()
    return relay


def die(relay: Relay) -> None:
    """What a relay's death leaves: its database lock released, its segment unsealed.

    The segment's fd stays open (still locked) until the power loss closes it with the others.
    """
    relay.store.close()
    writer = relay._writer
    assert writer is not None
    writer._closed = True  # nothing more is written through it, and nothing is sealed
    os.close(writer._dir_fd)


def lost_after_power_loss(dsn: str, journal: Path, ops: PowerLossFileOps, ids: list[str]) -> list[str]:
    """Cut the power; the committed jobs neither in the journal nor still in the outbox."""
    ops.crash("drop", random.Random(0))
    ops.release()
    in_journal = {Envelope.from_bytes(r.payload).id for r in JournalReader(journal).records()}
    with sqlite3.connect(dsn.removeprefix("sqlite:///")) as conn:
        in_outbox = {job for (job,) in conn.execute("SELECT job_id FROM hybridq_outbox")}
    return [job for job in ids if job not in in_journal | in_outbox]


@pytest.mark.parametrize("again", ["same-relay", "new-relay", "unmark-failed"])
def test_a_batch_whose_fsync_failed_is_appended_again_not_deleted(
    outbox_db: tuple[str, list[str]], journal_dir: Path, again: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next pass (the same relay, or a new one as `hybridq relay` restarted and the
    forwarder's supervised relay make) found the unsynced records and deleted the rows."""
    dsn, ids = outbox_db
    ops = FailingSync(1, OSError(errno.EIO, "injected"))
    relay = opened(dsn, journal_dir, ops)
    if again == "unmark-failed":  # the rows stay marked: the failed segment still proves nothing

        def unmark(ids: list[int]) -> None:
            raise sqlite3.OperationalError("database is locked")

        monkeypatch.setattr(relay.store, "unmark", unmark)
    with pytest.raises(JournalIOError):
        relay.step()
    if again == "new-relay":
        relay.close()
        relay = opened(dsn, journal_dir, ops)
    try:
        assert relay.run_once() == ROWS
    finally:
        relay.close()
    assert lost_after_power_loss(dsn, journal_dir, ops, ids) == []


def test_rows_a_relay_killed_before_its_fsync_ended_are_made_durable_before_their_delete(
    outbox_db: tuple[str, list[str]], journal_dir: Path
) -> None:
    """Killed between its write and the end of its fsync: its records are in the page cache,
    not on the disk. The next relay finds them there: it syncs them before deleting the rows."""
    dsn, ids = outbox_db
    ops = FailingSync(1, Killed())
    dead = opened(dsn, journal_dir, ops)
    with pytest.raises(Killed):
        dead.step()
    die(dead)
    relay = opened(dsn, journal_dir, ops)
    try:
        assert relay.run_once() == ROWS
    finally:
        relay.close()
    assert relay.skipped_present == ROWS  # found in the journal: not appended a second time
    assert lost_after_power_loss(dsn, journal_dir, ops, ids) == []
