"""Queues over several Redis instances: one transport that routes each queue to its own Redis.

:class:`ShardedTransport` implements the transport port by delegating to one transport per Redis
(:class:`~hybridq.transport.rq.RQTransport` by default), chosen by the job's queue
(:class:`~hybridq.transport.routes.Routes`). All of a job's keys (its RQ hash and queue entry, its
outcome, lease and cancel mark) live on its queue's Redis, where that queue's workers run it;
each Redis keeps the forwarder's completion stream of the jobs it ran.

The epoch fence holds per Redis. The forwarder keeps one epoch; here it is *composed*: the
run ids of every Redis and a digest of the queue → Redis map (``"gen:run1,run2@digest:token"``),
and each Redis stores its own part (``"gen:run_i:token"``, the form its workers' claims check
against its own run id). The token read back is the composition again only while every Redis
still holds its part under the same generation and token, and the map is the same: one Redis
restarted (new run id), flushed (part gone) or brought back from an older snapshot (an older
part), or a queue moved to another Redis, changes it, and the forwarder bumps the generation
and refills: finished jobs' copies purged, unfinished ones rewritten, on every Redis, and every
Redis's copies of jobs of queues that no longer live there removed (docs/deploy.md, "Sharded:
queues over several Redis").

Completion events are read from every Redis (event ids become ``"i/<id>"``, ``i`` the Redis's
index in :attr:`Routes.urls`), and :meth:`wait_events` blocks on all of them at once, one thread
per Redis, so the forwarder's event watcher wakes for an event on any.

A call that needs an unreachable Redis raises :class:`~hybridq.errors.TransportError`, as the
single-Redis transport does: the forwarder backs off as a whole (its journal checkpoint is one).
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from hybridq.errors import TransportError
from hybridq.transport.redisurl import redact_url

from .base import (
    Delivery,
    Event,
    Finished,
    MemoryInfo,
    Probe,
    Published,
    PushResult,
    RefillResult,
    StateToken,
    Transport,
    Verdict,
)
from .routes import Routes

__all__ = ["ShardedTransport", "compose_epoch", "split_epoch"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_PART = re.compile(r"^(\d+):([0-9a-f]*):(.+)$")
_WHOLE = re.compile(r"^(\d+):([0-9a-f,]*)(?:@[0-9a-f]*)?:(.+)$")


def split_epoch(epoch: str, count: int) -> list[str] | None:
    """The per-Redis parts of a composed epoch (``None``: not one for ``count`` instances)."""
    m = _WHOLE.match(epoch)
    if m is None:
        return None
    runs = m.group(2).split(",")
    if len(runs) != count:
        return None
    return [f"{m.group(1)}:{run}:{m.group(3)}" for run in runs]


def compose_epoch(parts: Sequence[str | None], digest: str = "") -> str | None:
    """The epoch the parts stand for: the composition, or a value no forwarder ever set.

    Every part present, of one generation and token: ``"gen:run1,...:token"`` (with
    ``digest``, the map's: ``"gen:run1,...@digest:token"``). All the same
    value (one not in the composed form, e.g. set by a test): that value. None present: ``None``.
    Otherwise (one Redis lost or rolled back its part) a value that equals no stored epoch and
    carries the highest generation seen, so the forwarder's new generation is above every one.
    """
    if all(p is None for p in parts):
        return None
    matches = [_PART.match(p) if p is not None else None for p in parts]
    if all(m is not None for m in matches):
        heads = {(m.group(1), m.group(3)) for m in matches if m is not None}
        if len(heads) == 1:
            gen, token = heads.pop()
            runs = ",".join(m.group(2) for m in matches if m is not None)
            return f"{gen}:{runs}{'@' if digest else ''}{digest}:{token}"
    if len(set(parts)) == 1:
        return parts[0]
    top = max((int(m.group(1)) for m in matches if m is not None), default=0)
    return f"{top}:!:mixed"


class ShardedTransport(Transport):
    """Routes each queue to its Redis (see the module docstring).

    Args:
        routes: the default Redis and the queues that live elsewhere.
        make: builds the transport of one Redis from its URL (default: an ``RQTransport``).
    """

    blocking_events = True

    def __init__(self, routes: Routes, *, make: Callable[[str], Transport] | None = None) -> None:
        if make is None:
            from .rq import RQTransport  # noqa: PLC0415 - redis-py only when one is built

            make = RQTransport
        self.routes = routes
        self.urls = routes.urls
        self.shards: list[Transport] = []
        try:
            for url in self.urls:
                self.shards.append(make(url))
        except BaseException:
            self.close()
            raise
        self._index = {url: i for i, url in enumerate(self.urls)}
        #: Each shard's push adds its limited copies itself (``RQTransport``'s does), so the gate
        #: must not add them again should it ever read keys here (docs/forwarder.md, "Limits per key").
        self.counts_limited_pushes = all(s.counts_limited_pushes for s in self.shards)
        #: Per Redis: the newest event id acknowledged (its waiter waits for a newer one).
        self._cursor = ["0-0"] * len(self.shards)
        #: Per Redis: its waiter in flight (kept across calls: a wait is never started twice).
        self._waits: list[concurrent.futures.Future[bool] | None] = [None] * len(self.shards)
        self._waited_after = ["0-0"] * len(self.shards)  # the cursor each waiter was given
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._first = 0  # the Redis harvested first (rotates, so none waits behind another)
        self._closed = False

    def shard_of(self, queue: str) -> int:
        """The index (in :attr:`urls`) of the Redis that holds ``queue``."""
        return self._index[self.routes.url_for(queue)]

    def _split(self, items: Sequence[_T], queue: Callable[[_T], str]) -> dict[int, list[int]]:
        """Positions in ``items`` by Redis index, in order."""
        out: dict[int, list[int]] = {}
        for pos, item in enumerate(items):
            out.setdefault(self.shard_of(queue(item)), []).append(pos)
        return out

    # -- jobs -----------------------------------------------------------------------------------

    def push(self, jobs: Sequence[Delivery]) -> PushResult:
        """Push each job to its queue's Redis (all of them, or TransportError: push again)."""
        pushed = present = sent = 0
        queued: set[str] | None = set()
        for shard, positions in self._split(jobs, lambda d: d.envelope.queue).items():
            result = self.shards[shard].push([jobs[p] for p in positions])
            pushed += result.pushed
            present += result.already_present
            sent += result.sent_bytes
            if queued is not None:
                queued = None if result.queued is None else queued | result.queued
        return PushResult(pushed, present, sent, None if queued is None else frozenset(queued))

    def refill(self, terminal: Sequence[Probe], live: Sequence[Delivery]) -> RefillResult:
        """Refill each Redis with its own queues' jobs (see :meth:`Transport.refill`).

        First every Redis drops its copies of the jobs of queues that live elsewhere (a queue
        moved: :meth:`Transport.evict`); a job that runs or ran on its old Redis is not
        delivered on its new one (its outcome is harvested from the old one). Costs one more
        call per job on each other Redis, in each refill pass.
        """
        purged = 0
        elsewhere: set[str] = set()
        for i, backend in enumerate(self.shards):
            removed, here = backend.evict(
                [p for p in terminal if self.shard_of(p.queue) != i],
                [d for d in live if self.shard_of(d.envelope.queue) != i],
            )
            purged += removed
            elsewhere |= here
            if removed or here:
                log.warning(
                    "refill: %s held jobs of queues that now live on another Redis (the map "
                    "changed): %d copies removed, %d left there (run or ran there: not delivered again)",
                    redact_url(self.urls[i]),
                    removed,
                    len(here),
                )
        live = [d for d in live if d.envelope.id not in elsewhere]
        dead = self._split(terminal, lambda p: p.queue)
        alive = self._split(live, lambda d: d.envelope.queue)
        requeued, anew = 0, set[str]()
        for shard in sorted(dead.keys() | alive.keys()):
            result = self.shards[shard].refill(
                [terminal[p] for p in dead.get(shard, [])], [live[p] for p in alive.get(shard, [])]
            )
            requeued += result.requeued
            purged += result.purged
            anew |= result.queued
        return RefillResult(requeued, purged, frozenset(anew))

    def probe(self, jobs: Sequence[Probe], *, lease_s: float) -> list[Verdict]:
        """Ask each job's Redis; the verdicts in the order of ``jobs``."""
        out: list[Verdict | None] = [None] * len(jobs)
        for shard, positions in self._split(jobs, lambda p: p.queue).items():
            verdicts = self.shards[shard].probe([jobs[p] for p in positions], lease_s=lease_s)
            for p, verdict in zip(positions, verdicts, strict=True):
                out[p] = verdict
        return [v for v in out if v is not None]

    def cancel(self, jobs: Sequence[Probe], *, key_ttl_s: float) -> list[bool]:
        """Cancel each job on its Redis; per job, whether a worker runs it."""
        out = [False] * len(jobs)
        for shard, positions in self._split(jobs, lambda p: p.queue).items():
            running = self.shards[shard].cancel([jobs[p] for p in positions], key_ttl_s=key_ttl_s)
            for p, busy in zip(positions, running, strict=True):
                out[p] = busy
        return out

    @property
    def default_result_ttl_s(self) -> float | None:
        """Every Redis's (see :attr:`Transport.default_result_ttl_s`)."""
        return self.shards[0].default_result_ttl_s if self.shards else None

    @default_result_ttl_s.setter
    def default_result_ttl_s(self, seconds: float | None) -> None:
        for shard in self.shards:
            shard.default_result_ttl_s = seconds

    def memory(self) -> MemoryInfo | None:
        """The fullest Redis (highest share of its ``maxmemory`` used): the one a push may fill."""
        infos = [info for info in (shard.memory() for shard in self.shards) if info is not None]
        if not infos:
            return None
        return max(infos, key=lambda i: (i.used / i.maxmemory if i.maxmemory else 0.0, i.used))

    def queue_lengths(self, queues: Sequence[str]) -> dict[str, int] | None:
        """Each queue's length, asked of its own Redis."""
        out: dict[str, int] = {}
        for shard, positions in self._split(queues, lambda q: q).items():
            lengths = self.shards[shard].queue_lengths([queues[p] for p in positions])
            if lengths is None:
                return None
            out.update(lengths)
        return out

    def drop_finished(self, jobs: Sequence[Finished], *, result_ttl_s: float) -> None:
        """Forget each finished job on its queue's Redis."""
        for shard, positions in self._split(jobs, lambda j: j.queue).items():
            self.shards[shard].drop_finished([jobs[p] for p in positions], result_ttl_s=result_ttl_s)

    def ping(self) -> None:
        """Raise TransportError unless every Redis answers (the message names the one that did not)."""
        for url, shard in zip(self.urls, self.shards, strict=True):
            try:
                shard.ping()
            except TransportError as exc:
                raise type(exc)(f"{redact_url(url)}: {exc}") from exc

    # -- the epoch ------------------------------------------------------------------------------

    def state_token(self, owner: str) -> StateToken:
        """The composed epoch and the run ids of every Redis with the map's digest (module docstring)."""
        tokens = [shard.state_token(owner) for shard in self.shards]
        digest = self.routes.digest
        runs = ",".join(t.run_id for t in tokens)
        return StateToken(compose_epoch([t.epoch for t in tokens], digest), f"{runs}@{digest}")

    def set_epoch(self, owner: str, epoch: str) -> None:
        """Store each Redis's part of ``epoch`` (a value not in the composed form: on every one)."""
        parts = split_epoch(epoch, len(self.shards)) or [epoch] * len(self.shards)
        for shard, part in zip(self.shards, parts, strict=True):
            shard.set_epoch(owner, part)

    # -- completion events ----------------------------------------------------------------------

    def harvest(self, owner: str, limit: int) -> list[Event]:
        """Up to ``limit`` of the oldest events of every Redis, ids tagged with the Redis's index."""
        out: list[Event] = []
        count = len(self.shards)
        for k in range(count):
            shard = (self._first + k) % count
            if len(out) >= limit:
                break
            out += [
                Event(f"{shard}/{ev.event_id}", ev.body, ev.refused)
                for ev in self.shards[shard].harvest(owner, limit - len(out))
            ]
        self._first = (self._first + 1) % count
        return out

    def ack(self, owner: str, event_ids: Sequence[str]) -> None:
        """Delete harvested events, each from the Redis it came from."""
        by_shard: dict[int, list[str]] = {}
        for tagged in event_ids:
            head, sep, event_id = tagged.partition("/")
            if not sep or not head.isdigit() or int(head) >= len(self.shards):
                raise ValueError(f"not an event id of this transport: {tagged!r}")
            by_shard.setdefault(int(head), []).append(event_id)
        for shard, ids in by_shard.items():
            self.shards[shard].ack(owner, ids)
            self._cursor[shard] = ids[-1]

    def wait_events(self, owner: str, after: str, timeout_s: float) -> bool:  # noqa: ARG002
        """Block up to ``timeout_s`` until an event arrives on any Redis (one waiter per Redis).

        ``after`` (one Redis's event id) is not used: each Redis's waiter waits for an event
        newer than the newest acknowledged there. A waiter still blocked from an earlier call
        is waited on again, never doubled; one that saw only events acknowledged since is not
        taken for news.
        """
        if self._closed:
            raise TransportError("the transport is closed")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=len(self.shards), thread_name_prefix="hybridq-shard-events"
            )
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(0.001, deadline - time.monotonic())
            for shard, transport in enumerate(self.shards):
                if self._waits[shard] is None:
                    self._waited_after[shard] = after_id = self._cursor[shard]
                    self._waits[shard] = self._pool.submit(transport.wait_events, owner, after_id, left)
            pending = [w for w in self._waits if w is not None]
            done, _ = concurrent.futures.wait(
                pending, timeout=left + 1.0, return_when=concurrent.futures.FIRST_COMPLETED
            )
            found, error = False, None
            for shard, wait in enumerate(self._waits):
                if wait is None or wait not in done:
                    continue
                self._waits[shard] = None
                exc = wait.exception()
                if exc is not None:
                    error = exc
                elif wait.result() and self._waited_after[shard] == self._cursor[shard]:
                    found = True  # (an event older than what was acknowledged since: look again)
            if found:
                return True
            if error is not None:
                raise TransportError(f"waiting for completion events: {error}")
            if time.monotonic() >= deadline:
                return False

    publishes_stats = True

    def publish_stats(self, owner: str, body: bytes, ttl_s: float) -> None:
        """On the default Redis, the one ``hybridq status --all --redis URL`` is given."""
        self.shards[0].publish_stats(owner, body, ttl_s)

    def read_stats(self, limit: int) -> list[Published]:
        """From the default Redis (where :meth:`publish_stats` puts them)."""
        return self.shards[0].read_stats(limit)

    def forget_stats(self, owner: str) -> bool:
        """From the default Redis (where :meth:`publish_stats` puts them)."""
        return self.shards[0].forget_stats(owner)

    def close(self) -> None:
        """Stop the waiters (each ends within its block time) and close every Redis's transport."""
        self._closed = True
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for shard in self.shards:
            shard.close()
