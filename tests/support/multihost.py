"""Producer hosts and worker hosts on a :class:`~tests.support.netns.Network`, one shared Redis.

A producer host is a namespace with its own journal, ``hybridq forward --lease 2`` and, when
asked, a producer process (:mod:`tests.support.netns_producer`); a worker host runs
``hybridq worker --processes 1``. Every job is ``tests.netns_tasks.hosted``, which appends its
start and end (token, attempt, worker host, time) to one effects file: the figures come from it,
from the producers' acknowledgements and from each forwarder's ledger, not from hybridq's counters.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import redis
from hybridq.journal.paths import ensure_journal_dir
from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.ledger.store import read_ledger
from hybridq.protocol import keys
from hybridq.testing.embedded import RedisServer

from tests.support.netns import Host, Network
from tests.support.processes import wait_until

__all__ = ["LEASE_S", "Cluster", "ProducerHost", "Run", "WorkerHost", "line", "since", "wait_exit"]

#: The forwarders' ``--lease``: a cut-off worker's jobs are delivered again after about this.
LEASE_S = 2.0


@dataclass(frozen=True)
class Run:
    """One line of the effects file."""

    kind: str  # "start" | "done"
    token: str
    attempt: int
    host: str
    pid: int
    at: float


@dataclass
class ProducerHost:
    """A producer host: its namespace, journal, acknowledgements and forwarder."""

    host: Host
    journal: Path
    acks: Path
    forwarder: subprocess.Popen[bytes] | None = None
    producers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.host.role

    def accepted(self) -> dict[str, tuple[str, float]]:
        """token -> (job id, time acknowledged)."""
        out: dict[str, tuple[str, float]] = {}
        with contextlib.suppress(FileNotFoundError), open(self.acks, encoding="utf-8") as f:
            for line in f:
                token, job_id, at = line.split()
                out[token] = (job_id, float(at))
        return out

    def ledger_done(self) -> Counter[str]:
        """job id -> how many ``done`` entries this host's ledger holds for it."""
        return Counter(e.job_id for _, e in read_ledger(str(self.journal)) if e.kind == "done")

    def owner(self) -> str:
        checkpoint = load_checkpoint(str(self.journal))
        assert checkpoint is not None, "no forwarder.state yet"
        return checkpoint.owner


@dataclass
class WorkerHost:
    host: Host
    proc: subprocess.Popen[bytes]

    @property
    def name(self) -> str:
        return self.host.role


class Cluster:
    """The scenario's hosts, its Redis (reachable from every host) and its effects file."""

    def __init__(self, tmp_path: Path, env: dict[str, str], network: Network, server: RedisServer) -> None:
        self.tmp_path = tmp_path
        self.env = env
        self.network = network
        self.server = server
        self.url = f"redis://{network.gateway}:{server.port}/0"
        self.effects = tmp_path / "effects.txt"

    # -- hosts ------------------------------------------------------------------------------

    def producer_host(self, name: str, journal: Path | None = None) -> ProducerHost:
        """A new producer host with its forwarder running (on ``journal``: a disk moved to it)."""
        host = self.network.add_host(name)
        journal = journal or self.tmp_path / name / "journal"
        ensure_journal_dir(journal)
        ph = ProducerHost(host, journal, self.tmp_path / f"{name}.acks")
        self.start_forwarder(ph)
        return ph

    def start_forwarder(self, ph: ProducerHost) -> None:
        args = [sys.executable, "-m", "hybridq", "forward", "--journal", str(ph.journal)]
        args += ["--redis", self.url, "--lease", str(LEASE_S)]
        ph.forwarder = ph.host.popen(args, env=self.env, log_path=self.tmp_path / f"{ph.name}-forward.log")

    def produce(
        self,
        ph: ProducerHost,
        count: int,
        *,
        rate: float = 0.0,
        first: int = 0,
        sleep: float = 0.0,
        wait_for: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start the host's application enqueueing ``count`` jobs (``rate`` per second).

        With ``wait_for``, it starts (Python loaded, journal open) and enqueues once that file exists.
        """
        args = [sys.executable, "-m", "tests.support.netns_producer", "--journal", str(ph.journal)]
        args += ["--host", ph.name, "--effects", str(self.effects), "--acks", str(ph.acks)]
        args += ["--count", str(count), "--rate", str(rate), "--first", str(first), "--sleep", str(sleep)]
        args += ["--wait-for", str(wait_for)] if wait_for is not None else []
        proc = ph.host.popen(args, env=self.env, log_path=self.tmp_path / f"{ph.name}-produce.log")
        ph.producers.append(proc)
        return proc

    def worker_host(self, name: str, *, threads: int = 4) -> WorkerHost:
        host = self.network.add_host(name)
        args = [sys.executable, "-m", "hybridq", "worker", "--redis", self.url]
        args += ["--processes", "1", "--threads", str(threads), "default"]
        env = {**self.env, "HQ_NETNS_HOST": name}
        log_path = self.tmp_path / f"{name}-worker.log"
        return WorkerHost(host, host.popen(args, env=env, log_path=log_path, cwd=self.tmp_path))

    def wait_workers(self, n: int) -> None:
        """Until ``n`` RQ workers are registered in Redis (the pools are serving)."""
        wait_until(lambda: len(self.client().smembers(f"{keys.RQ_PREFIX}:workers")) >= n, what="workers")

    def cut_in_blocking_pop(self, wh: WorkerHost) -> None:
        """Cut ``wh`` off just after its idle worker sent a blocking pop (it waits up to 1 s).

        Redis keeps that pop waiting after the cut: a job pushed meanwhile is moved into RQ's
        intermediate list for a worker that never hears of it.
        """
        prefix = f"{wh.host.address}:"
        with contextlib.closing(self.client()) as client:

            def blocked() -> bool:
                return any(c["addr"].startswith(prefix) and "b" in c["flags"] for c in client.client_list())

            deadline = time.monotonic() + 30
            while True:
                assert time.monotonic() < deadline, f"{wh.name} never waited in a blocking pop"
                while blocked():
                    pass
                if wait_until(blocked, timeout=5, interval=0.0005, what="a blocking pop"):
                    wh.host.cut()
                    return

    def client(self) -> redis.Redis:
        return self.server.client()

    # -- what happened ----------------------------------------------------------------------

    def runs(self) -> list[Run]:
        out: list[Run] = []
        with contextlib.suppress(FileNotFoundError), open(self.effects, encoding="utf-8") as f:
            for line in f:
                kind, token, attempt, host, pid, at = line.split()
                out.append(Run(kind, token, int(attempt), host, int(pid), float(at)))
        return out

    def finished(self, tokens: Iterable[str]) -> set[str]:
        want = set(tokens)
        return {r.token for r in self.runs() if r.kind == "done" and r.token in want}

    def wait_finished(self, tokens: Iterable[str], *, timeout: float = 60.0, what: str = "jobs done") -> None:
        want = set(tokens)
        wait_until(lambda: self.finished(want) == want, timeout=timeout, interval=0.2, what=what)

    def wait_ledgers(self, hosts: Iterable[ProducerHost], *, timeout: float = 60.0) -> None:
        """Until each host's ledger holds an outcome for every job it accepted."""

        def settled() -> bool:
            return all(set(ph.ledger_done()) >= {j for j, _ in ph.accepted().values()} for ph in hosts)

        wait_until(settled, timeout=timeout, interval=0.2, what="every outcome in its owner's ledger")

    def tally(self, hosts: Iterable[ProducerHost]) -> dict[str, object]:
        """accepted, succeeded (ledgers), lost, runs, dup_execution, runs per worker host, latency."""
        hosts = list(hosts)
        runs = self.runs()
        starts = Counter(r.token for r in runs if r.kind == "start")
        done_at: dict[str, float] = {}
        for r in runs:
            if r.kind == "done":
                done_at.setdefault(r.token, r.at)
        accepted = {t: v for ph in hosts for t, v in ph.accepted().items()}
        succeeded = sum(len(ph.ledger_done()) for ph in hosts)
        latency = sorted(done_at[t] - at for t, (_, at) in accepted.items() if t in done_at)
        by_worker = Counter(r.host for r in runs if r.kind == "done" and r.token in accepted)
        return {
            "accepted": len(accepted),
            "succeeded": succeeded,
            "lost": len(set(accepted) - set(done_at)),
            "runs": sum(starts[t] for t in accepted),
            "dup_execution": sum(max(0, starts[t] - 1) for t in accepted),
            "by_worker": ",".join(f"{h}:{n}" for h, n in sorted(by_worker.items())),
            "p50_s": f"{statistics.median(latency):.2f}" if latency else "-",
            "max_s": f"{latency[-1]:.2f}" if latency else "-",
        }


def line(name: str, figures: dict[str, object]) -> str:
    """``MH <name> k=v k=v ...``: one scenario figure line."""
    return f"MH {name} " + " ".join(f"{k}={v}" for k, v in figures.items())


def wait_exit(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Wait for a producer to finish; fail if it did not exit 0."""
    rc = proc.wait(timeout)
    assert rc == 0, f"producer exited {rc}"


def since(start: float) -> str:
    return f"{time.monotonic() - start:.1f}"
