"""A ``CancelledError`` an ``async def`` task raises itself is its failure under RQ's loop too
(``hybridq.worker.values.call``, which ``--rq``, ``--simple`` and a plain ``rq worker`` run every
task with): main let it out of ``asyncio.run`` as a ``BaseException``, so no outcome was stored
and the job ran again as ``lost``. A cancel from outside (Ctrl-C's, through ``asyncio.run``)
still leaves as one. The pool's side: ``tests/integration/test_async_call.py``."""

from __future__ import annotations

import asyncio

import pytest
from hybridq.envelope.model import Envelope
from hybridq.worker.values import OwnCancel, call, format_error


async def raises_its_own() -> None:
    await asyncio.sleep(0)
    raise asyncio.CancelledError("mine")


async def awaits_a_cancelled_future() -> None:
    future = asyncio.get_running_loop().create_future()
    future.cancel()
    await future


async def cancelled_from_outside() -> None:
    task = asyncio.current_task()
    assert task is not None
    task.cancel()  # what asyncio.run does to its main task on Ctrl-C
    await asyncio.sleep(1)


def env() -> Envelope:
    return Envelope("j1", "tests.unit.test_own_cancel.raises_its_own", "default", "j1", 1.0)


@pytest.mark.parametrize("func", [raises_its_own, awaits_a_cancelled_future])
def test_the_tasks_own_cancelled_error_is_its_failure(func: object) -> None:
    with pytest.raises(OwnCancel) as caught:
        call(func, env())  # type: ignore[arg-type]
    assert isinstance(caught.value.__cause__, asyncio.CancelledError)
    text = format_error(caught.value)
    assert "CancelledError" in text, text
    assert "raised asyncio.CancelledError itself" in text, text


def test_a_cancel_from_outside_still_leaves_as_one() -> None:
    with pytest.raises(asyncio.CancelledError):
        call(cancelled_from_outside, env())
