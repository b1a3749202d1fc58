"""Journal benchmark: hybridq's journal next to its peers, in one run, interleaved.

Run it through ``scripts/bench-journal`` (see ``docs/benchmarks.md``). Every measurement runs in a
fresh temporary directory under ``--dir``. Within a repetition the durable-append rows (raw, sqlite,
hybridq; 1 and 16 threads) run round-robin in short slices, as do the two batch rows, so a burst of
load from another tenant of the shared machine hits all of them alike; the units run in an order
rotated each repetition. Reported: the median over repetitions, the spread (min..max), and the
target ratios, each computed per repetition and then reduced to its median.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sqlite3
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import benchlib
import crc32c
from benchlib import Contestant, Figure, Sample, latency_us, p50, per_rep, print_field, rotated
from hybridq.journal import JournalWriter
from hybridq.journal.recovery import verify

PAYLOAD = b"x" * 100
VERIFY_PAYLOAD = b"v" * 200
THREADS = 16
WARMUP_OPS = 50
SCAN_PASSES = 2  # verify() and the peer scan each read the journal this many times per repetition
MB = 1_000_000  # MB/s is 10**6 bytes per second of segment file (headers included)


@dataclass
class Config:
    base: str
    repeat: int
    seconds: float
    slice: float
    batch: int
    verify_records: int


# -- the measurements ---------------------------------------------------------------------------


def timed_loop(op: Callable[[], None], seconds: float) -> Sample:
    """Call ``op`` until ``seconds`` have passed; time every call."""
    lat: list[int] = []
    clock = time.perf_counter_ns
    start = clock()
    deadline = start + int(seconds * 1e9)
    now = start
    while now < deadline:
        t0 = clock()
        op()
        now = clock()
        lat.append(now - t0)
    return Sample(len(lat), (now - start) / 1e9, lat)


def threaded_loop(op: Callable[[], None], seconds: float, threads: int) -> Sample:
    """Call ``op`` from ``threads`` threads until ``seconds`` have passed; time every call."""
    lats: list[list[int]] = [[] for _ in range(threads)]
    barrier = threading.Barrier(threads + 1)
    clock = time.perf_counter_ns
    stop_at = [0]

    def worker(lat: list[int]) -> None:
        barrier.wait()
        deadline = stop_at[0]
        now = clock()
        while now < deadline:
            t0 = clock()
            op()
            now = clock()
            lat.append(now - t0)

    pool = [threading.Thread(target=worker, args=(lat,)) for lat in lats]
    for t in pool:
        t.start()
    start = clock()
    stop_at[0] = start + int(seconds * 1e9)
    barrier.wait()
    for t in pool:
        t.join()
    elapsed = (clock() - start) / 1e9
    merged = [x for lat in lats for x in lat]
    return Sample(len(merged), elapsed, merged)


def raw_fd(d: str) -> int:
    return os.open(os.path.join(d, "raw.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)


def setup_raw(d: str, _cfg: Config, threads: int = 1) -> Contestant:
    fd = raw_fd(d)

    def op() -> None:
        os.write(fd, PAYLOAD)
        os.fdatasync(fd)

    return Contestant(op, lambda: os.close(fd), threads)


def setup_sqlite(d: str, _cfg: Config) -> Contestant:
    conn = sqlite3.connect(os.path.join(d, "bench.sqlite"), isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, payload BLOB NOT NULL)")
    sql = "INSERT INTO jobs (payload) VALUES (?)"
    args = (PAYLOAD,)

    def op() -> None:
        conn.execute("BEGIN")
        conn.execute(sql, args)
        conn.execute("COMMIT")

    return Contestant(op, conn.close)


def setup_hybridq(d: str, _cfg: Config, threads: int = 1) -> Contestant:
    writer = JournalWriter(os.path.join(d, "journal"))
    append = writer.append

    def op() -> None:
        append(PAYLOAD)

    return Contestant(op, writer.close, threads, fsyncs=lambda: writer.fsync_count)


def setup_hybridq_batch(d: str, cfg: Config) -> Contestant:
    writer = JournalWriter(os.path.join(d, "journal"))
    batch = [PAYLOAD] * cfg.batch
    return Contestant(lambda: writer.append_many(batch), writer.close, per_op=cfg.batch)


def frame(seed: int, seq: int, payload: bytes) -> bytes:
    """A record in the journal's framing (CRC32C seeded, length, sequence, type 1), minimally."""
    head = struct.pack("<IQI", len(payload), seq, 1)
    return struct.pack("<I", crc32c.crc32c(payload, crc32c.crc32c(head, seed))) + head + payload


def setup_raw_batch(d: str, cfg: Config) -> Contestant:
    """Peer of append_many: frame the batch in plain Python, one write, one fdatasync."""
    fd = raw_fd(d)
    seq = [1]
    seed = crc32c.crc32c(b"saltsalt")
    n = cfg.batch

    def op() -> None:
        first = seq[0]
        os.write(fd, b"".join([frame(seed, first + i, PAYLOAD) for i in range(n)]))
        os.fdatasync(fd)
        seq[0] = first + n

    return Contestant(op, lambda: os.close(fd), per_op=n)


def run_group(
    base: str, cfg: Config, members: list[tuple[str, Callable[[str, Config], Contestant]]], rep: int
) -> dict[str, Sample]:
    """Run each member for ``cfg.seconds`` in total, round-robin in slices of ``cfg.slice``.

    Slicing makes the members of a group see the same disk weather: a burst of load from another
    tenant hits all of them instead of one.
    """

    def measure(c: Contestant) -> Sample:
        if c.threads == 1:
            return timed_loop(c.op, cfg.slice)
        return threaded_loop(c.op, cfg.slice, c.threads)

    return benchlib.run_group(
        base,
        cfg,
        members,
        rep,
        turns=max(1, round(cfg.seconds / cfg.slice)),
        warmup_ops=WARMUP_OPS,
        warm=lambda c: c.op(),  # creates the files (first segment, sqlite tables) before timing
        measure=measure,
        batch_latency=False,
    )


def write_verify_journal(d: str, cfg: Config) -> str:
    path = os.path.join(d, "journal")
    writer = JournalWriter(path)
    try:
        batch = [VERIFY_PAYLOAD] * 1000
        left = cfg.verify_records
        while left > 0:
            writer.append_many(batch[: min(1000, left)])
            left -= 1000
    finally:
        writer.close()
    return path


def scan_verify(path: str, cfg: Config) -> Sample:
    t0 = time.perf_counter()
    report = verify(path)
    elapsed = time.perf_counter() - t0
    if report.records != cfg.verify_records:
        sys.exit(f"bench-journal: verify saw {report.records} records, wrote {cfg.verify_records}")
    return Sample(report.records, elapsed, extra={"mb_s": report.bytes / elapsed / MB})


def scan_raw(path: str, _cfg: Config) -> Sample:
    """Peer of verify: read each segment in 1 MiB chunks, unpack and CRC-check each record."""
    names = sorted(n for n in os.listdir(path) if n.endswith(".wal"))
    unpack = struct.Struct("<IIQI").unpack_from
    crc = crc32c.crc32c
    t0 = time.perf_counter()
    records = total = 0
    for name in names:
        with open(os.path.join(path, name), "rb", buffering=0) as f:
            header = f.read(64)
            seed = crc(header[20:28])
            buf = b""
            while True:
                data = f.read(1 << 20)
                if not data:
                    break
                buf += data
                view = memoryview(buf)
                p = 0
                n = len(buf)
                while p + 20 <= n:
                    stored, length, _seq, _type = unpack(buf, p)
                    end = p + 20 + length
                    if end > n:
                        break
                    if crc(view[p + 4 : end], seed) != stored:
                        sys.exit(f"bench-journal: raw scan CRC mismatch in {name}")
                    records += 1
                    p = end
                view.release()
                buf = buf[p:]
            total += os.fstat(f.fileno()).st_size
    elapsed = time.perf_counter() - t0
    records -= 2 * len(names)  # the seal records
    return Sample(records, elapsed, extra={"mb_s": total / elapsed / MB})


def run_scans(base: str, cfg: Config, rep: int) -> dict[str, Sample]:
    """Write one journal with append_many, then scan it alternately with verify() and the peer."""
    d = tempfile.mkdtemp(prefix="scan-", dir=base)
    try:
        path = write_verify_journal(d, cfg)
        order = rotated([("verify", scan_verify), ("rawscan", scan_raw)], rep)
        out = {key: Sample(0, 0.0) for key, _ in order}
        nbytes = dict.fromkeys(out, 0.0)
        for _ in range(SCAN_PASSES):
            for key, scan in order:
                gc.collect()
                part = scan(path, cfg)
                out[key].count += part.count
                out[key].seconds += part.seconds
                nbytes[key] += part.extra["mb_s"] * part.seconds
        for key, sample in out.items():
            sample.extra["mb_s"] = nbytes[key] / sample.seconds
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


@dataclass
class Row:
    key: str
    label: str
    latency: bool = True


ROWS = [
    Row("raw1", "raw write+fdatasync, 1 thread"),
    Row("sqlite1", "sqlite3 WAL sync=FULL, commit/row, 1 thread"),
    Row("hq1", "hybridq append, 1 thread"),
    Row("raw16", "raw write+fdatasync, 16 threads, shared fd"),
    Row("hq16", "hybridq append, 16 threads"),
    Row("rawbatch", "raw framing + 1 fdatasync per 1,000 (peer)", latency=False),
    Row("hqbatch", "hybridq append_many of 1,000 x 100 B", latency=False),
    Row("rawscan", "raw CRC scan, struct+crc32c (peer)", latency=False),
    Row("verify", "hybridq verify()", latency=False),
]
LABELS = {r.key: r.label for r in ROWS}

APPENDS = [
    ("raw1", setup_raw),
    ("sqlite1", setup_sqlite),
    ("hq1", setup_hybridq),
    ("raw16", lambda d, c: setup_raw(d, c, THREADS)),
    ("hq16", lambda d, c: setup_hybridq(d, c, THREADS)),
]
BATCHES = [("rawbatch", setup_raw_batch), ("hqbatch", setup_hybridq_batch)]


#: What one repetition runs, in an order rotated by one each repetition.
UNITS: list[Callable[[str, Config, int], dict[str, Sample]]] = [
    lambda base, cfg, rep: run_group(base, cfg, APPENDS, rep),
    lambda base, cfg, rep: run_group(base, cfg, BATCHES, rep),
    run_scans,
]


# -- reporting ----------------------------------------------------------------------------------


def print_header(cfg: Config, args: argparse.Namespace) -> dict[str, str]:
    version = benchlib.version
    header = benchlib.print_machine(
        "hybridq journal benchmark",
        cfg.base,
        f"hybridq {version('hybridq')}, crc32c {version('crc32c')}, sqlite {sqlite3.sqlite_version}",
        fs_note=f" (st_dev={os.stat(cfg.base).st_dev})",
    )
    mode = "quick" if args.quick else "default"
    header["run"] = (
        f"mode={mode}, {cfg.repeat} repetitions; per repetition each append/batch row runs "
        f"{cfg.seconds:g} s in round-robin slices of {cfg.slice:g} s; payload 100 B; verify and "
        f"the peer scan alternate {SCAN_PASSES}x each over one journal of {cfg.verify_records:,} x 200 B"
    )
    print_field("run", header["run"])
    print()
    return header


def print_table(results: dict[str, list[Sample]]) -> None:
    head = ("measurement", "records/s (median)", "spread (min..max)", "p50 us", "p99 us", "other")
    rows = [head]
    for b in ROWS:
        samples = results[b.key]
        med, rng = benchlib.spread([s.rate for s in samples], ",.0f")
        p50s = p99s = "-"
        other = ""
        if b.latency:
            p50s = benchlib.med_range([latency_us(s, 50) for s in samples], ",.0f")
            p99s = benchlib.med_range([latency_us(s, 99) for s in samples], ",.0f")
        if "per_fsync" in samples[0].extra:
            m, r = benchlib.spread([s.extra["per_fsync"] for s in samples], ".2f")
            other = f"{m} records/fsync ({r})"
        if "mb_s" in samples[0].extra:
            m, r = benchlib.spread([s.extra["mb_s"] for s in samples], ".1f")
            other = f"{m} MB/s ({r})"
        rows.append((b.label, med, rng, p50s, p99s, other))
    benchlib.print_rows(rows, {1, 2, 3, 4})


def ratio_line(target_id: str, name: str, ratios: list[float], goal: float, what: str) -> Figure:
    return benchlib.target(target_id, name, ratios, goal, what=what, widths=(46, 6))


def print_ratios(results: dict[str, list[Sample]]) -> list[Figure]:
    """Print the targets and the context ratios; return them (targets first)."""
    print("targets (ratio per repetition, median of the ratios):")
    targets = [
        ratio_line(
            "J1",
            "1-thread durable append / raw fdatasync loop",
            per_rep(results, "hq1", "raw1"),
            0.8,
            "hybridq append 1 thread vs raw write+fdatasync 1 thread",
        ),
        ratio_line(
            "J2",
            "16-thread append / 1-thread append",
            per_rep(results, "hq16", "hq1"),
            3.0,
            "hybridq append 16 threads vs 1 thread",
        ),
        ratio_line(
            "J3",
            "append_many(1,000) / 200,000 records/s",
            [s.rate / 200_000 for s in results["hqbatch"]],
            1.0,
            f"median {statistics.median(s.rate for s in results['hqbatch']):,.0f} records/s",
        ),
        ratio_line(
            "F3",
            "verify / 150 MB/s",
            [s.extra["mb_s"] / 150 for s in results["verify"]],
            1.0,
            f"median {statistics.median(s.extra['mb_s'] for s in results['verify']):.1f} MB/s",
        ),
    ]
    print()
    context = benchlib.print_context(
        [
            ("hybridq 1 thread / sqlite3 WAL 1 thread", per_rep(results, "hq1", "sqlite1")),
            ("hybridq 16 threads / raw 16 threads shared fd", per_rep(results, "hq16", "raw16")),
            ("raw 16 threads shared fd / raw 1 thread", per_rep(results, "raw16", "raw1")),
            ("hybridq 1-thread p50 / raw fdatasync p50", per_rep(results, "hq1", "raw1", p50)),
            ("hybridq append_many / raw framing batch", per_rep(results, "hqbatch", "rawbatch")),
            ("hybridq verify / raw CRC scan (records/s)", per_rep(results, "verify", "rawscan")),
        ],
        46,
    )
    benchlib.print_result([f.ok for f in targets])
    return targets + context


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = benchlib.arg_parser("scripts/bench-journal", __doc__)
    p.add_argument(
        "--dir",
        default=None,
        help="parent of the temporary directories (default: a new tempdir); put it on the disk to measure",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="seconds each append/batch row runs per repetition (default 2.5; 0.4 with --quick)",
    )
    benchlib.add_json_option(p)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    repeat = benchlib.pick(args.repeat, args.quick, 2, 5)
    seconds = benchlib.pick(args.seconds, args.quick, 0.4, 2.5)
    if repeat < 1 or seconds <= 0:
        sys.exit("bench-journal: --repeat must be >= 1 and --seconds > 0")
    base = benchlib.make_base("bench-journal", args.dir)
    cfg = Config(
        base=base,
        repeat=repeat,
        seconds=seconds,
        slice=min(0.5, seconds / 4),
        batch=1000,
        verify_records=50_000 if args.quick else 500_000,
    )
    try:
        header = print_header(cfg, args)
        results = benchlib.run_repetitions(
            repeat,
            [lambda rep, unit=unit: unit(base, cfg, rep) for unit in UNITS],
            LABELS,
            46,
            lambda _key, sample: f"{sample.rate:>12,.0f} records/s",
        )
        print_table(results)
        figures = print_ratios(results)
        if args.json:
            benchlib.write_json(
                args.json, "bench-journal", header, benchlib.json_rows(results, LABELS, "records/s"), figures
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
