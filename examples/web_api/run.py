"""Run the web API with everything it needs: ``python run.py [--port 8000] [--demo N]``.

The harness, not the application (that is app.py and textjobs.py): it starts a private
redis-server (from PATH or hybridq's ``embedded`` extra), ``hybridq forward``, ``hybridq worker``
for the queue ``web`` and the app under uvicorn, then serves until Ctrl-C. With ``--demo N`` it
POSTs N jobs at once instead, polls ``GET /jobs/{id}`` until every one has finished, prints a
tally and exits (1 unless all finished).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from hybridq.testing.embedded import RedisServer

HERE = Path(__file__).resolve().parent


def call(
    base: str, method: str, path: str, body: dict[str, Any] | None = None
) -> tuple[int, dict[str, str], Any]:
    """One HTTP request: the status, the headers and the JSON body."""
    data = None if body is None else json.dumps(body).encode()
    # Always http://127.0.0.1:PORT/... (built by main()), so no file: or other scheme can come in.
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers)  # noqa: S310
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, dict(err.headers), json.loads(err.read())


def demo(base: str, n: int, timeout: float = 60.0) -> dict[str, int]:
    """POST ``n`` jobs at once, then GET each until it is finished or failed; the tally."""
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        posted = list(
            pool.map(lambda i: call(base, "POST", "/jobs", {"text": f"job {i} " * (i % 7 + 1)}), range(n))
        )
    locations = [headers["location"] for code, headers, _ in posted if code == 202]
    statuses: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for location in locations:
            if statuses.get(location) not in ("finished", "failed"):
                statuses[location] = call(base, "GET", location)[2]["status"]
        if all(statuses[loc] in ("finished", "failed") for loc in locations):
            break
        time.sleep(0.2)
    done = list(statuses.values())
    return {
        "posted": n,
        "accepted": len(locations),
        "finished": done.count("finished"),
        "failed": done.count("failed"),
    }


def main() -> int:
    """Start everything, then serve until Ctrl-C (or run the demo); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1 (0: any free one)")
    parser.add_argument(
        "--demo", type=int, metavar="N", help="POST N jobs, wait for them, print a tally, exit"
    )
    parser.add_argument("--dir", help="keep the journal and logs here (default: a new temporary directory)")
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="hybridq-web-api-"))
    work.mkdir(parents=True, exist_ok=True)
    journal = work / "journal"
    env = {
        **os.environ,
        "HYBRIDQ_JOURNAL": str(journal),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    }
    # The app's socket is bound here and handed to uvicorn (--fd): the port is known before it starts.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.set_inheritable(True)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    procs: list[subprocess.Popen[bytes]] = []
    with RedisServer(directory=work / "redis") as redis, open(work / "processes.log", "ab") as log:
        hq = [sys.executable, "-m", "hybridq"]
        commands = [
            [*hq, "forward", "--journal", str(journal), "--redis", redis.url],
            [*hq, "worker", "--redis", redis.url, "--allow", "textjobs", "--processes", "1", "web"],
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--fd",
                str(sock.fileno()),
                "--log-level",
                "warning",
                "app:app",
            ],
        ]
        try:
            for command in commands:
                # One at a time (not a generator): the finally below stops the ones that started.
                proc = subprocess.Popen(
                    command,
                    env=env,
                    cwd=HERE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(sock.fileno(),),
                )
                procs.append(proc)
            sock.close()  # uvicorn has its own copy
            _wait_until_serving(base, procs)
            if args.demo is None:
                print(f"serving on {base}  (journal {journal}, logs {work / 'processes.log'}); Ctrl-C stops")
                print(f'  curl -si -X POST {base}/jobs -d \'{{"text": "hello world"}}\'')
                procs[-1].wait()
                return 0
            started = time.monotonic()
            tally = demo(base, args.demo)
            print(
                " ".join(f"{k}={v}" for k, v in tally.items()) + f" seconds={time.monotonic() - started:.1f}"
            )
            return 0 if tally["finished"] == args.demo else 1
        except KeyboardInterrupt:
            return 0
        finally:
            for proc in reversed(procs):
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _wait_until_serving(base: str, procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(f"{proc.args} exited with {proc.returncode}: see processes.log")
        try:
            call(base, "GET", "/jobs/none")
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"the app did not answer on {base} within {timeout:g} s") from None
            time.sleep(0.1)
        else:
            return


if __name__ == "__main__":
    sys.exit(main())
