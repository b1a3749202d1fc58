"""A failed task's frames and data go with its run, not at the next garbage collection.

A pool process collects its youngest generation only after 10,000 allocations
(``hybridq/worker/gcpace.py``): whatever a failed run leaves in a reference cycle (its error,
whose traceback holds the task's frames and so their data) stays many times longer than under
CPython's default. Each test turns the cyclic collector off, fails a task that holds an object
only its own frame references, and finds that object freed by reference counts once the run is
over: in the pool (a plain task, an ``async def`` task, one past its timeout) and under RQ's
loop (``--rq``, ``--simple``, a plain ``rq worker``: hybridq's ``execute``).

Beside them, what the ``async def`` path must keep doing while it changes: its timeout, the task's
own ``TimeoutError``, the stop of a cancelled task after its grace, a cancel from outside.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
import weakref
import zlib
from base64 import b64decode
from collections.abc import Iterator
from typing import Any

import pytest
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Delivery
from hybridq.transport.rq import RQTransport
from hybridq.worker import acall, perform, scripts
from hybridq.worker.perform import Performer
from hybridq.worker.run import release
from hybridq.worker.runner import Taken
from hybridq.worker.starter import Starter

from tests import tasks
from tests.integration.test_batch_scripts import take_one
from tests.support.rqwork import Work


@contextlib.contextmanager
def no_collector() -> Iterator[None]:
    """The cyclic collector off: only reference counts free anything meanwhile."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def claimed(server: RedisServer) -> tuple[Performer, Taken]:
    """A performer, and the one job pushed to ``server`` claimed by a START (its lease held)."""
    client, items = take_one(server)
    conn = scripts.client(client)
    starter = Starter(conn, "w1", 120)
    starter.exchange([], items, None)
    assert items[0].run.claim_reply[0] == 0, "claimed"
    assert items[0].run.renewal is not None, "its lease held, as in the pool"
    return Performer(conn, starter=starter), items[0]


def recorded(item: Taken) -> str:
    """What RQ records of ``item``'s failure (its ``exc_string``)."""
    assert item.ok is False, f"not recorded failed: {item.ok=} {item.rq_value=}"
    return zlib.decompress(b64decode(item.rq_value or "")).decode()


def run_async(performer: Performer, item: Taken) -> bool:
    """Run ``item`` as the pool's event loop does; whether the data its task held (noted in
    ``tasks.DATA``) was freed by the time the run was over."""
    held = len(tasks.DATA)

    async def main() -> bool:
        await performer.work_async(item)
        # The step of this task that a cancel woke (a timeout, a stop) holds its CancelledError
        # until it yields (asyncio's C task): as the pool's, which ends then.
        await asyncio.sleep(0)
        return all(ref() is None for ref in tasks.DATA[held:])  # before the loop and its tasks go

    try:
        return asyncio.run(main())
    finally:
        release(item.run)


# -- the task's data, freed with its run ---------------------------------------------------------


def test_a_failed_plain_tasks_data_goes_with_its_run_in_the_pool(redis_server: RedisServer) -> None:
    """``perform`` no longer held its error, but its caller (``Performer.work``) did, in a local:
    the frame that caught the error (in its traceback) links to its caller's (``f_back``), so a
    reference cycle again (the test of ``perform`` alone, in test_batch_scripts.py, passed)."""
    performer, item = claimed(redis_server)
    item.run.func = tasks.fail_holding
    try:
        with no_collector():
            assert performer.work(item)
            freed = tasks.DATA[-1]() is None
    finally:
        release(item.run)
    assert "failed, holding data" in recorded(item)
    assert freed, "held in a reference cycle until a collection"


@pytest.mark.parametrize("timeout", [None, 60.0], ids=["no-timeout", "timeout"])
def test_a_failed_async_tasks_data_goes_with_its_run_in_the_pool(
    redis_server: RedisServer, timeout: float | None
) -> None:
    """asyncio's task (``_stoppable``) and ``wait_for``'s held the error, in frames it holds."""
    performer, item = claimed(redis_server)
    item.run.func = tasks.afail_holding
    item.timeout = timeout
    with no_collector():
        freed = run_async(performer, item)
    assert "failed, holding data" in recorded(item)
    assert freed, "held in a reference cycle until a collection"


def test_a_timed_out_async_tasks_data_goes_with_its_run_in_the_pool(redis_server: RedisServer) -> None:
    performer, item = claimed(redis_server)

    async def stuck(*_args: object) -> None:
        data = tasks.Data()
        tasks.DATA.append(weakref.ref(data))
        await asyncio.sleep(3600)

    item.run.func = stuck
    item.timeout = 0.2
    with no_collector():
        freed = run_async(performer, item)
    assert "JobTimeoutException" in recorded(item)
    assert freed, "held in a reference cycle until a collection"


@pytest.mark.parametrize("func", ["tests.tasks.fail_holding", "tests.tasks.afail_holding"])
def test_a_failed_tasks_data_goes_with_its_run_under_rqs_loop(
    redis_server: RedisServer, work: Work, func: str
) -> None:
    """``execute`` raised the error from a local of the frame its traceback holds, and RQ's
    ``asyncio.run`` of an ``async def`` task kept it in its task, which a frame in its traceback
    holds.

    A job that succeeds runs first: the first outcome after Redis's scripts were flushed (a new
    server here) finds its script missing (NOSCRIPT), and under hybridq's pipelining worker that
    error reply comes while RQ handles the failure: redis-py keeps it in a reference cycle of its
    own, whose frames lead to RQ's (``exc_info``), the job's error with them. Once per flush.
    """
    transport = RQTransport(redis_server.url)
    try:
        envs = [
            Envelope(
                id=new_job_id(),
                func=name,
                args=args,
                queue="default",
                idempotency_key=new_job_id(),
                created_at=time.time(),
            )
            for name, args in (("tests.tasks.add", (1, 2)), (func, ()))
        ]
        transport.push([Delivery(env, "owner1", ("w", 0, 64)) for env in envs])
        ran = len(tasks.DATA)
        with no_collector():
            work(transport)
            assert len(tasks.DATA) == ran + 1, "the task ran"
            freed = tasks.DATA[-1]() is None
        assert freed, "held in a reference cycle until a collection"
    finally:
        transport.close()


# -- an async task's timeout and stop (kept as they are) ----------------------------------------


def test_an_async_task_past_its_timeout_is_cancelled_and_fails_with_jobtimeoutexception(
    redis_server: RedisServer,
) -> None:
    performer, item = claimed(redis_server)
    stopped: list[str] = []

    async def stuck(*_args: object) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            stopped.append("cancelled")
            raise

    item.run.func = stuck
    item.timeout = 0.3
    started = time.monotonic()
    run_async(performer, item)
    took = time.monotonic() - started
    assert "rq.timeouts.JobTimeoutException: Task exceeded maximum timeout value (0.3 seconds)" in recorded(
        item
    )
    assert stopped == ["cancelled"], "CancelledError raised in the task"
    assert 0.3 <= took < 5.0, took
    assert item.run.finish is not None, "an outcome: the run failed (an attempt used)"


@pytest.mark.parametrize("timeout", [None, 60.0], ids=["no-timeout", "timeout"])
def test_an_async_tasks_own_timeouterror_is_its_error_not_its_timeout(
    redis_server: RedisServer, timeout: float | None
) -> None:
    performer, item = claimed(redis_server)

    async def times_out(*_args: object) -> None:
        async with asyncio.timeout(0.05):
            await asyncio.sleep(3600)

    item.run.func = times_out
    item.timeout = timeout
    run_async(performer, item)
    error = recorded(item)
    assert error.splitlines()[-1] == "TimeoutError", error


def test_a_cancelled_async_task_is_stopped_after_its_grace_and_fails_cancelled(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop is a ``CancelledError`` in the task (its ``finally`` runs), recorded ``Cancelled``."""
    monkeypatch.setattr(acall, "ASYNC_POLL_S", 0.05)
    monkeypatch.setattr(perform, "CANCEL_GRACE_S", 0.3)
    performer, item = claimed(redis_server)
    assert item.run.renewal is not None
    flag = item.run.renewal.cancelled
    cleaned: list[float] = []
    asked: list[float] = []

    async def ignores_the_cancel(*_args: object) -> None:
        data = tasks.Data()
        tasks.DATA.append(weakref.ref(data))
        asked.append(time.monotonic())
        flag.set()  # what the lease renewal does when it finds the cancel mark
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append(time.monotonic())

    item.run.func = ignores_the_cancel
    item.timeout = 60.0
    with no_collector():
        freed = run_async(performer, item)
    error = recorded(item)
    assert "hybridq.errors.Cancelled: job" in error, error
    assert "stopped after its grace period" in error, error
    assert len(cleaned) == 1, "its finally ran"
    assert 0.3 <= cleaned[0] - asked[0] < 5.0, cleaned[0] - asked[0]
    assert item.run.finish is not None, "an outcome: cancelled"
    assert freed, "its data held in a reference cycle until a collection"


def test_a_cancelled_async_task_that_ends_within_its_grace_keeps_its_outcome(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(acall, "ASYNC_POLL_S", 0.05)
    monkeypatch.setattr(perform, "CANCEL_GRACE_S", 5.0)
    performer, item = claimed(redis_server)
    assert item.run.renewal is not None
    flag = item.run.renewal.cancelled

    async def ends_soon(*_args: object) -> int:
        flag.set()
        await asyncio.sleep(0.2)
        return 7

    item.run.func = ends_soon
    run_async(performer, item)
    assert item.ok is True, item.rq_value


def test_an_async_run_cancelled_by_other_code_is_its_failure(redis_server: RedisServer) -> None:
    """Its event loop's task cancelled by neither its stop nor its timeout: nothing in the pool
    does that (docs/worker.md), so some code the task runs did. An outcome, failed, naming the
    ``CancelledError``; the task's ``finally`` ran. Main stored none and let the lease lapse: the
    job ran again as ``lost``, up to ``--max-lost`` times."""
    performer, item = claimed(redis_server)
    running = threading.Event()
    cleaned: list[bool] = []

    async def long(*_args: object) -> None:
        running.set()
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append(True)

    item.run.func = long
    item.timeout = 60.0

    async def main() -> Any:
        run = asyncio.ensure_future(performer.work_async(item))
        while not running.is_set():  # noqa: ASYNC110 - set by the task, on this loop
            await asyncio.sleep(0.01)
        run.cancel()
        return await asyncio.gather(run, return_exceptions=True)

    try:
        asyncio.run(main())
    finally:
        release(item.run)
    assert cleaned == [True], "its finally ran"
    assert item.run.finish is not None, "an outcome: failed"
    assert "CancelledError" in recorded(item)
