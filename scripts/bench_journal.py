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
import platform
import shutil
import sqlite3
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import crc32c
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


@dataclass
class Sample:
    """One measurement of one repetition."""

    records: int
    seconds: float
    lat_ns: list[int] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.records / self.seconds


def percentile(sorted_ns: list[int], q: float) -> float:
    """Nearest-rank percentile of sorted nanosecond latencies, in microseconds."""
    if not sorted_ns:
        return float("nan")
    rank = max(0, min(len(sorted_ns) - 1, round(q / 100 * len(sorted_ns)) - 1))
    return sorted_ns[rank] / 1000


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


@dataclass
class Contestant:
    """One side of a throughput comparison, set up in its own fresh directory."""

    op: Callable[[], None]
    close: Callable[[], None]
    threads: int = 1
    records_per_op: int = 1
    fsyncs: Callable[[], int] | None = None  # hybridq's writer.fsync_count


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
    return Contestant(lambda: writer.append_many(batch), writer.close, records_per_op=cfg.batch)


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

    return Contestant(op, lambda: os.close(fd), records_per_op=n)


def run_group(
    base: str, cfg: Config, members: list[tuple[str, Callable[[str, Config], Contestant]]], rep: int
) -> dict[str, Sample]:
    """Run each member for ``cfg.seconds`` in total, round-robin in slices of ``cfg.slice``.

    Slicing makes the members of a group see the same disk weather: a burst of load from another
    tenant hits all of them instead of one.
    """
    dirs: list[str] = []
    live: dict[str, Contestant] = {}
    samples = {key: Sample(0, 0.0) for key, _ in members}
    try:
        for key, setup in members:
            dirs.append(tempfile.mkdtemp(prefix=f"{key}-", dir=base))
            c = live[key] = setup(dirs[-1], cfg)
            for _ in range(max(1, WARMUP_OPS // c.records_per_op)):
                c.op()  # creates the files (first segment, sqlite tables) before timing
        gc.collect()
        rounds = max(1, round(cfg.seconds / cfg.slice))
        fsyncs = dict.fromkeys(live, 0)
        for r in range(rounds):
            shift = (r + rep) % len(members)
            for key, _ in members[shift:] + members[:shift]:
                c = live[key]
                before = c.fsyncs() if c.fsyncs else 0
                if c.threads == 1:
                    part = timed_loop(c.op, cfg.slice)
                else:
                    part = threaded_loop(c.op, cfg.slice, c.threads)
                if c.fsyncs:
                    fsyncs[key] += c.fsyncs() - before
                sample = samples[key]
                sample.records += part.records * c.records_per_op
                sample.seconds += part.seconds
                if c.records_per_op == 1:
                    sample.lat_ns.extend(part.lat_ns)
        for key, c in live.items():
            if c.fsyncs:
                samples[key].extra["per_fsync"] = samples[key].records / max(1, fsyncs[key])
    finally:
        for c in live.values():
            c.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return samples


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
        order = [("verify", scan_verify), ("rawscan", scan_raw)]
        if rep % 2:
            order.reverse()
        out = {key: Sample(0, 0.0) for key, _ in order}
        nbytes = dict.fromkeys(out, 0.0)
        for _ in range(SCAN_PASSES):
            for key, scan in order:
                gc.collect()
                part = scan(path, cfg)
                out[key].records += part.records
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


def mount_of(path: str) -> tuple[str, str, str]:
    """(mount point, device, filesystem type) of the mount holding ``path``."""
    real = os.path.realpath(path)
    best = ("?", "?", "?")
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        dev, mnt, fstype = line.split()[:3]
        mnt = mnt.replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
            best = (mnt, dev, fstype)
    return best


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def git_revision() -> str:
    """Commit of the working tree, and whether hybridq/ has uncommitted changes."""
    root = str(Path(__file__).resolve().parent.parent)
    try:
        rev = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "hybridq"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return rev + (" (hybridq/ has uncommitted changes)" if dirty else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def print_header(cfg: Config, args: argparse.Namespace) -> None:
    mnt, dev, fstype = mount_of(cfg.base)
    st = os.stat(cfg.base)
    print("hybridq journal benchmark")
    print(f"  date        {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"  machine     nproc={os.cpu_count()}  cpu={cpu_model()}  loadavg={os.getloadavg()[0]:.2f}")
    print(f"  kernel      {platform.system()} {platform.release()} ({platform.machine()})")
    print(f"  python      {platform.python_version()} ({platform.python_implementation()})")
    print(
        f"  versions    hybridq {version('hybridq')}, crc32c {version('crc32c')}, sqlite {sqlite3.sqlite_version}"
    )
    print(f"  commit      {git_revision()}")
    print(f"  dir         {cfg.base}")
    print(f"  filesystem  {fstype} on {dev}, mounted at {mnt} (st_dev={st.st_dev})")
    mode = "quick" if args.quick else "default"
    print(
        f"  run         mode={mode}, {cfg.repeat} repetitions; per repetition each append/batch row runs "
        f"{cfg.seconds:g} s in round-robin slices of {cfg.slice:g} s; payload 100 B; verify and "
        f"the peer scan alternate {SCAN_PASSES}x each over one journal of {cfg.verify_records:,} x 200 B"
    )
    print()


def spread(values: list[float], fmt: str) -> tuple[str, str]:
    return format(statistics.median(values), fmt), f"{min(values):{fmt}}..{max(values):{fmt}}"


def print_table(results: dict[str, list[Sample]]) -> None:
    head = ("measurement", "records/s (median)", "spread (min..max)", "p50 us", "p99 us", "other")
    rows = [head]
    for b in ROWS:
        samples = results[b.key]
        med, rng = spread([s.rate for s in samples], ",.0f")
        p50 = p99 = "-"
        other = ""
        if b.latency:
            p50s = [percentile(sorted(s.lat_ns), 50) for s in samples]
            p99s = [percentile(sorted(s.lat_ns), 99) for s in samples]
            p50 = f"{statistics.median(p50s):,.0f} ({min(p50s):,.0f}..{max(p50s):,.0f})"
            p99 = f"{statistics.median(p99s):,.0f} ({min(p99s):,.0f}..{max(p99s):,.0f})"
        if "per_fsync" in samples[0].extra:
            m, r = spread([s.extra["per_fsync"] for s in samples], ".2f")
            other = f"{m} records/fsync ({r})"
        if "mb_s" in samples[0].extra:
            m, r = spread([s.extra["mb_s"] for s in samples], ".1f")
            other = f"{m} MB/s ({r})"
        rows.append((b.label, med, rng, p50, p99, other))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    right = {1, 2, 3, 4}
    for n, row in enumerate(rows):
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    print()


def ratio_line(name: str, ratios: list[float], goal: float, what: str) -> bool:
    med = statistics.median(ratios)
    ok = med >= goal
    verdict = "PASS" if ok else "FAIL"
    print(
        f"  {verdict}  {name:<46} {med:6.2f}x  (spread {min(ratios):.2f}..{max(ratios):.2f})  "
        f"target >= {goal:g}x  [{what}]"
    )
    return ok


def print_ratios(results: dict[str, list[Sample]]) -> None:
    def per_rep(num: str, den: str, f: Callable[[Sample], float] = lambda s: s.rate) -> list[float]:
        return [f(a) / f(b) for a, b in zip(results[num], results[den], strict=True)]

    print("targets (ratio per repetition, median of the ratios):")
    ok = [
        ratio_line(
            "1-thread durable append / raw fdatasync loop",
            per_rep("hq1", "raw1"),
            0.8,
            "hybridq append 1 thread vs raw write+fdatasync 1 thread",
        ),
        ratio_line(
            "16-thread append / 1-thread append",
            per_rep("hq16", "hq1"),
            3.0,
            "hybridq append 16 threads vs 1 thread",
        ),
        ratio_line(
            "append_many(1,000) / 200,000 records/s",
            [s.rate / 200_000 for s in results["hqbatch"]],
            1.0,
            f"median {statistics.median(s.rate for s in results['hqbatch']):,.0f} records/s",
        ),
        ratio_line(
            "verify / 150 MB/s",
            [s.extra["mb_s"] / 150 for s in results["verify"]],
            1.0,
            f"median {statistics.median(s.extra['mb_s'] for s in results['verify']):.1f} MB/s",
        ),
    ]
    print()
    print("context (no target; same-run ratios):")

    def p50(s: Sample) -> float:
        return percentile(sorted(s.lat_ns), 50)

    for name, values in (
        ("hybridq 1 thread / sqlite3 WAL 1 thread", per_rep("hq1", "sqlite1")),
        ("hybridq 16 threads / raw 16 threads shared fd", per_rep("hq16", "raw16")),
        ("raw 16 threads shared fd / raw 1 thread", per_rep("raw16", "raw1")),
        ("hybridq 1-thread p50 / raw fdatasync p50", per_rep("hq1", "raw1", p50)),
        ("hybridq append_many / raw framing batch", per_rep("hqbatch", "rawbatch")),
        ("hybridq verify / raw CRC scan (records/s)", per_rep("verify", "rawscan")),
    ):
        print(
            f"        {name:<46} {statistics.median(values):6.2f}x  (spread {min(values):.2f}..{max(values):.2f})"
        )
    print()
    failed = ok.count(False)
    if failed:
        print(f"RESULT: {failed} of {len(ok)} targets FAIL (this is a report; exit status stays 0)")
    else:
        print(f"RESULT: all {len(ok)} targets PASS")


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/bench-journal", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--repeat", type=int, default=None, help="interleaved repetitions (default 5; 2 with --quick)"
    )
    p.add_argument("--quick", action="store_true", help="small counts, for smoke testing (< 30 s)")
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
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    repeat = args.repeat if args.repeat is not None else (2 if args.quick else 5)
    seconds = args.seconds if args.seconds is not None else (0.4 if args.quick else 2.5)
    if repeat < 1 or seconds <= 0:
        sys.exit("bench-journal: --repeat must be >= 1 and --seconds > 0")
    if args.dir is not None:
        os.makedirs(args.dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="bench-journal-", dir=args.dir)
    cfg = Config(
        base=base,
        repeat=repeat,
        seconds=seconds,
        slice=min(0.5, seconds / 4),
        batch=1000,
        verify_records=50_000 if args.quick else 500_000,
    )
    try:
        print_header(cfg, args)
        results: dict[str, list[Sample]] = {r.key: [] for r in ROWS}
        for rep in range(repeat):
            shift = rep % len(UNITS)
            for unit in UNITS[shift:] + UNITS[:shift]:
                for key, sample in unit(base, cfg, rep).items():
                    results[key].append(sample)
                    print(
                        f"  [rep {rep + 1}/{repeat}] {LABELS[key]:<46} {sample.rate:>12,.0f} records/s",
                        file=sys.stderr,
                        flush=True,
                    )
        print(file=sys.stderr)
        print_table(results)
        print_ratios(results)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
