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
import weakref
from typing import Any

from hybridq.testing.embedded import RedisServer
from hybridq.worker.perform import Performer
from hybridq.worker.run import release
from hybridq.worker.runner import Taken

from tests import tasks
from tests.integration.test_worker_failed_data import claimed, recorded


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
