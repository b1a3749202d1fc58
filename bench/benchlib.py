"""What the benchmark scripts share: samples, interleaving, statistics, the machine header, the report.

Every benchmark in ``bench/`` imports this module (they run as ``python bench/X.py``, through
``scripts/bench*``, so ``bench/`` is on ``sys.path``). The timing loops themselves stay in each
script: they measure
different things (a time budget, a job count, one call). What a script prints it also returns
(the header's fields, its :class:`Figure` targets and context ratios), and :func:`write_json`
dumps that with every row's per-repetition values for ``--json``: ``scripts/bench`` reads those
files, so nothing is computed twice.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from hybridq.testing.embedded import RedisServer

T = TypeVar("T")
C = TypeVar("C")  # a script's Config


@dataclass
class Sample:
    """One measurement of one repetition: ``count`` records or jobs in ``seconds``."""

    count: int
    seconds: float
    lat_ns: list[int] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds else float("nan")


def _rank(n: int, q: float) -> int:
    """The index of the nearest-rank percentile ``q`` (0 to 100) among ``n`` sorted values."""
    return max(0, min(n - 1, round(q / 100 * n) - 1))


def percentile(sorted_ns: list[int], q: float) -> float:
    """Nearest-rank percentile of sorted nanosecond latencies, in microseconds."""
    if not sorted_ns:
        return float("nan")
    return sorted_ns[_rank(len(sorted_ns), q)] / 1000


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0 to 100) of ``values`` in any order, in their own unit."""
    if not values:
        return float("nan")
    return sorted(values)[_rank(len(values), q)]


def latency_us(s: Sample, q: float) -> float:
    """Percentile ``q`` of one sample's latencies, in microseconds."""
    return percentile(sorted(s.lat_ns), q)


def p50(s: Sample) -> float:
    return latency_us(s, 50)


def rate(s: Sample) -> float:
    return s.rate


# -- interleaving -------------------------------------------------------------------------------


def rotated(items: Sequence[T], shift: int) -> list[T]:
    """``items`` rotated left by ``shift`` (modulo its length): the order of one turn or repetition."""
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


@dataclass
class Contestant:
    """One side of a comparison, set up in its own fresh directory; ``op`` does ``per_op`` records/jobs."""

    op: Callable[..., object]
    close: Callable[[], None] = lambda: None
    threads: int = 1
    per_op: int = 1
    fsyncs: Callable[[], int] | None = None  # hybridq's writer.fsync_count


def run_group(
    base: str,
    cfg: C,
    members: Sequence[tuple[str, Callable[[str, C], Contestant]]],
    rep: int,
    *,
    turns: int,
    warmup_ops: int,
    warm: Callable[[Contestant], object],
    measure: Callable[[Contestant], Sample],
    batch_latency: bool,
) -> dict[str, Sample]:
    """Set up each member in a fresh directory under ``base``, then run ``measure`` round-robin.

    ``turns`` rounds; in each the members take turns in an order rotated by one per round (and per
    repetition), so a burst of load from another tenant hits all of them instead of one. Each
    member is warmed up first with ``warm`` (files, connections, imports before timing). Latencies
    of members doing more than one record per op are kept only with ``batch_latency``.
    """
    dirs: list[str] = []
    live: dict[str, Contestant] = {}
    samples = {key: Sample(0, 0.0) for key, _ in members}
    try:
        for key, setup in members:
            dirs.append(tempfile.mkdtemp(prefix=f"{key}-", dir=base))
            c = live[key] = setup(dirs[-1], cfg)
            for _ in range(max(1, warmup_ops // c.per_op)):
                warm(c)
        gc.collect()
        fsyncs = dict.fromkeys(live, 0)
        for turn in range(turns):
            for key, _ in rotated(members, turn + rep):
                c = live[key]
                before = c.fsyncs() if c.fsyncs else 0
                part = measure(c)
                if c.fsyncs:
                    fsyncs[key] += c.fsyncs() - before
                s = samples[key]
                s.count += part.count * c.per_op
                s.seconds += part.seconds
                if batch_latency or c.per_op == 1:
                    s.lat_ns.extend(part.lat_ns)
        for key, c in live.items():
            if c.fsyncs:
                samples[key].extra["per_fsync"] = samples[key].count / max(1, fsyncs[key])
    finally:
        for c in live.values():
            c.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return samples


def run_repetitions(
    repeat: int,
    units: Sequence[Callable[[int], dict[str, Sample]]],
    labels: dict[str, str],
    label_width: int,
    shown: Callable[[str, Sample], str],
) -> dict[str, list[Sample]]:
    """Run ``units`` ``repeat`` times, in an order rotated each repetition; progress to stderr."""
    results: dict[str, list[Sample]] = {key: [] for key in labels}
    for rep in range(repeat):
        for unit in rotated(units, rep):
            for key, sample in unit(rep).items():
                results[key].append(sample)
                print(
                    f"  [rep {rep + 1}/{repeat}] {labels[key]:<{label_width}} {shown(key, sample)}",
                    file=sys.stderr,
                    flush=True,
                )
    print(file=sys.stderr)
    return results


def per_rep(
    results: dict[str, list[Sample]], num: str, den: str, f: Callable[[Sample], float] = rate
) -> list[float]:
    """``f(num) / f(den)`` for each repetition."""
    return [f(a) / f(b) for a, b in zip(results[num], results[den], strict=True)]


# -- options ------------------------------------------------------------------------------------


def arg_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A parser with the options every benchmark has first: --repeat and --quick."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n", maxsplit=1)[0])
    p.add_argument(
        "--repeat", type=int, default=None, help="interleaved repetitions (default 5; 2 with --quick)"
    )
    p.add_argument("--quick", action="store_true", help="small counts, for smoke testing (< 30 s)")
    return p


def pick(value: T | None, quick: bool, quick_default: T, default: T) -> T:
    """An option's value if given, else its --quick or its normal default."""
    if value is not None:
        return value
    return quick_default if quick else default


def make_base(name: str, parent: str | None) -> str:
    """A fresh temporary directory for the run, under ``parent`` (created if need be)."""
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{name}-", dir=parent)


# -- machine facts ------------------------------------------------------------------------------


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


def print_field(label: str, value: str) -> None:
    """One line of the header: ``  label       value``."""
    print(f"  {label:<11} {value}")


def print_machine(
    title: str,
    base: str,
    versions: str,
    *,
    extra: Sequence[tuple[str, str]] = (),
    dir_label: str = "dir",
    fs_note: str = "",
) -> dict[str, str]:
    """The header: date, machine, kernel, python, ``versions``, ``extra`` lines, commit, directory.

    Returns the fields as printed (label -> value), for ``--json``.
    """
    mnt, dev, fstype = mount_of(base)
    fields = [
        ("date", time.strftime("%Y-%m-%d %H:%M:%S %Z")),
        ("machine", f"nproc={os.cpu_count()}  cpu={cpu_model()}  loadavg={os.getloadavg()[0]:.2f}"),
        ("kernel", f"{platform.system()} {platform.release()} ({platform.machine()})"),
        ("python", f"{platform.python_version()} ({platform.python_implementation()})"),
        ("versions", versions),
        *extra,
        ("commit", git_revision()),
        (dir_label, base),
        ("filesystem", f"{fstype} on {dev}, mounted at {mnt}{fs_note}"),
    ]
    print(title)
    for label, value in fields:
        print_field(label, value)
    return {"title": title, **dict(fields)}


def print_redis_machine(title: str, base: str, server: RedisServer) -> dict[str, str]:
    """The header of a benchmark against hybridq, rq and a private redis-server; its fields."""
    with server.client() as client:
        info = client.info("server")
    redis = (
        f"redis-server {info.get('redis_version', '?')} ({server.executable}), {server.url}, no persistence"
    )
    return print_machine(
        title,
        base,
        f"hybridq {version('hybridq')}, rq {version('rq')}, redis-py {version('redis')}",
        extra=[("redis", redis)],
        dir_label="journal dir",
    )


# -- the report ---------------------------------------------------------------------------------


def spread(values: list[float], fmt: str) -> tuple[str, str]:
    """(median, ``min..max``) of ``values``, each formatted with ``fmt``."""
    return format(statistics.median(values), fmt), f"{min(values):{fmt}}..{max(values):{fmt}}"


def med_range(values: list[float], fmt: str) -> str:
    m, r = spread(values, fmt)
    return f"{m} ({r})"


def print_rows(rows: list[tuple[str, ...]], right: set[int]) -> None:
    """A table: the first row is the head, underlined; columns in ``right`` are right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    print()


def verdict_line(
    name: str,
    values: list[float],
    ok: bool,
    goal: str,
    unit: str = "x",
    what: str = "",
    widths: tuple[int, int] = (44, 8),
) -> bool:
    """``PASS``/``FAIL``, the median of ``values`` and their spread, against ``goal``; returns ``ok``."""
    name_w, num_w = widths
    med = statistics.median(values)
    print(
        f"  {'PASS' if ok else 'FAIL'}  {name:<{name_w}} {med:{num_w}.2f}{unit}  (spread {min(values):.2f}..{max(values):.2f})"
        f"  target {goal}" + (f"  [{what}]" if what else "")
    )
    return ok


@dataclass
class Figure:
    """One figure of the report, per repetition: a target's ratio (or bound) or a context ratio.

    ``goal`` is empty for context figures (no target); ``ok`` is then None.
    """

    name: str
    values: list[float]
    unit: str = "x"
    goal: str = ""
    ok: bool | None = None
    what: str = ""
    id: str = ""  # the target's name in docs/benchmarks.md (P1, F2, ...), if it has one

    def as_dict(self) -> dict[str, object]:
        return {
            "id": self.id,
            "name": self.name,
            "unit": self.unit.strip(),
            "goal": self.goal,
            "ok": self.ok,
            "what": self.what,
            **stats(self.values),
        }


def target(
    target_id: str,
    name: str,
    values: list[float],
    bound: float,
    *,
    at_most: bool = False,
    unit: str = "x",
    what: str = "",
    widths: tuple[int, int] = (44, 8),
) -> Figure:
    """Print the verdict of ``median(values) >= bound`` (``<=`` with ``at_most``) and return it."""
    med = statistics.median(values)
    ok = med <= bound if at_most else med >= bound
    goal = f"{'<=' if at_most else '>='} {bound:g}{unit}"
    verdict_line(name, values, ok, goal, unit, what, widths)
    return Figure(name, values, unit, goal, ok, what, target_id)


def print_context(ratios: Sequence[tuple[str, list[float]]], name_width: int) -> list[Figure]:
    """The same-run ratios that have no target, then a blank line; returns them as figures."""
    print("context (no target; same-run ratios):")
    for name, values in ratios:
        print(
            f"        {name:<{name_width}} {statistics.median(values):6.2f}x  (spread {min(values):.2f}..{max(values):.2f})"
        )
    print()
    return [Figure(name, values) for name, values in ratios]


def print_result(ok: Sequence[bool | None]) -> None:
    failed = list(ok).count(False)
    if failed:
        print(f"RESULT: {failed} of {len(ok)} targets FAIL (this is a report; exit status stays 0)")
    else:
        print(f"RESULT: all {len(ok)} targets PASS")


def profile_call(title: str, fn: Callable[[], object], top: int = 18) -> None:
    """Run ``fn`` under cProfile and print where the time goes (cumulative and own time)."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    print(f"profile: {title}")
    stats = pstats.Stats(prof, stream=sys.stdout).strip_dirs()
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)


# -- --json -------------------------------------------------------------------------------------

#: The latency quantiles (percent) written for each row with latencies: enough for a CDF plot.
CDF_QUANTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9, 100)


def add_json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json", default=None, metavar="PATH", help="also write the rows, samples and ratios to PATH"
    )


def stats(values: Sequence[float]) -> dict[str, object]:
    """Median, min, max and every per-repetition value."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "per_rep": list(values),
    }


def row_dict(label: str, samples: list[Sample], unit: str) -> dict[str, object]:
    """One row's figures over its repetitions: rate, latency percentiles, a pooled latency CDF."""
    row: dict[str, object] = {"label": label, "unit": unit, "rate": stats([s.rate for s in samples])}
    if all(s.lat_ns for s in samples):
        for q in (50, 95, 99):
            row[f"p{q}_us"] = stats([latency_us(s, q) for s in samples])
        row["cdf_us"] = latency_cdf(samples)
    for name in samples[0].extra:
        if all(name in s.extra for s in samples):
            row[name] = stats([s.extra[name] for s in samples])
    return row


def latency_cdf(samples: Sequence[Sample]) -> list[list[float]]:
    """``[quantile %, microseconds]`` of all repetitions' latencies pooled, at :data:`CDF_QUANTILES`."""
    pooled = sorted(x for s in samples for x in s.lat_ns)
    return [[q, percentile(pooled, q)] for q in CDF_QUANTILES]


def write_json(
    path: str,
    benchmark: str,
    header: dict[str, str],
    rows: dict[str, dict[str, object]],
    figures: Sequence[Figure],
    **extra: object,
) -> None:
    """Write what a benchmark printed, with every per-repetition value, to ``path``."""
    doc = {
        "benchmark": benchmark,
        "header": header,
        "rows": rows,
        "targets": [f.as_dict() for f in figures if f.goal],
        "context": [f.as_dict() for f in figures if not f.goal],
        **extra,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)


def json_rows(
    results: dict[str, list[Sample]], labels: dict[str, str], unit: str
) -> dict[str, dict[str, object]]:
    """Every row of ``results`` as :func:`row_dict`, by key, in the order of ``labels``."""
    return {key: row_dict(label, results[key], unit) for key, label in labels.items() if results.get(key)}


def ready_to_burn(n: int) -> int:
    """How many of ``n`` journaled jobs a burn-down waits to see queued in Redis before it starts.

    The forwarder keeps a window per queue in Redis, not the backlog (docs/forwarder.md): all
    ``n`` only when they fit its floor. The rest wait on disk, and the forwarder's refill during
    the drain is part of what a burn-down measures.
    """
    from hybridq.forwarder.config import DEFAULT_WINDOW_MIN  # noqa: PLC0415

    return min(n, DEFAULT_WINDOW_MIN)
