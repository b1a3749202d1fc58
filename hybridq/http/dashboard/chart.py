"""The last hour's throughput and latency, as inline SVG drawn by the server (no script, no CDN).

From the forwarder's lookup index (:func:`hybridq.lookup.search.activity`): per minute, the
outcomes (succeeded, and the rest) and the time from acceptance to outcome (mean, longest). The
SVG's shapes carry classes (``dashboard.css`` colours them) and a ``<title>`` each (the figures
on hover): no inline style or script, so the dashboard's CSP stays as it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hybridq.http.dashboard.templating import age
from hybridq.lookup.search import Minute, activity

__all__ = ["HOUR_S", "Chart", "hour_chart"]

#: What the chart covers (seconds), and its bars' width (one per minute).
HOUR_S = 3600
_BUCKET_S = 60
#: The drawing's size (SVG units; it scales to the page's width).
WIDTH, HEIGHT, LEFT = 760.0, 100.0, 50.0


@dataclass(frozen=True, slots=True)
class Bar:
    """One minute's outcomes: the successes' rectangle under the failures'."""

    x: float
    width: float
    ok_y: float
    ok_h: float
    bad_y: float
    bad_h: float
    label: str


@dataclass
class Chart:
    """What the template draws (sections/chart.html); coordinates in SVG units."""

    minutes: list[Minute]
    bars: list[Bar] = field(default_factory=list)
    top_jobs: int = 0
    #: Latency lines as SVG path data (``M x y L x y ...``), mean and longest, and the scale's top.
    mean_path: str = ""
    max_path: str = ""
    top_latency: str = "-"
    #: Per minute with outcomes: x, the longest's y, the mean's y, what its tooltip says.
    points: list[tuple[float, float, float, str]] = field(default_factory=list)
    total: int = 0
    failed: int = 0

    width: float = WIDTH
    height: float = HEIGHT
    left: float = LEFT


def hour_chart(journal: str, now: float | None = None) -> Chart | None:
    """The chart of the hour before ``now`` (``None``: no lookup index to draw it from)."""
    now = time.time() if now is None else now
    since = (int(now) // _BUCKET_S + 1) * _BUCKET_S - HOUR_S  # 60 whole minutes, the last one now
    minutes = activity(journal, since, now, _BUCKET_S)
    if minutes is None:
        return None
    chart = Chart(minutes)
    _bars(chart)
    _latency(chart)
    return chart


def _x(chart: Chart, i: int) -> float:
    return chart.left + i * (chart.width - chart.left) / max(1, len(chart.minutes))


def _bars(chart: Chart) -> None:
    top = max((m.succeeded + m.failed for m in chart.minutes), default=0) or 1
    chart.top_jobs = top
    step = (chart.width - chart.left) / max(1, len(chart.minutes))
    for i, m in enumerate(chart.minutes):
        ok_h = chart.height * m.succeeded / top
        bad_h = chart.height * m.failed / top
        when = time.strftime("%H:%M", time.gmtime(m.start))
        chart.bars.append(
            Bar(
                x=round(_x(chart, i), 2),
                width=round(max(1.0, step - 1), 2),
                ok_y=round(chart.height - ok_h, 2),
                ok_h=round(ok_h, 2),
                bad_y=round(chart.height - ok_h - bad_h, 2),
                bad_h=round(bad_h, 2),
                label=f"{when} UTC: {m.succeeded} succeeded, {m.failed} failed",
            )
        )
        chart.total += m.succeeded + m.failed
        chart.failed += m.failed


def _latency(chart: Chart) -> None:
    top = max((m.latency_max for m in chart.minutes if m.latency_max is not None), default=0.0)
    chart.top_latency = age(top) if top else "-"
    scale = top or 1.0
    step = (chart.width - chart.left) / max(1, len(chart.minutes))
    mean: list[tuple[float, float] | None] = []
    longest: list[tuple[float, float] | None] = []
    for i, m in enumerate(chart.minutes):
        if m.latency_mean is None or m.latency_max is None:
            mean.append(None)
            longest.append(None)
            continue
        x = round(_x(chart, i) + step / 2, 2)
        top_y = round(chart.height * (1 - m.latency_max / scale), 2)
        mean_y = round(chart.height * (1 - m.latency_mean / scale), 2)
        mean.append((x, mean_y))
        longest.append((x, top_y))
        when = time.strftime("%H:%M", time.gmtime(m.start))
        label = f"{when} UTC: mean {age(m.latency_mean)}, longest {age(m.latency_max)}"
        chart.points.append((x, top_y, mean_y, label))
    chart.mean_path, chart.max_path = _path(mean), _path(longest)


def _path(points: list[tuple[float, float] | None]) -> str:
    """SVG path data through ``points``, broken where a minute had no outcome."""
    out: list[str] = []
    pen_down = False
    for point in points:
        if point is None:
            pen_down = False
            continue
        out.append(f"{'L' if pen_down else 'M'}{point[0]} {point[1]}")
        pen_down = True
    return " ".join(out)
