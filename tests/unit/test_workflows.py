"""Workflows and depends_on against the in-memory transport: shapes, results passed along, failures.

Each test drives a real forwarder step by step; the "worker" is the memory transport running the
task functions of tests/tasks.py in this process. About 2 s for the file.
"""

from __future__ import annotations

import datetime as dt
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hybridq
import pytest
from hybridq import Queue, fetch_job
from hybridq.envelope.model import Envelope
from hybridq.envelope.tagged import encode
from hybridq.errors import EnvelopeError, JobFailed, StateFileCorrupt
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalReader
from hybridq.lookup import reads
from hybridq.transport import MemoryTransport
from hybridq.workflows import store

from tests import tasks


def call(env: Envelope, _attempt: int) -> Any:
    """Run the envelope's function as a worker would (tests.tasks only), its result tagged."""
    module, name = env.func.rsplit(".", 1)
    args, kwargs = env.call_args()
    return encode(getattr(importlib.import_module(module), name)(*args, **kwargs))[0]


def drive(
    forwarder: Forwarder, transport: MemoryTransport, until: Callable[[], bool], rounds: int = 200
) -> None:
    """Step the forwarder and run what it pushed until ``until()`` (or fail after ``rounds``)."""
    for _ in range(rounds):
        forwarder.step()
        for q in list(transport.queues):
            transport.work(q, call)
        forwarder.step()
        if until():
            return
    raise AssertionError("the workflow did not end")


@pytest.fixture
def stack(journal_dir: Path):
    transport = MemoryTransport()
    forwarder = Forwarder(journal_dir, transport)
    forwarder.open()
    try:
        yield Queue(journal=journal_dir), forwarder, transport
    finally:
        forwarder.close()


def flow_state(queue: Queue, job: hybridq.Job) -> tuple[str, str]:
    """The workflow's state and its last step's, as the workflows' file holds them."""
    found = store.flow_steps(str(queue.journal), job.id)
    assert found is not None
    return found[0], found[1][-1][1]


def ended(job: hybridq.Job) -> Callable[[], bool]:
    return lambda: job.status in ("finished", "failed", "cancelled")


def test_a_chain_passes_each_result_to_the_next_step(stack) -> None:
    queue, forwarder, transport = stack
    job = queue.enqueue(
        hybridq.chain(hybridq.sig(tasks.add, 1, 2), hybridq.sig(tasks.add, 10), hybridq.sig(tasks.add, 100))
    )
    drive(forwarder, transport, ended(job))
    assert job.wait(timeout=1) == 113
    assert [transport.executions[f"{job.id}__{n}"] for n in range(3)] == [1, 1, 1]


def test_a_chord_gives_the_callback_the_list_of_results(stack) -> None:
    queue, forwarder, transport = stack
    header = hybridq.group([hybridq.sig(tasks.add, i, i) for i in range(20)])
    job = queue.enqueue(hybridq.chord(header, hybridq.sig(tasks.total)))
    drive(forwarder, transport, ended(job))
    assert job.wait(timeout=1) == sum(2 * i for i in range(20))
    assert transport.executions[f"{job.id}__20"] == 1


def test_a_group_result_is_the_list_in_order_and_nesting_works(stack) -> None:
    queue, forwarder, transport = stack
    flow = hybridq.group(
        hybridq.chain(hybridq.sig(tasks.add, 1, 1), hybridq.sig(tasks.add, 1)),
        hybridq.chain(
            hybridq.sig(tasks.add, 5, 5), hybridq.group(hybridq.sig(tasks.add, 1), hybridq.sig(tasks.add, 2))
        ),
    )
    job = queue.enqueue(flow)
    drive(forwarder, transport, ended(job))
    assert job.wait(timeout=1) == [3, 11, 12]


def test_immutable_steps_do_not_take_the_previous_result(stack) -> None:
    queue, forwarder, transport = stack
    job = queue.enqueue(
        hybridq.chain(hybridq.sig(tasks.add, 1, 2), hybridq.sig(tasks.add, 7, 7, immutable=True))
    )
    drive(forwarder, transport, ended(job))
    assert job.wait(timeout=1) == 14


def test_a_failing_member_fails_the_chord_and_on_error_runs_once(stack, tmp_path: Path) -> None:
    queue, forwarder, transport = stack
    marks = tmp_path / "callback"
    members = [hybridq.sig(tasks.add, i, i) for i in range(5)] + [hybridq.sig(tasks.fail)]
    job = queue.enqueue(
        hybridq.chord(members, hybridq.sig(tasks.record, str(marks), "cb", immutable=True)),
        on_error=hybridq.sig(tasks.record, str(tmp_path / "err"), "err", immutable=True),
    )
    drive(forwarder, transport, ended(job))
    for _ in range(5):  # on_error is released with the failure: let it run
        drive(forwarder, transport, (tmp_path / "err").exists)
    assert job.status == "failed"
    with pytest.raises(JobFailed, match="step 5"):
        job.wait(timeout=1)
    assert not marks.exists()
    assert (tmp_path / "err").read_text().split() == ["err"]
    assert flow_state(queue, job) == ("failed", "cancelled")


def test_depends_on_runs_after_its_dependencies_succeeded(stack) -> None:
    queue, forwarder, transport = stack
    first = queue.enqueue(tasks.add, 1, 1)
    second = queue.enqueue(tasks.add, 2, 2)
    after = queue.enqueue(tasks.add, 3, 3, depends_on=[first, second.id])
    forwarder.step()
    assert after.id not in transport.queues.get("default", [])
    drive(forwarder, transport, ended(after))
    assert after.wait(timeout=1) == 6


def test_depends_on_a_failed_job_cancels_the_dependent(stack) -> None:
    queue, forwarder, transport = stack
    bad = queue.enqueue(tasks.fail)
    after = queue.enqueue(tasks.add, 3, 3, depends_on=bad)
    drive(forwarder, transport, ended(after))
    assert after.status == "cancelled"
    assert transport.executions.get(after.id, 0) == 0


def test_bad_input_is_refused_in_one_line(journal_dir: Path, tmp_path: Path) -> None:
    queue = Queue(journal=journal_dir)
    with pytest.raises(EnvelopeError, match="depends_on"):
        queue.enqueue(tasks.add, 1, 1, depends_on="not an id!")
    other = Queue(journal=tmp_path / "other").enqueue(tasks.add, 1, 1)
    with pytest.raises(EnvelopeError, match="another journal"):
        queue.enqueue(tasks.add, 1, 1, depends_on=other)
    with pytest.raises(EnvelopeError, match="delay or run_at"):
        queue.enqueue(tasks.add, 1, 1, depends_on=other.id, delay=5)
    with pytest.raises(EnvelopeError, match="at least one"):
        hybridq.chain()
    with pytest.raises(EnvelopeError, match="not supported"):
        hybridq.sig(tasks.add, 1).set(bogus=1)
    with pytest.raises(EnvelopeError, match="does not take"):
        queue.enqueue(hybridq.chain(hybridq.sig(tasks.add, 1, 1)), delay=3)
    assert fetch_job("nothing", journal_dir) is None


def test_cancelling_a_workflow_cancels_what_has_not_started(stack) -> None:
    queue, forwarder, transport = stack
    job = queue.enqueue(
        hybridq.chain(*[hybridq.sig(tasks.add, 1, 1)] + [hybridq.sig(tasks.add, 1) for _ in range(3)])
    )
    forwarder.step()
    transport.work("default", call)  # the first step ran
    assert hybridq.cancel([job.id], queue.journal)[0].state == "requested"
    drive(forwarder, transport, ended(job))
    assert job.status == "cancelled"
    assert [transport.executions.get(f"{job.id}__{n}", 0) for n in range(4)][1:] in ([0, 0, 0], [1, 0, 0])
    assert flow_state(queue, job) == ("cancelled", "cancelled")


def test_cancelling_a_job_waiting_on_depends_on_never_pushes_it(stack) -> None:
    queue, forwarder, transport = stack
    first = queue.enqueue(tasks.add, 1, 1)
    after = queue.enqueue(tasks.add, 2, 2, depends_on=first)
    forwarder.step()
    hybridq.cancel([after.id], queue.journal)
    drive(forwarder, transport, ended(after))
    assert after.status == "cancelled"
    assert transport.executions.get(after.id, 0) == 0
    assert first.wait(timeout=1) == 2


def test_fetch_job_of_a_workflow_lists_its_steps_and_status_counts_workflows(stack) -> None:
    queue, forwarder, transport = stack
    job = queue.enqueue(hybridq.chain(hybridq.sig(tasks.add, 1, 1), hybridq.sig(tasks.add, 1)))
    forwarder.step()
    found = fetch_job(job.id, queue.journal)
    assert found is not None
    assert found.status == "started"
    assert [(s.n, s.state) for s in found.steps] == [(0, "released"), (1, "waiting")]
    assert store.counts(str(queue.journal))["running"] == 1
    drive(forwarder, transport, ended(job))
    assert [(s.id, s.state) for s in found.steps] == [
        (f"{job.id}__0", "succeeded"),
        (f"{job.id}__1", "succeeded"),
    ]
    assert found.status == "finished"
    assert fetch_job(f"{job.id}__1", queue.journal).result == 3


def test_status_and_metrics_count_workflows(stack) -> None:
    from hybridq.ops.metrics import workflow_metrics
    from hybridq.ops.status import stats
    from prometheus_client.core import Metric  # noqa: F401 - the metrics extra is installed in dev

    queue, forwarder, transport = stack
    ok = queue.enqueue(hybridq.chain(hybridq.sig(tasks.add, 1, 1), hybridq.sig(tasks.add, 1)))
    bad = queue.enqueue(hybridq.group(hybridq.sig(tasks.fail), hybridq.sig(tasks.add, 1, 1)))
    waiting = queue.enqueue(tasks.add, 1, 1, depends_on=[ok])
    forwarder.step()
    assert stats(queue.journal, redis_url=None)["workflows"] == {"running": 2, "waiting_on_deps": 1}
    drive(forwarder, transport, lambda: ended(ok)() and ended(bad)() and ended(waiting)())
    assert stats(queue.journal, redis_url=None)["workflows"] == {
        "succeeded": 1,
        "failed": 1,
        "waiting_on_deps": 0,
    }
    samples = {
        (s.name, s.labels.get("state")): s.value
        for m in workflow_metrics(str(queue.journal))
        for s in m.samples
    }
    assert samples[("hybridq_workflows", "failed")] == 1
    assert samples[("hybridq_waiting_on_dependencies", None)] == 0


def test_a_result_of_a_tagged_type_reaches_the_next_step_as_that_type(stack) -> None:
    queue, forwarder, transport = stack
    day = dt.date(2026, 12, 5)
    job = queue.enqueue(hybridq.chain(hybridq.sig(tasks.same, day), hybridq.sig(tasks.type_name)))
    drive(forwarder, transport, ended(job))
    assert job.wait(timeout=1) == "date"


def test_a_damaged_workflows_file_stops_the_forwarder_with_one_line(journal_dir: Path) -> None:
    Queue(journal=journal_dir).enqueue(hybridq.chain(hybridq.sig(tasks.add, 1, 1)))
    path = Path(store.path_of(str(journal_dir)))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a database" * 100)
    forwarder = Forwarder(journal_dir, MemoryTransport())
    with pytest.raises(StateFileCorrupt, match="workflows' file is damaged"):
        forwarder.open()
    assert path.read_bytes().startswith(b"not a database")  # kept for the operator


def test_a_remote_queue_refuses_a_workflow() -> None:
    remote = Queue(url="http://127.0.0.1:9")
    with pytest.raises(EnvelopeError, match="remote"):
        remote.enqueue(hybridq.chain(hybridq.sig(tasks.add, 1, 1)))


def test_a_release_repeated_after_a_crash_is_a_duplicate_that_never_runs(stack) -> None:
    queue, forwarder, transport = stack
    job = queue.enqueue(hybridq.chain(hybridq.sig(tasks.add, 1, 2), hybridq.sig(tasks.add, 10)))
    forwarder.step()  # step 0 released: appended, then marked released
    # The crash between the append and the mark: the file says step 0 still waits.
    forwarder.flows.db.execute("UPDATE steps SET state = 'waiting' WHERE flow = ?", (job.id,))
    forwarder.flows.commit()
    forwarder.flows.dirty = True
    drive(forwarder, transport, ended(job))
    assert job.wait(timeout=1) == 13
    assert [transport.executions[f"{job.id}__{n}"] for n in range(2)] == [1, 1]
    assert (
        len([r for r in JournalReader(queue.journal).records() if f"{job.id}__0".encode() in r.payload]) == 2
    )


def test_an_anchor_with_a_graph_this_version_cannot_run_is_recorded_invalid(stack) -> None:
    queue, forwarder, transport = stack
    env = queue.prepare("hybridq.workflows.canvas.anchor")
    env.meta = {"hybridq": {"wf": {"v": 1, "steps": [{"env": {}, "deps": [5], "pass": "one"}], "out": [0]}}}
    env._encoded = None
    (bad,) = queue.enqueue_many([env])
    good = queue.enqueue(hybridq.chain(hybridq.sig(tasks.add, 1, 1)))
    drive(forwarder, transport, ended(good))  # forwarding goes on past it
    assert good.wait(timeout=1) == 2
    assert bad.get_status() == "failed"  # terminal, as an invalid record reads
    assert store.flow_steps(str(queue.journal), bad.id) is None
    assert transport.executions.get(bad.id, 0) == 0


def test_a_second_workflow_under_the_same_id_is_recorded_invalid_never_pushed(stack) -> None:
    queue, forwarder, transport = stack
    first = queue.enqueue(hybridq.chain(hybridq.sig(tasks.add, 1, 1)), job_id="flow-1")
    drive(forwarder, transport, ended(first))
    again = queue.enqueue(hybridq.chain(hybridq.sig(tasks.add, 5, 5)), job_id="flow-1")
    for _ in range(3):
        forwarder.step()
    forwarder.completions.reconciler.hurry()
    forwarder.step()
    assert "flow-1" not in transport.queues.get("default", [])
    assert transport.executions.get("flow-1__0") == 1
    assert forwarder.state.index.is_terminal(
        (again.record.writer_id, again.record.segment, again.record.offset)
    )


def test_per_step_options_queue_retry_and_timeout_reach_the_steps_jobs(stack) -> None:
    queue, forwarder, transport = stack
    retry = hybridq.Retry(max_attempts=2, backoff_s=0)
    flow = hybridq.chain(
        hybridq.sig(tasks.add, 1, 1, queue="other", job_timeout=7),
        hybridq.task(queue="mail")(tasks.add).s(1).set(retry=retry),  # task.s: the decorator's queue
    )
    job = queue.enqueue(flow)
    drive(forwarder, transport, ended(job))
    assert job.wait(timeout=1) == 3
    first, second = (fetch_job(f"{job.id}__{n}", queue.journal) for n in range(2))
    assert (first.queue, first.envelope.timeout_s) == ("other", 7)
    assert (second.queue, second.envelope.retry) == ("mail", retry)


def test_a_pass_looks_only_at_the_workflows_an_outcome_concerns(
    stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue, forwarder, transport = stack
    flows = [
        queue.enqueue(hybridq.chain(hybridq.sig(tasks.add, i, 1), hybridq.sig(tasks.add, 1)))
        for i in range(10)
    ]
    forwarder.step()  # every first step released (a pass over everything: new anchors)
    looked: list[str] = []
    real_find = reads.find
    monkeypatch.setattr(
        reads, "find", lambda journal, job_id: looked.append(job_id) or real_find(journal, job_id)
    )
    forwarder.flows._next_look = float("inf")  # no periodic pass during the test
    transport.work("default", call, limit=1)  # one workflow's first step ends
    forwarder.step()
    forwarder.step()
    assert {i.rsplit("__", 1)[0] for i in looked} == {flows[0].id}  # before: all ten were read


def test_the_outbox_refuses_workflows_and_depends_on_in_one_line(tmp_path: Path) -> None:
    import sqlite3

    from hybridq.outbox import Outbox

    conn = sqlite3.connect(tmp_path / "app.db")
    for call in (
        lambda: Outbox().enqueue(conn, hybridq.chain(hybridq.sig(tasks.add, 1, 1))),
        lambda: Outbox().enqueue(conn, tasks.add, 1, 1, depends_on="x"),
    ):
        with pytest.raises(EnvelopeError, match="outbox takes neither workflows nor depends_on"):
            call()


@pytest.mark.parametrize("shape", ["group", "chord"])
def test_results_too_large_together_fail_the_workflow_and_forwarding_goes_on(
    stack, tmp_path: Path, shape: str
) -> None:
    queue, forwarder, transport = stack
    members = [hybridq.sig(tasks.big, 60000) for _ in range(20)]  # each under the cap, 1.2 MB together
    flow = hybridq.group(members) if shape == "group" else hybridq.chord(members, hybridq.sig(tasks.count))
    job = queue.enqueue(
        flow, on_error=hybridq.sig(tasks.record, str(tmp_path / "err"), "err", immutable=True)
    )
    drive(forwarder, transport, ended(job))  # before: RecordTooLarge out of forwarder.step()
    with pytest.raises(JobFailed, match="results too large to pass"):
        job.wait(timeout=1)
    plain = queue.enqueue(tasks.add, 1, 1)
    drive(forwarder, transport, (tmp_path / "err").exists)
    drive(forwarder, transport, ended(plain))
    assert plain.wait(timeout=1) == 2
    assert transport.executions.get(f"{job.id}__20", 0) == 0


def test_a_lost_workflows_file_never_pushes_an_anchor_or_a_dependent_early(journal_dir: Path) -> None:
    import shutil

    queue, transport = Queue(journal=journal_dir), MemoryTransport()
    first = queue.enqueue(tasks.add, 1, 1, delay=3600)
    after = queue.enqueue(tasks.add, 2, 2, depends_on=[first])
    flow = queue.enqueue(hybridq.chain(hybridq.sig(tasks.add, 1, 1), hybridq.sig(tasks.add, 1)))
    forwarder = Forwarder(journal_dir, transport)
    forwarder.open()
    forwarder.step()
    forwarder.close()
    shutil.rmtree(Path(store.path_of(str(journal_dir))).parent)  # lost (or restored from before)
    forwarder = Forwarder(journal_dir, transport)
    forwarder.open()
    try:
        transport.forget()  # Redis lost everything: a refill pass over the journal
        for _ in range(5):
            forwarder.step()
        pushed = {j for q in transport.queues.values() for j in q}
        assert after.id not in pushed  # before: pushed, its dependency not run
        assert flow.id not in pushed  # before: the anchor pushed as a job
        for q in list(transport.queues):
            transport.work(q, call)
        forwarder.step()
        assert transport.executions.get(after.id, 0) == 0
        assert transport.executions.get(flow.id, 0) == 0
    finally:
        forwarder.close()


@pytest.mark.parametrize(("task", "end"), [(tasks.add, "succeeded"), (tasks.fail, "failed")])
def test_an_end_cut_short_after_its_ledger_entry_keeps_the_ledgers_outcome(stack, task, end: str) -> None:
    queue, forwarder, transport = stack
    job = queue.enqueue(hybridq.chain(hybridq.sig(task, *([1, 1] if task is tasks.add else []))))
    drive(forwarder, transport, ended(job))
    # The crash at flows_after_end: the ledger has the anchor's done entry, the file not.
    forwarder.flows.db.execute("UPDATE flows SET state = 'running', error = NULL WHERE id = ?", (job.id,))
    forwarder.flows._recorded = True
    forwarder.flows.commit()
    assert store.flow_steps(str(queue.journal), job.id)[0] == "running"
    forwarder.flows.rollback()  # reloads what is held from the file
    forwarder.flows.dirty = True
    forwarder.step()
    found = store.flow_steps(str(queue.journal), job.id)
    assert found is not None
    assert found[0] == end  # before: "cancelled"


def test_a_lookup_index_being_rebuilt_never_cancels_a_dependent_as_unknown(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridq.forwarder import flow_steps
    from hybridq.lookup import index as lookup_index

    queue, transport = Queue(journal=journal_dir), MemoryTransport()
    before = [queue.enqueue(tasks.add, i, i) for i in range(5)]  # the rebuild reads them first
    first = queue.enqueue(tasks.add, 1, 1)
    forwarder = Forwarder(journal_dir, transport)
    forwarder.open()
    drive(forwarder, transport, lambda: all(ended(j)() for j in [*before, first]))
    forwarder.close()
    after = queue.enqueue(tasks.add, 2, 2, depends_on=[first])  # not read yet
    for path in Path(reads.index_path(str(journal_dir))).parent.glob("index.sqlite*"):
        path.unlink()  # the derived index lost: rebuilt from the journal
    monkeypatch.setattr(flow_steps, "UNKNOWN_DEP_S", 0.0)
    monkeypatch.setattr(lookup_index, "BUILD_STEP", 1)
    forwarder = Forwarder(journal_dir, transport)
    forwarder.open()
    try:
        forwarder.step()
        assert after.get_status() != "cancelled"  # before: "dependency ... is unknown"
        drive(forwarder, transport, ended(after))
        assert after.wait(timeout=1) == 4
    finally:
        forwarder.close()


def test_a_job_named_like_a_step_is_never_taken_for_it(stack) -> None:
    queue, forwarder, transport = stack
    other = queue.enqueue(tasks.add, 90, 9, job_id="w-1")
    drive(forwarder, transport, ended(other))
    job = queue.enqueue(
        hybridq.chain(hybridq.sig(tasks.add, 1, 1), hybridq.sig(tasks.add, 1), hybridq.sig(tasks.add, 1)),
        job_id="w",
    )
    drive(forwarder, transport, ended(job))
    assert job.wait(timeout=1) == 4  # before: step 2 took w-1's 99
    assert other.wait(timeout=1) == 99
    for taken in ("w__1", "w__err"):  # a step's id shape: refused in one line, nothing written
        with pytest.raises(EnvelopeError, match="workflow steps' own"):
            queue.enqueue(tasks.add, 1, 1, job_id=taken)


def test_a_workflow_with_a_long_id_moves_on_without_the_periodic_pass(stack) -> None:
    queue, forwarder, transport = stack
    job = queue.enqueue(
        hybridq.chain(hybridq.sig(tasks.add, 1, 1), hybridq.sig(tasks.add, 1), hybridq.sig(tasks.add, 1)),
        job_id="w" * 125,  # its steps' ids start with a hash of it
    )
    forwarder.step()
    forwarder.flows._next_look = float("inf")  # only the passes an outcome's news asks for
    drive(forwarder, transport, ended(job), rounds=10)  # before: each step waited for the 5 s pass
    assert job.wait(timeout=1) == 4


def test_a_hand_made_anchor_over_the_step_limit_is_recorded_invalid(
    stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridq.workflows import canvas

    queue, forwarder, _transport = stack
    monkeypatch.setattr(canvas, "MAX_STEPS", 3)  # the bound, made small: the same path as 2,001
    step = queue.prepare(tasks.add, (1, 1)).to_dict()
    env = queue.prepare("hybridq.workflows.canvas.anchor")
    graph = {"v": 1, "steps": [{"env": step, "deps": [], "pass": "none"}] * 4, "out": [3], "list": False}
    env.meta = {"hybridq": {"wf": {**graph, "err": None}}}
    env._encoded = None
    (big,) = queue.enqueue_many([env])
    forwarder.step()
    assert big.get_status() == "failed"  # before: accepted, its 4 steps released
    assert store.flow_steps(str(queue.journal), big.id) is None


def test_a_steps_priority_and_limit_key_reach_its_released_job(stack, journal_dir: Path) -> None:
    from hybridq.envelope.model import Envelope
    from hybridq.journal import JournalReader

    queue, forwarder, transport = stack
    job = queue.enqueue(
        hybridq.chain(
            hybridq.sig(tasks.add, 1, 2), hybridq.sig(tasks.add, 3, priority=7, limit_key="tenant:1")
        )
    )
    drive(forwarder, transport, ended(job))
    assert job.wait(timeout=1) == 6
    released = [
        Envelope.from_bytes(r.payload) for r in JournalReader(journal_dir).records() if r.payload[:1] == b"{"
    ]
    step = next(e for e in released if e.id.endswith("__1"))
    assert (step.priority, step.limit_key) == (7, "tenant:1")  # refused as an option before
