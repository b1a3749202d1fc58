"""F4 of ``scripts/bench-forward``: completion events harvested into the forwarder's ledger.

N jobs are forwarded (not timed), then one succeeded completion event per job is added to the
forwarder's stream exactly as the worker's outcome script writes it (``XADD
hybridq:events:<owner> * e <CompletionEvent JSON>``, pipelined, not timed). Timed: the
forwarder's ``step()`` calls until its ledger holds all N outcomes (fsync'd) and the stream is
empty. Next to it, in the same Redis and the same run, the floor any harvester pays: a bare loop
of ``XRANGE COUNT 1000`` + ``XDEL`` of the same events (no parsing, no ledger, no fsync).

Paced: the same N events written by another process at a steady rate (workers finishing jobs)
while the forwarder runs its loop (``Forwarder.run()`` in a thread, woken by its event watcher).
Reported: whether it keeps up, the forwarder process's CPU per event and share of a core, and
events per ledger fsync (the batches it forms by itself).
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import benchlib
import redis
from benchlib import Sample
from hybridq.envelope.model import Envelope
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalReader, RecordType
from hybridq.protocol import CompletionEvent, keys
from hybridq.transport.rq import RQTransport

if TYPE_CHECKING:
    from hybridq.testing.embedded import RedisServer

#: Events per XRANGE of the reference loop (the forwarder's own batch is HARVEST_BATCH).
REF_BATCH = 1000
#: Events added per pipeline when filling the stream.
FILL_BATCH = 5000

F4_ROWS = [
    ("f4hq", "Forwarder.step() harvest: events -> ledger (fsync) -> XDEL"),
    ("f4ref", "bare XRANGE COUNT 1000 + XDEL loop, same events (reference)"),
]
#: The paced row's label (its figures are CPU per event, not a rate to compare).
F4_PACED = ("f4paced", "Forwarder.run(), events arriving at a steady rate")
#: Events the paced writer adds per pipeline at most (a worker's batch).
PACED_CHUNK = 100


def fill_events(url: str, owner: str, journal: str) -> int:
    """One succeeded event per job of ``journal`` into ``owner``'s stream, as the worker writes it."""
    conn = redis.Redis.from_url(url)
    stream = keys.events(owner)
    n = 0
    try:
        pipe = conn.pipeline(transaction=False)
        for record in JournalReader(journal).records():
            if record.rtype != RecordType.DATA:
                continue
            env = Envelope.from_bytes(record.payload)
            loc = (record.writer_id, record.segment_index, record.offset)
            event = CompletionEvent(
                id=env.id,
                loc=loc,
                queue=env.queue,
                outcome="succeeded",
                final=True,
                retry_delay=None,
                attempt=1,
                dup=False,
                error=None,
                at=time.time(),
            )
            pipe.xadd(stream, {"e": json.dumps(event.to_json())})
            n += 1
            if n % FILL_BATCH == 0:
                pipe.execute()
        pipe.execute()
    finally:
        conn.close()
    return n


def stream_len(url: str, owner: str) -> int:
    conn = redis.Redis.from_url(url)
    try:
        return int(conn.xlen(keys.events(owner)))
    finally:
        conn.close()


def harvest_once(
    url: str, base: str, pristine: str, n: int, *, profile: bool = False
) -> tuple[Sample, Sample | None]:
    """Forward the journal, fill the stream, time the forwarder's harvest; then the reference.

    The reference runs on a second copy of the same events, added after the forwarder's run
    (so both read the same stream shapes from the same Redis).
    """
    journal = tempfile.mkdtemp(prefix="harvest-", dir=base)
    shutil.rmtree(journal)
    shutil.copytree(pristine, journal)
    transport = RQTransport(url)
    fwd = Forwarder(journal, transport)
    try:
        fwd.open()
        forwarded = fwd.step()  # every job pushed: their events may now say "succeeded"
        if forwarded != n:
            sys.exit(f"bench-forward: F4 forwarded {forwarded} jobs, expected {n}")
        owner = fwd.checkpoint.owner
        if fill_events(url, owner, journal) != n:
            sys.exit("bench-forward: F4 filled a wrong number of events")
        index = fwd.completions.index
        before = index.terminal_count
        fsyncs_before = _ledger_fsyncs(fwd)
        gc.collect()
        if profile:
            benchlib.profile_call(f"Forwarder.step() harvesting {n:,} completion events", fwd.step)
            return Sample(n, 1.0), None
        t0 = time.perf_counter()
        while index.terminal_count - before < n:
            fwd.step()
        elapsed = time.perf_counter() - t0
        fsyncs = _ledger_fsyncs(fwd) - fsyncs_before
        left = stream_len(url, owner)
        if left:
            sys.exit(f"bench-forward: F4 left {left} events in the stream")
        hq = Sample(n, elapsed, extra={"fsyncs": fsyncs})
        fill_events(url, owner, journal)
        ref = reference_once(url, owner, n)
    finally:
        fwd.close()
        transport.close()
        shutil.rmtree(journal, ignore_errors=True)
    return hq, ref


def _ledger_fsyncs(fwd: Forwarder) -> int:
    writer = fwd.state._writer
    return 0 if writer is None else writer.fsync_count


def reference_once(url: str, owner: str, n: int) -> Sample:
    """The floor: read the stream in batches of :data:`REF_BATCH` and delete what was read."""
    conn = redis.Redis.from_url(url)
    stream = keys.events(owner)
    done = 0
    try:
        conn.ping()
        gc.collect()
        t0 = time.perf_counter()
        while True:
            entries = conn.xrange(stream, count=REF_BATCH)
            if not entries:
                break
            conn.xdel(stream, *[event_id for event_id, _ in entries])
            done += len(entries)
        elapsed = time.perf_counter() - t0
    finally:
        conn.close()
    if done != n:
        sys.exit(f"bench-forward: the F4 reference read {done} events, expected {n}")
    return Sample(done, elapsed)


def run_f4(
    server: RedisServer,
    base: str,
    n: int,
    rate: float,
    prefill: Callable[[str, int], None],
    rep: int,
) -> dict[str, Sample]:
    """One repetition of F4 (``rep`` is unused: the reference always follows on the same events)."""
    del rep
    pristine = os.path.join(tempfile.mkdtemp(prefix="f4-prefill-", dir=base), "journal")
    prefill(pristine, n)
    try:
        server.flushall()
        hq, ref = harvest_once(server.url, base, pristine, n)
        server.flushall()
        paced = paced_once(server.url, base, pristine, n, rate)
        server.flushall()
    finally:
        shutil.rmtree(os.path.dirname(pristine), ignore_errors=True)
    assert ref is not None
    return {"f4hq": hq, "f4ref": ref, "f4paced": paced}


def _write_paced(url: str, stream: str, bodies: list[bytes], rate: float, go: Any) -> None:
    """In a child process: XADD ``bodies`` at ``rate`` per second once ``go`` is set."""
    conn = redis.Redis.from_url(url)
    conn.ping()
    go.wait()
    t0 = time.perf_counter()
    sent = 0
    while sent < len(bodies):
        due = min(len(bodies), int((time.perf_counter() - t0) * rate), sent + PACED_CHUNK)
        if due <= sent:
            time.sleep(0.0005)
            continue
        pipe = conn.pipeline(transaction=False)
        for body in bodies[sent:due]:
            pipe.xadd(stream, {"e": body})
        pipe.execute()
        sent = due
    conn.close()


def paced_once(url: str, base: str, pristine: str, n: int, rate: float) -> Sample:
    """N events at ``rate``/s into a running forwarder: wall time, its CPU, its ledger fsyncs."""
    journal = tempfile.mkdtemp(prefix="paced-", dir=base)
    shutil.rmtree(journal)
    shutil.copytree(pristine, journal)
    transport = RQTransport(url)
    fwd = Forwarder(journal, transport)
    thread: threading.Thread | None = None
    child = None
    try:
        fwd.open()
        fwd.step()
        owner = fwd.checkpoint.owner
        fill_events(url, owner, journal)  # the bodies, as the worker writes them
        conn = redis.Redis.from_url(url)
        stream = keys.events(owner)
        bodies = [fields[b"e"] for _, fields in conn.xrange(stream)]
        conn.delete(stream)
        conn.close()
        context = multiprocessing.get_context("spawn")
        go = context.Event()
        child = context.Process(target=_write_paced, args=(url, stream, bodies, rate, go), daemon=True)
        child.start()
        thread = threading.Thread(target=fwd.run, name="forwarder", daemon=True)
        thread.start()
        index = fwd.completions.index
        before = index.terminal_count
        time.sleep(0.5)  # the child connected, the loop idle
        fsyncs = _ledger_fsyncs(fwd)
        gc.collect()
        cpu0, t0 = time.process_time(), time.perf_counter()
        go.set()
        while index.terminal_count - before < n:
            time.sleep(0.002)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        fsyncs = _ledger_fsyncs(fwd) - fsyncs
    finally:
        fwd.stop()
        if thread is not None:
            thread.join(10)
        if child is not None:
            child.join(10)
        fwd.close()
        transport.close()
        shutil.rmtree(journal, ignore_errors=True)
    return Sample(n, elapsed, extra={"cpu_s": cpu, "fsyncs": fsyncs, "rate": rate})


def paced_cells(sample: Sample) -> tuple[str, ...]:
    """Offered rate, achieved rate, CPU per event, share of a core, events per fsync."""
    cpu, fsyncs = sample.extra["cpu_s"], sample.extra["fsyncs"]
    return (
        f"{sample.extra['rate']:,.0f}",
        f"{sample.rate:,.0f}",
        f"{cpu / sample.count * 1e6:.1f}",
        f"{cpu / sample.seconds * 100:.0f}%",
        f"{sample.count / max(1.0, fsyncs):.0f}",
    )
