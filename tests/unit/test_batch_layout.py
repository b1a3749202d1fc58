"""The batch scripts' argument layouts: what the pool sends is what each script's loop steps by.

START and END read each job's arguments at fixed offsets from a per-job stride (their
``*_ARITY``). A stride that drifted from what :func:`~hybridq.worker.batch_scripts.start_args`
or :func:`~hybridq.worker.batch_end.end_args` writes would hand each job its neighbour's claim
or outcome, silently; START also makes the claim's job key and job id itself, which holds only
because every claim is built of the job's own id (:mod:`hybridq.worker.intake`).
"""

from __future__ import annotations

import time

import pytest
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.protocol import Delivery, keys
from hybridq.worker import batch_end, batch_scripts
from hybridq.worker.run import Run, conclude
from hybridq.worker.runner import Taken

QUEUE = "layout"


def _taken(*, report_start: bool) -> Taken:
    now = time.time()
    job_id = new_job_id(now)
    env = Envelope(
        id=job_id, func="tests.tasks.add", args=(1, 2), queue=QUEUE, idempotency_key=job_id, created_at=now
    )
    d = Delivery(env, "layout-owner", ("w", 0, 1), report_start=report_start)
    return Taken(env.id, QUEUE, Run.new(d.to_json(), d, lambda a, b: a + b))


@pytest.mark.parametrize("report_start", [False, True])
def test_a_jobs_start_part_is_start_arity_long_and_its_claim_is_the_jobs_own(report_start: bool) -> None:
    item = _taken(report_start=report_start)
    claim_keys, claim_args = item.run.claim_keys, item.run.claim_args
    assert claim_keys[2] == keys.rq_job(item.job_id), "START makes the claim's job key of the job's id"
    assert claim_args[2] == item.job_id, "START passes the job's id as the claim's"
    assert len(batch_scripts.claim_part(item)) == batch_scripts.START_ARITY - 3
    args = batch_scripts.start_args("w1", [item, _taken(report_start=report_start)])
    assert len(args) == 3 + 2 * batch_scripts.START_ARITY
    assert f"local START_ARITY = {batch_scripts.START_ARITY}\n" in batch_scripts.START
    assert "#ARGV, START_ARITY do" in batch_scripts.START


@pytest.mark.parametrize("stored", [False, True])
def test_a_jobs_end_part_is_end_arity_long(stored: bool) -> None:
    items = [_taken(report_start=False), _taken(report_start=True)]
    if stored:
        for item in items:
            item.started = time.time()
            conclude(item.run, 3, None)
    args = batch_end.end_args("w1", items)
    assert len(args) == 5 + 2 * batch_end.END_ARITY
    assert "#ARGV, END_ARITY do" in batch_end.END
    assert "#ARGV, RECORD_ARITY do" in batch_scripts.RECORD
    assert len(batch_scripts.record_args("w1", items, 60)) == 4 + 2 * batch_scripts.RECORD_ARITY


def test_a_take_reply_of_no_whole_jobs_is_refused() -> None:
    step = 2 + len(batch_scripts.TAKE_FIELDS)
    reply = [b"a", 1, *range(len(batch_scripts.TAKE_FIELDS)), b"b", 2, *range(len(batch_scripts.TAKE_FIELDS))]
    assert [(i, q, len(f)) for i, q, f in batch_scripts.taken(reply)] == [
        (b"a", 1, step - 2),
        (b"b", 2, step - 2),
    ]
    with pytest.raises(ValueError, match="not a multiple of"):
        batch_scripts.taken(reply[:-3])
