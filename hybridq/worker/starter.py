"""A pool process's claims, made at the moment each task starts, batched across its threads.

The engine takes jobs ahead of its threads (:data:`~hybridq.worker.batch_scripts.TAKE`), but a
job taken is only **reserved**: moved into RQ's intermediate list, as RQ's own dequeue does. Its
claim (the idempotency key's lease, fenced by the forwarder's epoch and Redis's ``run_id``:
:mod:`hybridq.worker.scripts`) is made by :meth:`Starter.start` when a thread (or the event
loop) is about to call the task, and the task starts only if that claim says it may. A claim made
at take time and read seconds later could be gone by then (Redis restarted from an older
snapshot, this host cut off past the lease, a task holding the GIL), and the job could finish
elsewhere meanwhile: proving the claim at the start leaves only a task already running when its
lease was lost (docs/guarantees.md).

The threads that start a job at about the same moment share one
:data:`~hybridq.worker.batch_scripts.START` call (RQ's execution and hybridq's claim, per job),
as a journal's group commit shares an fsync: the first sends it for every job waiting, the
others wait for its reply, and the ones arriving meanwhile go in the next call.

A reservation that waits too long is given back (:func:`give_back`): the forwarder counts a job
left in an intermediate list for a lease as stranded and delivers it again; so is every
reservation of a process that stops.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError, RedisError

from hybridq.protocol import DEFAULT_LEASE_S, ClaimStatus, keys
from hybridq.worker import batch_end, batch_scripts, lease, scripts, wire
from hybridq.worker.run import Run, finished, release_all
from hybridq.worker.runner import Runner, Taken

__all__ = [
    "EXPIRY_CHECK_S",
    "GIVE_BACK_LEASES",
    "RECORD_AFTER_S",
    "Reservations",
    "Starter",
    "give_back",
    "hold_claimed",
]

log = logging.getLogger("hybridq.worker")

#: A job taken ahead and not started within this many of its leases is given back to its queue.
GIVE_BACK_LEASES = 0.5
#: How often the reservations are looked at for that (seconds).
EXPIRY_CHECK_S = 0.5
#: A job still running this long after its claim was sent gets RQ's execution records (seconds).
RECORD_AFTER_S = 0.25


class Starter:
    """Claims the jobs a process's threads are about to start, in shared calls (module docstring).

    Args:
        client: the Redis client of the worker's own calls.
        name: the RQ worker name of the process.
        exec_ttl_s: how long RQ's records of an execution last without a heartbeat.
    """

    def __init__(self, client: redis.Redis, name: str, exec_ttl_s: int) -> None:
        self.client = client
        self.name = name
        self.exec_ttl_s = exec_ttl_s
        self._prefix = uuid.uuid4().hex[:16]
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._waiting: list[Taken] = []
        self._sending = False
        #: Calls made, and jobs claimed in them (the batching's measure).
        self.calls = 0
        self.sent = 0

    def start(self, item: Taken) -> Any:
        """Claim ``item`` now; the claim's reply, or ``None`` if it could not be sent.

        A claimed job's lease is renewed from this moment (the pool's supervisor is told before
        this returns). Called by the thread that runs the task right after, if it may.
        """
        with self._cond:
            self._waiting.append(item)
            while self._sending and not _answered(item):
                self._cond.wait()
            if _answered(item):  # another thread's call carried it
                return item.run.claim_reply
            batch, self._waiting = self._waiting, []
            self._sending = True
        try:
            self._send(batch)
        finally:
            with self._cond:
                self._sending = False
                for job in batch:
                    if not _answered(job):
                        job.dropped = True
                self._cond.notify_all()
        return item.run.claim_reply

    def _send(self, batch: list[Taken]) -> None:
        args = self._start_args(batch)
        sent = time.monotonic()
        self._started(
            batch, self._resend(batch, lambda: scripts.call(self.client, batch_scripts.START, [], args)), sent
        )

    def exchange(
        self,
        ending: list[Taken],
        starting: list[Taken],
        take: tuple[list[str], list[Any]] | None,
        running: Sequence[Taken] = (),
    ) -> list[Any]:
        """End ``ending``, start (claim) ``starting``, record ``running`` and take, in one round trip.

        Returns what was taken. Of ``ending``, those ``dropped`` are not ended (never started).
        ``running``: jobs started in an earlier turn and still running, whose RQ execution
        records (the started registry) are written now
        (:data:`~hybridq.worker.batch_scripts.RECORD`, best effort: RQ's view only).

        Raises the take's error if it failed (Redis away), once the other parts are dealt with.

        ``take``: the keys and arguments of a TAKE. Each part whose reply is lost (or that
        Redis refused for the moment) is sent again on its own, with the same arguments: a copy
        that ran is recognised (END's tokens, START's tokens and execution ids). A take whose
        reply is lost is not: the jobs it moved wait in RQ's intermediate list, where the
        forwarder finds them stranded and delivers them again. ``starting`` jobs whose claims
        could not be sent are marked ``dropped``; the others have their claim reply, and their
        leases are held, before this returns.
        """
        parts: list[tuple[str, list[str], list[Any]]] = []
        ending = [i for i in ending if not i.dropped]
        if ending:
            parts.append((batch_end.END, [], batch_end.end_args(self.name, ending)))
        if starting:
            parts.append((batch_scripts.START, [], self._start_args(starting)))
        if running:
            parts.append(
                (batch_scripts.RECORD, [], batch_scripts.record_args(self.name, running, self.exec_ttl_s))
            )
        if take is not None:
            parts.append((batch_scripts.TAKE, *take))
        sent = time.monotonic()  # the claims' age counts from here (_started)
        replies = self._pipeline(parts)

        def again(n: int) -> Callable[[], Any]:
            source, keys_, args = parts[n]
            return lambda: scripts.call(self.client, source, keys_, args)

        if ending:
            reply = replies.pop(0)
            _ended(ending, _resend(ending, again(0)) if isinstance(reply, Exception) else reply)
        if starting:
            reply = replies.pop(0)
            resent = isinstance(reply, Exception)
            reply = self._resend(starting, again(1 if ending else 0)) if resent else reply
            self._started(starting, reply, sent)
        lease.flush()  # the leases END freed, if START's claims did not carry them (keeper.Channel)
        if running:
            _recorded(running, replies.pop(0))
        taken = replies.pop(0) if take is not None else []
        if isinstance(taken, NoScriptError):  # it did not run: sent again, now that it is loaded
            taken = scripts.call(self.client, batch_scripts.TAKE, *take)  # type: ignore[misc]
        if isinstance(taken, Exception):
            raise taken  # nothing is known of the take: Redis away (the loop waits for it)
        return batch_scripts.taken(taken)

    def _pipeline(self, parts: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
        """Send the scripts ``parts`` in one round trip; each one's reply, or the error it met.

        By their SHAs, without redis-py's SCRIPT EXISTS round trip before each pipeline: a
        script Redis does not know (it restarted) did not run, is loaded here, and its part is
        sent again by the caller. Packed and read by :mod:`hybridq.worker.wire` (a pipeline's
        replies, for less of the process's CPU).
        """
        client = self.client
        try:
            replies = wire.round_trip(
                client,
                [
                    ("EVALSHA", scripts.sha(client, source), len(keys_), *keys_, *args)
                    for source, keys_, args in parts
                ],
            )
        except RedisError as exc:
            return [exc] * len(parts)
        for (source, _keys, _args), reply in zip(parts, replies, strict=True):
            if isinstance(reply, NoScriptError):
                with contextlib.suppress(RedisError):
                    self.client.script_load(source)
        return replies

    def _start_args(self, batch: list[Taken]) -> list[Any]:
        for item in batch:
            item.exec_id = item.exec_id or f"{self._prefix}{next(self._ids):x}"
        return batch_scripts.start_args(self.name, batch)

    def _resend(self, batch: list[Taken], call: Callable[[], Any]) -> Any:
        """START again (with the same tokens: a claim that ran finds its lease); None if given up."""
        try:
            return scripts.retrying(call)
        except RedisError as exc:
            # Left where the take put them (or started and claimed, if the call ran): the
            # forwarder finds them stranded or orphaned and delivers them again. Never started.
            log.error("cannot start %d job(s) (%s): left for the forwarder to deliver again", len(batch), exc)
            return None

    def _started(self, batch: list[Taken], replies: Any, sent: float) -> None:
        """Note the claims' replies (``None``: not sent) and hold the leases taken, before any start.

        ``sent``: when the claims were sent (monotonic), their age's start: Redis may have run
        them long before their reply is read (the thread reading it held up by another holding
        the GIL), and their leases were renewed by nobody meanwhile.
        """
        if replies is None:
            for item in batch:
                item.dropped = True
            return
        self.calls += 1
        self.sent += len(batch)
        claimed = []
        for item, reply in zip(batch, replies, strict=True):
            if int(reply[0]) < 0:  # a script error of this job's own (batch_scripts.ISOLATE_LUA)
                log.error(
                    "job %s: its claim failed (%s): not started; left for the forwarder",
                    item.job_id,
                    _text(reply[1]),
                )
                item.dropped = True
            elif reply[0] == ClaimStatus.CLAIMED:
                claimed.append(item)
        # Before any of them starts: the leases are renewed, by the supervisor too.
        hold_claimed(self.client, [item.run for item in claimed])
        for item in claimed:
            item.claimed_at = sent
        for item, reply in zip(batch, replies, strict=True):
            if int(reply[0]) >= 0:
                item.run.claim_reply = reply


def _recorded(running: Sequence[Taken], reply: Any) -> None:
    """Note RECORD's reply: a script Redis did not know (it restarted) is sent at the next turn."""
    if isinstance(reply, NoScriptError):
        for item in running:
            item.recorded = False
    elif isinstance(reply, Exception):
        log.debug("RQ's records of %d running job(s) not written: %s", len(running), reply)


def _answered(item: Taken) -> bool:
    return item.run.claim_reply is not None or item.dropped


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def give_back(client: redis.Redis, items: Sequence[tuple[str, str]]) -> None:
    """Put reserved jobs ``(job id, queue)`` back at the head of their queues (best effort).

    Not started, so nothing else is undone. If Redis cannot be reached they stay in RQ's
    intermediate lists, where the forwarder finds them stranded and delivers them again (the
    same attempt: none was used).
    """
    if not items:
        return
    args: list[Any] = [keys.RQ_PREFIX]
    for job_id, queue in items:
        args += [job_id, queue]
    try:
        back = scripts.call(client, batch_scripts.GIVE_BACK, [], args)
    except RedisError as exc:
        log.warning(
            "cannot give back %d job(s) taken ahead (%s): the forwarder delivers them again", len(items), exc
        )
        return
    log.debug("gave back %d of %d job(s) taken ahead", back, len(items))


class Reservations:
    """The jobs a pool process took and has not ended, and which of them wait to run alone.

    Args:
        client: the Redis client of the worker's own calls.
        runner: the runner the jobs were given to (a job not started yet is withdrawn from it).
    """

    def __init__(self, client: redis.Redis, runner: Runner) -> None:
        self.client = client
        self.runner = runner
        #: Taken and not yet ended: reserved, running, or done and not yet ended.
        self.held: set[Taken] = set()
        #: Reserved, waiting for a free thread (claimed as one takes it: the engine's turn).
        self.ready: collections.deque[Taken] = collections.deque()
        #: Waiting to run alone (reserved): deliveries whose earlier run vanished, and jobs RQ's
        #: code runs (``run`` None).
        self.isolated: collections.deque[Taken] = collections.deque()
        self._next_expiry = 0.0

    def unrecorded(self) -> list[Taken]:
        """The jobs claimed :data:`RECORD_AFTER_S` ago or more, still held, with no RQ execution records.

        A turn records them (:data:`~hybridq.worker.batch_scripts.RECORD`): a job ending sooner,
        as most do, never has them written and deleted. By age, not by turns: a loaded process's
        next turn can come before its threads even started the jobs of the last one.
        """
        due = time.monotonic() - RECORD_AFTER_S
        return [i for i in self.held if 0 < i.claimed_at <= due and not i.recorded and i.exec_id]

    def expire(self) -> None:
        """Give back the reservations that waited half a lease (looked at twice a second).

        The forwarder counts a job left in RQ's intermediate list for a lease as stranded and
        delivers it again; a job waiting behind a long one is better run by another worker.
        """
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + EXPIRY_CHECK_S
            self.give_back(everything=False)

    def give_back(self, *, everything: bool) -> None:
        """Give back the reservations not started yet: all of them, or those that waited too long."""
        now = time.monotonic()

        def due(item: Taken) -> bool:
            lease_s = item.run.d.lease_s if item.run is not None else DEFAULT_LEASE_S
            return everything or now - item.taken_at > lease_s * GIVE_BACK_LEASES

        back = []
        for waiting in (self.ready, self.isolated):
            out = [i for i in waiting if due(i)]
            for item in out:
                waiting.remove(item)
            back += out
        # Those given to the event loop or to a thread and not started there yet, if not claimed
        # already (a claimed job is started: a free thread runs it now; its coroutine claimed it).
        back += [
            i
            for i in self.held
            if i not in back and i.run.claim_reply is None and due(i) and self.runner.withdraw(i)
        ]
        self.held.difference_update(back)
        if back:
            log.info("giving back %d job(s) taken ahead and not started", len(back))
            give_back(self.client, [(i.job_id, i.queue) for i in back])


def _resend(items: list[Taken], call: Callable[[], Any]) -> Any:
    """END again on its own (a copy that ran is recognised); -1 each if given up (leases lapse)."""
    try:
        return scripts.retrying(call)
    except RedisError:
        return [-1] * len(items)


def _ended(items: list[Taken], replies: list[Any]) -> None:
    """Note what END said of each of ``items``, and release their leases."""
    freed: list[Run] = []
    lapsing: list[Run] = []
    for item, reply in zip(items, replies, strict=True):
        if isinstance(reply, bytes):  # a script error of this job's own (batch_scripts.ISOLATE_LUA)
            log.error(
                "job %s: its outcome could not be recorded (%s): its lease lapses and the forwarder "
                "delivers it again",
                item.job_id,
                reply.decode(errors="replace"),
            )
        elif reply >= 0:
            finished(item.run, reply)
        # A stored outcome deleted the lease (or found it no longer this run's): freed.
        (freed if isinstance(reply, int) and reply >= 0 else lapsing).append(item.run)
    release_all(freed, freed=True)
    release_all(lapsing)


def hold_claimed(conn: redis.Redis, runs: list[Run]) -> None:
    """Renew the leases of ``runs`` (just claimed) from their claims on, until :func:`release_all`.

    A pool worker's job waits for its batch's end once its task returned: its lease must not
    lapse meanwhile. In a pool process the supervisor is told of them in one message, before
    the tasks start (:mod:`hybridq.worker.keeper`).
    """
    runs = [run for run in runs if run.renewal is None]
    held = lease.hold_all(
        conn, [(run.claim_keys[1], run.token, run.d.lease_s, run.claim_keys[2]) for run in runs]
    )
    for run, renewal in zip(runs, held, strict=True):
        renewal.until = math.inf
        run.renewal = renewal
