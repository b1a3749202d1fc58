"""Prometheus metrics of a running forwarder (``hybridq forward --metrics-port N``).

Values are read on each scrape from the forwarder's own state (no scan of the ledger): durable
totals (forwarded, succeeded, failed, duplicates suppressed) that survive restarts, counters of
this process (redelivered), and gauges (pending, Redis up, forwarding lag, journal bytes). The
forwarder's own fsyncs (checkpoint saves, ledger appends) feed a latency histogram. With
``--outbox``, the outbox's backlog (rows, oldest age: one SQL count per scrape, on a connection
of its own) and the rows its relay moved.

The scrape runs in prometheus-client's HTTP thread; it only reads integers the forwarder loop
updates, plus the journal directory (its size, and the accepted count through its own reader).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from hybridq.journal.reader import journal_usage
from hybridq.ledger.compacted import AcceptedCounter
from hybridq.ops.limit_stats import fair_figures
from hybridq.outbox.backlog import Backlog
from hybridq.worker import waiting
from hybridq.workflows.store import counts as workflow_counts

if TYPE_CHECKING:
    from hybridq.forwarder.backlog import Backlog as JobBacklog
    from hybridq.forwarder.loop import Forwarder
    from hybridq.outbox.background import BackgroundRelay

__all__ = ["FSYNC_SECONDS", "ForwarderMetrics", "serve_metrics"]

#: Latency of the forwarder's durable writes (checkpoint saves, ledger appends): each ends in
#: an fsync, so this is what the disk makes the forwarder wait.
FSYNC_SECONDS = Histogram(
    "hybridq_fsync_seconds",
    "Latency of the forwarder's durable writes (checkpoint saves and ledger appends, each fsync'd).",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
    registry=None,
)


class ForwarderMetrics(Collector):
    """Collects a forwarder's metrics at scrape time."""

    def __init__(
        self, forwarder: Forwarder, *, capacity: int | None = None, outbox: BackgroundRelay | None = None
    ) -> None:
        self.forwarder = forwarder
        self.capacity = capacity
        self.outbox = outbox
        self._accepted = AcceptedCounter(forwarder.journal)
        self._lock = threading.Lock()

    def accepted(self) -> int:
        """Every job ever accepted into the journal (compacted ones included)."""
        with self._lock:  # scrapes may overlap
            return self._accepted.count()

    def waiting(self) -> int | None:
        """Jobs workers left for another worker (:mod:`hybridq.worker.waiting`); ``None``: unknown."""
        conn = getattr(self.forwarder.transport, "connection", None)  # the RQ transport's client
        if conn is None or self.forwarder.stats.down_since is not None:
            return None
        try:
            return waiting.current(conn, limit=0).count
        except RedisError:
            return None

    def outbox_backlog(self) -> Backlog | None:
        """The outbox's backlog, read now; ``None`` when it cannot be read (the gauges are left out)."""
        if self.outbox is None:
            return None
        try:
            return self.outbox.backlog()
        except Exception:  # any driver's error: the relay logs its own failures
            return None

    def collect(self) -> Iterator[Metric]:
        """The metric families (prometheus-client calls this on each scrape)."""
        f = self.forwarder
        c = f.completions
        cp = f.checkpoint
        outcomes = f.state.outcome_counts()
        succeeded = outcomes["succeeded"]
        failed = outcomes["failed"] + outcomes["invalid"]
        dups = outcomes["dups"]
        cancelled = outcomes["cancelled"]
        failed += cancelled  # as status --json counts them: pending is what has not ended
        accepted = self.accepted()
        yield _counter("hybridq_accepted", "Jobs accepted into the journal.", accepted)
        yield _counter(
            "hybridq_forwarded", "Jobs pushed to Redis (a re-push after a crash counts again).", cp.forwarded
        )
        yield _counter("hybridq_succeeded", "Jobs that succeeded (from the ledger).", succeeded)
        yield _counter(
            "hybridq_failed", "Jobs that failed for good or were cancelled (from the ledger).", failed
        )
        yield _counter(
            "hybridq_duplicates_suppressed",
            "Deliveries that found their key's outcome stored and did not run the task.",
            dups,
        )
        redelivered = c.redelivered + c.refilled
        yield _counter(
            "hybridq_redelivered",
            "Jobs this forwarder process delivered again (lost, missing, stranded, refilled).",
            redelivered,
        )
        yield _counter(
            "hybridq_events_dropped",
            "Completion events this forwarder process dropped because they did not parse.",
            c.dropped_events,
        )
        yield _counter(
            "hybridq_late_events",
            "Completion events for jobs the ledger already held as finished (a duplicate's report, "
            "a replay, or a finished job that ran again; each one is logged).",
            c.late_events,
        )
        yield _gauge(
            "hybridq_pending",
            "Jobs accepted and not yet terminal.",
            max(0, accepted - succeeded - failed),
        )
        yield _counter("hybridq_cancelled", "Jobs cancelled (hybridq cancel), from the ledger.", cancelled)
        if self.capacity is not None:
            yield _gauge(
                "hybridq_capacity",
                "The producers' Queue(capacity=...), as given to the forwarder.",
                self.capacity,
            )
        yield _gauge("hybridq_retrying", "Jobs waiting for their next attempt.", c.retrying)
        yield _gauge(
            "hybridq_delayed_held", "Delayed jobs the forwarder holds until their time.", len(cp.held)
        )
        yield _gauge(
            "hybridq_redis_up", "1 while the forwarder reaches Redis, else 0.", f.stats.down_since is None
        )
        lag = 0.0 if f.stats.oldest_unpushed is None else max(0.0, time.time() - f.stats.oldest_unpushed)
        yield _gauge("hybridq_forwarding_lag_seconds", "Age of the oldest job waiting to be pushed.", lag)
        waiting_now = self.waiting()
        if waiting_now is not None:
            yield _gauge(
                "hybridq_waiting_for_a_worker",
                "Jobs a worker recently left because it cannot import or may not run their task.",
                waiting_now,
            )
        segments, size, disk = journal_usage(f.journal)
        yield _gauge("hybridq_journal_bytes", "Bytes of journal segments on disk.", size)
        yield _gauge("hybridq_journal_disk_bytes", "Bytes of disk blocks the journal segments hold.", disk)
        yield _gauge("hybridq_journal_segments", "Journal segment files on disk.", segments)
        yield from self._outbox_metrics()
        yield from window_metrics(f.backlog)
        yield from limit_metrics(f.key_limits.figures())
        yield from fair_metrics(fair_figures(f.journal, None)["fair_keys"])
        yield from workflow_metrics(f.journal)

    def _outbox_metrics(self) -> Iterator[Metric]:
        """With ``forward --outbox``: the relay's count, and the outbox's backlog when readable."""
        if self.outbox is None:
            return
        yield _counter(
            "hybridq_outbox_relayed",
            "Outbox rows this forwarder process moved into the journal (its relay, --outbox).",
            self.outbox.relayed,
        )
        backlog = self.outbox_backlog()
        if backlog is None:
            return
        yield _gauge("hybridq_outbox_rows", "Committed outbox rows not yet relayed.", backlog.rows)
        yield _gauge(
            "hybridq_outbox_oldest_age_seconds",
            "Age of the oldest committed outbox row not yet relayed (0 when none).",
            backlog.oldest_age_s(),
        )
        yield _gauge(
            "hybridq_outbox_set_aside_rows",
            "Bad outbox rows the relay set aside: they cannot be relayed (hybridq doctor --outbox).",
            backlog.set_aside,
        )


def window_metrics(backlog: JobBacklog) -> Iterator[Metric]:
    """Per queue: the backlog in the journal, the window in Redis, the oldest wait; Redis's memory.

    Read from the forwarder's memory (no query at scrape time: the oldest waiting job is the
    one its last refill saw).
    """
    now = time.time()
    detail, memory = backlog.figures()
    families = {
        "backlog": GaugeMetricFamily(
            "hybridq_queue_backlog_jobs",
            "Jobs waiting in the journal for room in the window.",
            labels=["queue"],
        ),
        "window": GaugeMetricFamily(
            "hybridq_queue_window_jobs", "Jobs queued in Redis (LLEN at the last look).", labels=["queue"]
        ),
        "window_target": GaugeMetricFamily(
            "hybridq_queue_window_target_jobs", "Jobs the forwarder keeps queued in Redis.", labels=["queue"]
        ),
    }
    latency = GaugeMetricFamily(
        "hybridq_queue_latency_seconds",
        "How long the oldest job waiting in the journal has been eligible to run (0: none waits).",
        labels=["queue"],
    )
    by_priority = GaugeMetricFamily(
        "hybridq_queue_backlog_priority_jobs",
        'Jobs waiting in the journal, per priority (docs/forwarder.md, "Priorities and fairness").',
        labels=["queue", "priority"],
    )
    for queue, d in detail.items():
        for key, family in families.items():
            if d[key] is not None:
                family.add_metric([queue], float(d[key]))
        oldest = d["oldest_waiting"]
        latency.add_metric([queue], 0.0 if oldest is None else max(0.0, now - oldest))
        for prio, n in d.get("by_priority", {}).items():
            by_priority.add_metric([queue, prio], float(n))
    yield from families.values()
    yield latency
    if by_priority.samples:  # no backlog on disk: no family without samples
        yield by_priority
    paused = GaugeMetricFamily(
        "hybridq_redis_push_paused", "1 while pushes are paused for Redis's memory.", labels=["reason"]
    )
    for reason in ("high_water", "oom"):
        paused.add_metric([reason], float(memory is not None and memory["paused"] == reason))
    yield paused
    if memory is not None and memory["maxmemory"]:
        yield _gauge(
            "hybridq_redis_memory_ratio",
            "Redis's used_memory over its maxmemory.",
            memory["used"] / memory["maxmemory"],
        )
    yield _counter(
        "hybridq_redis_push_pauses", "Times pushes paused for Redis's memory.", backlog.gate.pauses
    )


def limit_metrics(figures: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Per limit key its gate looked at recently: running, queued, started in the period, held."""
    if not figures:
        return  # no limits: no families without samples
    families = {
        "running": GaugeMetricFamily(
            "hybridq_limit_key_running", "Runs of the limit key holding a slot.", labels=["key"]
        ),
        "queued": GaugeMetricFamily(
            "hybridq_limit_key_queued", "Jobs of the limit key pushed and not yet claimed.", labels=["key"]
        ),
        "started": GaugeMetricFamily(
            "hybridq_limit_key_started", "Starts of the limit key in its rate's last period.", labels=["key"]
        ),
    }
    held = GaugeMetricFamily(
        "hybridq_limit_key_held_seconds",
        "How long the limit key has had no room while its jobs wait (0: it has room).",
        labels=["key"],
    )
    now = time.time()
    for key, d in figures.items():
        for name, family in families.items():
            family.add_metric([key], float(d[name]))
        since = d["blocked_since"]
        held.add_metric([key], 0.0 if since is None else max(0.0, now - since))
    yield from families.values()
    yield held


def fair_metrics(figures: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Per fair key (``--fair-key``) with jobs waiting: how many wait in the run table."""
    if not figures:
        return  # no fair keys, or none waits: no family without samples
    family = GaugeMetricFamily(
        "hybridq_fair_key_waiting",
        "Jobs of the fair key waiting in the journal's run table (the keys with the most, up to 500).",
        labels=["key"],
    )
    for key, d in figures.items():
        family.add_metric([key], float(d["waiting"]))
    yield family


def workflow_metrics(journal: str) -> Iterator[Metric]:
    """Workflows by state and jobs waiting for their ``depends_on`` (docs/workflows.md)."""
    counts = workflow_counts(journal)
    family = GaugeMetricFamily("hybridq_workflows", "Workflows by state.", labels=["state"])
    for state in ("running", "succeeded", "failed", "cancelled"):
        family.add_metric([state], float(counts.get(state, 0)))
    yield family
    yield _gauge(
        "hybridq_waiting_on_dependencies",
        "Jobs waiting for the jobs they depend on.",
        counts.get("waiting_on_deps", 0),
    )


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def serve_metrics(
    forwarder: Forwarder,
    port: int,
    *,
    addr: str = "127.0.0.1",
    capacity: int | None = None,
    outbox: BackgroundRelay | None = None,
) -> CollectorRegistry:
    """Serve ``/metrics`` for ``forwarder`` (and its outbox relay) on ``addr:port`` (a daemon thread)."""
    registry = CollectorRegistry()
    registry.register(ForwarderMetrics(forwarder, capacity=capacity, outbox=outbox))
    registry.register(FSYNC_SECONDS)
    start_http_server(port, addr=addr, registry=registry)
    return registry
