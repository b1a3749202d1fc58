"""The dashboard's queues page (``GET /queues``): per queue, where its jobs are; the last hour's chart.

Every figure comes from what the forwarder already keeps (its stats snapshot, its lookup index,
its ledger) and, for one column, from Redis when the server was given one. A column is one line
of :data:`COLUMNS` (a label, the row's key, how it is shown); a row is a dict per queue that
:func:`queue_rows` fills from each source, so a new per-queue figure is one line there and one
line here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from hybridq.http.dashboard.chart import hour_chart
from hybridq.http.dashboard.pages import WINDOW_S, Body, Pages
from hybridq.http.dashboard.templating import age
from hybridq.lookup.search import queue_figures

__all__ = ["COLUMNS", "Column", "QueuesPage", "queue_rows"]


def _count(value: Any) -> str:
    return "-" if value is None else str(value)


def _rate(value: Any) -> str:
    return "-" if value is None else f"{value:.1f}"


@dataclass(frozen=True, slots=True)
class Column:
    """One column of the queues table: its heading, the row's key, how a value is shown."""

    label: str
    key: str
    show: Callable[[Any], str] = _count
    #: What the heading's tooltip says the figure is.
    means: str = ""


COLUMNS: tuple[Column, ...] = (
    Column("pending", "pending", means="accepted and not ended (the journal's count)"),
    Column("waiting", "waiting", means="read by the forwarder, no run yet (forwarded or held)"),
    Column("in Redis", "in_redis", means="on its RQ queue now: no worker took it yet"),
    Column("running", "running", means="a run in flight (its started event harvested)"),
    Column("retrying", "retrying", means="its last attempt failed; another is due"),
    Column("oldest waiting", "oldest_waiting_s", age, "since the oldest waiting job was accepted"),
    Column("top priority", "top_priority", means="the highest priority waiting in the journal for Redis"),
    Column("done / min", "done_per_min", _rate, "successes per minute, the last 5 minutes"),
    Column("failed / min", "failed_per_min", _rate, "failures and cancels per minute, the last 5 minutes"),
)


def queue_rows(
    stats: Mapping[str, Any],
    figures: Mapping[str, Any] | None,
    recent: Mapping[str, Mapping[str, int]],
    in_redis: Mapping[str, int] | None,
    now: float,
) -> dict[str, dict[str, Any]]:
    """Per queue, every figure a column may show (a figure a source lacks is left out: ``-``)."""
    rows: dict[str, dict[str, Any]] = {}
    # What a queue a source answered for but did not name has: none (a source that did not
    # answer leaves its columns out: "-").
    zero: dict[str, Any] = {"pending": 0, "done_per_min": 0.0, "failed_per_min": 0.0}
    if figures is not None:
        zero.update(waiting=0, running=0, retrying=0)
    if in_redis is not None:
        zero["in_redis"] = 0

    def row(queue: str) -> dict[str, Any]:
        return rows.setdefault(queue, dict(zero))

    for queue, n in stats.get("queues", {}).items():  # stats(): accepted, not terminal, per queue
        row(queue)["pending"] = n
    for queue, d in stats.get("queue_detail", {}).items():  # the run table: what waits for Redis
        if d.get("top_priority") is not None:
            row(queue)["top_priority"] = d["top_priority"]
    for queue, f in (figures or {}).items():  # the lookup index: the jobs that have not ended
        row(queue).update(waiting=f.waiting, running=f.running, retrying=f.retrying)
        if f.oldest_waiting is not None:
            row(queue)["oldest_waiting_s"] = max(0.0, now - f.oldest_waiting)
    minutes = WINDOW_S / 60
    for queue, done in recent.items():  # the ledger's last minutes
        failed = done.get("failed", 0) + done.get("cancelled", 0)
        row(queue).update(done_per_min=done.get("succeeded", 0) / minutes, failed_per_min=failed / minutes)
    for queue, n in (in_redis or {}).items():  # Redis, when the server has one and it answers
        row(queue)["in_redis"] = n
    return dict(sorted(rows.items()))


class QueuesPage:
    """``/queues`` over the dashboard's :class:`~hybridq.http.dashboard.pages.Pages`."""

    def __init__(self, pages: Pages) -> None:
        self.pages = pages

    def queues(self, request: Request) -> Response:
        """Per queue: pending, waiting, in Redis, running, oldest waiting, top priority, rates, an hour."""
        return self.pages.guarded(
            request, lambda _: self._build(), title="Queues", active="/queues", refresh=True
        )

    def _build(self) -> Body:
        now = time.time()
        journal = self.pages.journal
        in_redis = None
        if self.pages.config.redis_url is not None:
            from hybridq.http.dashboard.live import queue_lengths  # noqa: PLC0415 - only with a Redis

            in_redis = queue_lengths(self.pages.config.redis_url)
        figures = self.pages.figures()
        rows = queue_rows(figures, queue_figures(journal), self.pages.view.recent(now), in_redis, now)
        shown = [(queue, [c.show(values.get(c.key)) for c in COLUMNS]) for queue, values in rows.items()]
        redis_note = (
            "no Redis given to this server (--redis)"
            if self.pages.config.redis_url is None
            else ("Redis does not answer" if in_redis is None else "")
        )
        return "queues.html", {
            "columns": COLUMNS,
            "rows": shown,
            "redis_note": redis_note,
            # The per-key limits (docs/forwarder.md, "Limits per key"): the 100 keys waiting longest.
            "limit_keys": sorted(
                figures.get("limit_keys", {}).items(), key=lambda kv: -kv[1]["waiting_on_limit_s"]
            )[:100],
            # The fair keys (--fair-key): the 100 with the most jobs waiting.
            "fair_keys": list(figures.get("fair_keys", {}).items())[:100],
            "section": {"chart": hour_chart(journal, now)},
        }
