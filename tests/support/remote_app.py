"""An application host with no journal: enqueue through ingest nodes (``$HYBRIDQ_URL``).

``python -m tests.support.remote_app enqueue PREFIX COUNT THREADS EFFECTS OUT``: enqueues
``tests.tasks.record(EFFECTS, "PREFIX-i")`` for i < COUNT from THREADS threads, and appends
``token id`` to OUT for each job acknowledged (a 202), ``token ERROR message`` for each enqueue
that raised.

``python -m tests.support.remote_app wait IDS OUT TIMEOUT``: for each id in IDS (one per line),
``hybridq.fetch_job(id).wait(TIMEOUT)``; appends ``id result`` (or ``id ERROR message``) to OUT.
"""

from __future__ import annotations

import sys
import threading

import hybridq


def enqueue(prefix: str, count: int, threads: int, effects: str, out_path: str) -> None:
    queue = hybridq.Queue("default")  # no journal: $HYBRIDQ_URL, $HYBRIDQ_TOKEN
    lock = threading.Lock()
    with open(out_path, "a", buffering=1, encoding="utf-8") as out:

        def run(part: int) -> None:
            for i in range(part, count, threads):
                token = f"{prefix}-{i}"
                try:
                    line = f"{token} {queue.enqueue('tests.tasks.record', effects, token).id}\n"
                except hybridq.HybridqError as exc:
                    line = f"{token} ERROR {exc}\n"
                with lock:
                    out.write(line)

        workers = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()


def wait(ids_path: str, out_path: str, timeout: float) -> None:
    with open(ids_path, encoding="utf-8") as f:
        ids = f.read().split()
    with open(out_path, "w", encoding="utf-8") as out:
        for job_id in ids:
            try:
                job = hybridq.fetch_job(job_id)
                result = "MISSING" if job is None else job.wait(timeout)
            except hybridq.HybridqError as exc:
                result = f"ERROR {exc}"
            out.write(f"{job_id} {result}\n")


if __name__ == "__main__":
    if sys.argv[1] == "enqueue":
        enqueue(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    else:
        wait(sys.argv[2], sys.argv[3], float(sys.argv[4]))
