"""An ``async def`` task's end in the pool, awaited in its run's own asyncio task
(``hybridq/worker/acall.py``): what a timeout, a stop and the task's own doings record.

The task shares its run's asyncio task: a cancel request its code leaves there (Python 3.11's
``TaskGroup`` after a child's failure) must not turn its timeout into a cancel from outside
(no outcome: delivered again as ``lost``, up to ``--max-lost`` times); a stopped task ends
``cancelled`` whatever it does with the stop's cancel (docs/worker.md); ``SystemExit`` or
``KeyboardInterrupt`` out of a task stays in its run (the event loop's thread goes on).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Any

import pytest
from hybridq.testing.embedded import RedisServer
from hybridq.worker import acall, perform
from hybridq.worker.perform import Performer
from hybridq.worker.run import release
from hybridq.worker.runner import Taken

from tests import tasks
from tests.integration.test_worker_failed_data import claimed, no_collector, recorded


def run(performer: Performer, item: Taken) -> dict[str, Any]:
    """Run ``item`` as the pool's event loop does (one asyncio task per run); what was seen after.

    ``cancelling``: the run's asyncio task's cancel requests once the run is over; ``freed``:
    whether the data the task held (``tasks.DATA``) went with it; ``escaped``: what came out of
    the event loop (the pool's loop thread would have died of it).
    """
    held = len(tasks.DATA)
    seen: dict[str, Any] = {"escaped": None}

    async def main() -> None:
        await performer.work_async(item)
        current = asyncio.current_task()
        assert current is not None
        seen["cancelling"] = current.cancelling()
        await asyncio.sleep(0)  # the step a cancel woke holds its CancelledError until it yields
        seen["freed"] = all(ref() is None for ref in tasks.DATA[held:])

    try:
        asyncio.run(main())
    except BaseException as exc:  # what would end the pool's loop thread
        seen["escaped"] = exc
    finally:
        release(item.run)
    return seen


async def _child_fails() -> None:
    await asyncio.sleep(0)
    raise RuntimeError("child")


async def caught_taskgroup_failure_then_hangs(*_args: object) -> None:
    data = tasks.Data()
    tasks.DATA.append(weakref.ref(data))
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(_child_fails())
    except* RuntimeError:
        pass  # Python 3.11's TaskGroup leaves its task's cancelling() at 1 here
    await asyncio.sleep(3600)


def test_a_timeout_after_a_cancel_request_the_task_left_is_its_timeout(redis_server: RedisServer) -> None:
    performer, item = claimed(redis_server)
    item.run.func = caught_taskgroup_failure_then_hangs
    item.timeout = 0.3
    seen = run(performer, item)
    assert "JobTimeoutException" in recorded(item), recorded(item)
    assert item.run.finish is not None, "an outcome (not a cancel from outside: delivered again as lost)"
    assert seen["cancelling"] == 0, seen
    assert seen["escaped"] is None, seen
    # Its data waits for a collection: Python 3.11's TaskGroup leaves a cycle of its own.


@pytest.fixture
def fast_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acall, "ASYNC_POLL_S", 0.02)
    monkeypatch.setattr(perform, "CANCEL_GRACE_S", 0.2)


def cancelled_then(then: str, item: Taken) -> Any:
    """A task that sees its cancel (the lease renewal's flag) and ignores it until stopped, then
    ``then``: re-raises the stop's cancel, raises its own ValueError or TimeoutError, returns, or
    (after a caught TaskGroup failure) re-raises with a cancel request left on its task."""
    assert item.run.renewal is not None
    flag = item.run.renewal.cancelled

    async def task(*_args: object) -> int:
        data = tasks.Data()
        tasks.DATA.append(weakref.ref(data))
        if then == "taskgroup":
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(_child_fails())
            except* RuntimeError:
                pass
        flag.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if then == "ValueError":
                raise ValueError("converted") from None
            if then == "TimeoutError":
                raise TimeoutError("mine") from None
            if then == "returns":
                return 5
            raise
        return 0

    return task


@pytest.mark.parametrize("timeout", [None, 60.0, 0.5], ids=["no-timeout", "timeout", "timeout-racing"])
@pytest.mark.parametrize("then", ["re-raises", "ValueError", "TimeoutError", "returns", "taskgroup"])
def test_a_stopped_async_task_ends_cancelled_whatever_it_does_with_the_stop(
    redis_server: RedisServer, fast_stop: None, then: str, timeout: float | None
) -> None:
    """The stop (0.2 s after the cancel was seen) wins over a timeout due right after it, as on
    main, where ``wait_for``'s layer turned every stop into ``Cancelled``."""
    performer, item = claimed(redis_server)
    item.run.func = cancelled_then(then, item)
    item.timeout = timeout
    started = time.monotonic()
    with no_collector():
        seen = run(performer, item)
    error = recorded(item)
    assert "hybridq.errors.Cancelled: job" in error, error
    assert "stopped after its grace period" in error, error
    assert item.run.finish is not None, "an outcome: cancelled"
    assert seen["cancelling"] == 0, seen
    assert seen["escaped"] is None, seen
    assert seen["freed"] or then == "taskgroup", "held in a reference cycle until a collection"
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("error", [SystemExit, KeyboardInterrupt])
def test_systemexit_in_an_async_task_stays_in_its_run(redis_server: RedisServer, error: type) -> None:
    """Main awaited the task in an asyncio task of its own, whose step let it out of the event
    loop: the pool process's loop thread (hybridq-async) died, stalling its async jobs. Now it
    ends the run as a cancel from outside does on the loop (as a thread's does): recorded failed,
    no outcome, the lease let go (it lapses: delivered again)."""
    performer, item = claimed(redis_server)

    async def exits(*_args: object) -> None:
        await asyncio.sleep(0)
        raise error()

    item.run.func = exits
    item.timeout = 60.0
    seen = run(performer, item)
    assert seen["escaped"] is None, seen
    assert error.__name__ in recorded(item)
    assert item.run.finish is None, "no outcome"
    assert item.run.renewal is None, "its lease let go"
    assert seen["cancelling"] == 0, seen


async def _then_awaits_a_cancelled_future() -> None:
    future = asyncio.get_running_loop().create_future()
    future.cancel()
    await future  # someone else's cancelled future: CancelledError here, no cancel of this task


@pytest.mark.parametrize(
    "how", ["raises", "awaits-a-cancelled-future", "after-a-taskgroup-left-a-request", "cancels-itself"]
)
def test_a_cancelled_error_the_task_raises_itself_is_its_failure(redis_server: RedisServer, how: str) -> None:
    """A ``CancelledError`` out of the task that neither its stop nor its timeout caused is the
    task's own error: an outcome, failed (and retried as its policy says). Main took it for a
    cancel from outside: no outcome, the lease let go, the job delivered again as ``lost`` up to
    ``--max-lost`` times, the same error each time. Also when the task left a cancel request on
    its run's asyncio task first (Python 3.11's ``TaskGroup`` after a child's failure, or its own
    ``cancel()``): the request is the task's doing too. Its data is freed by reference counts."""
    performer, item = claimed(redis_server)

    async def own_cancel(*_args: object) -> None:
        data = tasks.Data()
        tasks.DATA.append(weakref.ref(data))
        await asyncio.sleep(0)
        if how == "raises":
            raise asyncio.CancelledError("mine")
        if how == "after-a-taskgroup-left-a-request":
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(_child_fails())
            except* RuntimeError:
                pass
        if how == "cancels-itself":
            current = asyncio.current_task()
            assert current is not None
            current.cancel()
            await asyncio.sleep(0)
        await _then_awaits_a_cancelled_future()

    item.run.func = own_cancel
    item.timeout = 60.0
    with no_collector():
        seen = run(performer, item)
    assert seen["escaped"] is None, seen
    assert item.run.finish is not None, "an outcome: the task failed"
    assert "CancelledError" in recorded(item)
    assert seen["cancelling"] == 0, seen
    # Python 3.11's TaskGroup keeps its child's error in a cycle of its own (as in the test above).
    assert seen["freed"] or how == "after-a-taskgroup-left-a-request", "held in a cycle until a collection"
