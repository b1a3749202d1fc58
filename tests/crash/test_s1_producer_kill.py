"""S1 (docs/reliability.md): producer killed at random.

Each cycle starts a child that appends records in a loop (one or several threads, single appends
and batches, some cycles with 4 KiB segments so rotation happens all the time) and writes each id
to its stdout file only after the append returned. The parent SIGKILLs it after a random delay.
Every few cycles, and at the end, ``recover()`` runs as a restarting consumer would. Then a full
read: every acked id present exactly once, where its ack said, and nothing that was never
appended.
"""

from __future__ import annotations

import hashlib  # noqa: F401 - used by payload(), defined by exec below
import os
import random
import textwrap
from pathlib import Path

from hybridq.journal import JournalReader
from hybridq.journal.recovery import recover, verify

from tests.conftest import PYTHON
from tests.support.processes import kill_when_ready

CYCLES = 30
RECOVER_EVERY = 10

# Shared by the parent and the child (which does not import pytest: it has to start fast).
PAYLOAD_SRC = textwrap.dedent(
    '''
    def payload(key):
        """Record ``key`` ("cycle.thread.k"): the key, then 20-600 bytes derived from it."""
        digest = hashlib.sha256(key.encode()).digest()
        return b"S1:" + key.encode() + b"|" + (digest * 20)[: 20 + digest[0] * 580 // 255]
    '''
)
exec(PAYLOAD_SRC)  # defines payload()

CHILD = (
    "import hashlib, os, random, sys, threading\n"
    + PAYLOAD_SRC
    + textwrap.dedent(
        """
        from hybridq.journal import JournalWriter

        directory, cycle, threads, segment, seed = sys.argv[1:6]
        writer = JournalWriter(directory, max_segment_bytes=int(segment))

        def work(t):
            rng = random.Random(f"{seed}.{t}")
            k = 0
            while True:
                keys = [f"{cycle}.{t}.{k + j}" for j in range(rng.choice((1, 1, 1, 2, 7)))]
                k += len(keys)
                if len(keys) == 1:
                    rids = [writer.append(payload(keys[0]))]
                else:
                    rids = writer.append_many([payload(key) for key in keys])
                # Acked: report (one write(2), so lines from threads never interleave).
                os.write(1, "".join(f"{key} {r.writer_id} {r.seq}\\n" for key, r in zip(keys, rids)).encode())

        workers = [threading.Thread(target=work, args=(t,)) for t in range(int(threads))]
        for w in workers:
            w.start()
        os.write(2, b"ready\\n")
        for w in workers:
            w.join()
        """
    )
)


def parse(data: bytes) -> str:
    assert data.startswith(b"S1:"), f"garbage record {data[:40]!r}"
    key = data[3:].split(b"|", 1)[0].decode()
    assert data == payload(key), f"record {key} does not hold its payload"  # noqa: F821
    return key


def run_cycle(directory: Path, env: dict[str, str], rng: random.Random, cycle: int, logs: Path):
    threads = rng.choice((1, 1, 2, 4))
    segment = rng.choice((4096, 4096, 65536, 1 << 26))
    argv = [PYTHON, "-c", CHILD, str(directory), str(cycle), str(threads), str(segment), str(rng.random())]
    text = kill_when_ready(argv, env, logs, cycle, rng.uniform(0.0, 0.25))
    acked = {}
    for line in text.split("\n")[:-1]:  # a line cut by the kill has no newline: not reported
        key, writer_id, seq = line.split()
        acked[key] = (writer_id, int(seq))
    return acked


def test_producer_kill(tmp_path, subprocess_env, figures):
    # HYBRIDQ_S1_SEED replays a run's choices (threads, segment sizes, kill delays).
    seed = int(os.environ.get("HYBRIDQ_S1_SEED") or int.from_bytes(os.urandom(4), "little"))
    rng = random.Random(seed)
    directory, logs = tmp_path / "journal", tmp_path / "logs"
    logs.mkdir()
    acked: dict[str, tuple[str, int]] = {}
    repaired = sealed = 0
    cycles_with_acks = 0
    for cycle in range(CYCLES):
        got = run_cycle(directory, subprocess_env, rng, cycle, logs)
        assert not set(got) & set(acked), f"seed={seed}: key reused"
        acked.update(got)
        cycles_with_acks += bool(got)
        if (cycle + 1) % RECOVER_EVERY == 0:
            report = recover(directory)
            repaired += len(report.repaired)
            sealed += len(report.sealed)
            assert not report.verify.live_chains, f"seed={seed}: a killed child's chain looks alive"
    again = recover(directory)
    assert not again.repaired, f"seed={seed}: a torn tail repaired twice: {again.repaired}"
    assert not again.sealed, f"seed={seed}: a chain sealed twice: {again.sealed}"
    assert not verify(directory).torn_tails

    seen: dict[str, tuple[str, int]] = {}
    positions = set()
    rotated = False
    reader = JournalReader(directory)
    for rec in reader.records():
        key = parse(rec.payload)
        assert key not in seen, f"seed={seed}: record {key} returned twice"
        assert (rec.writer_id, rec.seq) not in positions, f"seed={seed}: position returned twice"
        positions.add((rec.writer_id, rec.seq))
        seen[key] = (rec.writer_id, rec.seq)
        rotated |= rec.segment_index > 0
    # Each child had its own chain; after recovery every chain is closed (killed mid-rotation,
    # a chain may end with a segment the child sealed itself).
    open_chains = [info.path for info in reader.chain_ends.values() if not info.sealed]
    assert not open_chains, f"seed={seed}: chains left open after recovery: {open_chains}"
    assert sealed <= len(reader.chain_ends) <= CYCLES
    lost = sorted(set(acked) - set(seen))
    moved = sorted(k for k in acked if k in seen and seen[k] != acked[k])
    figures(
        f"S1 producer-kill cycles={CYCLES} acked={len(acked)} lost={len(lost)} "
        f"unacked_present={len(seen) - len(acked) + len(lost)} torn_tails_repaired={repaired} seed={seed}"
    )
    assert not lost, f"seed={seed}: acked records lost: {lost[:20]}"
    assert not moved, f"seed={seed}: records not where their ack said: {moved[:20]}"
    assert cycles_with_acks >= CYCLES // 2, f"seed={seed}: only {cycles_with_acks} cycles acked anything"
    assert rotated, f"seed={seed}: no cycle rotated a segment"
