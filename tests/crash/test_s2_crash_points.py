"""S2 (docs/reliability.md): producer killed at named crash points.

A child appends records one at a time with ``HYBRIDQ_CRASH_POINT=<point>:<N>`` set, printing each
id after its append returned. The child must die by SIGKILL at the Nth append, having acked
exactly the N-1 before it. Then ``recover()`` + a full read: every acked record present exactly
once where its ack said, the record being appended present only if it was fully written, a torn
tail (``mid_record``) backed up and cut off, and a second recovery that repairs nothing.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
from hybridq.crashpoints import NAMES
from hybridq.journal import JournalReader
from hybridq.journal.recovery import recover, verify

from tests.conftest import PYTHON

APPENDS = 20  # more than any N: a child that is not killed finishes and exits 0

CHILD = textwrap.dedent(
    """
    import sys
    from hybridq.journal import JournalWriter
    from tests.crash.test_s2_crash_points import payload

    directory, segment, size, appends = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    writer = JournalWriter(directory, max_segment_bytes=segment)
    for n in range(appends):
        rid = writer.append(payload(n, size))
        print(n, rid.writer_id, rid.seq, flush=True)
    writer.close()
    """
)


def payload(n: int, size: int) -> bytes:
    body = hashlib.sha256(b"%d" % n).hexdigest().encode() * (size // 64 + 1)
    return (b"S2:%06d:%05d:" % (n, size) + body)[:size]


def parse(data: bytes) -> int:
    assert data.startswith(b"S2:"), f"garbage record {data[:40]!r}"
    n, size = int(data[3:9]), int(data[10:15])
    assert data == payload(n, size), f"record {n} does not hold its payload"
    return n


def run_case(directory: Path, env: dict[str, str], point: str, nth: int, segment: int, size: int):
    """Run one crash-point child and check the journal; returns (acked, repaired)."""
    label = f"{point}:{nth} segment={segment}"
    env = dict(env, HYBRIDQ_CRASH_POINT=f"{point}:{nth}")
    proc = subprocess.run(
        [PYTHON, "-c", CHILD, str(directory), str(segment), str(size), str(APPENDS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"{label}: child was not killed by its crash point (exit {proc.returncode}): {proc.stderr}"
    )
    acked = {}
    for line in proc.stdout.splitlines():
        n, writer_id, seq = line.split()
        acked[int(n)] = (writer_id, int(seq))
    # One append per passage of every point: the Nth append is the one that died.
    assert sorted(acked) == list(range(nth - 1)), f"{label}: acked {sorted(acked)}"
    victim = nth - 1

    before = verify(directory)
    torn_expected = point == "mid_record"
    assert len(before.torn_tails) == int(torn_expected), f"{label}: torn tails {before.torn_tails}"

    first = recover(directory)
    broken = sorted(p for p in os.listdir(directory) if p.endswith(".broken"))
    if torn_expected:
        (torn,) = first.repaired
        assert broken == [os.path.basename(torn.path) + ".broken"], f"{label}: backups {broken}"
        with open(os.path.join(directory, broken[0]), "rb") as f:
            backup = f.read()
        assert len(backup) == torn.offset + torn.dropped_bytes > torn.offset, label
        # The dropped bytes are the first half of the record that was being appended.
        assert b"S2:%06d:" % victim in backup[torn.offset :], f"{label}: torn tail is not the victim"
        assert os.path.getsize(torn.path) > torn.offset, f"{label}: segment not sealed after the cut"
    else:
        assert not first.repaired, f"{label}: repaired {first.repaired}"
        assert not broken, f"{label}: unexpected backups {broken}"
    assert len(first.sealed) == 1, f"{label}: the dead chain should be sealed once: {first.sealed}"
    if segment == 4096:  # died in the chain's second segment, just after a rotation
        assert first.sealed[0].endswith("-00000001.wal"), f"{label}: no rotation: {first.sealed}"

    second = recover(directory)
    assert not second.repaired, f"{label}: second recovery repaired again"
    assert not second.sealed, f"{label}: second recovery sealed again"
    report = verify(directory)
    assert not report.torn_tails, label

    seen = {}
    for rec in JournalReader(directory).records():
        n = parse(rec.payload)
        assert n not in seen, f"{label}: record {n} returned twice"
        seen[n] = (rec.writer_id, rec.seq)
    lost = sorted(set(acked) - set(seen))
    assert not lost, f"{label}: acked records lost: {lost}"
    assert all(seen[n] == acked[n] for n in acked), f"{label}: records moved"
    # The victim was fully written (page cache survives a process kill) only after write().
    victim_written = point in ("after_write_before_fsync", "after_fsync_before_ack")
    expected = set(acked) | ({victim} if victim_written else set())
    assert set(seen) == expected, f"{label}: read {sorted(seen)}, expected {sorted(expected)}"
    return len(acked), len(first.repaired)


# (N, max_segment_bytes, payload size): N=4 with 1000-byte payloads in 4096-byte segments dies
# at the first append after a rotation (three records fit in a segment).
SHAPES = [(1, 1 << 26, 200), (5, 1 << 26, 200), (4, 4096, 1000)]


def test_crash_points(tmp_path, subprocess_env, figures):
    runs = acked = repaired = 0
    for point in NAMES:
        for nth, segment, size in SHAPES:
            if point == "mid_record" and nth > 1:
                continue  # test_mid_record_nth_passage: a hybridq bug
            directory = tmp_path / f"{point}-{nth}-{segment}"
            a, r = run_case(directory, subprocess_env, point, nth, segment, size)
            runs += 1
            acked += a
            repaired += r
    assert repaired == sum(1 for nth, _, _ in SHAPES if nth == 1)
    figures(
        f"S2 crash-points points={len(NAMES)} runs={runs} acked={acked} lost=0 torn_tails_repaired={repaired}"
    )


@pytest.mark.parametrize(("nth", "segment", "size"), [s for s in SHAPES if s[0] > 1])
def test_mid_record_nth_passage(tmp_path, subprocess_env, nth, segment, size):
    run_case(tmp_path / "journal", subprocess_env, "mid_record", nth, segment, size)
