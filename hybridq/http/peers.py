"""Ingest nodes look each other's jobs up through Redis (docs/http.md, "Several nodes, one client").

A ``hybridq forward --serve`` node knows Redis; another node's journal it cannot read. So each
such node:

* keeps ``hybridq:node:<name>`` set (a few seconds' expiry, renewed every second): its absence
  says the node is down; another process renewing it too is logged as an error (a journal
  copied to make a second node keeps the first one's name);
* takes lookups from ``hybridq:node:<name>:asks`` (one thread, ``BLPOP``): each is the job id
  and a one-off reply key; it answers with what its own ``GET /v1/jobs/{id}`` would say
  (``{"state": {...}}``, or ``{"state": null}``: no such job), pushed to that key, which expires;
* asks another node (:meth:`Peers.ask`) when a ``GET /v1/jobs/{id}`` names that node's id.

Only lookups cross Redis, never a cancel: a Redis writer could then cancel any job durably.
What a Redis writer can do here: forge an answer (a false status or result for a lookup made
through another node) or keep a node's lookup thread busy; it cannot make a node write anywhere
but a reply key (the key's shape is checked) nor read anything a token holder could not.

A lookup waits up to :data:`ASK_TIMEOUT_S` for the answer, on its own few threads
(:data:`MAX_ASKING`; more at once: :class:`NodeDown`, "busy", at once): lookups of a node a Redis
writer forged "alive" hold those threads, never the API's (a POST's key lookups). An answer is
taken out of Redis only if it is at most :data:`MAX_ANSWER` bytes (checked in Redis, by a
script) and has the shape of a job's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from redis.exceptions import RedisError

from hybridq.envelope.model import validate_job_id
from hybridq.errors import EnvelopeError, HybridqError
from hybridq.http.node import NodeDown
from hybridq.protocol import keys
from hybridq.transport import redisurl

__all__ = ["ASK_TIMEOUT_S", "MAX_ANSWER", "MAX_ASKING", "NodeDown", "Peers"]

log = logging.getLogger("hybridq.http")

#: How long a lookup waits for the other node's answer (seconds).
ASK_TIMEOUT_S = 2.0
#: How long ``hybridq:node:<name>`` outlives the node's last renewal (seconds).
SEEN_TTL_S = 5
#: How often two running nodes of one name are reported (seconds).
CLONE_REPORT_S = 60.0
#: A lookup request longer than this (bytes) is dropped.
MAX_ASK = 1024
#: The longest answer taken (bytes); a longer one is left in Redis (it expires) and is no answer.
MAX_ANSWER = 64 << 10
#: Lookups of other nodes running at once; past it, a lookup answers "busy" at once (a 503).
MAX_ASKING = 4
#: How often :meth:`Peers.ask` looks for the answer (seconds): from the first, doubling to the last.
_POLL_S = (0.005, 0.05)
#: Pops the answer if it is at most ARGV[1] bytes: -1 if longer (never sent to the asker), nil if none.
_TAKE = """
local v = redis.call('LINDEX', KEYS[1], 0)
if not v then return false end
redis.call('DEL', KEYS[1])
if string.len(v) > tonumber(ARGV[1]) then return -1 end
return v
"""
_REPLY = re.compile(re.escape(keys.NODE_REPLY_PREFIX) + r"[0-9a-f]{32}")


class Peers:
    """This node's side of the lookups between nodes (see the module docstring).

    Args:
        redis_url: the Redis the nodes share.
        node: this node's name.
        answer: this node's ``GET /v1/jobs/{id}`` state of a job (``None``: no such job).
    """

    def __init__(self, redis_url: str, node: str, answer: Callable[[str], dict[str, Any] | None]) -> None:
        self.node = node
        self.answer = answer
        self.client = redisurl.client(redis_url, socket_timeout=ASK_TIMEOUT_S + 3)
        self._take = self.client.register_script(_TAKE)
        self._asking = ThreadPoolExecutor(MAX_ASKING, thread_name_prefix="hybridq-ask")
        self._slots = threading.BoundedSemaphore(MAX_ASKING)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hybridq-peers", daemon=True)
        #: This process's id in ``hybridq:node:<name>`` (:meth:`_seen`).
        self.instance = secrets.token_hex(8)
        self._wrote = False
        self._reported = -CLONE_REPORT_S

    def start(self) -> None:
        """Say this node is up, and begin answering other nodes' lookups (a daemon thread)."""
        with contextlib.suppress(RedisError):  # Redis down: the thread says it once Redis is back
            self._seen()
        self._thread.start()

    def _seen(self) -> None:
        """Renew ``hybridq:node:<name>``; report another process renewing it too (a cloned journal).

        The key holds this process's instance id. A different one read back after this process
        wrote it means another live process has the same node name since: its journal is a copy
        of this one's (every id of one names both). A node killed and restarted is not one: the
        dead one's key is only overwritten, never written again.
        """
        key = keys.node_seen(self.node)
        pipe = self.client.pipeline(transaction=False)
        pipe.get(key)
        pipe.set(key, json.dumps({"seen": time.time(), "instance": self.instance}), ex=SEEN_TTL_S)
        before, _ = pipe.execute()
        try:
            other = json.loads(before).get("instance") if before else None
        except (ValueError, AttributeError, RecursionError):
            other = None
        clone = self._wrote and other not in (None, self.instance)
        self._wrote = True
        if clone and time.monotonic() - self._reported >= CLONE_REPORT_S:
            self._reported = time.monotonic()
            log.error(
                "node name %s is also used by another running node (instance %s; this one is "
                "%s): its journal is a copy of this one's (a cloned volume), and jobs of each "
                "read as missing through the other. Stop it, delete node.state in its journal, "
                "start it again (docs/http.md)",
                self.node,
                other,
                self.instance,
            )

    def stop(self) -> None:
        """Stop answering, within a second."""
        self._stop.set()
        self._thread.join(ASK_TIMEOUT_S + 5)
        self._asking.shutdown(wait=True)
        self.client.close()

    async def ask_async(self, node: str, job_id: str) -> dict[str, Any] | None:
        """:meth:`ask` on this node's lookup threads, off the loop (NodeDown at once when all are busy)."""
        if not self._slots.acquire(blocking=False):
            raise NodeDown(f"this node is busy looking up {MAX_ASKING} jobs of other nodes: retry")
        try:
            future = self._asking.submit(self.ask, node, job_id)
        except RuntimeError:  # stopping
            self._slots.release()
            raise NodeDown("this node is stopping") from None
        future.add_done_callback(lambda _: self._slots.release())  # when the thread is free
        return await asyncio.wrap_future(future)

    def ask(self, node: str, job_id: str) -> dict[str, Any] | None:
        """Node ``node``'s state of ``job_id`` (``None``: it holds no such job). Blocking.

        Raises:
            NodeDown: the node is not seen in Redis, did not answer in time, or Redis failed.
        """
        token = secrets.token_hex(16)
        try:
            if not self.client.exists(keys.node_seen(node)):
                raise NodeDown(f"node {node} is down (not seen in Redis for {SEEN_TTL_S} s)")
            pipe = self.client.pipeline()
            pipe.rpush(keys.node_asks(node), json.dumps({"id": job_id, "reply": keys.node_reply(token)}))
            pipe.expire(keys.node_asks(node), 30)
            pipe.execute()
            got = self._answer_of(keys.node_reply(token))
        except RedisError as exc:
            raise NodeDown(f"node {node} cannot be asked: Redis failed ({type(exc).__name__})") from None
        if got is None:
            raise NodeDown(f"node {node} did not answer within {ASK_TIMEOUT_S:g} s")
        if got == -1:
            raise NodeDown(f"node {node} answered over {MAX_ANSWER} bytes (ask that node itself)")
        try:
            state = json.loads(got)["state"]
        except (ValueError, TypeError, KeyError, RecursionError):
            raise NodeDown(f"node {node} answered garbage") from None
        if state is None:
            return None
        if (
            not isinstance(state, dict)
            or state.get("id") != job_id
            or not isinstance(state.get("status"), str)
        ):
            raise NodeDown(f"node {node} answered garbage")
        return state

    def _answer_of(self, reply: str) -> Any:
        """The answer pushed to ``reply`` within the timeout: its bytes, ``-1`` if too long, or ``None``."""
        deadline = time.monotonic() + ASK_TIMEOUT_S
        pause = _POLL_S[0]
        while True:
            got = self._take(keys=[reply], args=[MAX_ANSWER])
            if got is not None or time.monotonic() >= deadline:
                return got
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(_POLL_S[1], pause * 2)

    def _serve(self) -> None:
        renewed, failing = 0.0, False
        while not self._stop.is_set():
            try:
                if time.monotonic() - renewed >= 1.0:
                    self._seen()
                    renewed = time.monotonic()
                got = self.client.blpop([keys.node_asks(self.node)], timeout=1)
                if got is not None:
                    self._reply(got[1])
                if failing:
                    log.info("node lookups: Redis answers again")
                    failing = False
            except RedisError as exc:
                if not failing:  # once per outage: the forwarder says the rest
                    log.warning("node lookups: Redis failed (%s); retrying every second", type(exc).__name__)
                    failing = True
                self._stop.wait(1.0)

    def _reply(self, raw: bytes | str) -> None:
        """Answer one lookup; a malformed one is dropped (a Redis writer's, not a node's)."""
        if len(raw) > MAX_ASK:
            return
        try:
            ask = json.loads(raw)
            job_id, reply = validate_job_id(ask["id"]), ask["reply"]
        except (ValueError, TypeError, KeyError, EnvelopeError, RecursionError):
            return
        if not isinstance(reply, str) or not _REPLY.fullmatch(reply):
            return  # only a reply key: never a write to another key (an RQ queue, say)
        try:
            state = self.answer(job_id)
        except (HybridqError, OSError) as exc:
            log.warning("node lookups: cannot read job %s: %s", job_id, exc)
            return  # the asking node times out: "did not answer", never "no such job"
        pipe = self.client.pipeline()
        pipe.lpush(reply, json.dumps({"state": state}))
        pipe.expire(reply, 10)
        pipe.execute()
