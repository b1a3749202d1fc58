"""The ledger's part of a forwarder's start (issue 29): a full replay against the saved index.

A journal of ``--jobs`` jobs (~200 B of arguments) in one live journal chain (and 1,000 more not
finished, spread, so that no segment is compacted), every one of them finished in the ledger (``done``/``succeeded`` entries shaped as the harvest writes them, with
an event id, a queue, a worker and a start time): what a restart in the middle of a drain holds
before compaction. Then, alternately, ``--runs`` times each, in one process:

  * ``full``: ``load_index`` (what every start did before the saved index, and what a start does
    without one);
  * ``stop``: ``ForwarderState.load`` after a clean stop (the index saved at the stop);
  * ``kill``: ``ForwarderState.load`` after a kill -9 at the worst moment for it, just before a
    periodic save: the saved index misses as many entries as the saving rule lets it
    (``max(SAVE_EVERY, index / 8)``);
  * ``nosave``: ``ForwarderState.load`` with no saved index (the full replay plus the rest of
    the load);
  * ``save``: one save of the index (what the forwarder pays at a stop and per periodic save);
  * ``first push``: the same three starts of a whole forwarder (``Forwarder.open`` and its steps
    until it pushed one of 1,000 jobs enqueued after the stop), through the in-memory transport.

Prints seconds per run. No Redis, no worker: the start's own work only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from hybridq.journal import JournalWriter
from hybridq.ledger import saved_index
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.store import load_index, open_ledger_writer
from hybridq.transport import MemoryTransport

#: Jobs of the same segment left unfinished, so that it is not compacted (a drain's middle).
UNFINISHED = 1000


def build(journal: str, jobs: int) -> tuple[list[bytes], list[bytes]]:
    """The journal, and the ledger entries of its jobs (written in two parts by the caller)."""
    queue = Queue(journal=journal)
    args = "x" * 200
    locs = []
    total = jobs + UNFINISHED
    with JournalWriter(journal) as writer:
        for start in range(0, total, 1000):
            ids = writer.append_many(
                queue.prepare("tests.tasks.add", (args, i)).to_bytes()
                for i in range(start, min(total, start + 1000))
            )
            locs.extend((r.writer_id, r.segment, r.offset) for r in ids)
    # One job in every 201 not finished, spread: every segment stays live (compaction would
    # forget the finished jobs of a segment with none left).
    step = total // UNFINISHED
    locs = [loc for i, loc in enumerate(locs) if i % step != step - 1][:jobs]
    now = time.time()
    payloads = [
        Entry(
            "done",
            f"{i:032x}",
            loc,
            outcome="succeeded",
            queue="default",
            event_id=f"{int(now * 1000)}-{i}",
            at=now,
            started=now - 0.01,
            worker="host/1234",
        ).to_bytes()
        for i, loc in enumerate(locs)
    ]
    return payloads[: jobs * 7 // 8], payloads[jobs * 7 // 8 :]


def timed_load(journal: str) -> float:
    state = ForwarderState(journal, ForwarderConfig())
    started = time.perf_counter()
    state.load()
    took = time.perf_counter() - started
    state.runs.close()  # not close(): that would save the index
    return took


def first_pushes(
    journal: str, base: str, variants: dict[str, str | None], opts: argparse.Namespace
) -> dict[str, list[float]]:
    """Seconds from a forwarder's start (``Forwarder.open``) to its first push, per variant.

    A first forwarder reads the whole journal (every job finished: nothing pushed) and stops;
    1,000 jobs are then enqueued. Each run starts a forwarder on a copy of that journal, with
    the variant's saved index (``None``: none), and steps it until it pushed a job (the
    in-memory transport: no Redis).
    """
    first = Forwarder(journal, MemoryTransport())
    first.open()
    while first.step():
        pass
    for _ in range(30):  # the lookup index catches up with the ledger (a bounded slice per step)
        first.step()
    first.close()
    queue = Queue(journal=journal)
    with JournalWriter(journal) as writer:
        writer.append_many(queue.prepare("tests.tasks.add", ("x" * 200, i)).to_bytes() for i in range(1000))
    pristine = os.path.join(base, "pristine")
    shutil.copytree(journal, pristine)
    out: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(opts.runs):
        for name, saved in variants.items():
            shutil.rmtree(journal)
            shutil.copytree(pristine, journal)
            target = os.path.join(journal, "ledger-index.state")
            if saved is None:
                os.unlink(target)
            else:
                shutil.copy(saved, target)
            transport = MemoryTransport()
            started = time.perf_counter()
            forwarder = Forwarder(journal, transport)
            forwarder.open()
            while not transport.jobs:
                forwarder.step()
            out[name].append(time.perf_counter() - started)
            forwarder.close()
    shutil.rmtree(journal)
    shutil.copytree(pristine, journal)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    opts = parser.parse_args()
    base = tempfile.mkdtemp(prefix="bench-ledger-start-")
    try:
        journal = os.path.join(base, "journal")
        head, tail = build(journal, opts.jobs)
        ledger = open_ledger_writer(journal)
        for at in range(0, len(head), 1000):
            ledger.append_many(head[at : at + 1000])
        # The kill: saved at 7/8 of the entries (the rule saves every eighth of the index).
        state = ForwarderState(journal, ForwarderConfig())
        state.load()
        state.close()
        kill_file = os.path.join(journal, "ledger-index.state")
        kill_copy = kill_file + ".kill"
        shutil.copy(kill_file, kill_copy)
        for at in range(0, len(tail), 1000):
            ledger.append_many(tail[at : at + 1000])
        ledger.close()
        state = ForwarderState(journal, ForwarderConfig())
        state.load()
        state.close()  # the stop: saved whole
        stop_copy = kill_file + ".stop"
        shutil.copy(kill_file, stop_copy)
        first_push = first_pushes(journal, base, {"stop": stop_copy, "kill": kill_copy, "nosave": None}, opts)
        results: dict[str, list[float]] = {k: [] for k in ("full", "stop", "kill", "nosave", "save")}
        for _ in range(opts.runs):
            started = time.perf_counter()
            index = load_index(journal, Compacted())
            results["full"].append(time.perf_counter() - started)
            assert index.terminal_count == opts.jobs, (index.terminal_count, index.totals)
            started = time.perf_counter()
            saved_index.save(journal, index, {}, {})
            results["save"].append(time.perf_counter() - started)
            del index
            shutil.copy(stop_copy, kill_file)
            results["stop"].append(timed_load(journal))
            shutil.copy(kill_copy, kill_file)
            results["kill"].append(timed_load(journal))
            os.unlink(kill_file)
            results["nosave"].append(timed_load(journal))
        size = os.path.getsize(stop_copy)
        print(
            f"{opts.jobs:,} finished jobs in live segments; saved index {size / 1e6:.1f} MB; load {os.getloadavg()[0]:.1f}"
        )
        for name, values in results.items():
            runs = ", ".join(f"{v:.3f}" for v in values)
            print(f"  {name:7s} median {statistics.median(values):.3f} s  ({runs})")
        for name, values in first_push.items():
            runs = ", ".join(f"{v:.3f}" for v in values)
            print(f"  first push, {name:7s} median {statistics.median(values):.3f} s  ({runs})")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
