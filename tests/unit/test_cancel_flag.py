"""A lease's cancel flag (hybridq.worker.lease._CancelFlag): an Event whose lock is made at first use."""

from __future__ import annotations

import threading

import pytest
from hybridq.worker import lease
from hybridq.worker.lease import Renewal, _CancelFlag


def test_it_is_an_event_unset_until_set() -> None:
    flag = _CancelFlag()
    assert isinstance(flag, threading.Event)
    assert not flag.is_set()
    assert flag.wait(0.01) is False
    flag.set()
    assert flag.is_set()
    assert flag.wait(0) is True
    flag.clear()
    assert not flag.is_set()


def test_a_set_from_another_thread_wakes_a_wait() -> None:
    flag = _CancelFlag()
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(flag.wait(10.0)))
    waiter.start()
    flag.set()
    waiter.join(10.0)
    assert woke == [True]


def test_threads_that_use_a_new_flag_at_once_share_one_condition() -> None:
    for _ in range(50):
        flag = _CancelFlag()
        start = threading.Barrier(4)
        seen: list[threading.Condition] = []

        def use(
            f: _CancelFlag = flag, b: threading.Barrier = start, out: list[threading.Condition] = seen
        ) -> None:
            b.wait()
            out.append(f._cond)

        threads = [threading.Thread(target=use) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({id(c) for c in seen}) == 1


def test_a_condition_made_while_another_thread_stored_one_gives_way_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The race the test above can only hope to hit, made to happen: another thread stores its
    # condition between this one's look (none yet) and its store. A plain store would replace
    # it (two threads, two conditions: a ``set`` could miss a ``wait``); ``setdefault`` keeps it.
    flag = _CancelFlag()
    other = threading.Condition(threading.Lock())
    made = threading.Condition

    class Racing:
        Lock = staticmethod(threading.Lock)

        @staticmethod
        def Condition(lock: threading.Lock) -> threading.Condition:
            flag.__dict__["_lazy_cond"] = other  # the other thread, in between
            return made(lock)

    monkeypatch.setattr(lease, "threading", Racing)
    assert flag._cond is other
    monkeypatch.undo()
    assert flag._cond is other


def test_each_renewal_has_its_own_flag() -> None:
    made = [Renewal(None, "k", "t", 1000, 1.0, 0.0) for _ in range(2)]  # type: ignore[arg-type]
    assert isinstance(made[0].cancelled, _CancelFlag)
    assert made[0].cancelled is not made[1].cancelled
