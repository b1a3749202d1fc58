"""Peers benchmark: enqueue into hybridq and into other task queues and durable local queues, side by side.

Run it through ``scripts/bench-peers`` (it installs the ``bench`` extra; see ``docs/benchmarks.md``).
One run measures, at each thread count of ``--threads`` (default 1 and 16):

  * hybridq ``Queue.enqueue`` (durable: fsync before it returns) and ``rq.Queue.enqueue`` on a
    Redis without persistence: the anchors of the targets in ``docs/benchmarks.md``, and the ratio's denominator;
  * ``rq.Queue.enqueue`` on Redis with ``appendonly yes`` and ``appendfsync everysec``, and with
    ``appendfsync always``;
  * Celery ``.delay()`` and Dramatiq ``.send()`` to the Redis without persistence (broker only: no
    result backend, no worker);
  * persist-queue's ``SQLiteQueue`` and its file ``Queue``, huey's ``SqliteHuey(fsync=True)``, and
    plain sqlite3 (WAL, ``synchronous=FULL``, one commit per job).

The three redis-server processes are private (``hybridq.testing.embedded.RedisServer``), started in the
run's temporary directory and stopped at its end. Each repetition runs one group per thread count,
in an order rotated each repetition; within a group every row enqueues ``--n`` jobs in slices,
taking turns round-robin (the order rotated by one each repetition), so a burst of load from
another tenant of the shared machine hits all of them alike. Every group gets fresh directories
and FLUSHALLed Redis servers. After its last slice each row counts the jobs its system holds and
reports any that are missing.

Reported per row: the median over repetitions of jobs/s, its spread (min..max), p50/p99 latency
of one call, the ratio to ``rq.Queue.enqueue`` on the Redis without persistence at the same thread
count (computed per repetition, then its median), and what survives a crash of the enqueuing
process, a power loss and a Redis restart (``DURABILITY``). ``--json`` writes every row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sqlite3
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import benchlib
import celery
import dramatiq
import huey
import persistqueue
import redis
import rq
from benchlib import Contestant, Sample, latency_us, per_rep, version
from dramatiq.brokers.redis import RedisBroker
from enqueue import counted_loop, setup_hq, threaded_counted
from hybridq.journal import JournalReader
from hybridq.testing.embedded import RedisServer
from rq.serializers import JSONSerializer

#: Only the dotted path is recorded at enqueue time (no system imports it: no worker runs).
FUNC = "tests.tasks.add"
WARMUP_OPS = 20
#: Items per chunk file of persist-queue's file Queue (its default): the chunk is fsynced when full.
PQ_FILE_CHUNK = 100


def add(x: int, y: int) -> int:
    """The task body Celery, Dramatiq and huey register; never run here."""
    return x + y


def job_record() -> dict[str, object]:
    """What the local queues store per job: an id, the function's path and its arguments."""
    return {"id": uuid.uuid4().hex, "func": FUNC, "args": [1, 2]}


# -- what survives what: the one table ----------------------------------------------------------


@dataclass(frozen=True)
class Durability:
    """What an acknowledged enqueue survives, and why."""

    crash: str  # a crash of the enqueuing process after the call returned
    power: str  # a power loss (or kernel crash) of the machine holding the data
    redis: str  # a restart of redis-server (crash or clean)
    how: str

    @property
    def short(self) -> str:
        return f"{self.crash} / {self.power} / {self.redis}"

    @property
    def text(self) -> str:
        return (
            f"process crash: {self.crash}; power loss: {self.power}; Redis restart: {self.redis}. {self.how}"
        )


_REDIS_ONLY = "the job lives only in the memory of a Redis with no persistence (--save '' --appendonly no)"

DURABILITY: dict[str, Durability] = {
    "hybridq": Durability(
        "yes",
        "yes",
        "yes",
        "append + fdatasync to the local journal before enqueue returns (fsync before return); Redis "
        "is only transport: after a Redis restart the forwarder delivers the journal's jobs again",
    ),
    "rq-none": Durability(
        "yes",
        "no",
        "no",
        f"{_REDIS_ONLY}: nothing survives a Redis restart or a power loss",
    ),
    "rq-everysec": Durability(
        "yes",
        "up to ~1 s lost",
        "yes",
        "AOF with appendfsync everysec: Redis writes each command to the AOF before it replies, so a "
        "Redis crash or restart loses nothing acknowledged; the fsync runs once a second in the "
        "background, so a power loss loses up to ~1 s of acknowledged jobs (~2 s if an fsync stalls)",
    ),
    "rq-always": Durability(
        "yes",
        "yes",
        "yes",
        "AOF with appendfsync always: Redis fsyncs the AOF before it replies (the commands of one "
        "event-loop turn share one fsync)",
    ),
    "celery": Durability(
        "yes",
        "no",
        "no",
        f".delay() returns after kombu's LPUSH; {_REDIS_ONLY}: nothing survives a Redis restart or "
        "a power loss (as the rq row on the same Redis; an AOF would cost what it costs rq)",
    ),
    "dramatiq": Durability(
        "yes",
        "no",
        "no",
        f".send() returns after the enqueue script (HSET + RPUSH); {_REDIS_ONLY}: nothing survives a "
        "Redis restart or a power loss (as the rq row on the same Redis)",
    ),
    "pq-sqlite": Durability(
        "yes",
        "yes",
        "n/a",
        "persist-queue SQLiteQueue(auto_commit=True, multithreading=True): one commit per put, "
        "journal_mode=WAL (set by persist-queue); synchronous is left at SQLite's default by "
        "persist-queue (FULL unless SQLite was built otherwise), so the script sets PRAGMA "
        "synchronous=FULL on its connections: the WAL is fsynced at every commit",
    ),
    "pq-file": Durability(
        "yes",
        "recent jobs lost",
        "n/a",
        "persist-queue file Queue has no fsync option: put() writes the pickled item to the chunk "
        "file (flushed to the OS, not fsynced) and replaces the info file (write + rename, no fsync, "
        f"no directory fsync); a chunk is fsynced only when it fills (chunksize={PQ_FILE_CHUNK}). A "
        "process crash loses nothing acknowledged; a power loss can lose the jobs since the last "
        "full chunk, or the info file's update that points at them",
    ),
    "huey": Durability(
        "yes",
        "yes",
        "n/a",
        "SqliteHuey(fsync=True): PRAGMA synchronous=FULL, journal_mode=WAL (huey's default), one "
        "BEGIN EXCLUSIVE ... COMMIT per enqueue; one connection behind huey's lock",
    ),
    "sqlite": Durability(
        "yes",
        "yes",
        "n/a",
        "sqlite3 journal_mode=WAL, synchronous=FULL, one INSERT committed per job (the WAL is "
        "fsynced at every commit); one connection behind a lock when threads share it",
    ),
}


# -- contestants --------------------------------------------------------------------------------

#: The Redis modes: name -> extra arguments of redis-server (RedisServer starts it with
#: ``--save '' --appendonly no``; later arguments win).
REDIS_MODES: dict[str, tuple[str, ...]] = {
    "none": (),
    "everysec": ("--appendonly", "yes", "--appendfsync", "everysec"),
    "always": ("--appendonly", "yes", "--appendfsync", "always"),
}


@dataclass
class Config:
    base: str
    n: int  # jobs per row per repetition
    slices: int  # round-robin turns per row and repetition
    servers: dict[str, RedisServer]
    lost: dict[str, list[int]] = field(default_factory=dict)  # row key -> jobs missing, per repetition

    def url(self, mode: str = "none") -> str:
        return self.servers[mode].url


@dataclass
class Peer(Contestant):
    """A contestant that can count the jobs its system holds, to check that none went missing."""

    count: Callable[[], int] | None = None
    key: str = ""  # its row
    issued: int = 0  # calls made (warm-up included)
    turns: int = 0


def peer(c: Contestant, count: Callable[[], int] | None) -> Peer:
    return Peer(c.op, c.close, c.threads, c.per_op, c.fsyncs, count)


def setup_hybridq(d: str, cfg: Config, threads: int) -> Peer:
    c = setup_hq(d, cfg, threads)  # the same contestant as scripts/bench-enqueue's
    return peer(c, lambda: JournalReader(os.path.join(d, "journal")).check())  # records in the journal


def setup_rq(_d: str, cfg: Config, threads: int, mode: str, name: str) -> Peer:
    pool = redis.ConnectionPool.from_url(cfg.url(mode), max_connections=threads + 4)
    conn = redis.Redis(connection_pool=pool)
    queues = [rq.Queue(name, connection=conn, serializer=JSONSerializer) for _ in range(threads)]

    def op(t: int) -> None:
        queues[t].enqueue(FUNC, 1, 2)

    return Peer(op, pool.disconnect, threads, count=lambda: queues[0].count)


def redis_llen(cfg: Config, key: str) -> Callable[[], int]:
    def count() -> int:
        with redis.Redis.from_url(cfg.url()) as client:
            return int(client.llen(key))

    return count


def setup_celery(_d: str, cfg: Config, threads: int, name: str) -> Peer:
    app = celery.Celery(f"bench-{name}", broker=cfg.url(), set_as_current=False)
    # No result backend (the default). One producer per thread, so none waits on the pool.
    app.conf.update(
        task_default_queue=name,
        broker_pool_limit=threads + 2,
        broker_connection_retry_on_startup=True,
    )
    task = app.task(name=FUNC, shared=False)(add)

    def op(_t: int) -> None:
        task.delay(1, 2)

    return Peer(op, app.close, threads, count=redis_llen(cfg, name))


def setup_dramatiq(_d: str, cfg: Config, threads: int, name: str) -> Peer:
    broker = RedisBroker(url=cfg.url())  # its default middleware, as an application gets it
    actor = dramatiq.actor(add, actor_name=FUNC, queue_name=name, broker=broker)

    def op(_t: int) -> None:
        actor.send(1, 2)

    def close() -> None:
        broker.close()
        broker.client.connection_pool.disconnect()

    return Peer(op, close, threads, count=redis_llen(cfg, f"{broker.namespace}:{name}"))


def sqlite_count(path: str, table: str) -> Callable[[], int]:
    def count() -> int:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])

    return count


def setup_pq_sqlite(d: str, _cfg: Config, threads: int) -> Peer:
    path = os.path.join(d, "pq")
    q = persistqueue.SQLiteQueue(path, multithreading=True, auto_commit=True)
    for conn in {q._putter, q._getter}:  # persist-queue has no option for it
        conn.execute("PRAGMA synchronous=FULL")

    def op(_t: int) -> None:
        q.put(job_record())

    return Peer(op, q.close, threads, count=sqlite_count(os.path.join(path, "data.db"), "queue_default"))


def setup_pq_file(d: str, _cfg: Config, threads: int) -> Peer:
    tmp = os.path.join(d, "tmp")  # its info-file temporaries: on the same disk, not in /tmp
    os.makedirs(tmp)
    q = persistqueue.Queue(os.path.join(d, "pq"), chunksize=PQ_FILE_CHUNK, tempdir=tmp)

    def op(_t: int) -> None:
        q.put(job_record())

    def close() -> None:
        q.headf.close()
        q.tailf.close()

    return Peer(op, close, threads, count=q.qsize)


def setup_huey(d: str, _cfg: Config, threads: int) -> Peer:
    h = huey.SqliteHuey("bench", filename=os.path.join(d, "huey.db"), fsync=True, results=False)
    task = h.task(name=FUNC)(add)

    def op(_t: int) -> None:
        task(1, 2)  # enqueues; returns None without a result store

    return Peer(op, h.storage.close, threads, count=h.pending_count)


def setup_sqlite(d: str, _cfg: Config, threads: int) -> Peer:
    path = os.path.join(d, "jobs.sqlite")
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
    lock = threading.Lock()  # one connection, one transaction at a time (as huey and persist-queue)
    sql = "INSERT INTO jobs (body) VALUES (?)"

    def op(_t: int) -> None:
        body = json.dumps(job_record())
        with lock:
            conn.execute("BEGIN")
            conn.execute(sql, (body,))
            conn.execute("COMMIT")

    return Peer(op, conn.close, threads, count=sqlite_count(path, "jobs"))


PeerSetup = Callable[[str, Config, int, str], Peer]


@dataclass(frozen=True)
class System:
    """One system in one mode: a row per thread count."""

    key: str  # also its DURABILITY key
    name: str
    mode: str
    setup: PeerSetup
    #: Why it is not measured with more than one thread (empty: it is thread-safe).
    single_thread_only: str = ""


SYSTEMS = [
    System(
        "hybridq",
        "hybridq Queue.enqueue",
        "journal, fsync before return",
        lambda d, c, t, _n: setup_hybridq(d, c, t),
    ),
    System(
        "rq-none",
        "rq Queue.enqueue",
        "Redis, no persistence",
        lambda d, c, t, n: setup_rq(d, c, t, "none", n),
    ),
    System(
        "rq-everysec",
        "rq Queue.enqueue",
        "Redis, AOF appendfsync everysec",
        lambda d, c, t, n: setup_rq(d, c, t, "everysec", n),
    ),
    System(
        "rq-always",
        "rq Queue.enqueue",
        "Redis, AOF appendfsync always",
        lambda d, c, t, n: setup_rq(d, c, t, "always", n),
    ),
    System("celery", "Celery .delay()", "Redis broker, no persistence", setup_celery),
    System("dramatiq", "Dramatiq .send()", "Redis broker, no persistence", setup_dramatiq),
    System(
        "pq-sqlite",
        "persist-queue SQLiteQueue",
        "WAL, synchronous=FULL, auto_commit",
        lambda d, c, t, _n: setup_pq_sqlite(d, c, t),
    ),
    System(
        "pq-file",
        "persist-queue Queue (file)",
        f"chunksize={PQ_FILE_CHUNK}, no fsync",
        lambda d, c, t, _n: setup_pq_file(d, c, t),
    ),
    System(
        "huey",
        "huey SqliteHuey task()",
        "fsync=True (WAL, sync=FULL)",
        lambda d, c, t, _n: setup_huey(d, c, t),
    ),
    System(
        "sqlite",
        "sqlite3 INSERT + COMMIT",
        "WAL, synchronous=FULL",
        lambda d, c, t, _n: setup_sqlite(d, c, t),
    ),
]
assert {s.key for s in SYSTEMS} == set(DURABILITY), "every system states its durability"
BASELINE = "rq-none"


def row_key(system: System, threads: int) -> str:
    return f"{system.key}-{threads}"


def row_label(system: System, threads: int) -> str:
    return f"{system.name} [{system.mode}], {threads} thread{'s' if threads > 1 else ''}"


# -- one group: every system at one thread count ------------------------------------------------


def run_group(cfg: Config, threads: int, rep: int) -> dict[str, Sample]:
    """Every thread-safe system enqueues ``cfg.n`` jobs with ``threads`` threads, round-robin."""

    def setup(system: System, key: str) -> Callable[[str, Config], Peer]:
        def made(d: str, c: Config) -> Peer:
            p = system.setup(d, c, threads, key)
            p.key = key
            return p

        return made

    members = [
        (row_key(s, threads), setup(s, row_key(s, threads)))
        for s in SYSTEMS
        if threads == 1 or not s.single_thread_only
    ]

    def warm(c: Peer) -> None:
        c.op(0)
        c.issued += 1

    def measure(c: Peer) -> Sample:
        ops = max(1, round(cfg.n / cfg.slices))
        part = counted_loop(c.op, ops) if c.threads == 1 else threaded_counted(c.op, ops, c.threads)
        c.issued += part.count
        c.turns += 1
        if c.turns == cfg.slices and c.count is not None:  # after its last slice, outside the timing
            cfg.lost.setdefault(c.key, []).append(c.issued - c.count())
        return part

    for server in cfg.servers.values():
        server.flushall()
    try:
        return benchlib.run_group(
            cfg.base,
            cfg,
            members,
            rep,
            turns=cfg.slices,
            warmup_ops=WARMUP_OPS,
            warm=warm,
            measure=measure,
            batch_latency=True,
        )
    finally:
        for server in cfg.servers.values():
            server.flushall()


# -- the report ---------------------------------------------------------------------------------


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def build_rows(
    results: dict[str, list[Sample]], cfg: Config, thread_counts: list[int]
) -> list[dict[str, object]]:
    """Every row as a plain dict: what the table prints and what --json writes."""
    rows: list[dict[str, object]] = []
    for threads in thread_counts:
        base_key = f"{BASELINE}-{threads}"
        for s in SYSTEMS:
            key = row_key(s, threads)
            d = DURABILITY[s.key]
            row: dict[str, object] = {
                "key": key,
                "system_key": s.key,
                "system": s.name,
                "mode": s.mode,
                "threads": threads,
                "durability": d.text,
                "survives": {"process_crash": d.crash, "power_loss": d.power, "redis_restart": d.redis},
            }
            if threads > 1 and s.single_thread_only:
                row["skipped"] = f"not thread-safe: {s.single_thread_only}"
                rows.append(row)
                continue
            samples = results[key]
            rates = [x.rate for x in samples]
            ratios = per_rep(results, key, base_key)
            p50s = [latency_us(x, 50) for x in samples]
            p99s = [latency_us(x, 99) for x in samples]
            row |= {
                "jobs_per_s": statistics.median(rates),
                "jobs_per_s_min": min(rates),
                "jobs_per_s_max": max(rates),
                "jobs_per_s_per_rep": rates,
                "p50_us": median_or_none(p50s),
                "p50_us_min": min(p50s),
                "p50_us_max": max(p50s),
                "p99_us": median_or_none(p99s),
                "p99_us_min": min(p99s),
                "p99_us_max": max(p99s),
                "ratio_vs_rq_no_persistence": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "jobs_missing": sum(cfg.lost[key]) if key in cfg.lost else None,
                "latency_cdf_us": benchlib.latency_cdf(samples),  # [quantile %, us], repetitions pooled
            }
            if "per_fsync" in samples[0].extra:
                row["jobs_per_fsync"] = statistics.median(x.extra["per_fsync"] for x in samples)
            rows.append(row)
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    head = (
        "system [mode]",
        "thr",
        "jobs/s",
        "spread (min..max)",
        "p50 us",
        "p99 us",
        "vs rq (no pers.)",
        "check",
        "survives crash / power loss / Redis restart",
    )
    table = [head]
    for r in rows:
        label = f"{r['system']} [{r['mode']}]"
        survives = DURABILITY[str(r["system_key"])].short
        if "skipped" in r:
            table.append((label, str(r["threads"]), "skipped", str(r["skipped"]), "", "", "", "", survives))
            continue
        missing = r["jobs_missing"]
        check = "-" if missing is None else ("all there" if missing == 0 else f"{missing} MISSING")
        if "jobs_per_fsync" in r:
            check += f", {r['jobs_per_fsync']:.1f} jobs/fsync"
        table.append(
            (
                label,
                str(r["threads"]),
                f"{r['jobs_per_s']:,.0f}",
                f"{r['jobs_per_s_min']:,.0f}..{r['jobs_per_s_max']:,.0f}",
                f"{r['p50_us']:,.0f}",
                f"{r['p99_us']:,.0f}",
                f"{r['ratio_vs_rq_no_persistence']:.2f}x ({r['ratio_min']:.2f}..{r['ratio_max']:.2f})",
                check,
                survives,
            )
        )
    benchlib.print_rows(table, {1, 2, 3, 4, 5, 6})
    print("durability (what an acknowledged enqueue survives; n/a: no Redis involved):")
    for s in SYSTEMS:
        print(f"  {s.key:<12} {DURABILITY[s.key].how}")
    print()


def versions() -> str:
    dists = ("hybridq", "rq", "redis", "celery", "kombu", "dramatiq", "persist-queue", "huey")
    return ", ".join(f"{d} {version(d)}" for d in dists) + f", sqlite {sqlite3.sqlite_version}"


def redis_line(cfg: Config) -> str:
    server = cfg.servers["none"]
    with server.client() as client:
        v = client.info("server").get("redis_version", "?")
    return f"redis-server {v} ({server.executable}); private instances: " + ", ".join(
        f"{mode} {cfg.url(mode)}" for mode in REDIS_MODES
    )


def write_json(path: str, rows: list[dict[str, object]], run: dict[str, object]) -> None:
    doc = {
        "benchmark": "bench-peers",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {
            "nproc": os.cpu_count(),
            "cpu": benchlib.cpu_model(),
            "loadavg_at_start": run.pop("loadavg"),
            "kernel": f"{platform.system()} {platform.release()} ({platform.machine()})",
            "python": platform.python_version(),
            "filesystem": run.pop("filesystem"),
        },
        "versions": versions(),
        "commit": benchlib.git_revision(),
        "run": run,
        "baseline": f"{BASELINE}: rq.Queue.enqueue on the Redis without persistence, same thread count",
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


# -- main ---------------------------------------------------------------------------------------


def thread_list(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of thread counts: {text}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be >= 1: {text}")
    return sorted(set(counts))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = benchlib.arg_parser("scripts/bench-peers", __doc__)
    p.add_argument(
        "--n", type=int, default=None, help="jobs per row per repetition (default 2,000; 300 with --quick)"
    )
    p.add_argument(
        "--threads", type=thread_list, default=[1, 16], help="thread counts, comma-separated (default 1,16)"
    )
    p.add_argument(
        "--dir", default=None, help="parent of the run's temporary directory (default: a new tempdir)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write every row to PATH as JSON")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # keep order with stderr
    repeat = benchlib.pick(args.repeat, args.quick, 2, 5)
    n = benchlib.pick(args.n, args.quick, 300, 2000)
    if repeat < 1 or n < 1:
        sys.exit("bench-peers: --repeat and --n must be >= 1")
    slices = 3 if args.quick else 5
    loadavg = os.getloadavg()[0]
    started = time.monotonic()
    base = benchlib.make_base("bench-peers", args.dir)
    mnt, dev, fstype = benchlib.mount_of(base)
    try:
        with contextlib.ExitStack() as stack:
            servers = {
                mode: stack.enter_context(
                    RedisServer(directory=os.path.join(base, f"redis-{mode}"), extra_args=extra)
                )
                for mode, extra in REDIS_MODES.items()
            }
            cfg = Config(base, n, slices, servers)
            benchlib.print_machine(
                "hybridq peers benchmark (enqueue)",
                base,
                versions(),
                extra=[("redis", redis_line(cfg))],
                dir_label="dir",
            )
            run_line = (
                f"mode={'quick' if args.quick else 'default'}, {repeat} repetitions, threads "
                f"{','.join(map(str, args.threads))}; per repetition each row enqueues {n:,} jobs of "
                f"{FUNC}(1, 2) in {slices} round-robin turns; rq uses the JSON serializer"
            )
            benchlib.print_field("run", run_line)
            print()
            labels = {row_key(s, t): row_label(s, t) for t in args.threads for s in SYSTEMS}
            results = benchlib.run_repetitions(
                repeat,
                [lambda rep, t=t: run_group(cfg, t, rep) for t in args.threads],
                labels,
                max(map(len, labels.values())),
                lambda _key, sample: f"{sample.rate:>10,.0f} jobs/s",
            )
            rows = build_rows(results, cfg, args.threads)
            print_table(rows)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    elapsed = time.monotonic() - started
    print(f"took {elapsed:.0f} s")
    if args.json:
        run = {
            "mode": "quick" if args.quick else "default",
            "repeat": repeat,
            "n": n,
            "slices": slices,
            "threads": args.threads,
            "dir": base,
            "seconds": round(elapsed, 1),
            "loadavg": loadavg,
            "filesystem": f"{fstype} on {dev}, mounted at {mnt}",
            "description": run_line,
        }
        write_json(args.json, rows, run)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
