"""The ended runs' sets against a real Redis (hybridq.worker.limit_scripts ``limit_end``, ``limit_ended``).

A renewal sent before a run's outcome and run after it must not take the slot back, also once a
later run's outcome replaced the stored one. The renewal that lost its lease reads the stored
outcome (which names its run) first; the outcome keeps a run's end in a set per 10 s (10 minutes)
of Redis's clock only where that stored outcome will not name it: kept another run's success,
stored less than ``END_STORED_S``, or replaced by a later run's (docs/forwarder.md, "Limits per key").
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from hybridq.envelope.model import new_job_id
from hybridq.protocol import ClaimStatus, keys
from hybridq.transport.rq_scripts import _FORGET
from hybridq.worker.limit_scripts import END_STORED_S

from tests.integration.test_key_limits_scripts import claim, conn, finish, renew, settled, token

__all__ = ["conn"]  # the fixture, used by this module's tests

DAY_S = 86400  # a key TTL of the usual kind: far longer than the ended sets keep an end


def attempts(limit: str) -> tuple[str, str, str]:
    """A job's id and the tokens of its attempts 1 and 2 (on two hosts), limited by ``limit``."""
    job_id = new_job_id(time.time())
    return job_id, f"{job_id}/1/host-1/aaaa#L{limit}", f"{job_id}/2/host-2/bbbb#L{limit}"


def test_a_renewal_after_its_runs_outcome_was_replaced_by_a_later_runs_does_not_take_the_slot_back(
    conn: redis.Redis,
) -> None:
    # Run A stored its own failure; the retry (run B) ran and stored its outcome over it; A's
    # renewal, sent before A's outcome, runs now: the stored outcome is no longer A's.
    settled(conn)
    job_id, run, later = attempts("1,0,0,tenant:o")
    assert claim(conn, run)[0] == ClaimStatus.CLAIMED
    assert finish(conn, run, what="failed") == 0
    failed = f'{{"outcome":"failed","job_id":"{job_id}","attempt":2,"requeue":0,"token":"{later}"}}'
    conn.set(keys.result(job_id), failed)
    assert renew(conn, run) & 4 == 0, "the ended run took its slot back"
    assert claim(conn, token("1,0,0,tenant:o"))[0] == ClaimStatus.CLAIMED


def ended_runs(conn: redis.Redis) -> dict[bytes, set[bytes]]:
    """Every set of ended runs (one per 10 s, or 10 minutes) and what it holds."""
    return {key: conn.smembers(key) for key in conn.keys(f"{keys.LIMITS_ENDED}:*")}


def test_the_ended_runs_of_every_key_are_in_sets_by_time_and_a_refusal_sent_again_is_admitted(
    conn: redis.Redis,
) -> None:
    # Sets for every key (with a key per tenant and a job or two each, a set per key was
    # created at one outcome and dropped by its expiry), one per 10 s: kept a minute to a
    # minute and 10 s, not an hour. A run admitted, whose claim is refused by a full key, and then made
    # again by its holder, is admitted: the holder check is made only when a refusal would be given.
    settled(conn)
    runs = []
    for key in ("tenant:e1", "tenant:e2"):
        run = token(f"1,0,0,{key}")
        assert claim(conn, run)[0] == ClaimStatus.CLAIMED
        finish(conn, run)
        runs.append(run)
    ended = ended_runs(conn)
    assert set().union(*ended.values()) == {r.encode() for r in runs}
    assert all(key.decode().split(":")[-1].startswith("m") for key in ended), ended
    assert not conn.keys(f"{keys.LIMIT_PREFIX}tenant:e*:ended")
    for key in ended:
        assert 50_000 < conn.pttl(key) <= 70_000, "a minute after its span, not an hour on"
    holder = token("1,0,0,tenant:e3")
    assert claim(conn, holder)[0] == ClaimStatus.CLAIMED
    conn.delete(keys.lease(holder.split("/", 1)[0]))  # its lease lost, its slot still held
    assert claim(conn, holder)[0] == ClaimStatus.CLAIMED, "the slot is its own: admitted again"
    assert claim(conn, token("1,0,0,tenant:e3"))[0] != ClaimStatus.CLAIMED, "another run: over the limit"


def test_ended_sets_of_another_type_fail_no_outcome_and_no_renewal(conn: redis.Redis) -> None:
    # One key for every limit key: written by something else, it must not fail every limited
    # run's outcome (the per-key set it replaced could fail only its own key's).
    settled(conn)
    now_ms = int(time.time() * 1000)
    for at in range(now_ms - 60_000, now_ms + 20_000, 10_000):
        conn.set(keys.limits_ended(at), "not a set")
    run = token("1,0,0,tenant:odd-ended")
    assert claim(conn, run)[0] == ClaimStatus.CLAIMED
    finish(conn, run)
    assert claim(conn, token("1,0,0,tenant:odd-ended"))[0] == ClaimStatus.CLAIMED, "its slot was freed"
    job_id = run.split("/", 1)[0]
    conn.set(keys.result(job_id), f'{{"outcome":"failed","job_id":"{job_id}","attempt":2,"token":"x"}}')
    # A later run's outcome replaced its own: only the ended set could say this run ended.
    assert renew(conn, run) & 4 == 4, "not known to have ended: the slot is held again (one run fewer)"


def test_a_renewal_finds_its_run_ended_a_minute_before(conn: redis.Redis) -> None:
    # An end is kept in the set of its 10 s until a minute after them: a renewal run up to a
    # minute after the outcome still finds it there (the renewal reads the last minute's sets).
    settled(conn)
    run = token("1,0,0,tenant:late")
    assert claim(conn, run)[0] == ClaimStatus.CLAIMED
    finish(conn, run)
    job_id = run.split("/", 1)[0]
    conn.set(keys.result(job_id), f'{{"outcome":"failed","job_id":"{job_id}","attempt":2,"token":"x"}}')
    for key in ended_runs(conn):
        conn.delete(key)
    # Redis's clock (the renewal reads it): five spans back, six if one ends before the renewal.
    now_ms = redis_ms(conn)
    conn.sadd(keys.limits_ended(now_ms - 50_000), run)
    assert renew(conn, run) & 4 == 0, "the ended run took its slot back"
    conn.delete(keys.limits_ended(now_ms - 50_000))
    conn.sadd(keys.limits_ended(now_ms - 3_000_000, kept=True), run)
    assert renew(conn, run) & 4 == 0, "an end kept an hour is found in the hour before too"


def redis_ms(conn: redis.Redis) -> int:
    seconds, micros = conn.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_a_renewal_finds_an_end_written_when_redis_clock_read_later(conn: redis.Redis) -> None:
    # Redis's clock stepped back (or a replica behind took over) after the outcome: the end is
    # in the next span's set, which the renewal reads too.
    settled(conn)
    run = token("1,0,0,tenant:ahead")
    assert claim(conn, run)[0] == ClaimStatus.CLAIMED
    job_id = run.split("/", 1)[0]
    conn.delete(keys.lease(job_id))  # its lease lost: only the ended sets can say it ended
    conn.set(keys.result(job_id), f'{{"outcome":"failed","job_id":"{job_id}","attempt":2,"token":"x"}}')
    conn.sadd(keys.limits_ended(redis_ms(conn) + 10_000), run)
    assert renew(conn, run) & 4 == 0, "the ended run took its slot back"


def test_a_renewal_whose_lease_is_its_own_reads_no_ended_set(conn: redis.Redis) -> None:
    # Its outcome deletes its lease: while the lease is its own it has not ended, whatever the
    # (shared, writable) ended sets say.
    settled(conn)
    run = token("1,0,0,tenant:own")
    assert claim(conn, run)[0] == ClaimStatus.CLAIMED
    conn.sadd(keys.limits_ended(redis_ms(conn)), run)
    assert renew(conn, run) & 4 == 4, "its slot is held a lease on"
    assert claim(conn, token("1,0,0,tenant:own")) == (ClaimStatus.FENCED, "limited: concurrency")


def test_an_outcome_stored_long_keeps_no_end_and_a_late_renewal_reads_the_stored_outcome(
    conn: redis.Redis,
) -> None:
    # The stored outcome names the run for longer than the ended sets would: no SADD.
    settled(conn)
    run = token("1,0,0,tenant:long")
    assert claim(conn, run)[0] == ClaimStatus.CLAIMED
    assert finish(conn, run, what="failed", ttl_s=DAY_S) == 0
    assert ended_runs(conn) == {}, "no end kept: its stored outcome names it"
    assert renew(conn, run) & 4 == 0, "the ended run took its slot back"
    assert claim(conn, token("1,0,0,tenant:long"))[0] == ClaimStatus.CLAIMED


def test_a_later_runs_outcome_keeps_the_end_of_the_limited_run_whose_outcome_it_replaces(
    conn: redis.Redis,
) -> None:
    # Run A stored its failure (no end kept); the retry B stores its outcome over it: from then
    # on only the ended sets say A ended. Without B's outcome adding A's end, A's late renewal
    # took its slot back for a lease.
    settled(conn)
    _, run, later = attempts("2,0,0,tenant:rep")
    assert claim(conn, run)[0] == ClaimStatus.CLAIMED
    assert finish(conn, run, what="failed", ttl_s=DAY_S) == 0
    assert claim(conn, later, attempt=2)[0] == ClaimStatus.CLAIMED
    assert finish(conn, later, what="failed", attempt=2, ttl_s=DAY_S) == 0
    kept = set().union(*ended_runs(conn).values())
    assert kept == {run.encode()}, "the replaced run's end, and only it"
    assert renew(conn, run) & 4 == 0, "the replaced run took its slot back"
    assert renew(conn, later) & 4 == 0, "the later run's own outcome names it"
    assert conn.zcard(f"{keys.LIMIT_PREFIX}tenant:rep:run") == 0


def test_an_outcome_stored_less_than_the_sets_keep_an_end_keeps_its_end(conn: redis.Redis) -> None:
    # Stored 60 s (under END_STORED_S): once it expired only the ended set says the run ended.
    settled(conn)
    run = token("1,0,0,tenant:short")
    assert claim(conn, run)[0] == ClaimStatus.CLAIMED
    assert finish(conn, run, what="failed", ttl_s=60) == 0
    assert set().union(*ended_runs(conn).values()) == {run.encode()}
    conn.delete(keys.result(run.split("/", 1)[0]))  # its lifetime over
    assert renew(conn, run) & 4 == 0, "the ended run took its slot back"


def test_an_outcome_that_kept_another_runs_success_keeps_its_end_an_hour_whatever_the_key_ttl(
    conn: redis.Redis,
) -> None:
    settled(conn)
    job_id, run, later = attempts("1,0,0,tenant:kd")
    assert claim(conn, run)[0] == ClaimStatus.CLAIMED
    conn.set(
        keys.result(job_id), f'{{"outcome":"succeeded","job_id":"{job_id}","attempt":2,"token":"{later}"}}'
    )
    assert finish(conn, run, what="succeeded", ttl_s=DAY_S) == 3
    sets = ended_runs(conn)
    assert [k.decode().split(":")[-1][0] for k in sets] == ["h"], sets
    assert set().union(*sets.values()) == {run.encode()}
    assert renew(conn, run) & 4 == 0, "the ended run took its slot back"


def test_an_outcome_replacing_a_limited_runs_reads_the_clock_once_and_keeps_both_ends_in_one_command(
    conn: redis.Redis,
) -> None:
    # Both stored 60 s (under END_STORED_S): each run's outcome keeps its own end, and the second
    # also keeps the end of the run it replaces. One table per call for both ends: one TIME, one
    # SADD and one set's expiry per outcome (before: 2 of each for the second).
    settled(conn)
    _, run, later = attempts("3,0,0,tenant:cmds")
    assert claim(conn, run)[0] == ClaimStatus.CLAIMED
    assert calls(conn, finish, run, what="failed") == {"time": 1, "sadd": 1, "pexpireat": 1}
    assert claim(conn, later, attempt=2)[0] == ClaimStatus.CLAIMED
    assert calls(conn, finish, later, what="failed", attempt=2) == {"time": 1, "sadd": 1, "pexpireat": 1}
    assert set().union(*ended_runs(conn).values()) == {run.encode(), later.encode()}
    assert renew(conn, run) & 4 == 0, "the replaced run took its slot back"


def calls(conn: redis.Redis, call: Any, *args: Any, **kwargs: Any) -> dict[str, int]:
    """The TIME, SADD and PEXPIREAT commands Redis ran for ``call``; its reply must be 0 (stored)."""
    conn.config_resetstat()
    assert call(conn, *args, **kwargs) == 0
    stats = conn.info("commandstats")
    return {name: stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("time", "sadd", "pexpireat")}


@pytest.mark.parametrize("life_s", [1, END_STORED_S - 1, END_STORED_S, 99, 100, DAY_S])
def test_an_outcome_keeps_its_end_only_when_stored_less_than_end_stored_s(
    conn: redis.Redis, life_s: int
) -> None:
    # 69 s keeps the end, 70 s not (the script reads a lifetime of 3 digits or more as long
    # without making a number of it).
    settled(conn)
    run = token(f"1,0,0,tenant:life{life_s}")
    assert claim(conn, run)[0] == ClaimStatus.CLAIMED
    assert finish(conn, run, what="failed", ttl_s=life_s) == 0
    assert (run.encode() in set().union(*ended_runs(conn).values())) == (life_s < END_STORED_S)


def test_after_the_harvests_short_keep_an_ended_runs_renewals_hold_its_slot_a_lease_never_over_the_limit(
    conn: redis.Redis,
) -> None:
    # docs/forwarder.md, "Limits per key": the outcome script ran (stored a day: no end kept) but
    # its reply was lost; the worker sends it again for up to FINISH_PATIENCE_S and renews its
    # lease meanwhile. The forwarder harvested the event: with --forget-finished, the harvest
    # (_FORGET) keeps an implicit key's outcome harvested_key_keep_s (here 0.3 s). Once it
    # expired nothing says the run ended: each renewal holds its slot a lease on. A capacity
    # loss (one run fewer), never a run over the limit.
    settled(conn)
    run = token("1,0,0,tenant:harvest")
    job_id = run.split("/", 1)[0]
    assert claim(conn, run)[0] == ClaimStatus.CLAIMED
    assert finish(conn, run, ttl_s=DAY_S) == 0
    conn.register_script(_FORGET)(args=[keys.RQ_PREFIX, keys.result(""), 300, job_id, "default", job_id, "1"])
    deadline = time.monotonic() + 10
    while conn.exists(keys.result(job_id)):
        assert time.monotonic() < deadline, "the harvested outcome did not expire"
        time.sleep(0.05)
    lease_ms = 1_500
    assert [renew(conn, run, lease_ms) & 4 for _ in range(3)] == [4, 4, 4], "nothing says it ended"
    lapse_ms = int(conn.zscore(f"{keys.LIMIT_PREFIX}tenant:harvest:run", run) or 0)
    assert 0 < lapse_ms - redis_ms(conn) <= lease_ms, "held one lease on, no more"
    assert claim(conn, token("1,0,0,tenant:harvest")) == (ClaimStatus.FENCED, "limited: concurrency")
    time.sleep(lease_ms / 1000 + 0.2)  # no renewal since: its slot lapses
    assert claim(conn, token("1,0,0,tenant:harvest"))[0] == ClaimStatus.CLAIMED
