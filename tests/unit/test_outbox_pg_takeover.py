"""Taking over another journal's relay's rows on PostgreSQL only after its lock stayed free 60 s.

A relay marks the rows it claims with its token; rows of a relay on another journal are taken
over once that relay's advisory lock has been free for ``ADOPT_AFTER_S`` (docs/outbox.md, "The
relay on PostgreSQL"). Issue 26, item 6: a "first seen free" time kept from an earlier death of
that relay, one it came back from, made a later death look 60 s old at once: the rows were taken
over at the first look and the job was in both journals. A fake clock stands in for the 60 s.
"""

from __future__ import annotations

import time
import types
from pathlib import Path

import psycopg
import pytest
from hybridq.journal import JournalWriter
from hybridq.outbox import pg as pg_module
from hybridq.outbox.relay import Relay

from tests.unit.test_outbox_pg import enqueue_many, journal_ids, opened, pg  # noqa: F401 - the fixture

DEADLINE_S = 10.0


class Clock:
    """``time.monotonic`` for the PostgreSQL store only: moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(pg_module, "time", types.SimpleNamespace(monotonic=fake.monotonic))
    return fake


def marks(dsn: str, job_ids: list[str]) -> set[int]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT relaying FROM hybridq_outbox WHERE job_id = ANY(%s)", (job_ids,))
        return {int(r[0]) for r in rows}


def seen_free(dsn: str, relay: Relay, other: int) -> None:
    """Once the advisory lock of ``other`` is free (its session ended), one housekeeping pass."""
    deadline = time.monotonic() + DEADLINE_S
    with psycopg.connect(dsn, autocommit=True) as conn:
        # A bigint advisory lock shows as its high and low 32 bits (classid, objid).
        held = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND (classid::bigint << 32 | objid::bigint) = %s"
        while conn.execute(held, (other,)).fetchone() != (0,):
            assert time.monotonic() < deadline, "the gone relay's lock never came free"
            time.sleep(0.02)
    relay.store.housekeeping()


def watch(relay: Relay, clock: Clock) -> None:
    """Housekeeping passes every ``WATCH_GAP_S`` for the whole grace (as an idle relay's polls)."""
    for _ in range(int(pg_module.ADOPT_AFTER_S / pg_module.WATCH_GAP_S) + 1):
        clock.now += pg_module.WATCH_GAP_S
        relay.store.housekeeping()


def test_a_relay_that_came_back_and_died_again_is_given_the_whole_grace_again(
    pg: str,  # noqa: F811 - the fixture
    tmp_path: Path,
    clock: Clock,
) -> None:
    first = enqueue_many(pg, 2)
    other = opened(pg, tmp_path / "b", batch_size=2)
    b_token = other.store.token  # type: ignore[attr-defined]
    assert len(other.store.claim(2)) == 2  # marked, then its relay dies
    other.close()
    relay = opened(pg, tmp_path / "a")
    try:
        seen_free(pg, relay, b_token)  # its clock starts now
        assert marks(pg, first) == {b_token}
        back = opened(pg, tmp_path / "b")  # restarted on its journal: its own rows at once
        assert back.store.token == b_token  # type: ignore[attr-defined]
        back.run_once()
        relay.store.housekeeping()  # nothing of its rows left to look at
        clock.now += pg_module.ADOPT_AFTER_S + 1  # it has lived all along since
        later = enqueue_many(pg, 2, start=2)
        rows = back.store.claim(2)
        with JournalWriter(str(tmp_path / "b")) as writer:  # appended, then killed before the delete
            writer.append_many([env for _, _, env, _, _ in rows])
        back.store.close()
        back.close()
        seen_free(pg, relay, b_token)
        relay.run_once()
        assert marks(pg, later) == {b_token}, "taken over at the first look, not after the grace"
        assert set(journal_ids(tmp_path / "a")).isdisjoint(later)
        watch(relay, clock)  # the whole grace, watched: taken over
        relay.run_once()
    finally:
        relay.close()
    assert set(later) <= set(journal_ids(tmp_path / "a"))  # in both journals, as documented


def test_a_relay_not_looked_at_for_long_gets_its_grace_again(
    pg: str,  # noqa: F811 - the fixture
    tmp_path: Path,
    clock: Clock,
) -> None:
    """Free at two looks far apart says nothing of the time between: it may have lived then."""
    ids = enqueue_many(pg, 2)
    other = opened(pg, tmp_path / "b", batch_size=2)
    b_token = other.store.token  # type: ignore[attr-defined]
    other.store.claim(2)
    other.close()
    relay = opened(pg, tmp_path / "a")
    try:
        seen_free(pg, relay, b_token)
        clock.now += pg_module.ADOPT_AFTER_S + 1  # no look in between (a busy relay)
        relay.store.housekeeping()
        relay.run_once()
        assert marks(pg, ids) == {b_token}
        watch(relay, clock)
        relay.run_once()
    finally:
        relay.close()
    assert sorted(journal_ids(tmp_path / "a")) == sorted(ids)
