"""S7 (docs/reliability.md): I/O errors. EIO/ENOSPC on the Nth write/fdatasync/fsync/rename/dir fsync/open,
and a real short write (RLIMIT_FSIZE -> EFBIG) in a child process.

Every case checks the same contract: the append that hit the error raised ``JournalIOError``
(never returned), later appends succeed in a new chain, and after ``recover()`` every acknowledged
record is there exactly once, byte for byte, failed records are absent or intact, and ``verify()``
finds no corruption.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from hybridq.errors import JournalIOError
from hybridq.journal import JournalReader, JournalWriter
from hybridq.journal.recovery import recover, verify

from tests.conftest import PYTHON
from tests.support.faulty import FaultyFileOps

RECORDS = 40
SEGMENT = 4096  # the minimum: a rotation every ~10 records
OPS = ("write", "fdatasync", "fsync", "replace", "fsync_dir", "open")
ERRNOS = (errno.EIO, errno.ENOSPC)


def payload(i: int, size: int | None = None) -> bytes:
    """Deterministic payload of record ``i`` (150-449 bytes unless ``size``), so any damage shows."""
    size = 150 + (i * 97) % 300 if size is None else size
    body = hashlib.sha256(str(i).encode()).hexdigest().encode() * 15
    return (b"S7:%06d:%04d:" % (i, size) + body)[:size]


def parse(data: bytes) -> int:
    """The id in a payload; fails unless the payload is exactly what record ``id`` was."""
    assert data.startswith(b"S7:"), f"garbage record {data[:40]!r}"
    i, size = int(data[3:9]), int(data[10:14])
    assert data == payload(i, size), f"record {i} does not hold its payload"
    return i


def run_appends(directory: Path, ops: FaultyFileOps, label: str):
    """Append RECORDS records (some in batches) through ``ops``; returns (acked, failed, errors)."""
    directory.mkdir(mode=0o700)
    writer = JournalWriter(directory, max_segment_bytes=SEGMENT, fileops=ops)
    acked: dict[int, tuple[str, int]] = {}
    failed: set[int] = set()
    errors: list[JournalIOError] = []
    failed_chain: str | None = None
    try:
        i = 0
        while i < RECORDS:
            ids = list(range(i, min(i + 3, RECORDS))) if i % 7 == 6 else [i]
            i = ids[-1] + 1
            injected, chain = ops.injected, writer.writer_id
            error = None
            try:
                rids = writer.append_many([payload(n) for n in ids])
            except JournalIOError as exc:
                error = exc
            if error is not None:
                assert ops.injected > injected, f"{label}: JournalIOError without an injected fault: {error}"
                assert error.errno == ops.err, f"{label}: errno {error.errno} is not the injected {ops.err}"
                errors.append(error)
                failed.update(ids)
                failed_chain = chain
                continue
            assert ops.injected == injected, f"{label}: append of {ids} returned although a fault hit it"
            if failed_chain is not None:
                assert rids[0].writer_id != failed_chain, f"{label}: kept writing the failed chain"
                failed_chain = None
            for n, rid in zip(ids, rids, strict=True):
                acked[n] = (rid.writer_id, rid.seq)
    except BaseException:
        with contextlib.suppress(JournalIOError):
            writer.close()
        raise
    # A fault may also hit close(), which seals the last segment: it must raise, typed.
    injected = ops.injected
    error = None
    try:
        writer.close()
    except JournalIOError as exc:
        error = exc
    if error is None:
        assert ops.injected == injected, f"{label}: close() returned although a fault hit it"
    else:
        assert ops.injected > injected, f"{label}: close() failed without an injected fault: {error}"
        assert error.errno == ops.err, f"{label}: errno {error.errno} is not the injected {ops.err}"
        errors.append(error)
    return acked, failed, errors


def check_journal(directory: Path, acked: dict[int, tuple[str, int]], failed: set[int], label: str) -> int:
    """Recover, verify and read back; returns the number of torn tails repaired."""
    first = recover(directory)
    second = recover(directory)
    assert not second.repaired, f"{label}: second recovery repaired again: {second.repaired}"
    assert not second.sealed, f"{label}: second recovery sealed again: {second.sealed}"
    report = verify(directory)  # raises JournalCorruption on damage
    assert not report.torn_tails, f"{label}: torn tails left after recovery: {report.torn_tails}"
    seen: dict[int, tuple[str, int]] = {}
    for rec in JournalReader(directory).records():
        n = parse(rec.payload)
        assert n not in seen, f"{label}: record {n} returned twice"
        seen[n] = (rec.writer_id, rec.seq)
    lost = sorted(set(acked) - set(seen))
    assert not lost, f"{label}: acknowledged records lost: {lost}"
    moved = {n: (acked[n], seen[n]) for n in acked if acked[n] != seen[n]}
    assert not moved, f"{label}: records not where their ack said: {moved}"
    strays = sorted(set(seen) - set(acked) - failed)
    assert not strays, f"{label}: records never appended: {strays}"
    assert report.records == len(seen)
    return len(first.repaired)


def test_injected_io_errors(tmp_path, figures):
    dry = FaultyFileOps()  # counts only: how many calls of each op a clean run (and close) makes
    acked, failed, errors = run_appends(tmp_path / "dry", dry, "dry run")
    assert len(acked) == RECORDS
    assert not failed
    assert not errors
    counts = dict(dry.calls)
    assert counts["replace"] >= 4, f"expected several rotations: {counts}"

    cases = injections = typed = total_acked = repaired = 0
    for op in OPS:
        for err in ERRNOS:
            for nth in range(1, counts[op] + 1):
                label = f"{op}#{nth} {errno.errorcode[err]}"
                ops = FaultyFileOps(op, nth, err)
                directory = tmp_path / f"{op}-{nth}-{err}"
                acked, failed, errors = run_appends(directory, ops, label)
                assert ops.injected == 1, f"{label}: fault not injected"
                assert len(errors) == 1, f"{label}: {len(errors)} typed errors"
                assert len(acked) + len(failed) == RECORDS
                assert len(acked) >= RECORDS - 3, f"{label}: appends after the error failed"
                repaired += check_journal(directory, acked, failed, label)
                cases += 1
                injections += ops.injected
                typed += len(errors)
                total_acked += len(acked)
    assert injections == typed == cases
    figures(
        f"S7 io-errors injections={injections} acked={total_acked} lost=0 typed_errors={typed} "
        f"torn_tails_repaired={repaired}"
    )


class _WriteKinds(FaultyFileOps):
    """Counts only, and remembers what each write carried: header, data or seal records."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: list[str] = []

    def write(self, fd, data):
        kind = {0x01: "data", 0xFF: "seal"}.get(data[16], "?")
        self.kinds.append("header" if bytes(data[:8]) == b"HYBRIDQJ" else kind)
        return super().write(fd, data)


def test_torn_write(tmp_path):
    """EIO after half of a segment header or of a data batch reached the file."""
    dry = _WriteKinds()
    run_appends(tmp_path / "dry", dry, "dry run")
    assert {"header", "data", "seal"} <= set(dry.kinds), dry.kinds
    # Torn seal writes are test_real_short_write_on_seal's (they hit a hybridq bug).
    for nth, kind in enumerate(dry.kinds, 1):
        if kind == "seal":
            continue
        label = f"torn {kind} write#{nth}"
        ops = FaultyFileOps("write", nth, errno.EIO, torn=True)
        acked, failed, errors = run_appends(tmp_path / str(nth), ops, label)
        assert len(errors) == 1, label
        check_journal(tmp_path / str(nth), acked, failed, label)


# -- real short write: RLIMIT_FSIZE makes write(2) short, then fail with EFBIG ------------------

CHILD = textwrap.dedent(
    """
    import json, resource, signal, sys
    from hybridq.errors import JournalCorruption, JournalIOError
    from hybridq.journal import JournalWriter
    from tests.crash.test_s7_io_errors import payload

    directory, limit, segment, after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    size = int(sys.argv[5]) or None
    writer = JournalWriter(directory, max_segment_bytes=segment)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    n, error, failed = 0, None, []
    while n < 100000:
        try:
            rid = writer.append(payload(n, size))
        except JournalIOError as exc:
            error = {"op": exc.op, "errno": exc.errno}
            failed.append(n)
            n += 1
            break
        print(json.dumps({"acked": n, "chain": rid.writer_id, "seq": rid.seq}), flush=True)
        n += 1
    for _ in range(after):  # a new chain in a new file: far from the limit again
        rid = writer.append(payload(n, size))
        print(json.dumps({"acked": n, "chain": rid.writer_id, "seq": rid.seq}), flush=True)
        n += 1
    writer.close()
    print(json.dumps({"error": error, "failed": failed}), flush=True)
    """
)


def run_short_write_child(directory: Path, env: dict[str, str], limit: int, segment: int, size: int = 0):
    proc = subprocess.run(
        [PYTHON, "-c", CHILD, str(directory), str(limit), str(segment), "3", str(size)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    acked = {d["acked"]: (d["chain"], d["seq"]) for d in lines if "acked" in d}
    (end,) = [d for d in lines if "error" in d]
    return acked, end


def test_real_short_write_on_data_record(journal_dir, subprocess_env, figures):
    acked, end = run_short_write_child(journal_dir, subprocess_env, 20000, 1 << 26)
    assert end["error"] == {"op": "write", "errno": errno.EFBIG}, end
    failed = set(end["failed"])
    assert len(acked) > 20
    repaired = check_journal(journal_dir, acked, failed, "RLIMIT_FSIZE data record")
    figures(f"S7 short-write efbig=data-record acked={len(acked)} lost=0 typed_errors=1 repaired={repaired}")


@pytest.mark.parametrize(
    "limit",
    [
        # The cut falls after the first seal record, inside the second, and inside the first:
        # the writer takes the partial seal back off, so the segment simply ends unsealed.
        pytest.param(8128 + 36, id="after-first-seal-record"),
        pytest.param(8192, id="inside-second-seal-record"),
        pytest.param(8128 + 20, id="inside-first-seal-record"),
    ],
)
def test_real_short_write_on_seal(journal_dir, subprocess_env, limit):
    """Segment 0 holds 63 records of 128 bytes (64 + 63 * 128 = 8128); the 64th does not fit in
    8192, so the writer seals: the 72 seal bytes cross the file size limit."""
    acked, end = run_short_write_child(journal_dir, subprocess_env, limit, 8192, size=108)
    assert end["error"] == {"op": "write", "errno": errno.EFBIG}, end
    assert len(acked) == 63 + 3
    check_journal(journal_dir, acked, set(end["failed"]), f"RLIMIT_FSIZE={limit} during seal")
