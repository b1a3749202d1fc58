"""Run the upload pipeline with crashing uploaders and print a tally: ``python run.py [options]``.

The harness, not the application (that is uploads.py and uploader.py): it starts a private
redis-server (from PATH or hybridq's ``embedded`` extra), ``hybridq forward``, ``hybridq worker``
and several uploader processes, SIGKILLs each uploader a few times between its enqueue and its
move (``UPLOADS_DIE_AFTER_ENQUEUE``) and restarts it. After odd crashes the client sends its
unacknowledged upload again (the same key is enqueued twice); after even ones it gives up (only
the job can finish that upload). It waits until every job is finished and counts what happened
from the files: ``processed.log`` has one line per processing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from hybridq.testing.embedded import RedisServer

HERE = Path(__file__).resolve().parent


def hybridq(*args: str) -> list[str]:
    """``python -m hybridq ARGS...`` with this interpreter."""
    return [sys.executable, "-m", "hybridq", *args]


class Uploader(threading.Thread):
    """Runs one uploader's files to the end, restarting it each time it dies."""

    def __init__(self, root: Path, prefix: str, count: int, die_at: set[str], env: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.root, self.prefix, self.count, self.env = root, prefix, count, env
        self.die_at = die_at  # names whose upload dies between its enqueue and its move
        self.crashes = 0

    def run(self) -> None:
        """Start the uploader; restart it from its first unacknowledged file until all are done."""
        first = 0
        while first < self.count:
            env = {**self.env, "UPLOADS_DIE_AFTER_ENQUEUE": ",".join(sorted(self.die_at))}
            args = [
                str(HERE / "uploader.py"),
                str(self.root),
                self.prefix,
                str(first),
                str(self.count - first),
            ]
            done = subprocess.run(
                [sys.executable, *args], env=env, capture_output=True, text=True, check=False
            )
            first += sum(1 for line in done.stdout.splitlines() if line.startswith("acked "))
            if done.returncode == -9:  # SIGKILLed after enqueueing `first`, before moving it
                self.crashes += 1
                self.die_at.discard(f"{self.prefix}-{first:04d}")
                if self.crashes % 2 == 0:
                    first += 1  # this client gave up: the job alone has to finish its upload
                # else the client sends its unacknowledged upload again (same name, same key)
            elif done.returncode != 0:
                raise SystemExit(f"uploader {self.prefix} exited {done.returncode}: {done.stderr[-2000:]}")


def status(journal: Path, env: dict[str, str]) -> dict[str, int]:
    """``hybridq status --json``."""
    out = subprocess.run(
        hybridq("status", "--json", "--journal", str(journal)), env=env, capture_output=True, check=True
    )
    return dict(json.loads(out.stdout))


def tally(root: Path, files: int) -> dict[str, int]:
    """What the files say: processings per name, files never processed or processed twice."""
    try:
        lines = (root / "processed.log").read_text().splitlines()
    except FileNotFoundError:
        lines = []
    runs = collections.Counter(line.split()[0] for line in lines)
    return {
        "processed": len(runs),
        "never_processed": files - len(runs),
        "processed_twice": sum(n - 1 for n in runs.values()),
        "left_in_incoming": sum(1 for n in os.listdir(root / "incoming") if not n.startswith(".")),
    }


def main() -> int:
    """Run it; exit 1 unless every file was processed exactly once."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uploaders", type=int, default=4)
    parser.add_argument("--files", type=int, default=60, help="per uploader")
    parser.add_argument("--crashes", type=int, default=3, help="SIGKILLs per uploader")
    parser.add_argument("--dir", help="where everything goes (default: a new temporary directory)")
    parser.add_argument("--seed", type=int, default=1)
    opts = parser.parse_args()
    started = time.monotonic()
    root = Path(opts.dir or tempfile.mkdtemp(prefix="upload-pipeline-")).resolve()
    journal = root / "journal"
    env = {**os.environ, "HYBRIDQ_JOURNAL": str(journal), "PYTHONPATH": str(HERE)}
    for sub in ("incoming", "ready", "processed"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    journal.mkdir(mode=0o700, exist_ok=True)  # what the first enqueue would do; forward needs it
    rng = random.Random(opts.seed)
    redis = RedisServer(directory=str(root / "redis"))
    procs: list[subprocess.Popen[bytes]] = []
    with open(root / "processes.log", "ab") as log:
        try:
            redis.start()
            print(f"directory {root}; private Redis on {redis.url}")
            forward = hybridq("forward", "--journal", str(journal), "--redis", redis.url)
            worker = hybridq(
                "worker", "--redis", redis.url, "--allow", "uploads", "--processes", "1", "uploads"
            )
            procs.append(subprocess.Popen(forward, env=env, stdout=log, stderr=log))
            procs.append(subprocess.Popen(worker, env=env, stdout=log, stderr=log, cwd=HERE))
            uploaders = []
            for u in range(opts.uploaders):
                names = [f"u{u}-{i:04d}" for i in range(opts.files)]
                die_at = set(rng.sample(names, min(opts.crashes, opts.files)))
                uploaders.append(Uploader(root, f"u{u}", opts.files, die_at, env))
            for uploader in uploaders:
                uploader.start()
            for uploader in uploaders:
                uploader.join()
            files, crashes = opts.uploaders * opts.files, sum(u.crashes for u in uploaders)
            print(f"{files} uploads, {crashes} uploaders SIGKILLed on the way; waiting for the jobs")
            deadline = time.monotonic() + 120
            while (st := status(journal, env))["pending"] and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait()
            redis.stop()
    counts = tally(root, files)
    print(
        f"files={files} crashes={crashes} jobs={st['accepted']} (at most {files + crashes}) "
        f"duplicates_suppressed={st['duplicates_suppressed']} processed={counts['processed']} "
        f"never_processed={counts['never_processed']} processed_twice={counts['processed_twice']} "
        f"left_in_incoming={counts['left_in_incoming']} seconds={time.monotonic() - started:.1f}"
    )
    ok = st["accepted"] <= files + crashes and counts["processed"] == files
    return 0 if ok and counts["processed_twice"] == counts["left_in_incoming"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
