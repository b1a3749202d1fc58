"""The pool's question "is this task an ``async def``?", asked twice per job and remembered."""

from __future__ import annotations

import functools
from typing import Any

from hybridq.worker import perform
from hybridq.worker.perform import is_async


def plain() -> None:
    pass


async def coro() -> None:
    pass


@functools.wraps(coro)
def wrapper(*args: Any) -> Any:
    return coro(*args)


class Unhashable:
    __hash__ = None  # type: ignore[assignment]

    async def __call__(self) -> None:
        pass


def test_is_async_answers_as_inspect_does_and_again_from_memory() -> None:
    for _ in range(2):
        assert not is_async(plain)
        assert is_async(coro)
        assert is_async(wrapper)  # what a hybridq.task wraps
        assert is_async(functools.partial(coro))
        assert not is_async(Unhashable())  # not remembered: asked each time
    assert perform._async[coro] is True


def test_the_memory_is_bounded() -> None:
    funcs = [functools.partial(plain) for _ in range(perform._ASYNC_MAX + 5)]
    for f in funcs:
        assert not is_async(f)
    assert len(perform._async) <= perform._ASYNC_MAX


def test_a_hash_that_raises_is_asked_each_time() -> None:
    class Odd:
        def __hash__(self) -> int:
            raise RuntimeError("no hash")

        def __call__(self) -> None:
            return None

    assert perform.is_async(Odd()) is False
