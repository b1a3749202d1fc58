"""The pool worker's runner: a job's timeout is raised only inside the task's own call."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hybridq.worker.runner import Runner, Taken


def _runner(work: Any) -> Runner:
    async def no_async(_item: Taken) -> None:
        raise AssertionError("no async job here")

    return Runner(1, 1, work, no_async, lambda _item: None)


def test_a_timeout_is_not_raised_in_the_code_around_the_task() -> None:
    """The claim and the outcome around a task must never be cut by its timeout."""
    finished: list[str] = []
    runner: Runner

    def work(item: Taken) -> bool:
        task = runner.guard(item, lambda: time.sleep(0.01))
        task()  # well within its timeout
        deadline = time.monotonic() + 0.6  # then slow code of the run's own (past the timeout)
        while time.monotonic() < deadline:
            pass
        finished.append(item.job_id)
        return True

    runner = _runner(work)
    try:
        item = Taken("j1", "q", timeout=0.05)
        runner.submit(item)
        done = runner.done.get(timeout=5)
        assert done is item
        assert finished == ["j1"], "the code after the task was interrupted"
        assert not item.signalled
    finally:
        runner.close()


def test_a_task_past_its_timeout_gets_jobtimeoutexception() -> None:
    raised: list[BaseException] = []
    runner: Runner

    def spin() -> None:
        while True:
            time.monotonic()

    def work(item: Taken) -> bool:
        try:
            runner.guard(item, spin)()
        except Exception as exc:
            raised.append(exc)
        return True

    runner = _runner(work)
    try:
        runner.submit(Taken("j2", "q", timeout=0.1))
        runner.done.get(timeout=5)
        assert [type(e).__name__ for e in raised] == ["JobTimeoutException"]
    finally:
        runner.close()


def test_a_cancelled_task_is_stopped_with_cancelled_after_the_grace() -> None:
    import threading

    raised: list[BaseException] = []
    stopped_after: list[float] = []
    runner: Runner
    flag = threading.Event()

    def spin() -> None:
        flag.set()  # the lease renewal saw the cancel mark
        while True:
            time.monotonic()

    def work(item: Taken) -> bool:
        item.cancel_flag = flag
        started = time.monotonic()
        try:
            runner.guard(item, spin)()
        except Exception as exc:
            raised.append(exc)
        stopped_after.append(time.monotonic() - started)
        return True

    async def no_async(_item: Taken) -> None:
        raise AssertionError("no async job here")

    runner = Runner(1, 1, work, no_async, lambda _item: None, cancel_grace_s=0.3)
    try:
        runner.submit(Taken("j3", "q", timeout=60.0))
        runner.done.get(timeout=5)
        assert [type(e).__name__ for e in raised] == ["Cancelled"]
        assert 0.3 <= stopped_after[0] < 2.0, stopped_after
        assert not runner.poisoned, "an exception stopped it: the process goes on"
    finally:
        runner.close()


def test_an_async_task_cancelled_while_it_waited_for_the_loop_never_starts() -> None:
    """It started once the loop had room and ran on for the whole grace (found in review)."""
    import asyncio
    import threading
    import types

    from hybridq.errors import Cancelled
    from hybridq.worker.acall import stoppable

    started: list[bool] = []

    async def task() -> None:
        started.append(True)

    flag = threading.Event()
    flag.set()
    item: Any = types.SimpleNamespace(
        job_id="j1", run=types.SimpleNamespace(renewal=types.SimpleNamespace(cancelled=flag))
    )
    with pytest.raises(Cancelled, match="before it started"):
        asyncio.run(stoppable(item, task(), 1.0))
    assert started == []
