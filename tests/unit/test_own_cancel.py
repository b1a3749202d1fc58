"""A ``CancelledError`` an ``async def`` task ends with is its failure under RQ's loop too
(``hybridq.worker.values.call``, which ``--rq``, ``--simple`` and a plain ``rq worker`` run every
task with): main let it out of ``asyncio.run`` as a ``BaseException``, so no outcome was stored
and the job ran again as ``lost``. Only Ctrl-C, where ``asyncio.run`` installs its handler (the
main thread, Python's own SIGINT handler), still leaves as one. The pool's side:
``tests/integration/test_async_call.py``."""

from __future__ import annotations

import asyncio
import os
import signal
import weakref
from collections.abc import Iterator

import pytest
from hybridq.envelope.model import Envelope
from hybridq.errors import UnexpectedCancel
from hybridq.worker.values import call, format_error

from tests import tasks
from tests.integration.test_worker_failed_data import no_collector


async def raises_its_own() -> None:
    data = tasks.Data()
    tasks.DATA.append(weakref.ref(data))
    await asyncio.sleep(0)
    raise asyncio.CancelledError("mine")


async def awaits_a_cancelled_future() -> None:
    future = asyncio.get_running_loop().create_future()
    future.cancel()
    await future


async def cancels_itself() -> None:
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    await asyncio.sleep(1)


async def interrupted() -> None:
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: asyncio.run's handler cancels its main task
    await asyncio.sleep(1)


def env() -> Envelope:
    return Envelope("j1", "tests.unit.test_own_cancel.raises_its_own", "default", "j1", 1.0)


@pytest.fixture
def own_sigint_handler() -> Iterator[None]:
    """A SIGINT handler of the worker's own, as RQ's SimpleWorker installs (asyncio.run adds none)."""
    old = signal.signal(signal.SIGINT, lambda *_: None)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("func", [raises_its_own, awaits_a_cancelled_future])
def test_the_tasks_own_cancelled_error_is_its_failure(func: object) -> None:
    held = len(tasks.DATA)
    with no_collector():
        with pytest.raises(UnexpectedCancel) as caught:
            call(func, env())  # type: ignore[arg-type]
        assert isinstance(caught.value.__cause__, asyncio.CancelledError)
        text = format_error(caught.value)
        del caught
        assert all(ref() is None for ref in tasks.DATA[held:]), "held in a cycle until a collection"
    assert "CancelledError" in text, text
    assert "neither a stop nor its timeout asked for" in text, text


@pytest.fixture
def python_sigint_handler() -> Iterator[None]:
    """Python's own SIGINT handler (an earlier test's in-process RQ worker may have left its own)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_ctrl_c_still_stops_the_call(python_sigint_handler: None) -> None:
    with pytest.raises(KeyboardInterrupt):
        call(interrupted, env())


def test_under_a_workers_own_sigint_handler_even_a_self_cancel_is_the_tasks(own_sigint_handler: None) -> None:
    """RQ's work-horse ignores SIGINT and SimpleWorker handles it itself: nothing outside the task
    can cancel asyncio.run's task there, so a cancel request on it is the task's own doing."""
    with pytest.raises(UnexpectedCancel):
        call(cancels_itself, env())
