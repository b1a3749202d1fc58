"""Remote enqueue benchmark: ``hybridq.Queue(url=...)`` through one and two ingest nodes, side by side.

Run it through ``scripts/bench-remote`` (see ``docs/benchmarks.md``). Two ``hybridq serve``
processes (tokens, each its own journal on the same disk) and a private redis-server (no
persistence) are started for the run; every row runs in this one client process:

  * a remote ``Queue.enqueue`` through one node (``url=A``) and through two (``url=A,B``: each
    call goes to the nodes in turn), each answered after the node's fsync (a durable 202);
  * a local ``Queue.enqueue`` (this process's own journal, fsync'd);
  * ``rq.Queue.enqueue`` to the redis-server over loopback TCP (no persistence, no fsync).

1 thread and 16 threads (one ``Queue`` shared by the threads: its pool keeps 16 connections per
node). Members take turns in slices of jobs, the order rotated each repetition (``bench/enqueue.py``'s
groups), so a burst of load from another tenant hits them alike. Reported: medians over
repetitions, the spread, and same-run ratios. The nodes, the client and Redis share the machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import benchlib
import enqueue
from benchlib import Contestant, Sample
from enqueue import FUNC, THREADS, Config, setup_hq, setup_rq
from hybridq import Queue
from hybridq.testing.embedded import RedisServer

TOKEN = "bench-remote-token-0123456789abcdef"


@dataclass
class RemoteConfig(Config):
    nodes: list[str] = field(default_factory=list)


class Ingest:
    """``hybridq serve --journal J --bind 127.0.0.1:0 --tokens-file T --allow tests``."""

    def __init__(self, journal: str, tokens: str, log: str) -> None:
        args = [sys.executable, "-m", "hybridq", "serve", "--journal", journal, "--bind", "127.0.0.1:0",
                "--tokens-file", tokens, "--allow", "tests"]  # fmt: skip
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("listening on "):
            self.stop()
            sys.exit(f"bench-remote: hybridq serve did not start: {line!r} (see {log})")
        self.url = line.split()[-1]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def setup_remote(nodes: int, threads: int = 1) -> enqueue.Setup:
    def setup(_d: str, cfg: Config) -> Contestant:
        assert isinstance(cfg, RemoteConfig)
        q = Queue("default", url=cfg.nodes[:nodes], token=TOKEN)
        do = q.enqueue

        def op(_t: int) -> None:
            do(FUNC, 1, 2)

        return Contestant(op, lambda: None, threads)

    return setup


ROWS = [
    ("local1", "hybridq Queue.enqueue, local journal, 1 thread"),
    ("one1", "hybridq Queue(url=A).enqueue, 1 thread"),
    ("two1", "hybridq Queue(url=A,B).enqueue, 1 thread"),
    ("rq1", "rq Queue.enqueue over TCP, 1 thread"),
    ("local16", "hybridq Queue.enqueue, local journal, 16 threads"),
    ("one16", "hybridq Queue(url=A).enqueue, 16 threads"),
    ("two16", "hybridq Queue(url=A,B).enqueue, 16 threads"),
    ("rq16", "rq Queue.enqueue over TCP, 16 threads"),
]
LABELS = dict(ROWS)
GROUPS: list[list[tuple[str, enqueue.Setup]]] = [
    [("local1", setup_hq), ("one1", setup_remote(1)), ("two1", setup_remote(2)), ("rq1", setup_rq)],
    [
        ("local16", lambda d, c: setup_hq(d, c, THREADS)),
        ("one16", setup_remote(1, THREADS)),
        ("two16", setup_remote(2, THREADS)),
        ("rq16", lambda d, c: setup_rq(d, c, THREADS)),
    ],
]


def print_table(results: dict[str, list[Sample]]) -> None:
    rows = [("measurement", "jobs/s (median)", "spread (min..max)", "p50 us", "p99 us")]
    for key, label in ROWS:
        samples = results[key]
        med, rng = benchlib.spread([s.rate for s in samples], ",.0f")
        p50s = benchlib.med_range([benchlib.latency_us(s, 50) for s in samples], ",.0f")
        p99s = benchlib.med_range([benchlib.latency_us(s, 99) for s in samples], ",.0f")
        rows.append((label, med, rng, p50s, p99s))
    benchlib.print_rows(rows, {1, 2, 3, 4})


def print_ratios(results: dict[str, list[Sample]]) -> list[benchlib.Figure]:
    per_rep = benchlib.per_rep
    ratios = []
    for n in ("1", "16"):
        ratios += [
            (f"remote 1 node / local journal, {n} thread(s)", per_rep(results, f"one{n}", f"local{n}")),
            (f"remote 2 nodes / remote 1 node, {n} thread(s)", per_rep(results, f"two{n}", f"one{n}")),
            (f"remote 1 node / rq over TCP, {n} thread(s)", per_rep(results, f"one{n}", f"rq{n}")),
            (f"remote 2 nodes / rq over TCP, {n} thread(s)", per_rep(results, f"two{n}", f"rq{n}")),
        ]
    print()
    return benchlib.print_context(ratios, 48)


def main(argv: list[str]) -> int:
    p = benchlib.arg_parser("scripts/bench-remote", __doc__)
    p.add_argument(
        "--n", type=int, default=None, help="jobs per row per repetition (default 3,000; 400 with --quick)"
    )
    p.add_argument("--dir", default=None, help="parent of the journals (default: a new tempdir)")
    benchlib.add_json_option(p)
    args = p.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    repeat = benchlib.pick(args.repeat, args.quick, 2, 3)
    n = benchlib.pick(args.n, args.quick, 400, 3000)
    base = benchlib.make_base("bench-remote", args.dir)
    tokens = os.path.join(base, "tokens")
    with open(os.open(tokens, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(TOKEN + "\n")
    nodes = [
        Ingest(os.path.join(base, f"node-{x}"), tokens, os.path.join(base, f"node-{x}.log")) for x in "ab"
    ]
    try:
        with RedisServer(directory=os.path.join(base, "redis")) as server:
            cfg = RemoteConfig(
                base, repeat, n, 4 if args.quick else 6, server.url, server, [x.url for x in nodes]
            )
            header = benchlib.print_redis_machine("hybridq remote enqueue benchmark", base, server)
            header["run"] = (
                f"mode={'quick' if args.quick else 'default'}, {repeat} repetitions; per repetition each "
                f"row enqueues {n:,} jobs of {FUNC}(...) in {cfg.slices} round-robin turns; two "
                "`hybridq serve` nodes with tokens on loopback, their journals on the same disk"
            )
            benchlib.print_field("run", header["run"])
            print()
            results = benchlib.run_repetitions(
                repeat,
                [lambda rep, group=group: enqueue.run_group(cfg, group, rep) for group in GROUPS],
                LABELS,
                48,
                lambda _key, sample: f"{sample.rate:>10,.0f} jobs/s",
            )
            print_table(results)
            figures = print_ratios(results)
            if args.json:
                benchlib.write_json(
                    args.json, "bench-remote", header, benchlib.json_rows(results, LABELS, "jobs/s"), figures
                )
    finally:
        for node in nodes:
            node.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
