"""Run the example shop: a private Redis, the forwarder, a worker and Django's runserver.

    python examples/django_shop/run.py              # serve on http://127.0.0.1:8000 until Ctrl-C
    python examples/django_shop/run.py --demo 9     # place 9 orders over HTTP, wait for every receipt

It migrates the SQLite database, creates hybridq's outbox table (``manage.py
hybridq_outbox_init``) and starts ``manage.py hybridq_forward`` (the forwarder and the outbox
relay), ``manage.py hybridq_worker`` and ``manage.py runserver``. With ``--demo N``, every third
order asks for more than the stock: its transaction rolls back, order and receipt job together.
"""

from __future__ import annotations

import argparse
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


def call(base: str, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        text = error.read()
        return error.code, json.loads(
            text
        ) if error.headers.get_content_type() == "application/json" else None


def demo(base: str, n: int, timeout: float = 60.0) -> dict[str, Any]:
    start = time.monotonic()
    placed: list[int] = []
    rolled_back = 0
    for i in range(n):
        quantity = 99 if i % 3 == 2 else 1
        status, body = call(
            base, "POST", "/orders", {"email": f"c{i}@example.com", "item": "book", "quantity": quantity}
        )
        if status == 201:
            placed.append(body["order"])
        elif status == 409:
            rolled_back += 1
    sent = 0
    deadline = time.monotonic() + timeout
    for order in placed:
        while time.monotonic() < deadline:
            _, body = call(base, "GET", f"/orders/{order}")
            if body["receipt"]["status"] == "SUCCESSFUL" and body["receipt_sent"]:
                sent += 1
                break
            time.sleep(0.05)
    return {
        "orders": n,
        "placed": len(placed),
        "rolled_back": rolled_back,
        "receipts_sent": sent,
        "seconds": round(time.monotonic() - start, 1),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_serving(base: str, procs: list[subprocess.Popen[bytes]], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(f"{proc.args[2]} exited with {proc.returncode}: see processes.log")
        try:
            call(base, "GET", "/orders/0")
        except OSError:
            time.sleep(0.1)
        else:
            return
    raise SystemExit(f"runserver did not answer on {base} within {timeout:g} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=int, metavar="N", help="place N orders, wait for their receipts, exit")
    parser.add_argument("--port", type=int, default=8000, help="runserver's port (0: a free one)")
    parser.add_argument("--dir", type=Path, help="where the database, the journal and processes.log go")
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="hybridq-django-shop-"))
    work.mkdir(parents=True, exist_ok=True)
    port = args.port or free_port()
    with RedisServer(directory=work / "redis") as redis, open(work / "processes.log", "ab") as log:
        env = {**os.environ, "SHOP_DIR": str(work), "HYBRIDQ_REDIS_URL": redis.url}
        env.pop("HYBRIDQ_ALLOW", None)  # the worker's allowlist is the settings' OPTIONS["allow"]

        def manage(*command: str) -> list[str]:
            return [sys.executable, str(HERE / "manage.py"), *command]

        for command in (("migrate", "--verbosity", "0"), ("hybridq_outbox_init",)):
            subprocess.run(manage(*command), env=env, check=True, stdout=log, stderr=log)
        procs = [
            subprocess.Popen(manage(*command), env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
            for command in (
                ("hybridq_forward",),
                ("hybridq_worker", "--processes", "1"),
                ("runserver", "--noreload", f"127.0.0.1:{port}"),
            )
        ]
        base = f"http://127.0.0.1:{port}"
        try:
            wait_serving(base, procs)
            if args.demo is None:
                print(f"serving on {base} (files in {work}); Ctrl-C stops")
                print(f'  curl -s -X POST {base}/orders -d \'{{"email": "a@example.com", "item": "book"}}\'')
                print(f"  curl -s {base}/orders/1")
                procs[-1].wait()
                return 0
            tally = demo(base, args.demo)
            print(" ".join(f"{key}={value}" for key, value in tally.items()))
            expected_rolled_back = args.demo // 3
            ok = tally["rolled_back"] == expected_rolled_back and tally["receipts_sent"] == tally["placed"]
            return 0 if ok else 1
        except KeyboardInterrupt:
            return 0
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


if __name__ == "__main__":
    sys.exit(main())
