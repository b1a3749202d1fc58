"""M1, F3 and D1 from PERFORMANCE.md, measured on a journal of N jobs (default 1,000,000).

* M1: peak RSS (VmHWM) of `hybridq forward` while Redis is unreachable and N jobs wait.
* F3: seconds from starting `hybridq forward` over that journal to its first push attempt
  (recovery scan, checkpoint load, first batch read).
* D1: journal bytes per job against the envelope's own size (target: payload + 64 B).

No Redis is started: the forwarder points at a loopback port where nothing listens.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import hybridq
from hybridq.envelope import Envelope


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="100,000 jobs")
    parser.add_argument("--dir", default=None, help="parent of the temporary journal")
    args = parser.parse_args()
    jobs = 100_000 if args.quick else args.jobs
    journal = os.path.join(tempfile.mkdtemp(prefix="bench-memory-", dir=args.dir), "journal")
    queue = hybridq.Queue("default", journal)
    started = time.perf_counter()
    payload_bytes = 0
    for first in range(0, jobs, 1000):
        batch = [queue.prepare("tests.tasks.add", (i, 1)) for i in range(first, min(jobs, first + 1000))]
        payload_bytes += sum(len(Envelope.to_bytes(e)) for e in batch)
        queue.enqueue_many(batch)
    print(f"enqueued {jobs:,} jobs in {time.perf_counter() - started:.1f} s")
    journal_bytes = sum(os.path.getsize(os.path.join(journal, f)) for f in os.listdir(journal))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = os.path.join(os.path.dirname(journal), "forward.log")
    with open(log, "w", encoding="utf-8") as out:
        began = time.monotonic()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hybridq",
                "forward",
                "--journal",
                journal,
                "--redis",
                f"redis://127.0.0.1:{port}/0",
            ],
            stderr=out,
        )
        first_push = None
        peak_kb = 0
        deadline = began + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
            with open(f"/proc/{proc.pid}/status", encoding="utf-8") as status:
                peak_kb = max(
                    peak_kb, int(next(line for line in status if line.startswith("VmHWM")).split()[1])
                )
            if first_push is None:
                with open(log, encoding="utf-8") as text:
                    if "transport unavailable" in text.read():
                        first_push = time.monotonic() - began
            elif time.monotonic() - began > first_push + 5:
                break  # five seconds of backing off with the backlog waiting
        proc.terminate()
        proc.wait()
    per_job = journal_bytes / jobs
    envelope = payload_bytes / jobs
    print(
        f"M1  forwarder peak RSS, Redis down, {jobs:,} jobs waiting: {peak_kb / 1024:.1f} MB  (target <= 100 MB)"
    )
    if first_push is None:
        print("F3  the forwarder made no push attempt within 60 s")
    else:
        print(f"F3  start over {jobs:,} records -> first push attempt: {first_push:.2f} s  (target <= 2 s)")
    print(
        f"D1  journal {per_job:.1f} B/job for a {envelope:.1f} B envelope: +{per_job - envelope:.1f} B  "
        "(target <= +64 B)"
    )


if __name__ == "__main__":
    main()
