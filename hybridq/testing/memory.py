"""An in-memory transport for tests: the forwarder's logic without Redis.

Like dramatiq's ``StubBroker`` or procrastinate's ``InMemoryConnector``, it ships in the package
so users can test their own code. It can be told to fail, to simulate Redis being down, to lose
everything (:meth:`MemoryTransport.forget`), and it has a simulated worker (:meth:`work`,
:meth:`take`, :meth:`kill`) that follows the same idempotency rules as :mod:`hybridq.worker`.
What it holds, its faults and its snapshots are :class:`hybridq.testing.memory_state.MemoryState`'s,
its base; this module owns the port's calls and the simulated worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from hybridq.envelope.model import Envelope
from hybridq.errors import RetryLater, RetryLaterExpired, TransportError
from hybridq.protocol import CompletionEvent, Overwrite, StartedEvent
from hybridq.protocol.later import Later, resolve
from hybridq.testing.memory_state import MemoryState
from hybridq.transport.base import (
    Delivery,
    Event,
    Probe,
    PushResult,
    RefillResult,
    StateToken,
    Transport,
    Verdict,
)

__all__ = ["MemoryTransport"]


class MemoryTransport(MemoryState, Transport):
    """Queues in a dict. ``down = True`` (or :meth:`fail_next`) makes calls fail."""

    # -- the port -----------------------------------------------------------------------------

    def push(self, jobs: Sequence[Delivery]) -> PushResult:
        """Queue the jobs not already known (or forced), in order (see :class:`Transport`)."""
        with self._lock:
            self.push_calls += 1
            self._check()
            limit = len(jobs)
            failing = self._failures > 0
            if failing:
                self._failures -= 1
                limit = min(limit, self._partial or 0)
            pushed = present = 0
            queued: set[str] = set()
            for delivery in jobs[:limit]:
                env = delivery.envelope
                run = env.requeue * 100000 + delivery.attempt
                if env.id in self.jobs:
                    known = self.runs.get(env.id, 0)
                    # As the push script: a copy of this very run RQ ended without a claim
                    # (refused, left for another worker) can no longer run, and is queued again.
                    ended = self.status.get(env.id) in ("finished", "failed")
                    stale = known > run or (
                        known == run and not (ended and self.claimed.get(env.id, 0) < run)
                    )
                    mode = delivery.overwrite
                    if not (mode is Overwrite.ALWAYS or (mode is Overwrite.EARLIER and not stale)):
                        present += 1
                        continue
                    for ids in self.queues.values():
                        if env.id in ids:
                            ids.remove(env.id)
                self.jobs[env.id] = env
                self.deliveries[env.id] = delivery
                self.runs[env.id] = run
                self.claimed.pop(env.id, None)
                self.fenced.discard(env.id)
                self.cancelled.discard(env.id)  # a new hash, as the push script writes it
                self.status[env.id] = "queued"
                self.queues.setdefault(env.queue, []).append(env.id)
                queued.add(env.id)
                pushed += 1
            if failing:
                raise TransportError(f"injected failure after {limit} jobs")
            return PushResult(pushed, present, queued=frozenset(queued))

    def refill(self, terminal: Sequence[Probe], live: Sequence[Delivery]) -> RefillResult:
        """Purge finished jobs' queued copies, bring live ones up (see :meth:`Transport.refill`)."""
        with self._lock:
            self._check()
            purged = requeued = 0
            for job in terminal:
                if self.status.get(job.job_id) == "queued" and job.job_id not in self.fenced:
                    self._unqueue(job.job_id)
                    for table in (self.jobs, self.deliveries, self.runs, self.claimed, self.status):
                        table.pop(job.job_id, None)
                    purged += 1
            for delivery in live:
                job_id = delivery.envelope.id
                if job_id in self.fenced or job_id not in self.jobs:
                    self.fenced.discard(job_id)
                    self._unqueue(job_id)
                    self.jobs.pop(job_id, None)
                    self.push([delivery])
                    requeued += 1
                elif self.status.get(job_id) == "queued":
                    self.deliveries[job_id] = delivery  # rewritten in place: keeps its place
                    self.runs[job_id] = delivery.envelope.requeue * 100000 + delivery.attempt
                    requeued += 1
            return RefillResult(requeued, purged)

    def _unqueue(self, job_id: str) -> None:
        for ids in self.queues.values():
            if job_id in ids:
                ids.remove(job_id)

    def cancel(self, jobs: Sequence[Probe], *, key_ttl_s: float) -> list[bool]:  # noqa: ARG002
        """Mark known jobs cancelled and unqueue them; whether each one's lease is held."""
        with self._lock:
            self._check()
            out: list[bool] = []
            for job in jobs:
                if job.job_id in self.jobs:
                    self.cancelled.add(job.job_id)
                    if self.status.get(job.job_id) == "queued":
                        self._unqueue(job.job_id)
                        self.status[job.job_id] = "canceled"
                out.append(job.key_id in self.leases)
            return out

    def ping(self) -> None:
        """Raise TransportError while down."""
        self._check()

    def harvest(self, owner: str, limit: int) -> list[Event]:
        """The oldest events of ``owner``."""
        with self._lock:
            self._check()
            return list(self.events.get(owner, [])[:limit])

    def ack(self, owner: str, event_ids: Sequence[str]) -> None:
        """Delete events."""
        with self._lock:
            self._check()
            gone = set(event_ids)
            self.events[owner] = [e for e in self.events.get(owner, []) if e.event_id not in gone]

    def state_token(self, owner: str) -> StateToken:
        """The epoch and this "server's" run id."""
        with self._lock:
            self._check()
            return StateToken(self.epochs.get(owner), self.run_id)

    def set_epoch(self, owner: str, epoch: str) -> None:
        """Store the epoch."""
        with self._lock:
            self._check()
            self.epochs[owner] = epoch

    def probe(self, jobs: Sequence[Probe], *, lease_s: float) -> list[Verdict]:  # noqa: ARG002
        """Verdicts without the grace period (a job no worker holds is orphaned at once)."""
        with self._lock:
            self._check()
            out: list[Verdict] = []
            for job in jobs:
                stored = self.results.get(job.key_id)
                if job.job_id not in self.jobs:  # a finished job's copy gone at its end: "done"
                    done = stored is not None and stored["job_id"] == job.job_id
                    out.append(Verdict.DONE if done else Verdict.MISSING)
                elif job.key_id in self.leases:
                    out.append(Verdict.RUNNING)
                elif stored is not None and stored["job_id"] == job.job_id:
                    out.append(Verdict.DONE)
                elif self.status.get(job.job_id) == "queued":
                    out.append(Verdict.QUEUED)
                elif self.claimed.get(job.job_id) == self.runs.get(job.job_id):
                    out.append(Verdict.ORPHANED)  # its task started, its worker is gone
                else:
                    out.append(Verdict.STRANDED)  # taken by a worker that died before starting it
            return out

    # -- the simulated worker -----------------------------------------------------------------

    def pop(self, queue: str) -> Envelope | None:
        """Take the next job off ``queue`` without running it (what a dying worker would do)."""
        delivery = self.take(queue)
        return None if delivery is None else delivery.envelope

    def take(self, queue: str) -> Delivery | None:
        """Dequeue the next job of ``queue`` and mark it started (no lease taken)."""
        with self._lock:
            ids = self.queues.get(queue)
            if not ids:
                return None
            job_id = ids.pop(0)
            self.status[job_id] = "started"
            return self.deliveries[job_id]

    def work(
        self,
        queue: str = "default",
        func: Callable[[Envelope, int], Any] | None = None,
        *,
        limit: int | None = None,
    ) -> int:
        """Run up to ``limit`` queued jobs of ``queue`` like ``hybridq.worker.execute`` would.

        ``func(envelope, attempt)`` stands for the task (default: returns ``None``); an exception
        it raises is the job's failure, except ``hybridq.RetryLater`` (the job runs again later,
        no attempt used). ``attempt`` is the job's (``current_job().attempt``). Returns the
        number of deliveries handled.
        """
        done = 0
        while limit is None or done < limit:
            delivery = self.take(queue)
            if delivery is None:
                break
            self.run(delivery, func)
            done += 1
        return done

    def run(self, delivery: Delivery, func: Callable[[Envelope, int], Any] | None = None) -> None:
        """Handle one taken delivery: suppress a duplicate, or run ``func`` and record it."""
        env = delivery.envelope
        with self._lock:
            if env.id in self.cancelled:
                # hybridq.worker's claim: the job hash says cancelled: not run, not reported.
                self.status[env.id] = "canceled"
                return
            if self._fenced(delivery):
                # hybridq.worker's _CLAIM: older than the owner's epoch, or a restart the
                # forwarder has not seen yet: not run, not reported.
                self.fenced.add(env.id)
                self.status[env.id] = "finished"
                return
            stored = self.results.get(env.key_id)
            # The claim rule of hybridq.worker: a success, or a final failure of this requeue
            # generation (or a later one), is reported without running the task again.
            if stored is not None and (
                stored["outcome"] == "succeeded" or (stored["final"] and stored["requeue"] >= env.requeue)
            ):
                self._emit(delivery, stored, dup=True)
                self.status[env.id] = "finished"
                return
            # A stale copy of an attempt of this job that already failed: report it, do not run.
            if (
                stored is not None
                and stored["job_id"] == env.id
                and (stored["requeue"], stored["attempt"]) >= (env.requeue, delivery.attempt)
            ):
                self._emit(delivery, stored, dup=False)
                self.status[env.id] = "finished"
                return
            self.leases.add(env.key_id)
            self.claimed[env.id] = self.runs.get(env.id, 0)
            if delivery.report_start:  # hybridq.worker's claim adds a started event
                event = Event(f"{next(self._event_ids)}-0", StartedEvent.of(delivery, self.clock()).to_json())
                self.events.setdefault(delivery.owner, []).append(event)
        error: str | None = None
        value: Any = None
        later: Later | None = None
        expired = False
        try:
            self.executions[env.id] = self.executions.get(env.id, 0) + 1
            value = (func or (lambda _env, _attempt: None))(env, delivery.job_attempt)
        except RetryLater as exc:  # as hybridq.worker.run.conclude decides
            failure, later = resolve(delivery, exc, self.clock())
            if failure is not None:
                error = f"{type(failure).__name__}: {failure}"
                expired = isinstance(failure, RetryLaterExpired)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            outcome = {
                "outcome": "succeeded" if error is None else "failed",
                "result": value,
                "error": error,
                "job_id": env.id,
                "attempt": delivery.attempt,
                "requeue": env.requeue,
                "final": error is None or delivery.job_attempt >= env.max_attempts or expired,
                "at": self.clock(),
            }
            if later is not None:
                outcome.update(
                    outcome="later",
                    result=None,
                    final=False,
                    retry_delay=later.delay,
                    later=later.count,
                    later_since=later.since,
                )
            kept = self.results.get(env.key_id)
            if kept is not None and kept["outcome"] == "succeeded":
                # A success stored meanwhile is kept, and reported (hybridq.worker's _FINISH).
                outcome = {**outcome, "outcome": "succeeded", "final": True, "error": None}
            else:
                self.results[env.key_id] = outcome
            self.leases.discard(env.key_id)
            self.status[env.id] = "finished" if error is None else "failed"
            self._emit(delivery, outcome, dup=False)

    def _fenced(self, delivery: Delivery) -> bool:
        epoch = self.epochs.get(delivery.owner)
        parts = epoch.split(":") if epoch is not None else []
        if len(parts) < 3 or not parts[0].isdigit():
            return False
        return delivery.gen < int(parts[0]) or parts[1] not in ("", self.run_id)

    def kill(self, delivery: Delivery, *, started: bool = True) -> None:
        """The worker that took ``delivery`` died: no lease, no outcome.

        ``started``: it had claimed the job and started the task (an attempt), or it died before.
        """
        with self._lock:
            env = delivery.envelope
            self.leases.discard(env.key_id)
            self.status[env.id] = "started"
            if started:
                self.claimed[env.id] = self.runs.get(env.id, 0)

    def _emit(self, delivery: Delivery, outcome: dict[str, Any], *, dup: bool) -> None:
        body = CompletionEvent.of(delivery, outcome, dup=dup, at=time.time()).to_json()
        event = Event(f"{next(self._event_ids)}-0", body)
        self.events.setdefault(delivery.owner, []).append(event)
