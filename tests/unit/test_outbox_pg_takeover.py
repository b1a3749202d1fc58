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
from collections.abc import Iterator
from dataclasses import dataclass
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


def marked_by_a_dead_relay(dsn: str, journal: Path) -> int:
    """A relay on ``journal`` marks the two oldest rows and dies; its token."""
    other = opened(dsn, journal, batch_size=2)
    token: int = other.store.token  # type: ignore[attr-defined]
    assert len(other.store.claim(2)) == 2
    other.close()
    return token


def watch(relay: Relay, clock: Clock) -> None:
    """Housekeeping passes every ``WATCH_GAP_S`` for the whole grace (as an idle relay's polls)."""
    for _ in range(int(pg_module.ADOPT_AFTER_S / pg_module.WATCH_GAP_S) + 1):
        clock.now += pg_module.WATCH_GAP_S
        relay.store.housekeeping()


@dataclass
class Scene:
    """Two rows marked by a relay on journal ``b`` that died, and a relay on journal ``a``."""

    dsn: str
    tmp_path: Path
    ids: list[str]
    token: int
    relay: Relay


@pytest.fixture
def scene(pg: str, tmp_path: Path) -> Iterator[Scene]:  # noqa: F811 - the fixture
    ids = enqueue_many(pg, 2)
    token = marked_by_a_dead_relay(pg, tmp_path / "b")
    relay = opened(pg, tmp_path / "a")
    try:
        yield Scene(pg, tmp_path, ids, token, relay)
    finally:
        relay.close()


def test_a_relay_that_came_back_and_died_again_is_given_the_whole_grace_again(
    scene: Scene, clock: Clock
) -> None:
    dsn, relay, b_token = scene.dsn, scene.relay, scene.token
    seen_free(dsn, relay, b_token)  # its clock starts now
    assert marks(dsn, scene.ids) == {b_token}
    back = opened(dsn, scene.tmp_path / "b")  # restarted on its journal: its own rows at once
    assert back.store.token == b_token  # type: ignore[attr-defined]
    back.run_once()
    relay.store.housekeeping()  # nothing of its rows left to look at
    clock.now += pg_module.ADOPT_AFTER_S + 1  # it has lived all along since
    later = enqueue_many(dsn, 2, start=2)
    rows = back.store.claim(2)
    with JournalWriter(str(scene.tmp_path / "b")) as writer:  # appended, then killed before the delete
        writer.append_many([env for _, _, env, _, _ in rows])
    back.store.close()
    back.close()
    seen_free(dsn, relay, b_token)
    relay.run_once()
    assert marks(dsn, later) == {b_token}, "taken over at the first look, not after the grace"
    assert set(journal_ids(scene.tmp_path / "a")).isdisjoint(later)
    watch(relay, clock)  # the whole grace, watched: taken over
    relay.run_once()
    assert set(later) <= set(journal_ids(scene.tmp_path / "a"))  # in both journals, as documented


def test_a_relay_not_looked_at_for_long_gets_its_grace_again(scene: Scene, clock: Clock) -> None:
    """Free at two looks far apart says nothing of the time between: it may have lived then."""
    seen_free(scene.dsn, scene.relay, scene.token)
    clock.now += pg_module.ADOPT_AFTER_S + 1  # no look in between (a busy relay)
    scene.relay.store.housekeeping()
    scene.relay.run_once()
    assert marks(scene.dsn, scene.ids) == {scene.token}
    watch(scene.relay, clock)
    scene.relay.run_once()
    assert sorted(journal_ids(scene.tmp_path / "a")) == sorted(scene.ids)
