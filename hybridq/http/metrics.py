"""``GET /metrics`` of a standalone ``hybridq serve``: the journal's figures and the server's own.

With ``hybridq forward --serve`` the forwarder's own collector (:mod:`hybridq.ops.metrics`) is served
instead, which has everything the forwarder knows; this one reads :func:`hybridq.stats` (what
the forwarder saved with its last step, and the journal after it) at each scrape, under the same
metric names, and adds the POSTs this server answered, by status code.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridq.errors import HybridqError, TransportError
from hybridq.ops.fleet import COUNTS, fleet
from hybridq.ops.status import stats

if TYPE_CHECKING:
    from hybridq.http.api import Api

__all__ = ["FleetCollector", "StatsCollector"]

_COUNTERS = (
    ("accepted", "hybridq_accepted", "Jobs accepted into the journal."),
    ("forwarded", "hybridq_forwarded", "Jobs pushed to Redis (a re-push after a crash counts again)."),
    ("succeeded", "hybridq_succeeded", "Jobs that succeeded (from the ledger)."),
    ("failed", "hybridq_failed", "Jobs that failed for good or were cancelled (from the ledger)."),
    ("duplicates_suppressed", "hybridq_duplicates_suppressed", "Duplicates that did not run."),
)


class StatsCollector(Collector):
    """Collects the journal's figures and the server's POST answers at scrape time.

    Args:
        api: the server's API (its POST counts, its journal and capacity).
        journal: also the journal's figures (``False`` when the forwarder's collector has them).
    """

    def __init__(self, api: Api, *, journal: bool = True) -> None:
        self.api = api
        self.journal = journal

    def collect(self) -> Iterator[Metric]:
        """The metric families (prometheus-client calls this on each scrape)."""
        posts = CounterMetricFamily(
            "hybridq_http_posts", "POST /v1/jobs answers of this server, by status code.", labels=["code"]
        )
        for code, n in sorted(self.api.posts.items()):
            posts.add_metric([str(code)], n)
        yield posts
        if not self.journal:
            return
        try:
            out = stats(self.api.journal, redis_url=None, outbox=None, redis_for=None)  # the journal only
        except (HybridqError, OSError):
            yield GaugeMetricFamily("hybridq_journal_readable", "1 if the journal could be read.", 0.0)
            return
        yield GaugeMetricFamily("hybridq_journal_readable", "1 if the journal could be read.", 1.0)
        for field, name, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=out.get(field, 0))
        yield GaugeMetricFamily("hybridq_pending", "Jobs accepted and not yet terminal.", out["pending"])
        by_queue = GaugeMetricFamily(
            "hybridq_queue_pending", "Jobs accepted and not yet terminal, by queue.", labels=["queue"]
        )
        for queue, n in sorted(out.get("queues", {}).items()):
            by_queue.add_metric([queue], n)
        yield by_queue
        if self.api.config.capacity is not None:
            yield GaugeMetricFamily(
                "hybridq_capacity", "The server's --capacity (pending jobs).", self.api.config.capacity
            )
        yield GaugeMetricFamily(
            "hybridq_forwarding_lag_seconds",
            "Age of the oldest job waiting to be pushed.",
            out.get("forwarding_lag_s", 0.0),
        )
        yield GaugeMetricFamily(
            "hybridq_oldest_pending_age_seconds",
            "Age of the oldest job not yet terminal.",
            out.get("oldest_pending_age_s", 0.0),
        )
        journal = out.get("journal", {})
        yield GaugeMetricFamily(
            "hybridq_journal_bytes", "Bytes of journal segments on disk.", journal.get("bytes", 0)
        )
        yield GaugeMetricFamily(
            "hybridq_journal_disk_bytes",
            "Bytes of disk blocks the journal segments hold.",
            journal.get("disk_bytes", 0),
        )


class FleetCollector(Collector):
    """``/metrics`` of every forwarder publishing to one Redis, labelled per forwarder and journal.

    Served by a standalone ``hybridq serve --redis URL`` (one place that sees them all); each
    ``hybridq forward`` serves its own journal's metrics. The labels come from Redis: the
    exposition format escapes them, and their number is bounded (``hybridq.ops.fleet.MAX_FORWARDERS``).
    """

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url

    def collect(self) -> Iterator[Metric]:
        """The metric families (prometheus-client calls this on each scrape)."""
        try:
            out = fleet(self.redis_url)
        except TransportError:
            yield GaugeMetricFamily("hybridq_fleet_redis_up", "1 if the fleet's Redis answered.", 0.0)
            return
        yield GaugeMetricFamily("hybridq_fleet_redis_up", "1 if the fleet's Redis answered.", 1.0)
        labels = ["forwarder", "host", "journal"]
        jobs = GaugeMetricFamily(
            "hybridq_fleet_jobs",
            "Each forwarder's counts as it last published them (status --all), by count.",
            labels=[*labels, "count"],
        )
        ages = {
            age: GaugeMetricFamily(f"hybridq_fleet_{age.removesuffix('_s')}_seconds", doc, labels=labels)
            for age, doc in (
                ("oldest_pending_age_s", "Age of each forwarder's oldest job not yet terminal."),
                ("forwarding_lag_s", "Age of each forwarder's oldest job waiting to be pushed."),
            )
        }
        seen = GaugeMetricFamily(
            "hybridq_fleet_last_seen_seconds",
            "Seconds since each forwarder last published.",
            labels=["forwarder"],
        )
        stale = GaugeMetricFamily(
            "hybridq_fleet_stale",
            "1 when a forwarder's snapshot expired (not seen for its TTL).",
            labels=["forwarder"],
        )
        for f in out["forwarders"]:
            seen.add_metric([f["owner"]], f["last_seen_age_s"])
            stale.add_metric([f["owner"]], 1.0 if f["stale"] else 0.0)
            if f["stale"] or "invalid" in f:
                continue
            values = [f["owner"], f["host"], f["journal"]]
            for name in COUNTS:
                jobs.add_metric([*values, name], f[name])
            for age, family in ages.items():
                family.add_metric(values, f[age])
        yield from (jobs, *ages.values(), seen, stale)
