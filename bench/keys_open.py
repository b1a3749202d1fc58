"""The key table's open at 1,000,000 keys: what the forwarder's thread spends on it (issue 29).

Builds ``--keys`` random owners in a table file (once; ``--path`` keeps it between runs), then
opens it ``--runs`` times each way, alternately, its pages read into the OS cache first:

  * ``checked``: ``KeyTable(path)``, ``PRAGMA quick_check`` at open (main's forwarder);
  * ``deferred``: ``KeyTable(path, deferred=True)``, the check on its own thread (the
    forwarder's table now: docs/reliability.md, "The key table").

For each: the open's wall and CPU time on the opening thread (``time.thread_time``: what the
first push waits for), and when the first read (an owner looked up) returned -- deferred, it
waits for the check's verdict. Runs against whatever ``hybridq`` is importable (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

from hybridq.ledger.entries import Entry
from hybridq.ledger.keytable import KeyTable


def build(path: str, keys: int) -> None:
    """``keys`` owners with random keys (random B-tree pages, as real keys), marked and closed."""
    table = KeyTable(path)
    with table.bulk():
        for i in range(keys):
            table.own(Entry("key", uuid.uuid4().hex, ("w", 0, 32 + i), key=f"k{uuid.uuid4().hex}", at=1.0))
    table.mark()
    table.close()


def warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--path", default="/var/tmp/hybridq-bench-keys.sqlite")
    args = parser.parse_args()
    if not os.path.exists(args.path):
        build(args.path, args.keys)
    print(f"{args.path}: {os.path.getsize(args.path) / 2**20:.0f} MB")
    for _ in range(args.runs):
        for deferred in (False, True):
            warm(args.path)
            wall, cpu = time.perf_counter(), time.thread_time()
            table = KeyTable(args.path, deferred=deferred)
            opened, opened_cpu = time.perf_counter(), time.thread_time()
            table.get("k-nobody")
            read = time.perf_counter()
            print(
                f"{'deferred' if deferred else 'checked '}: open {opened - wall:.3f} s wall, "
                f"{opened_cpu - cpu:.3f} s CPU; first read after {read - wall:.3f} s"
            )
            table.close()


if __name__ == "__main__":
    main()
