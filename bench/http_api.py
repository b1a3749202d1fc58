"""HTTP API benchmark: ``POST /v1/jobs`` (durable) next to a no-op endpoint of the same server.

Run it through ``scripts/bench-http`` (see ``docs/benchmarks.md``, "HTTP API"). A child process
serves ``hybridq serve``'s application (``create_app``, uvicorn, ``Server`` as the command runs
it, the access log off) with one more route, ``POST /bench/noop``: it reads and parses the same
JSON body and answers 202 with a made-up id, without touching the journal. The parent runs
``--clients`` keep-alive HTTP/1.1 connections on one event loop (a minimal client on asyncio
streams), each POSTing one request after the other for ``--seconds``:

  * ``noop``:     ``POST /bench/noop``: what the stack costs (uvicorn, h11, Starlette, JSON)
  * ``durable``:  ``POST /v1/jobs``: validated, appended to the journal and fsync'd (concurrent
                  POSTs share the fsync) before the 202

The two modes take turns within each repetition, their order swapped each repetition, so load
from other tenants of the machine hits them alike. Reported: per mode, the median jobs/s and its
range, p50 and p99 latency (pooled); the ratio durable / noop per repetition (median, range:
target >= 0.5x); jobs per fsync; and a check that every 202 is a record in the journal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import benchlib
from hybridq.http.app import create_app
from hybridq.http.config import ServeConfig
from hybridq.http.server import Server
from hybridq.journal import JournalReader, RecordType
from hybridq.producer.queue import shared_writer
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

MODES = ("noop", "durable")
PATHS = {"noop": "/bench/noop", "durable": "/v1/jobs"}
TARGET = 0.5


def child(journal: str) -> None:
    """The server: hybridq serve's app plus the no-op route, printing its address, until SIGTERM."""
    config = ServeConfig(journal=Path(journal), port=0, allow=("bench",), access_log=False)
    app = create_app(config)

    async def noop(request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        if not isinstance(body, dict) or not isinstance(body.get("task"), str):
            return JSONResponse({"error": "bad_request"}, status_code=400)
        return JSONResponse({"id": "0" * 32}, status_code=202, headers={"Location": "/v1/jobs/" + "0" * 32})

    async def fsyncs(request: Request) -> JSONResponse:
        del request
        return JSONResponse({"fsyncs": shared_writer(journal).fsync_count})

    app.router.routes.append(Route("/bench/noop", noop, methods=["POST"]))
    app.router.routes.append(Route("/bench/fsyncs", fsyncs, methods=["GET"]))
    server = Server(app, config)
    print(server.url, flush=True)
    server.run()


async def one_client(
    host: str, port: int, path: str, deadline: float, latencies: list[int], n: int
) -> tuple[int, int]:
    """POST on one keep-alive connection until ``deadline``; (answers 202, other answers)."""
    reader, writer = await asyncio.open_connection(host, port)
    ok = bad = 0
    i = 0
    try:
        while time.perf_counter() < deadline:
            body = json.dumps({"task": "bench.tasks.noop", "args": [n, i]}).encode()
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            started = time.perf_counter_ns()
            writer.write(head + body)
            status = int((await reader.readline()).split()[1])
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            latencies.append(time.perf_counter_ns() - started)
            if status == 202:
                ok += 1
            else:
                bad += 1
            i += 1
    finally:
        writer.close()
    return ok, bad


async def run_mode(url: str, mode: str, clients: int, seconds: float) -> tuple[float, list[int], int, int]:
    host, port = url.removeprefix("http://").split(":")
    latencies: list[int] = []
    started = time.perf_counter()
    deadline = started + seconds
    outcomes = await asyncio.gather(
        *(one_client(host, int(port), PATHS[mode], deadline, latencies, n) for n in range(clients))
    )
    elapsed = time.perf_counter() - started
    ok = sum(o for o, _ in outcomes)
    bad = sum(b for _, b in outcomes)
    return ok / elapsed, latencies, ok, bad


def fsync_count(url: str) -> int:
    with urllib.request.urlopen(url + "/bench/fsyncs", timeout=30) as resp:  # our own child
        return int(json.loads(resp.read())["fsyncs"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--clients", type=int, default=None, help="concurrent connections (default 32; --quick 8)"
    )
    parser.add_argument(
        "--seconds", type=float, default=None, help="per mode and repetition (default 4; --quick 1)"
    )
    parser.add_argument("--repeat", type=int, default=None, help="repetitions (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--dir", help="where the journal goes (default: a temporary directory)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    clients = args.clients or (8 if args.quick else 32)
    seconds = args.seconds or (1.0 if args.quick else 4.0)
    repeat = args.repeat or (1 if args.quick else 3)
    base = tempfile.mkdtemp(prefix="bench-http-", dir=args.dir)
    journal = os.path.join(base, "journal")
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", journal], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    results: dict[str, dict[str, list[float]]] = {m: {"rate": []} for m in MODES}
    latencies: dict[str, list[int]] = {m: [] for m in MODES}
    accepted = refused = 0
    per_fsync: list[float] = []
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().decode().strip()
        asyncio.run(run_mode(url, "noop", clients, 0.3))  # warm up: imports, first segment
        asyncio.run(run_mode(url, "durable", clients, 0.3))
        warm = sum(1 for _ in _records(journal))
        for rep in range(repeat):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                before = fsync_count(url) if mode == "durable" else 0
                rate, lat, ok, bad = asyncio.run(run_mode(url, mode, clients, seconds))
                results[mode]["rate"].append(rate)
                latencies[mode].extend(lat)
                if bad:
                    print(f"# {mode}: {bad} answers were not 202", file=sys.stderr)
                if mode == "durable":
                    accepted += ok
                    refused += bad
                    per_fsync.append(ok / max(1, fsync_count(url) - before))
    finally:
        proc.terminate()
        proc.wait(30)
    in_journal = sum(1 for _ in _records(journal)) - warm
    shutil.rmtree(base, ignore_errors=True)
    ratios = [d / n for d, n in zip(results["durable"]["rate"], results["noop"]["rate"], strict=True)]
    print(
        f"# bench-http: {clients} keep-alive clients, {seconds:g} s per mode, {repeat} repetitions, "
        f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, journal on {args.dir or tempfile.gettempdir()}"
    )
    print(f"{'mode':<10}{'req/s (median)':>16}{'range':>18}{'p50 ms':>9}{'p99 ms':>9}")
    figures: dict[str, dict[str, float]] = {}
    for mode in MODES:
        rates = results[mode]["rate"]
        p50, p99 = (benchlib.quantile(latencies[mode], q) / 1e6 for q in (50, 99))  # ns -> ms
        figures[mode] = {"rate": statistics.median(rates), "p50_ms": p50, "p99_ms": p99}
        print(
            f"{mode:<10}{statistics.median(rates):>16.0f}{f'{min(rates):.0f}..{max(rates):.0f}':>18}"
            f"{p50:>9.2f}{p99:>9.2f}"
        )
    ratio = statistics.median(ratios)
    print(
        f"durable / noop req/s: median {ratio:.2f}x (range {min(ratios):.2f}..{max(ratios):.2f}), "
        f"target >= {TARGET}x: {'PASS' if ratio >= TARGET else 'MISS'}"
    )
    print(f"jobs per fsync (median): {statistics.median(per_fsync):.1f}")
    print(
        f"202 answers: {accepted}, records in the journal: {in_journal}, lost: {max(0, accepted - in_journal)}"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "clients": clients,
                    "seconds": seconds,
                    "repeat": repeat,
                    "results": results,
                    "figures": figures,
                    "ratios": ratios,
                    "ratio_median": ratio,
                    "target": TARGET,
                    "per_fsync": per_fsync,
                    "accepted": accepted,
                    "in_journal": in_journal,
                },
                fh,
                indent=1,
            )


def _records(journal: str):
    if not os.path.isdir(journal):
        return
    for record in JournalReader(journal).records():
        if record.rtype == RecordType.DATA:
            yield record


if __name__ == "__main__":
    main()
