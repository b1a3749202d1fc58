"""A stored outcome's JSON, as Redis's Lua scripts read it: a lone surrogate (issue 26, item 4).

``os.fsdecode`` of a file name that is not UTF-8 gives text with a lone surrogate (``"\\udcff"``).
JSON carries it (``\\udcff``), Python reads it back, but Redis's Lua JSON decoder (cjson) refuses
it: the claim script read that refusal as "nothing stored under this key", so a job whose key
had finished with such a result (or such an error) ran again when a second journal enqueued the
same key. Every script that reads a stored outcome must read it, and one it truly cannot read
must never count as "nothing stored" (docs/guarantees.md, "Results").
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from hybridq import Queue, fetch_job
from hybridq.envelope.model import Envelope
from hybridq.protocol import ClaimStatus, FinishReply, keys
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Delivery, Probe
from hybridq.transport.rq import RQTransport
from hybridq.worker import scripts

from tests.integration.test_worker_protocol import envelope, transport  # noqa: F401 - the fixture
from tests.integration.test_worker_redis import (  # noqa: F401 - the stack fixture
    Stack,
    alive,
    lines_of,
    stack,
    wait_status,
)
from tests.surrogate_tasks import NAME

OWNER = "owner1"


def test_a_key_that_finished_with_a_lone_surrogate_does_not_run_again_from_another_journal(
    redis_server: RedisServer,
    stack: Stack,  # noqa: F811 - the fixture
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    """Two journals, one Redis: the second journal's forwarder does not know the key, so the
    worker's claim is what must find the first run's outcome, a success or a final failure."""
    effects = tmp_path / "effects.txt"
    journals = [journal_dir, tmp_path / "journal-b"]
    forwarders = [stack.forwarder(redis_server.url, journal=j) for j in journals]
    stack.worker(redis_server.url)
    running = alive(*forwarders)
    first = Queue("default", journals[0])
    ok = first.enqueue("tests.surrogate_tasks.fsdecoded", str(effects), "ok", idempotency_key="k-ok")
    bad = first.enqueue(
        "tests.surrogate_tasks.fsdecoded", str(effects), "bad", fail=True, idempotency_key="k-bad"
    )

    def finished(n: int) -> Callable[[dict[str, object]], bool]:
        return lambda s: s["succeeded"] == n and s["failed"] == n and s["pending"] == 0

    wait_status(journals[0], subprocess_env, finished(1), what="both keys to finish", alive=running)
    assert ok.wait(timeout=10) == NAME  # the user's value, lone surrogate and all
    second = Queue("default", journals[1])
    ok2 = second.enqueue("tests.surrogate_tasks.fsdecoded", str(effects), "ok", idempotency_key="k-ok")
    second.enqueue("tests.surrogate_tasks.fsdecoded", str(effects), "bad", fail=True, idempotency_key="k-bad")
    status = wait_status(journals[1], subprocess_env, finished(1), what="both duplicates", alive=running)
    time.sleep(0.5)  # a second run, had there been one, has time to write its effects line
    runs = {token: len(lines_of(effects, "start", token)) for token in ("ok", "bad")}
    assert runs == {"ok": 1, "bad": 1}, "a finished key ran again"
    assert status["duplicates_suppressed"] == 2
    assert ok2.wait(timeout=10) == NAME  # the suppressed duplicate returns the stored result
    job = fetch_job(bad.id, journals[0])
    assert job is not None
    assert job.get_status() == "failed"
    figures(f"IDEM lone-surrogate journals=2 keys=2 runs={runs} duplicates_suppressed=2")


# -- the scripts, one state at a time --------------------------------------------------------------


def _store(rq: RQTransport, env: Envelope, raw: bytes) -> None:
    rq.push([Delivery(env, OWNER, ("w", 0, 64), attempt=1)])
    rq.connection.set(keys.result(env.key_id), raw)


def _claim(rq: RQTransport, env: Envelope) -> list[object]:
    claim_keys = [keys.result(env.key_id), keys.lease(env.key_id), keys.rq_job(env.id), keys.epoch(OWNER)]
    return list(scripts.claim(rq.connection, claim_keys, ["token", 10_000, env.id, 0, 1, 0]))


def _outcome(env: Envelope, **fields: object) -> bytes:
    body = {"outcome": "succeeded", "result": NAME, "error": None, "job_id": env.id, "attempt": 1}
    body.update({"requeue": 0, "final": True, "at": time.time(), **fields})
    return json.dumps(body).encode()  # ensure_ascii: the surrogate is the escape \udcff


def test_the_claim_reads_a_stored_success_or_failure_holding_a_lone_surrogate(
    transport: RQTransport,  # noqa: F811 - the fixture
) -> None:
    for fields in ({}, {"outcome": "failed", "result": None, "error": f"ValueError: {NAME}"}):
        env = envelope()
        stored = _outcome(env, **fields)
        _store(transport, env, stored)
        assert _claim(transport, env) == [ClaimStatus.SUPPRESSED, stored]


def test_a_stored_outcome_no_script_can_read_never_counts_as_nothing_stored(
    transport: RQTransport,  # noqa: F811 - the fixture
) -> None:
    """Fail closed: the claim runs nothing, the probe says done, the eviction keeps the copy."""
    env = envelope()
    _store(transport, env, b"\x00 not JSON")
    assert _claim(transport, env)[0] == ClaimStatus.FENCED
    assert not transport.connection.exists(keys.lease(env.key_id))  # nothing started
    [verdict] = transport.probe([Probe(env.id, env.key_id, env.queue)], lease_s=10.0)
    assert verdict == "done"  # not "queued": it is delivered again only after the done grace
    delivery = Delivery(env, OWNER, ("w", 0, 64), attempt=1)
    assert transport.evict([], [delivery]) == (0, {env.id})  # kept here, not delivered elsewhere


def test_the_outcome_script_reads_this_runs_outcome_and_event_holding_a_lone_surrogate(
    transport: RQTransport,  # noqa: F811 - the fixture
) -> None:
    """A success already stored, and this run's failure with the surrogate: the script keeps the
    success and rewrites this run's event into it (cjson.decode raised on both before)."""
    env = envelope()
    _store(transport, env, _outcome(env, token="first"))
    mine = _outcome(env, outcome="failed", result=None, error=f"ValueError: {NAME}", attempt=2, token="t2")
    event = json.dumps({"id": env.id, "outcome": "failed", "error": f"ValueError: {NAME}", "attempt": 2})
    finish_keys = [keys.result(env.key_id), keys.lease(env.key_id), keys.events(OWNER)]
    kept = scripts.finish(transport.connection, finish_keys, ["t2", mine.decode(), 60, event])
    assert kept == FinishReply.KEPT
    [(_, [(_, fields)])] = transport.connection.xread({keys.events(OWNER): 0})
    assert json.loads(fields[b"e"])["outcome"] == "succeeded"
