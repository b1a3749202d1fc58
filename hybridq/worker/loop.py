"""``hybridq worker``: an RQ worker loop that survives Redis going away.

:func:`run_worker` runs hybridq's pipelining worker classes (:mod:`hybridq.rqworker`) with
hybridq's job class (:class:`hybridq.worker.guard.Job`), checks its access to Redis before RQ starts
(a refusal is not retried), and starts RQ's loop again after a backoff when it ends on its own.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import RedisError
from rq.serializers import JSONSerializer
from rq.utils import now as rq_now

from hybridq.errors import ConfigError
from hybridq.protocol import keys
from hybridq.security.signing import keyring
from hybridq.transport import redisurl
from hybridq.worker.guard import Job

__all__ = ["RECONNECT_MAX_S", "STABLE_S", "WORKER_TTL_S", "check_access", "run_worker"]

log = logging.getLogger("hybridq.worker")

#: RQ's worker TTL for ``hybridq worker``: RQ's own socket timeout is this plus 10 s less 15 s
#: (its blocking dequeue waits TTL - 15 s), so a hung Redis is noticed in 30 s, not 415 s.
WORKER_TTL_S = 35
#: The longest wait between two attempts of RQ's own loop to reach a Redis that went away.
RECONNECT_MAX_S = 5.0
#: An RQ loop that served this long before it ended starts the restart backoff from scratch.
STABLE_S = 60.0


def run_worker(
    queues: Sequence[str],
    *,
    url: str,
    burst: bool = False,
    simple: bool = False,
    name: str | None = None,
    max_backoff_s: float = 30.0,
    with_scheduler: bool = False,
) -> int:
    """Run an RQ worker on ``queues`` until it is asked to stop; restart it when Redis goes away.

    RQ's own loop quits on a Redis timeout or an unexpected error, and cannot start while Redis
    is down; this loop starts it again after a backoff (doubling, with jitter, up to
    ``max_backoff_s``) instead of exiting or spinning. Returns 0 (stopped or, with ``burst``,
    out of work) or 1 (burst mode could not reach Redis).
    """
    if not simple and redisurl.is_sentinel(url):
        # RQ's work-horse rebuilds its client from the parent's connection options, which cannot
        # describe a Sentinel-managed connection (it would fail on the first job, not here).
        raise ConfigError(
            "--rq forks a work-horse RQ cannot connect through Sentinel: add --simple, or use the pool"
        )
    # RQ's worker module is heavy: loaded only by a process that runs a worker loop.
    from hybridq.rqworker import SimpleWorker, Worker  # noqa: PLC0415

    worker_class = SimpleWorker if simple else Worker
    commanded: list[str] = []  # RQ's pub/sub "shutdown" command arrived (see _log_commands)
    ring = keyring()  # a key configured but unusable stops the worker here, not on every job
    if ring is not None:
        log.info("verifying envelope signatures (%s, %d key(s))", ring.source, len(ring.keys))
    delay = 1.0
    down_since: float | None = None
    while True:
        conn = redisurl.client(url)
        started = time.monotonic()
        try:
            check_access(conn, queues)
            # job_class: RQ must not import whatever function a job hash names (see Job).
            worker = worker_class(
                queues,
                connection=conn,
                serializer=JSONSerializer,
                name=name,
                job_class=Job.serving_only(queues),  # and no job moved from another queue
                worker_ttl=WORKER_TTL_S,
            )
            # RQ waits up to 60 s between reconnection attempts while it polls a dead Redis;
            # cap it so that work resumes within seconds of Redis coming back.
            worker.max_connection_wait_time = RECONNECT_MAX_S
            _log_commands(worker, commanded)
            _stop_warmly_until_rq_listens(worker)
            worker.work(burst=burst, with_scheduler=with_scheduler)
        except RedisError as exc:
            if redisurl.refusal(exc) is not None:
                raise redisurl.transport_error(exc) from exc  # retrying cannot fix it
            if burst:
                log.error("Redis unavailable (%s): --burst does not wait for it; exiting 1, nothing run", exc)
                return 1
            if down_since is None:
                down_since = time.monotonic()
                log.warning("Redis unavailable (%s): retrying, backing off up to %.0f s", exc, max_backoff_s)
        else:
            # A SIGTERM/SIGINT while idle ends RQ's loop without setting _stop_requested (it raises
            # StopRequested); the shutdown date is set either way. RQ has no public flag.
            if burst or worker._stop_requested or worker._shutdown_requested_date is not None:
                if commanded:
                    log.warning(
                        "stopped by RQ's shutdown command (Redis pub/sub channel %s), not by a signal: "
                        "exiting 0; a supervisor restarts this worker only with Restart=always "
                        "(docs/deploy.md)",
                        commanded[0],
                    )
                return 0
            log.warning("the RQ worker loop ended on its own (Redis went away?): starting it again")
            if time.monotonic() - started > STABLE_S:
                delay = 1.0  # it had been serving for a while: this is a new incident
        finally:
            conn.close()
        time.sleep(random.uniform(delay / 2, delay))  # noqa: S311 - jitter
        delay = min(max_backoff_s, delay * 2)
        if down_since is not None and _reachable(url):
            log.warning("Redis available again after %.1f s", time.monotonic() - down_since)
            down_since, delay = None, 1.0


def check_access(conn: redis.Redis, queues: Sequence[str]) -> None:
    """Touch what a worker needs (login, database, its queues' and hybridq's keys).

    RQ's loop logs and swallows what it does not expect, a refusal included, so a wrong password,
    database or ACL is caught here, before RQ starts: RedisRefused instead of a restart loop.
    """
    pipe = conn.pipeline(transaction=False)
    pipe.ping()
    for queue in queues:
        pipe.llen(keys.rq_queue(queue))
    pipe.exists(keys.result("-"), keys.lease("-"), keys.events("-"), keys.waiting())
    pipe.execute()


def _stop_warmly_until_rq_listens(worker: Any) -> None:
    """Make SIGINT and SIGTERM a warm stop until RQ installs its own handlers.

    RQ subscribes to its command channel before it installs them: a shutdown command (a SIGINT
    to itself) or a supervisor's SIGTERM in between met Python's defaults, a KeyboardInterrupt
    (exit 1) or death. This asks RQ's loop to stop at its first turn instead, as its handler
    would (RQ has no public flag for it).
    """
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers (and receives the signals)

    def early(_signum: int, _frame: object) -> None:
        worker._stop_requested = True
        worker._shutdown_requested_date = rq_now()

    signal.signal(signal.SIGINT, early)
    signal.signal(signal.SIGTERM, early)


def _log_commands(worker: Any, commanded: list[str]) -> None:
    """Note RQ's pub/sub "shutdown" command, so that run_worker can say why it stopped.

    Anyone who may PUBLISH on Redis can send it (``rq shutdown``); it looks like a SIGINT to RQ.
    """
    handle = worker.handle_payload

    def on_payload(message: dict[str, Any]) -> None:
        try:
            command = json.loads(message["data"]).get("command")
        except (ValueError, TypeError, KeyError, AttributeError):
            command = None  # RQ's own handler reports what it cannot parse
        if command == "shutdown":
            channel = message.get("channel")
            commanded.append(channel.decode(errors="replace") if isinstance(channel, bytes) else str(channel))
            log.warning("RQ shutdown command received on %s: stopping after the current job", commanded[-1])
        handle(message)

    worker.handle_payload = on_payload  # RQ subscribes with it when work() starts


def _reachable(url: str) -> bool:
    conn = redisurl.client(url, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        conn.ping()
    except RedisError:
        return False
    finally:
        conn.close()
    return True
