"""A Hypothesis state machine over enqueue / forward / work / kill / flush / crash (S14's core).

The in-memory transport stands for Redis and its simulated worker for RQ workers. Steps mix
producers, the forwarder (stepped, crashed and restarted), workers that succeed, fail (with and
without retries) or die mid-job, Redis forgetting everything, and completion events lost on
their own (an evicted stream). Checked:

* after every step: no job runs again once the ledger has it as terminal (dup_execution = 0);
* at the end, once Redis behaves and the forwarder and workers run until quiet: every accepted
  job is terminal in the ledger (lost = 0), and ``status`` adds up.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hybridq import Queue, Retry
from hybridq.envelope.model import Envelope
from hybridq.forwarder.loop import Forwarder
from hybridq.journal.reader import list_chains
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.store import load_index
from hybridq.ops.status import collect_status
from hybridq.producer.queue import _close_writers
from hybridq.transport import MemoryTransport
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tests.support.tiers import skip_unless_asked

KINDS = ("ok", "fail-once", "fail-always")
#: A tmpfs where there is one: the model crashes processes, never the machine, so its fsyncs need
#: not reach a disk (on a loaded disk they were most of its wall time).
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def task(env: Envelope, attempt: int) -> str:
    kind = env.args[0]
    if kind == "fail-always" or (kind == "fail-once" and attempt == 1):
        raise RuntimeError(f"{kind} attempt {attempt}")
    return "ok"


class CompletionsModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="hq-cmodel-", dir=SCRATCH))
        self.journal = self.dir / "journal"
        self.queue = Queue(journal=self.journal)
        self.transport = MemoryTransport()
        #: job id -> journal loc, for every accepted job
        self.accepted: dict[str, tuple[str, int, int]] = {}
        #: job id -> executions when the ledger first had it as terminal
        self.terminal_at: dict[str, int] = {}
        self.forwarder: Forwarder | None = None

    def _forwarder(self) -> Forwarder:
        if self.forwarder is None:
            self.forwarder = Forwarder(
                self.journal,
                self.transport,
                batch_size=5,
                backoff_initial_s=0.0001,
                backoff_max_s=0.0002,
                reconcile_interval_s=0.0,
                lease_s=0.0,
                max_lost=3,
            )
            self.forwarder.open()
            assert self.forwarder.completions is not None
            self.forwarder.completions.done_grace_s = 0.0
            self.forwarder.completions.stranded_grace_s = 0.0
        return self.forwarder

    @rule(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=6), retry=st.booleans())
    def enqueue(self, kinds: list[str], retry: bool) -> None:
        policy = Retry(max_attempts=2, backoff_s=0, jitter=False) if retry else None
        for kind in kinds:
            job = self.queue.enqueue("tests.tasks.add", kind, 0, retry=policy)
            self.accepted[job.id] = (job.record.writer_id, job.record.segment, job.record.offset)

    @rule()
    def forward(self) -> None:
        forwarder = self._forwarder()
        assert forwarder.completions is not None
        forwarder.completions.hurry()
        forwarder.maintenance.next_epoch_check = 0.0  # the model's steps are faster than the 1 s timer
        forwarder.step()

    @rule(n=st.integers(1, 5))
    def work(self, n: int) -> None:
        self.transport.work(func=task, limit=n)

    @rule()
    def worker_dies_mid_job(self) -> None:
        delivery = self.transport.take("default")
        if delivery is not None:
            self.transport.kill(delivery)

    @rule()
    def redis_forgets_everything(self) -> None:
        self.transport.forget()

    @rule()
    def completion_events_lost(self) -> None:
        self.transport.events.clear()

    @rule()
    def crash_forwarder(self) -> None:
        if self.forwarder is not None:
            self.forwarder.close()
            self.forwarder = None

    @rule()
    def producer_restarts(self) -> None:
        _close_writers()

    def _terminal_ids(self) -> set[str]:
        compacted = load_compacted(str(self.journal))
        index = load_index(str(self.journal), compacted)
        present = set(list_chains(str(self.journal)))
        out = set()
        for job_id, loc in self.accepted.items():
            seg = (loc[0], loc[1])
            # Compaction deletes only segments whose every job is terminal, and forgets a chain
            # once all of it is gone (the status counts below check the totals independently).
            gone = compacted.is_compacted(seg) or loc[0] not in present
            if gone or loc[2] in index.terminal.get(seg, {}) or loc in index.failed:
                out.add(job_id)
        return out

    @invariant()
    def finished_jobs_never_run_again(self) -> None:
        if not self.journal.exists():
            return
        for job_id in self._terminal_ids():
            runs = self.transport.executions.get(job_id, 0)
            first = self.terminal_at.setdefault(job_id, runs)
            assert runs == first, f"job {job_id} ran again after the ledger had it as terminal"

    def teardown(self) -> None:
        try:
            if not self.accepted:
                return
            forwarder = self._forwarder()
            for _ in range(60):
                assert forwarder.completions is not None
                forwarder.completions.hurry()
                forwarder.step()
                self.transport.work(func=task)
                forwarder.step()
                if self._terminal_ids() == set(self.accepted):
                    break
            self.finished_jobs_never_run_again()
            missing = set(self.accepted) - self._terminal_ids()
            assert not missing, f"lost: {sorted(missing)}"
            forwarder.close()
            self.forwarder = None
            out = collect_status(str(self.journal))
            assert out["accepted"] == len(self.accepted)
            assert out["pending"] == 0
            assert out["succeeded"] + out["failed"] == len(self.accepted)
        finally:
            if self.forwarder is not None:
                self.forwarder.close()
            _close_writers()
            shutil.rmtree(self.dir, ignore_errors=True)


#: The default run's examples: 50 of 40 steps (about 5 s); the slow tier runs the full 150.
DEFAULT_EXAMPLES = 50
TIER_EXAMPLES = 150


def test_completions_model() -> None:
    run_state_machine_as_test(
        CompletionsModel,
        settings=settings(max_examples=DEFAULT_EXAMPLES, stateful_step_count=40, deadline=None),
    )


@pytest.mark.slow
def test_completions_model_full(request: pytest.FixtureRequest) -> None:
    """The full count (about 16 s): ``scripts/test -m slow tests/unit/test_completions_model.py``."""
    skip_unless_asked(request, "pytest -m slow tests/unit/test_completions_model.py")
    run_state_machine_as_test(
        CompletionsModel, settings=settings(max_examples=TIER_EXAMPLES, stateful_step_count=40, deadline=None)
    )
