"""A ``SystemExit`` or ``KeyboardInterrupt`` raised in a child asyncio task that a job's task
started (``create_task``, a ``TaskGroup``'s child) no longer ends the pool process's event loop.

asyncio lets those two out of ``run_forever`` from any task's step: on main the loop's thread
(``hybridq-async``) died of it, and every ``async def`` job of the process stalled until the
process was replaced. The runner now logs it and runs the loop on (``hybridq.worker.aloop.serve_loop``); the
job whose child raised it sees it as its own (docs/worker.md).
"""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest
from hybridq.worker.aloop import serve_loop
from hybridq.worker.runner import Runner, Taken


@pytest.mark.parametrize("error", [SystemExit, KeyboardInterrupt])
def test_the_event_loop_runs_on_after_a_child_task_raises(error: type[BaseException]) -> None:
    seen: dict[str, BaseException | None] = {}

    async def child() -> None:
        await asyncio.sleep(0)
        raise error()

    async def work_async(item: Taken) -> None:
        if item.job_id == "exits":
            try:
                await asyncio.create_task(child())
            except BaseException as exc:
                seen["exits"] = exc
        else:
            await asyncio.sleep(0.01)
            seen[item.job_id] = None

    runner = Runner(1, 10, work=lambda _item: False, work_async=work_async, on_stuck=lambda _item: None)
    try:
        runner.start_async(Taken("exits", "q"))
        done = {runner.done.get(timeout=5).job_id}
        runner.start_async(Taken("after", "q"))
        try:
            done.add(runner.done.get(timeout=5).job_id)
        except queue.Empty:
            pytest.fail("the event loop stopped: a later async job never ran")
        assert done == {"exits", "after"}
        assert isinstance(seen["exits"], error), seen
    finally:
        runner.close()
        loop = runner._loop
        for thread in threading.enumerate():
            if thread.name == "hybridq-async":
                thread.join(timeout=5)
        if loop is not None:
            loop.close()


def test_a_stop_in_the_same_iteration_as_the_error_still_ends_the_thread() -> None:
    """``run_forever`` forgets a ``loop.stop()`` run in the iteration a task's SystemExit left it
    from: the thread checks whether the runner is closing before it runs the loop again."""
    loop = asyncio.new_event_loop()
    closing = threading.Event()
    thread = threading.Thread(target=serve_loop, args=(loop, closing.is_set), daemon=True)
    thread.start()

    async def raiser() -> None:
        raise SystemExit(3)

    made: list[asyncio.Task[None]] = []

    def same_iteration() -> None:
        closing.set()  # Runner.close() sets its flag, then schedules loop.stop
        loop.call_soon(loop.stop)
        made.append(loop.create_task(raiser()))  # its first step: the same iteration, after the stop

    try:
        loop.call_soon_threadsafe(same_iteration)
        thread.join(timeout=5)
        assert not thread.is_alive(), "the loop ran on after the runner closed"
        assert isinstance(made[0].exception(), SystemExit)  # retrieved: no report when it is freed
    finally:
        if not thread.is_alive():
            loop.close()
