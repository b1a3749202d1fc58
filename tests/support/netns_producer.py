"""A producer host's application: enqueue jobs at a steady rate, noting each acknowledgement.

Run on a host (``python -m tests.support.netns_producer --journal J --host p0 ...``): each job is
``tests.netns_tasks.hosted(effects, "<host>-<n>", sleep)``; every acknowledged one is appended to
``--acks`` as ``<token> <job id> <time>``, so the test knows what was accepted and when.
"""

from __future__ import annotations

import argparse
import os
import time

from hybridq import Queue


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--journal", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--effects", required=True)
    parser.add_argument("--acks", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--rate", type=float, default=0.0, help="jobs/s; 0: as fast as possible")
    parser.add_argument("--first", type=int, default=0, help="number of the first job")
    parser.add_argument("--sleep", type=float, default=0.0, help="how long each job's task sleeps")
    parser.add_argument("--wait-for", help="start once this file exists")
    args = parser.parse_args()
    queue = Queue("default", args.journal)
    while args.wait_for and not os.path.exists(args.wait_for):
        time.sleep(0.002)
    start = time.monotonic()
    with open(args.acks, "a", encoding="utf-8") as acks:
        for i in range(args.count):
            token = f"{args.host}-{args.first + i:05d}"
            job = queue.enqueue("tests.netns_tasks.hosted", args.effects, token, args.sleep)
            acks.write(f"{token} {job.id} {time.time():.6f}\n")
            acks.flush()
            if args.rate > 0:
                time.sleep(max(0.0, start + (i + 1) / args.rate - time.monotonic()))


if __name__ == "__main__":
    main()
