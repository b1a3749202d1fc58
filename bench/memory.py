"""M1, F3 and D1 (targets: docs/benchmarks.md), measured on a journal of N jobs (default 1,000,000).

* M1: peak RSS (VmHWM) of `hybridq forward` while Redis is unreachable and N jobs wait.
* F3: seconds from starting `hybridq forward` over that journal to its first push attempt
  (recovery scan, checkpoint load, first batch read).
* D1: journal bytes per job against the envelope's own size (target: payload + 64 B); and, with
  the in-memory transport running every job, the journal's segments while a producer keeps
  writing and after it stops (target: a few), as tests/integration/test_compaction_load.py does.

No Redis is started: the forwarder points at a loopback port where nothing listens. Each figure
is one measurement (no repetitions): these targets are absolute, not ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import benchlib
import hybridq
from benchlib import Figure
from hybridq.envelope.model import Envelope
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.journal.reader import segment_usage
from hybridq.transport import MemoryTransport

#: D1 under load: jobs per producer round and the (small) segment size that makes it rotate often.
COMPACTION_CHUNK = 2_000
COMPACTION_SEGMENT_BYTES = 256 << 10


def fill(journal: str, jobs: int) -> tuple[float, float]:
    """Enqueue ``jobs`` jobs in batches of 1,000; (seconds taken, envelope bytes in total)."""
    queue = hybridq.Queue("default", journal)
    started = time.perf_counter()
    payload_bytes = 0
    for first in range(0, jobs, 1000):
        batch = [queue.prepare("tests.tasks.add", (i, 1)) for i in range(first, min(jobs, first + 1000))]
        payload_bytes += sum(len(Envelope.to_bytes(e)) for e in batch)
        queue.enqueue_many(batch)
    return time.perf_counter() - started, payload_bytes


def start_forwarder(journal: str) -> tuple[float, float | None]:
    """Start `hybridq forward` with Redis down; (peak RSS in kB, seconds to its first push attempt)."""
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
    return peak_kb, first_push


def compaction(journal: str, jobs: int) -> dict[str, int]:
    """Produce ``jobs`` jobs while the forwarder forwards and the in-memory worker runs them.

    The producer writes 256 KiB segments (so it rotates often); after each round of
    :data:`COMPACTION_CHUNK` jobs the forwarder pushes, the transport runs them, the completions
    are harvested and compaction deletes what is done. Segment counts are sampled after each
    round; "after" is once the producer has exited and two more rounds ran.
    """
    queue = hybridq.Queue(journal=journal)
    transport = MemoryTransport()
    forwarder = Forwarder(journal, transport, reconcile_interval_s=3600.0)
    forwarder.open()
    completions = forwarder.completions
    assert completions is not None
    peak_segments = peak_bytes = 0
    try:
        with JournalWriter(journal, max_segment_bytes=COMPACTION_SEGMENT_BYTES) as writer:
            for start in range(0, jobs, COMPACTION_CHUNK):
                for batch in range(start, min(jobs, start + COMPACTION_CHUNK), 100):
                    writer.append_many(
                        queue.prepare("tests.tasks.add", (i, i)).to_bytes()
                        for i in range(batch, min(jobs, batch + 100))
                    )
                forwarder.step()
                transport.work()
                completions.hurry(reconcile=False)
                forwarder.step()
                segments, size = segment_usage(journal)
                peak_segments, peak_bytes = max(peak_segments, segments), max(peak_bytes, size)
            live_segments, _ = segment_usage(journal)
        # The producer's last segment is sealed now: the forwarder reads the seal, then the next
        # round deletes that segment too.
        for _ in range(2):
            completions.hurry(reconcile=False)
            forwarder.step()
    finally:
        forwarder.close()
    end_segments, _ = segment_usage(journal)
    return {
        "jobs": jobs,
        "peak_segments": peak_segments,
        "peak_bytes": peak_bytes,
        "segments_while_producing": live_segments,
        "segments_after": end_segments,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/bench-memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="100,000 jobs (20,000 for D1's compaction)")
    parser.add_argument(
        "--compaction-jobs", type=int, default=None, help="jobs run for D1's segments (default 100,000)"
    )
    parser.add_argument("--dir", default=None, help="parent of the temporary journal")
    benchlib.add_json_option(parser)
    args = parser.parse_args(argv)
    jobs = 100_000 if args.quick else args.jobs
    compaction_jobs = benchlib.pick(args.compaction_jobs, args.quick, 20_000, 100_000)
    base = tempfile.mkdtemp(prefix="bench-memory-", dir=args.dir)
    header = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"nproc={os.cpu_count()}  cpu={benchlib.cpu_model()}  loadavg={os.getloadavg()[0]:.2f}",
        "versions": f"hybridq {benchlib.version('hybridq')}, rq {benchlib.version('rq')}",
        "commit": benchlib.git_revision(),
        "dir": base,
        "run": f"{jobs:,} jobs for M1, F3 and D1's bytes; {compaction_jobs:,} for D1's segments; one run",
    }
    try:
        journal = os.path.join(base, "journal")
        seconds, payload_bytes = fill(journal, jobs)
        print(f"enqueued {jobs:,} jobs in {seconds:.1f} s")
        journal_bytes = sum(os.path.getsize(os.path.join(journal, f)) for f in os.listdir(journal))
        peak_kb, first_push = start_forwarder(journal)
        per_job = journal_bytes / jobs
        envelope = payload_bytes / jobs
        print(
            f"M1  forwarder peak RSS, Redis down, {jobs:,} jobs waiting: {peak_kb / 1024:.1f} MB  (target <= 100 MB)"
        )
        if first_push is None:
            print("F3  the forwarder made no push attempt within 60 s")
        else:
            print(
                f"F3  start over {jobs:,} records -> first push attempt: {first_push:.2f} s  (target <= 2 s)"
            )
        print(
            f"D1  journal {per_job:.1f} B/job for a {envelope:.1f} B envelope: +{per_job - envelope:.1f} B  "
            "(target <= +64 B)"
        )
        shutil.rmtree(journal, ignore_errors=True)
        seg = compaction(os.path.join(base, "compaction"), compaction_jobs)
        print(
            f"D1  after {compaction_jobs:,} jobs complete: {seg['segments_after']} segments left "
            f"({seg['segments_while_producing']} while producing; peak {seg['peak_segments']}, "
            f"{seg['peak_bytes'] / 1000:,.0f} KB)  (target: a few)"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        figures = [
            Figure(
                "M1 forwarder peak RSS, Redis down",
                [peak_kb / 1024],
                " MB",
                "<= 100 MB",
                peak_kb <= 100 * 1024,
                id="M1",
            ),
            Figure(
                "F3 start -> first push attempt",
                [first_push if first_push is not None else float("inf")],
                " s",
                "<= 2 s",
                first_push is not None and first_push <= 2,
                id="F3",
            ),
            Figure(
                "D1 journal bytes per job over the envelope",
                [per_job - envelope],
                " B",
                "<= +64 B",
                per_job - envelope <= 64,
                id="D1",
            ),
            Figure(
                "D1 segments left after the jobs complete",
                [float(seg["segments_after"])],
                "",
                "a few (<= 3)",
                seg["segments_after"] <= 3 and seg["segments_while_producing"] <= 3,
                what=f"{seg['segments_while_producing']} while producing, peak {seg['peak_segments']}",
                id="D1",
            ),
        ]
        benchlib.write_json(
            args.json,
            "bench-memory",
            header,
            {},
            figures,
            figures_raw={
                "jobs": jobs,
                "enqueue_seconds": seconds,
                "peak_rss_mb": peak_kb / 1024,
                "first_push_s": first_push,
                "journal_bytes_per_job": per_job,
                "envelope_bytes_per_job": envelope,
                "compaction": seg,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
