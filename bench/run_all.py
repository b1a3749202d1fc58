"""``scripts/bench``: every benchmark in one invocation, one JSON result file, the generated docs.

Runs, one after the other (each is side by side with its peers inside, interleaved, and prints
its machine header, medians, spreads and ratios): ``journal``, ``enqueue``,
``forward``, ``memory``, ``worker``, ``peers`` (at 1, 4 and 16 producer
threads), ``e2e`` (jobs/s vs worker processes) and ``burndown`` (issue 15's burn-down:
queued jobs, one worker command, time to done, against Dramatiq, Huey, Celery and RQ). Each runs
as a subprocess, its output shown and kept; each writes its own ``--json``, except
``worker`` (it has none), whose printed report is parsed. The results go into one file,
``bench-results.json`` in the run directory (``--json`` to put it elsewhere), with each
benchmark's output, duration, date and commit; then :mod:`report` draws the plots and
renders the generated part of ``docs/benchmarks.md``.

``docs/`` (``benchmarks.md`` between its markers, ``benchmarks.json``, ``img/``) is written only
by a complete, default run: a ``--quick`` run is a smoke test, and a run with ``--only`` is
merged into the published ``benchmarks.json`` (every row says which run it comes from). Either
way the run directory gets the same files (``benchmarks.md``, ``img/``), to look at.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import benchlib
import report

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
DOCS = ROOT / "docs"


@dataclass(frozen=True)
class Bench:
    name: str
    script: str
    wrapper: str  # the command a person runs for it alone
    has_json: bool = True
    args: tuple[str, ...] = ()


BENCHES = [
    Bench("journal", "journal.py", "scripts/bench-journal"),
    Bench("enqueue", "enqueue.py", "scripts/bench-enqueue"),
    Bench("forward", "forward.py", "scripts/bench-forward"),
    Bench("memory", "memory.py", "scripts/bench-memory"),
    Bench("worker", "worker.py", "scripts/bench-worker", has_json=False),
    Bench("peers", "peers.py", "scripts/bench-peers", args=("--threads", "1,4,16")),
    Bench("e2e", "e2e.py", "python bench/e2e.py"),
    Bench("burn", "burndown.py", "scripts/bench-burn"),
]
NAMES = [b.name for b in BENCHES]


# -- running one benchmark ----------------------------------------------------------------------


def pump(src: IO[bytes], sink: IO[str], log: Path, keep: list[bytes] | None) -> None:
    """Copy ``src`` line by line to ``sink`` (the terminal) and ``log``; keep the lines if asked."""
    with log.open("wb") as f:
        for line in iter(src.readline, b""):
            f.write(line)
            sink.buffer.write(line)  # type: ignore[attr-defined]
            sink.flush()
            if keep is not None:
                keep.append(line)


def run(bench: Bench, args: argparse.Namespace, run_dir: Path, tmp: Path) -> dict[str, Any]:
    """Run one benchmark as a subprocess, showing and keeping its output; its entry in the results."""
    argv = [sys.executable, str(BENCH / bench.script), *(["--quick"] if args.quick else []), *bench.args]
    shown = [bench.wrapper, *argv[2:]]
    argv += ["--dir", str(tmp)]
    json_path = run_dir / f"{bench.name}.json"
    if bench.has_json:
        argv += ["--json", str(json_path)]
    date, commit = time.strftime("%Y-%m-%d %H:%M:%S %Z"), benchlib.git_revision()
    print(f"\n=== {' '.join(shown)}  ({date})\n", flush=True)
    started = time.monotonic()
    out: list[bytes] = []
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    pumps = [
        threading.Thread(target=pump, args=(proc.stdout, sys.stdout, run_dir / f"{bench.name}.out", out)),
        threading.Thread(target=pump, args=(proc.stderr, sys.stderr, run_dir / f"{bench.name}.err", None)),
    ]
    for t in pumps:
        t.start()
    code = proc.wait()
    for t in pumps:
        t.join()
    stdout = b"".join(out).decode(errors="replace")
    entry: dict[str, Any] = {
        "command": shown,
        "seconds": round(time.monotonic() - started, 1),
        "exit": code,
        "stdout": stdout,
        "date": date,  # when it started, and the tree it started on
        "commit": commit,
    }
    if code != 0:
        entry["error"] = f"exit status {code}; see {run_dir / bench.name}.err"
        return entry
    if bench.has_json:
        entry["result"] = json.loads(json_path.read_text())
    else:
        entry["result"] = parse_report(stdout, f"bench-{bench.name}")
        entry["parsed_from"] = "stdout"
    return entry


# -- a report read back from its printed output (worker) ----------------------------------

_NUM = r"-?[\d,]+(?:\.\d+)?"
TARGET_LINE = re.compile(
    rf"^  (?P<ok>PASS|FAIL)  (?P<name>.+?)\s+(?P<median>{_NUM})(?P<unit>x| ms| us| s| MB| B)?"
    rf"\s+\(spread (?P<min>{_NUM})\.\.(?P<max>{_NUM})\)\s+target (?P<goal>.+?)(?:\s+\[(?P<what>.*)\])?$"
)
CONTEXT_LINE = re.compile(
    rf"^ {{8}}(?P<name>.+?)\s+(?P<median>{_NUM})(?P<unit>x| ms| us| s)\s+\(spread (?P<min>{_NUM})\.\.(?P<max>{_NUM})\)$"
)


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def parse_report(stdout: str, benchmark: str) -> dict[str, Any]:
    """The header, tables, targets and context figures of a benchlib-style report.

    The format is benchlib's: header fields ``  label       value`` (label padded to 11), tables
    underlined with dashes (the dashes give the columns), verdict lines from
    ``benchlib.verdict_line`` and context lines. Only medians and spreads are printed, so
    ``per_rep`` is left empty.
    """
    lines = stdout.splitlines()
    header: dict[str, str] = {"title": lines[0] if lines else ""}
    for line in lines[1:]:
        if not line.strip():
            break
        header[line[2:13].strip()] = line[14:]
    tables = []
    for i, line in enumerate(lines):
        if i == 0 or not re.fullmatch(r"-+(  -+)*", line):
            continue
        spans = [m.span() for m in re.finditer(r"-+", line)]

        def cells(row: str, spans: list[tuple[int, int]] = spans) -> list[str]:
            return [row[a : (b if n + 1 < len(spans) else None)].strip() for n, (a, b) in enumerate(spans)]

        body = []
        for row in lines[i + 1 :]:
            if not row.strip():
                break
            body.append(cells(row))
        tables.append({"head": cells(lines[i - 1]), "rows": body})
    targets, context = [], []
    for line in lines:
        if m := TARGET_LINE.match(line):
            unit = (m["unit"] or "").strip()
            targets.append(
                {
                    "id": m["name"].split()[0] if re.fullmatch(r"[A-Z]\d", m["name"].split()[0]) else "",
                    "name": m["name"].strip(),
                    "unit": unit,
                    "goal": m["goal"].strip(),
                    "ok": m["ok"] == "PASS",
                    "what": m["what"] or "",
                    "median": _num(m["median"]),
                    "min": _num(m["min"]),
                    "max": _num(m["max"]),
                    "per_rep": [],
                }
            )
        elif m := CONTEXT_LINE.match(line):
            context.append(
                {
                    "name": m["name"].strip(),
                    "unit": m["unit"].strip(),
                    "median": _num(m["median"]),
                    "min": _num(m["min"]),
                    "max": _num(m["max"]),
                }
            )
    return {
        "benchmark": benchmark,
        "header": header,
        "tables": tables,
        "targets": targets,
        "context": context,
    }


# -- the run ------------------------------------------------------------------------------------


def machine(run_dir: Path, loadavg: float) -> dict[str, Any]:
    mnt, dev, fstype = benchlib.mount_of(str(run_dir))
    return {
        "nproc": os.cpu_count(),
        "cpu": benchlib.cpu_model(),
        "kernel": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "filesystem": f"{fstype} on {dev}, mounted at {mnt}",
        "loadavg_start": loadavg,
        "loadavg_end": os.getloadavg()[0],
    }


def versions() -> str:
    dists = ("hybridq", "rq", "redis", "crc32c", "celery", "dramatiq", "persist-queue", "huey", "matplotlib")
    return ", ".join(f"{d} {benchlib.version(d)}" for d in dists)


def redis_version(doc: dict[str, Any]) -> str:
    for entry in doc["benchmarks"].values():
        line = entry.get("result", {}).get("header", {}).get("redis", "")
        if line:
            return re.sub(r", redis://\S+,", ",", line)  # the port is the run's, not the machine's
    return "?"


def publish(doc: dict[str, Any], run_dir: Path, args: argparse.Namespace) -> None:
    """Render into the run directory; copy into docs/ when the run may be published."""
    # A --render of a merged file is already merged: merging it into the published file (itself)
    # again would name its own run as the one it was merged into.
    merge = args.only and not args.render and not args.quick and not args.no_docs
    if merge and (DOCS / "benchmarks.json").exists():
        published = json.loads((DOCS / "benchmarks.json").read_text())
        merged = published["benchmarks"] | doc["benchmarks"]
        doc = doc | {
            "benchmarks": {name: merged[name] for name in NAMES if name in merged},
            "merged_into": {"started": published.get("started"), "commit": published.get("commit")},
        }
    doc["targets"] = report.summary(doc)
    images = report.plot_all(doc, run_dir / "img")
    block = report.generated_block(doc, images)
    (run_dir / "benchmarks.md").write_text(block)
    print(f"wrote {run_dir / 'benchmarks.md'} and {len(images)} plot(s) in {run_dir / 'img'}")
    failed = [name for name, e in doc["benchmarks"].items() if e["exit"] != 0]
    if args.no_docs:
        return
    if args.quick or failed or (not args.only and len(doc["benchmarks"]) < len(BENCHES)):
        why = "a --quick run" if args.quick else f"{', '.join(failed)} failed"
        print(f"docs/ not touched: {why} is not published (--no-docs silences this)")
        return
    text = (DOCS / "benchmarks.md").read_text()
    (DOCS / "benchmarks.md").write_text(report.splice(text, block))
    (DOCS / "img").mkdir(exist_ok=True)
    for name in images:
        shutil.copyfile(run_dir / "img" / name, DOCS / "img" / name)
    (DOCS / "benchmarks.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(
        f"wrote docs/benchmarks.md (the generated part), docs/benchmarks.json and {len(images)} plot(s) in docs/img/"
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.split("\n\n", maxsplit=1)[0])
    p.add_argument(
        "--quick", action="store_true", help="pass --quick to each: a smoke run of the whole pipeline"
    )
    p.add_argument(
        "--only",
        default=None,
        metavar="NAMES",
        help=f"comma-separated subset of {','.join(NAMES)} (merged into the published results)",
    )
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/")
    p.add_argument(
        "--dir",
        default=None,
        help="the run directory: logs, results, temporary files (default: a new tempdir)",
    )
    p.add_argument(
        "--json", default=None, metavar="PATH", help="the results file (default: DIR/bench-results.json)"
    )
    p.add_argument(
        "--render",
        default=None,
        metavar="PATH",
        help="run nothing: render the plots and the markdown from a results file written before",
    )
    args = p.parse_args(argv)
    if args.only:
        wanted = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = sorted(set(wanted) - set(NAMES))
        if unknown or not wanted:
            p.error(f"--only: unknown benchmark(s) {', '.join(unknown)}; choose from {','.join(NAMES)}")
        args.only = wanted
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    run_dir = Path(args.dir).resolve() if args.dir else Path(tempfile.mkdtemp(prefix="hybridq-bench-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        args.quick, args.only = doc["mode"] == "quick", doc.get("only")
        publish(doc, run_dir, args)
        return 0
    tmp = run_dir / "tmp"
    tmp.mkdir(exist_ok=True)
    loadavg = os.getloadavg()[0]
    started = time.monotonic()
    doc: dict[str, Any] = {
        "generator": "scripts/bench",
        "argv": argv,
        "mode": "quick" if args.quick else "default",
        "only": args.only,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": benchlib.git_revision(),
        "versions": versions(),
        "benchmarks": {},
    }
    print(f"scripts/bench: run directory {run_dir}; load average {loadavg:.2f}", flush=True)
    for bench in BENCHES:
        if args.only and bench.name not in args.only:
            continue
        doc["benchmarks"][bench.name] = run(bench, args, run_dir, tmp)
    doc["seconds"] = round(time.monotonic() - started, 1)
    doc["machine"] = machine(run_dir, loadavg)
    doc["redis"] = redis_version(doc)
    results = Path(args.json) if args.json else run_dir / "bench-results.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    doc["targets"] = report.summary(doc)
    results.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nscripts/bench: took {doc['seconds'] / 60:.1f} minutes; wrote {results}")
    publish(doc, run_dir, args)
    shutil.rmtree(tmp, ignore_errors=True)
    failed = [name for name, e in doc["benchmarks"].items() if e["exit"] != 0]
    for t in doc["targets"]:
        print(
            f"  {t['status'].replace('**', ''):<34} {t['id']:<3} {t['name']}: {report.fmt(t['median'], t['unit'])}"
        )
    if failed:
        print(f"scripts/bench: {', '.join(failed)} failed (see the run directory)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
