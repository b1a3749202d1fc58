"""What losing an ingest node costs: SIGKILL ``hybridq forward --serve`` under load, then restart it.

Real processes: a private redis-server, one ingest node (``hybridq forward --serve`` with a tokens
file: the HTTP API and the forwarder in one process, its journal on local disk), a
``hybridq worker`` pool, and ``--threads`` clients POSTing ``/v1/jobs`` back to back (each job
appends its own token to an effects file). After ``--load`` seconds the node is SIGKILLed while
the clients keep posting; it stays down ``--down`` seconds (a pod being rescheduled onto its
volume) and is started again on the same journal.

Printed: jobs acknowledged (202) before the kill; of those, how many the journal held but the
forwarder had not pushed yet at the kill (``status --json``'s ``not_yet_forwarded``, read while
no forwarder runs); how many had run by then and during the outage (pushed jobs run without
the node); and how long after the restart until every acknowledged job had run; then missing
and duplicate runs (both must be 0). ``--stall S`` hangs Redis (SIGSTOP) for the last S seconds
before the kill: a forwarder that is behind, whose whole backlog the kill strands.

    python bench/ingest_node_loss.py --threads 8 --load 5 --down 5
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from hybridq.testing.embedded import RedisServer

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-ingest-token-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_node(journal: Path, redis_url: str, port: int, tokens: Path, env: dict[str, str], log: Path):
    args = [
        sys.executable, "-m", "hybridq", "forward", "--journal", str(journal), "--redis", redis_url,
        "--serve", f"127.0.0.1:{port}", "--tokens-file", str(tokens), "--serve-allow", "tests",
    ]  # fmt: skip
    with open(log, "ab") as out:
        return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=out)


def wait_http(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                conn.close()
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"the node on port {port} did not answer /healthz")


def client(port: int, effects: Path, prefix: str, acked: list[str], stop: threading.Event) -> None:
    """POST jobs until ``stop``; each 202's token goes to ``acked`` (a refused connection ends it)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    i = 0
    while not stop.is_set():
        token = f"{prefix}-{i}"
        body = json.dumps({"task": "tests.tasks.record", "args": [str(effects), token], "queue": "ingest"})
        try:
            conn.request(
                "POST",
                "/v1/jobs",
                body,
                {
                    "Authorization": f"Bearer {TOKEN}",
                    "Content-Type": "application/json",
                    "Idempotency-Key": token,
                },
            )
            resp = conn.getresponse()
            resp.read()
        except (OSError, http.client.HTTPException):
            return  # the node is gone: a real client would retry on another node
        if resp.status == 202:
            acked.append(token)
        i += 1


def ran(effects: Path) -> collections.Counter[str]:
    try:
        return collections.Counter(effects.read_text().split())
    except FileNotFoundError:
        return collections.Counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--load", type=float, default=5.0, help="seconds of load before the SIGKILL")
    parser.add_argument("--down", type=float, default=5.0, help="seconds the node stays down")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--stall",
        type=float,
        default=0.0,
        help="seconds before the kill Redis hangs (SIGSTOP): a forwarder behind",
    )
    opts = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="hq-ingest-loss-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYBRIDQ_ALLOW": "tests"}
    tokens = base / "tokens"
    tokens.write_text(TOKEN + "\n")
    tokens.chmod(0o600)
    journal, effects = base / "journal", base / "effects"
    redis = RedisServer(directory=base / "redis")
    redis.start()
    port = free_port()
    worker = subprocess.Popen(
        [sys.executable, "-m", "hybridq", "worker", "--redis", redis.url, "--processes", str(opts.workers), "ingest"],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(base / "worker.log", "ab"),  # noqa: SIM115
    )  # fmt: skip
    node = start_node(journal, redis.url, port, tokens, env, base / "node.log")
    try:
        wait_http(port)
        stop = threading.Event()
        acked: list[str] = []
        threads = [
            threading.Thread(target=client, args=(port, effects, f"t{n}", acked, stop))
            for n in range(opts.threads)
        ]
        for t in threads:
            t.start()
        time.sleep(max(0.0, opts.load - opts.stall))
        if opts.stall:
            redis.pause()  # the forwarder cannot push: its backlog grows on disk, POSTs still 202
            time.sleep(opts.stall)
        node.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        node.wait()
        if opts.stall:
            redis.resume()
        stop.set()
        for t in threads:
            t.join()
        status = subprocess.run(
            [sys.executable, "-m", "hybridq", "status", "--json", "--journal", str(journal)],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        out = json.loads(status.stdout)
        at_kill = ran(effects)
        time.sleep(opts.down)
        during = ran(effects)
        restarted = time.monotonic()
        node = start_node(journal, redis.url, port, tokens, env, base / "node.log")
        want = set(acked)
        while not want <= set(ran(effects)):
            if time.monotonic() - restarted > 120:
                break
            time.sleep(0.02)
        drained = time.monotonic() - restarted
        runs = ran(effects)
        report = {
            "threads": opts.threads,
            "load_s": opts.load,
            "down_s": opts.down,
            "redis_stalled_s": opts.stall,
            "acknowledged": len(acked),
            "acknowledged_per_s": round(len(acked) / opts.load),
            "journal_accepted": out["accepted"],
            "unforwarded_at_kill": out["not_yet_forwarded"],
            "ran_by_kill": sum(1 for t in acked if at_kill[t]),
            "ran_during_outage": sum(1 for t in acked if during[t] and not at_kill[t]),
            "left_for_restart": sum(1 for t in acked if not during[t]),
            "s_from_restart_to_all_run": round(drained, 2),
            "s_from_kill_to_all_run": round(time.monotonic() - killed_at, 2),
            "missing": sum(1 for t in acked if not runs[t]),
            "duplicates": sum(1 for t in acked if runs[t] > 1),
        }
        print(json.dumps(report))
    finally:
        for proc in (node, worker):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        redis.stop()


if __name__ == "__main__":
    main()
