"""Tasks quick enough that their claim sends no started event (docs/worker.md#the-started-event).

A started event costs a run an ``XADD`` in its claim, and the forwarder a harvest, a parse and a
delete: about 12% of a no-op job's cost on two cores (issue 15's burn-down). For a task that
ends within a fraction of a second the ``started`` state is never seen anyway: its lookup goes
from ``forwarded`` to its outcome. So a worker process stops asking for it for a task whose last
:data:`STREAK` runs in this process each took under :data:`QUICK_S`, and asks again from the
first run that takes longer, and from the moment a run of it has been going for longer than
that (claims made ahead while a long run is in flight send the event again).

The same record tells the runner how far ahead to take (:func:`all_quick`): a process whose
last :data:`WINDOW` runs were all quick takes twice as many jobs ahead of its threads, since a
batch of quick jobs is gone before the next round trip would bring more (docs/worker.md).
"""

from __future__ import annotations

import collections
import itertools
import time

__all__ = ["QUICK_S", "STREAK", "WINDOW", "all_quick", "is_quick", "ran", "started"]

#: A run shorter than this (seconds, wall clock from the task's start to its end) is quick.
QUICK_S = 0.1
#: Consecutive quick runs of a task after which its claims send no started event.
STREAK = 16

#: Consecutive quick runs per task path in this process (plain dict operations: thread-safe
#: enough under the GIL, and a lost count only costs one more started event).
_streaks: dict[str, int] = {}
#: Runs in flight per task path: their start (monotonic seconds) by a token of :func:`started`.
_running: dict[str, dict[int, float]] = {}
_tokens = itertools.count()
#: Runs of any task in this process, newest last: whether each was quick.
WINDOW = 32
_recent: collections.deque[bool] = collections.deque(maxlen=WINDOW)


def is_quick(func: str) -> bool:
    """Whether ``func``'s recent runs in this process were all quick, and none runs long now."""
    return _streaks.get(func, 0) >= STREAK and _none_long([_running.get(func, {})])


def all_quick() -> bool:
    """Whether this process's last :data:`WINDOW` runs were all quick, and none runs long now."""
    recent = tuple(_recent)  # runner threads append meanwhile
    return len(recent) == WINDOW and all(recent) and _none_long(list(_running.values()))


def _none_long(in_flight: list[dict[int, float]]) -> bool:
    """Whether none of these runs in flight (start times by token) has gone on for QUICK_S yet.

    One look per task: a dict keeps its insertion order, so its first run is its oldest (a list
    of every run in flight at every claim was about 6 % of a no-op job's CPU, profiled).
    """
    now = time.monotonic()
    for runs in in_flight:
        try:
            oldest = next(iter(runs.values()))
        except StopIteration:
            continue
        except RuntimeError:  # a runner thread changed it meanwhile: look at all of them
            oldest = min(list(runs.values()), default=now)
        if now - oldest >= QUICK_S:
            return False
    return True


def started(func: str) -> int:
    """Note that a run of ``func`` starts; the token for :func:`ran`."""
    token = next(_tokens)
    _running.setdefault(func, {})[token] = time.monotonic()
    return token


def ran(func: str, token: int) -> None:
    """Note that the run of ``func`` :func:`started` gave ``token`` to has ended."""
    at = _running.get(func, {}).pop(token, None)
    quick = at is None or time.monotonic() - at < QUICK_S
    _recent.append(quick)
    if quick:
        if _streaks.get(func, 0) < STREAK:
            _streaks[func] = _streaks.get(func, 0) + 1
    else:
        _streaks.pop(func, None)
