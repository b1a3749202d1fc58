"""The per-key limits' part of the workers' scripts against a real Redis (hybridq.worker.limit_scripts).

The claim (single-job and the pool's START) admits a run of a limited key only while its key
has a slot and rate left, renewals keep (and, after a FLUSHALL, restore) the slots of running
runs, the outcome frees them, a lapsed lease frees them, and a loss of Redis's state holds
every limited key for one lease (no burst).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hybridq import Queue
from hybridq.envelope.model import new_job_id
from hybridq.protocol import ClaimStatus, Delivery, StartedEvent, keys
from hybridq.security.signing import ENV_KEY, keyring
from hybridq.testing.embedded import RedisServer
from hybridq.worker import quick, scripts
from hybridq.worker.run import CLAIMED, Run
from hybridq.worker.run import claim as run_claim

LEASE_MS = 400


@pytest.fixture
def conn(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        client.close()


def settled(conn: redis.Redis) -> None:
    """Start the limits' epoch long ago on this server: no quarantine."""
    run_id = conn.info("server")["run_id"]
    conn.set(keys.LIMITS_EPOCH, f"1:{run_id}")


def token(limit: str) -> str:
    return f"{new_job_id(time.time())}/1/host-1/abcd#L{limit}"


def claim(conn: redis.Redis, tok: str, lease_ms: int = LEASE_MS, attempt: int = 1) -> Any:
    job_id = tok.split("/", 1)[0]
    claim_keys = [keys.result(job_id), keys.lease(job_id), keys.rq_job(job_id), keys.epoch("owner")]
    status, why = scripts.claim(conn, claim_keys, [tok, lease_ms, job_id, 0, attempt, 0])
    return int(status), why.decode() if isinstance(why, bytes) else why


def finish(
    conn: redis.Redis,
    tok: str,
    extra: str = "",
    *,
    what: str = "succeeded",
    attempt: int = 1,
    ttl_s: int = 60,
) -> int:
    """``tok``'s outcome through the outcome script, stored ``ttl_s``; the script's reply."""
    job_id = tok.split("/", 1)[0]
    stored = (
        f'{{"outcome":"{what}","job_id":"{job_id}","attempt":{attempt},"requeue":0,"token":"{tok}"{extra}}}'
    )
    return int(
        scripts.finish(
            conn, [keys.result(job_id), keys.lease(job_id), keys.events("owner")], [tok, stored, ttl_s, "{}"]
        )
    )


def renew(conn: redis.Redis, tok: str, lease_ms: int = LEASE_MS) -> int:
    return int(scripts.renew(conn, keys.lease(tok.split("/", 1)[0]), tok, lease_ms))


def test_a_concurrency_limit_admits_n_runs_and_the_outcome_frees_a_slot(conn: redis.Redis) -> None:
    settled(conn)
    runs = [token("2,0,0,tenant:1") for _ in range(3)]
    assert [claim(conn, t)[0] for t in runs[:2]] == [ClaimStatus.CLAIMED] * 2
    assert claim(conn, runs[2]) == (ClaimStatus.FENCED, "limited: concurrency")
    assert claim(conn, token("2,0,0,tenant:2"))[0] == ClaimStatus.CLAIMED, "another key is not held"
    assert claim(conn, runs[0])[0] == ClaimStatus.CLAIMED, "a claim sent again is its own slot"
    finish(conn, runs[0])
    assert renew(conn, runs[0]) & 4 == 0, "a renewal after the outcome does not take the slot back"
    assert claim(conn, runs[2])[0] == ClaimStatus.CLAIMED


def test_a_killed_runs_slot_frees_when_its_lease_would_have_lapsed(conn: redis.Redis) -> None:
    settled(conn)
    held = token("1,0,0,k")
    assert claim(conn, held)[0] == ClaimStatus.CLAIMED
    waiting = token("1,0,0,k")
    for _ in range(3):  # renewed: held past its first lease
        time.sleep(LEASE_MS / 3000)
        assert renew(conn, held) == 1 | 4
    assert claim(conn, waiting)[1] == "limited: concurrency"
    time.sleep(LEASE_MS / 1000 + 0.05)  # no renewal: the worker died
    assert claim(conn, waiting)[0] == ClaimStatus.CLAIMED


def test_after_a_flushall_limited_keys_wait_a_lease_and_running_runs_keep_their_slots(
    conn: redis.Redis,
) -> None:
    settled(conn)
    running = [token("2,0,0,k") for _ in range(2)]
    assert [claim(conn, t)[0] for t in running] == [ClaimStatus.CLAIMED] * 2
    conn.flushall()
    late = token("2,0,0,k")
    assert claim(conn, late) == (ClaimStatus.FENCED, "limited: quarantine after Redis lost state")
    assert [renew(conn, t) for t in running] == [4, 4], "lease gone, slot held again"
    time.sleep(LEASE_MS / 1000 + 0.05)
    for t in running:
        renew(conn, t)
    assert claim(conn, late)[1] == "limited: concurrency", "no burst: both still run"
    finish(conn, running[0])
    assert claim(conn, late)[0] == ClaimStatus.CLAIMED


def test_a_restarted_redis_is_a_new_epoch(conn: redis.Redis) -> None:
    conn.set(keys.LIMITS_EPOCH, "1:0123456789abcdef")  # another server's run_id (a snapshot)
    assert claim(conn, token("5,0,0,k"))[1] == "limited: quarantine after Redis lost state"
    conn.set(keys.LIMITS_EPOCH, f"{int(time.time() * 1000) + 10**9}:{conn.info('server')['run_id']}")
    assert claim(conn, token("5,0,0,k"))[1].startswith("limited: quarantine"), "a time ahead is not believed"


def test_a_rate_limit_admits_n_starts_per_period(conn: redis.Redis) -> None:
    conn.set(keys.LIMITS_EPOCH, f"1:{conn.info('server')['run_id']}")
    # the quarantine after a loss lasts a period too: long past here
    started = time.monotonic()
    replies = [claim(conn, token("0,3,500,api")) for _ in range(5)]
    assert [r[0] for r in replies] == [ClaimStatus.CLAIMED] * 3 + [ClaimStatus.FENCED] * 2
    assert replies[3][1] == "limited: rate"
    time.sleep(max(0.0, 0.55 - (time.monotonic() - started)))
    assert claim(conn, token("0,3,500,api"))[0] == ClaimStatus.CLAIMED


def test_the_forwarders_read_of_a_keys_use(redis_server: RedisServer, conn: redis.Redis) -> None:
    from hybridq.transport.rq import RQTransport

    settled(conn)
    transport = RQTransport(redis_server.url)
    try:
        claim(conn, token("3,0,0,k"))  # claimed before the forwarder added it: in either order
        use = transport.key_use({"k": 0, "other": 1000}, {"k": 3}, lease_s=0.4)
        assert use is not None
        assert (use["k"].running, use["k"].queued, use["k"].quarantine_s) == (1, 2, 0)
        claim(conn, token("3,0,0,k"))  # a claim takes one off the queued count
        use = transport.key_use({"k": 0}, {}, lease_s=0.4)
        assert use is not None
        assert (use["k"].running, use["k"].queued) == (2, 1)
        conn.flushall()
        use = transport.key_use({"k": 0}, {}, lease_s=0.4)
        assert use is not None
        assert use["k"].quarantine_s > 0.3
    finally:
        transport.close()


def test_a_limit_key_of_the_wrong_type_holds_its_own_jobs_only(
    redis_server: RedisServer, conn: redis.Redis
) -> None:
    from hybridq.protocol.keys import LIMIT_PREFIX
    from hybridq.transport.rq import RQTransport

    settled(conn)
    conn.hset(f"{LIMIT_PREFIX}evil:queued", "x", 1)  # anyone able to write the limits' keys
    conn.set(f"{LIMIT_PREFIX}odd:queued", "not a number")
    # Numbers to Lua's tonumber, not counts: NaN read as -2**63 (room for every waiting job for a
    # step) in the leaner script before, infinity as a huge count.
    conn.set(f"{LIMIT_PREFIX}nan:queued", "nan")
    conn.set(f"{LIMIT_PREFIX}inf:queued", "inf")
    transport = RQTransport(redis_server.url)
    try:  # before: WRONGTYPE failed the whole call, every key stayed without room
        use = transport.key_use({"good": 0, "evil": 0, "odd": 0, "nan": 0, "inf": 0}, {}, lease_s=0.4)
        assert use is not None
        assert (use["good"].running, use["good"].queued, use["good"].quarantine_s) == (0, 0, 0)
        for held in ("evil", "odd", "nan", "inf"):
            assert use[held].quarantine_s > 60, held  # held (never over its limit), not the others
            assert use[held].queued == 0, held
    finally:
        transport.close()


def test_a_renewal_after_an_outcome_with_a_lone_surrogate_does_not_take_the_slot_back(
    conn: redis.Redis,
) -> None:
    settled(conn)
    run, other = token("1,0,0,tenant:s"), token("1,0,0,tenant:s")
    assert claim(conn, run)[0] == ClaimStatus.CLAIMED
    finish(conn, run, ',"result":"bad \\udcff"')  # what cjson alone cannot decode
    assert renew(conn, run) & 4 == 0  # before: the slot was taken back for a lease
    assert claim(conn, other)[0] == ClaimStatus.CLAIMED


def queued(conn: redis.Redis, key: str) -> int:
    """The key's signed count of jobs pushed and not yet taken off a queue (raw, not clamped)."""
    return int(conn.get(f"{keys.LIMIT_PREFIX}{key}:queued") or 0)


def test_a_renewal_racing_an_outcome_that_kept_another_runs_success_does_not_take_the_slot_back(
    conn: redis.Redis,
) -> None:
    settled(conn)
    job_id = new_job_id(time.time())
    run, later = f"{job_id}/1/host-1/aaaa#L1,0,0,tenant:r", f"{job_id}/2/host-2/bbbb#L1,0,0,tenant:r"
    assert claim(conn, run)[0] == ClaimStatus.CLAIMED
    # Attempt 2 ran while this run had lost its lease, and stored its success: this run's outcome
    # script keeps it (the stored outcome is not this run's), and frees this run's slot.
    kept = f'{{"outcome":"succeeded","job_id":"{job_id}","attempt":2,"requeue":0,"token":"{later}"}}'
    conn.set(keys.result(job_id), kept)
    finish(conn, run)
    assert renew(conn, run) & 4 == 0  # sent before the outcome, run after: before, the slot came back
    assert claim(conn, token("1,0,0,tenant:r"))[0] == ClaimStatus.CLAIMED


def test_a_refused_claim_sent_again_takes_its_job_off_the_queued_count_once(conn: redis.Redis) -> None:
    settled(conn)
    assert claim(conn, token("1,0,0,once"))[0] == ClaimStatus.CLAIMED  # holds the slot: -1
    refused = token("1,0,0,once")
    conn.hset(keys.rq_job(refused.split("/", 1)[0]), "status", "started")  # its copy, taken
    assert claim(conn, refused) == (ClaimStatus.FENCED, "limited: concurrency")
    assert claim(conn, refused)[0] == ClaimStatus.FENCED  # its reply was lost: sent again
    assert queued(conn, "once") == -2  # before: -3, the copy counted as leaving twice


def test_a_copy_cancelled_before_its_claim_leaves_the_queued_count(conn: redis.Redis) -> None:
    settled(conn)
    cancelled = token("2,0,0,gone")
    conn.hset(keys.rq_job(cancelled.split("/", 1)[0]), mapping={"status": "started", "hybridq_cancel": "1"})
    assert claim(conn, cancelled)[0] == ClaimStatus.CANCELLED
    assert queued(conn, "gone") == -1  # before: 0, the forwarder's +1 for it stayed


def test_an_admitted_limited_claim_carries_no_refused_event_and_a_refused_one_sends_it_signed(
    conn: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: every limited claim carried its refused started event, signed, in case its key
    # refused (the workers' part of the limits' cost per job, docs/benchmarks.md). Now a
    # quick task's admitted claim carries no event at all, and only a refused claim is followed
    # by its refused event, signed: the forwarder believes only that (hybridq.forwarder.refusals).
    monkeypatch.setenv(ENV_KEY, "s" * 64)
    monkeypatch.setitem(quick._streaks, "tests.tasks.add", quick.STREAK)  # a quick task's runs
    settled(conn)
    queue = Queue("default", tmp_path / "journal")
    runs = []
    for i in range(2):
        env = queue.prepare("tests.tasks.add", [i, i], limit_key="ev")
        d = Delivery(env, "owner", ("w", 1, i), report_start=True, limit="1,0,0,ev")
        runs.append(Run.new(d.to_json(), d, print))
    assert len(runs[0].claim_args) == 6, "the admitted claim carried events"
    assert run_claim(conn, runs[0]) is CLAIMED
    assert conn.xlen(keys.events("owner")) == 0, "the admitted quick run added an event"
    assert run_claim(conn, runs[1]) is None  # refused: concurrency 1, held by the first
    (_, fields), *more = conn.xrange(keys.events("owner"))
    assert not more
    assert fields[b"r"] == b"limited: concurrency"
    body = json.loads(fields[b"e"])
    assert keyring().verify_event("owner", body), "the refusal is signed"  # type: ignore[union-attr]
    event = StartedEvent.from_json(body)
    assert (event.id, event.loc, event.attempt, event.refused) == (
        runs[1].d.envelope.id,
        ("w", 1, 1),
        1,
        True,
    )


def test_a_refusal_whose_signing_key_is_unreadable_is_not_sent_and_raises_nothing(
    conn: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The key file gone for a moment: the refusal is given up as when Redis is unreachable (the
    # reconcile pass delivers the job again), not an error out of the claim (found by review).
    from hybridq.errors import SigningKeyError
    from hybridq.worker import refusal

    def unreadable(*_: object) -> None:
        raise SigningKeyError("no signing key")

    monkeypatch.setattr(refusal, "sign_event", unreadable)
    env = Queue("default", tmp_path / "journal").prepare("tests.tasks.add", [1, 1], limit_key="ev")
    d = Delivery(env, "owner", ("w", 1, 0), report_start=True, limit="1,0,0,ev")
    refusal.send_refusal(conn, d, "limited: concurrency")
    assert conn.xlen(keys.events("owner")) == 0


@pytest.mark.parametrize("stored", ["succeeded", "failed", "unreadable", "busy"])
def test_a_claim_that_runs_nothing_takes_its_copy_off_the_queued_count(
    conn: redis.Redis, stored: str
) -> None:
    # Suppressed (the key succeeded), stale (this attempt failed already), unreadable (not
    # hybridq's value) or busy (another delivery holds the lease): the copy left its queue as a
    # refused one does.
    settled(conn)
    tok = token("2,0,0,left")
    job_id = tok.split("/", 1)[0]
    conn.hset(keys.rq_job(job_id), "status", "started")
    outcome = f'{{"outcome":"{stored}","job_id":"{job_id}","attempt":1,"requeue":0,"token":"other"}}'
    if stored == "busy":
        conn.set(keys.lease(job_id), "another-run")
    else:
        conn.set(keys.result(job_id), "\x00not json" if stored == "unreadable" else outcome)
    assert claim(conn, tok)[0] != ClaimStatus.CLAIMED
    assert claim(conn, tok)[0] != ClaimStatus.CLAIMED  # its reply was lost: sent again
    assert queued(conn, "left") == -1  # before: 0, the forwarder's +1 for it stayed


def test_a_queued_count_taken_to_zero_keeps_its_expiry(conn: redis.Redis) -> None:
    # A 0 reads as no key; the claim leaves it to its expiry (no DEL: a command fewer per job).
    settled(conn)
    queued = f"{keys.LIMIT_PREFIX}tenant:q0:queued"
    conn.set(queued, 1, px=20_000)
    assert claim(conn, token("1,0,0,tenant:q0"))[0] == ClaimStatus.CLAIMED
    assert int(conn.get(queued) or 0) == 0
    assert 0 < conn.pttl(queued) <= 20_000, "it still expires"
    assert claim(conn, token("5,0,0,tenant:q0"))[0] == ClaimStatus.CLAIMED
    assert int(conn.get(queued) or 0) == -1
    assert 0 < conn.pttl(queued) <= 20_000, "below zero: it expires (its expiry never shortened)"


def test_a_take_that_leaves_copies_counted_keeps_the_expiry_the_forwarders_add_set(conn: redis.Redis) -> None:
    # The key expires two leases after the forwarders' last add: a take above zero does not push
    # it further (its PTTL and PEXPIRE were two commands per such claim).
    settled(conn)
    queued = f"{keys.LIMIT_PREFIX}tenant:q3:queued"
    conn.set(queued, 3, px=2_000)
    assert claim(conn, token("5,0,0,tenant:q3"))[0] == ClaimStatus.CLAIMED
    assert int(conn.get(queued) or 0) == 2
    assert 0 < conn.pttl(queued) <= 2_000, "the expiry it had, not two of the claim's leases on"
    conn.delete(queued)
    assert claim(conn, token("5,0,0,tenant:q3"))[0] == ClaimStatus.CLAIMED
    assert int(conn.get(queued) or 0) == -1
    assert 0 < conn.pttl(queued) <= 2 * LEASE_MS, "made by the take: it expires"


def test_a_hold_pushes_the_run_sets_life_on_only_when_less_than_a_lease_and_a_half_is_left(
    conn: redis.Redis,
) -> None:
    # The set outlives every live slot (a lease ahead) with half a lease and a second to spare;
    # a PEXPIRE at every hold was a command per claim with a few keys.
    settled(conn)
    run = f"{keys.LIMIT_PREFIX}tenant:life:run"
    assert claim(conn, token("5,0,0,tenant:life"))[0] == ClaimStatus.CLAIMED
    assert 2 * LEASE_MS < conn.pttl(run) <= 2 * LEASE_MS + 1000, "a new set: two leases and a second"
    conn.pexpire(run, int(1.5 * LEASE_MS) + 1000 + 150)
    assert claim(conn, token("5,0,0,tenant:life"))[0] == ClaimStatus.CLAIMED
    assert conn.pttl(run) <= int(1.5 * LEASE_MS) + 1000 + 150, "enough left: kept as it was"
    conn.pexpire(run, LEASE_MS + 500)
    assert claim(conn, token("5,0,0,tenant:life"))[0] == ClaimStatus.CLAIMED
    assert conn.pttl(run) > int(1.5 * LEASE_MS) + 1000 + 150, "less left: two leases and a second again"
    conn.pexpire(run, LEASE_MS + 500)
    holder = token("5,0,0,tenant:life")
    assert claim(conn, holder)[0] == ClaimStatus.CLAIMED
    conn.pexpire(run, LEASE_MS + 500)
    assert renew(conn, holder) & 4 == 4
    assert conn.pttl(run) > int(1.5 * LEASE_MS) + 1000 + 150, "a renewal pushes it on the same way"


def test_a_claim_made_again_after_its_own_slot_lapsed_is_refused_when_the_rate_is_spent(
    conn: redis.Redis,
) -> None:
    # Its holder was cut off past its lease and the claim is made again (same token) after
    # another run took the period's one start: its lapsed slot is not a slot it holds.
    settled(conn)
    policy = "5,1,1000,tenant:lapsed"
    first = token(policy)
    assert claim(conn, first)[0] == ClaimStatus.CLAIMED
    time.sleep(1.1)  # its lease (and slot) lapsed, its start left the period
    assert claim(conn, token(policy))[0] == ClaimStatus.CLAIMED, "the one start this period allows"
    assert claim(conn, first) == (ClaimStatus.FENCED, "limited: rate")


def test_a_claim_made_again_after_its_own_slot_lapsed_is_a_new_start(conn: redis.Redis) -> None:
    # Admitted (the rate not spent), it counts against the rate: the next run waits the period.
    settled(conn)
    policy = "5,1,1000,tenant:restart"
    first = token(policy)
    assert claim(conn, first)[0] == ClaimStatus.CLAIMED
    time.sleep(1.1)
    assert claim(conn, first)[0] == ClaimStatus.CLAIMED
    assert claim(conn, token(policy)) == (ClaimStatus.FENCED, "limited: rate")
