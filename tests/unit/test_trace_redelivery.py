"""A run's claim in a job's trace says why it was delivered again (hybridq.ops.trace_steps).

The browser test (tests/integration/test_dashboard_browser.py) sees this reason only when the
forwarder's refill pushed the second copy; when its reconcile pass found the copy missing first,
the second run is under the same generation and has no such reason. Here both, deterministically.
"""

from __future__ import annotations

from hybridq.ledger.entries import Entry
from hybridq.ops.trace_steps import _run_steps
from hybridq.protocol import EntryKind

LOC = ("w", 0, 64)
REASON = "delivered again after Redis lost or rolled back its state (epoch generation 0 -> 1)"


def _run(worker: str, started: float, gen: int) -> Entry:
    return Entry(
        EntryKind.DONE, "j", LOC, outcome="succeeded", at=started + 1, started=started, worker=worker, gen=gen
    )


def test_a_run_pushed_again_under_a_new_generation_says_redis_lost_its_state() -> None:
    claims = [s for s in _run_steps([_run("a", 10.0, 0), _run("b", 12.0, 1)], []) if s.kind == "claimed"]
    assert len(claims) == 2
    assert claims[0].reason is None
    assert claims[1].reason is not None
    assert claims[1].reason.startswith(REASON)


def test_a_run_delivered_again_under_the_same_generation_gives_no_such_reason() -> None:
    claims = [s for s in _run_steps([_run("a", 10.0, 0), _run("b", 12.0, 0)], []) if s.kind == "claimed"]
    assert [c.reason for c in claims] == [None, None]
