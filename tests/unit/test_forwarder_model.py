"""A Hypothesis state machine over enqueue / forward / outage / crash (the forwarder's half of S14).

Invariants checked after every step:
* the checkpoint is never ahead of the transport: every job at or before it is queued;
* no job is ever queued twice;
and at the end, after Redis is back and the forwarder caught up, every accepted job is queued.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.producer.queue import _close_writers
from hybridq.transport import MemoryTransport
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule


class Killed(BaseException):
    """The forwarder process dies in the middle of a push."""


class KillableTransport(MemoryTransport):
    def __init__(self) -> None:
        super().__init__()
        self.kill_after: int | None = None

    def push(self, jobs):
        if self.kill_after is not None:
            after, self.kill_after = self.kill_after, None
            super().push(jobs[:after])
            raise Killed
        return super().push(jobs)


class ForwarderModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="hq-model-"))
        self.journal = self.dir / "journal"
        self.queue = Queue(journal=self.journal)
        self.transport = KillableTransport()
        self.accepted: list[tuple[str, str, int]] = []  # (job id, writer id, seq)
        self.forwarder: Forwarder | None = None

    def _forwarder(self) -> Forwarder:
        if self.forwarder is None:
            self.forwarder = Forwarder(
                self.journal, self.transport, batch_size=7, backoff_initial_s=0.0001, backoff_max_s=0.0002
            )
            self.forwarder.open()
        return self.forwarder

    @rule(n=st.integers(1, 20), batch=st.booleans())
    def enqueue(self, n: int, batch: bool) -> None:
        if batch:
            jobs = self.queue.enqueue_many([self.queue.prepare("tests.tasks.add", (i, i)) for i in range(n)])
        else:
            jobs = [self.queue.enqueue("tests.tasks.add", i, i) for i in range(n)]
        self.accepted += [(j.id, j.record.writer_id, j.record.seq) for j in jobs]

    @precondition(lambda self: not self.transport.down)
    @rule()
    def forward(self) -> None:
        self._forwarder().step()

    @rule(jobs_before_failure=st.integers(0, 10))
    def flaky_push(self, jobs_before_failure: int) -> None:
        if self.transport.down:
            return
        self.transport.fail_next(1, after=jobs_before_failure)
        self._forwarder().step()  # retries after the injected failure

    @precondition(lambda self: not self.transport.down)
    @rule(jobs_before_death=st.integers(0, 10))
    def crash_mid_push(self, jobs_before_death: int) -> None:
        """SIGKILL while a batch is half pushed: the checkpoint must not have moved past it."""
        self.transport.kill_after = jobs_before_death
        with contextlib.suppress(Killed):
            self._forwarder().step()
        self.transport.kill_after = None
        self.crash_forwarder()

    @rule()
    def redis_goes_down(self) -> None:
        self.transport.down = True

    @rule()
    def redis_comes_back(self) -> None:
        self.transport.down = False

    @rule()
    def crash_forwarder(self) -> None:
        """SIGKILL: drop the forwarder without any goodbye (its lock goes with its fd)."""
        if self.forwarder is not None:
            self.forwarder.close()
            self.forwarder = None

    @rule()
    def producer_restarts(self) -> None:
        _close_writers()  # the next enqueue starts a new chain, as a new process would

    @invariant()
    def checkpoint_never_ahead_of_the_transport(self) -> None:
        checkpoint = load_checkpoint(str(self.journal))
        if checkpoint is None:
            return
        for job_id, writer, seq in self.accepted:
            position = checkpoint.positions.get(writer)
            if position is not None and position.next_seq > seq:
                assert job_id in self.transport.jobs, job_id

    @invariant()
    def nothing_queued_twice(self) -> None:
        ids = self.transport.queues.get("default", [])
        assert len(ids) == len(set(ids))

    def teardown(self) -> None:
        try:
            self.transport.down = False
            self._forwarder().step()
            queued = set(self.transport.queues.get("default", []))
            assert queued == {job_id for job_id, _, _ in self.accepted}
        finally:
            if self.forwarder is not None:
                self.forwarder.close()
            _close_writers()
            shutil.rmtree(self.dir, ignore_errors=True)


ForwarderModel.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
test_forwarder_model = ForwarderModel.TestCase
