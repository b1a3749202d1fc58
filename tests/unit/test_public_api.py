"""The public API does not move: every import path README.md and docs/ name still imports (issue 28).

Internal modules may move between packages (their tests' patch targets move with them); what a
user's code, configuration or data names may not: the dotted paths in the docs, the ``from
hybridq... import`` lines of their examples, the paths stored outside the code (RQ job hashes,
``rq worker`` options, entry points) and the package's own entry points.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

#: Dotted words in the docs that are not Python: a file name and a logger's name.
NOT_PYTHON = {
    "hybridq.env": "deploy/systemd/hybridq.env, the units' environment file",
    "hybridq.relay": "the relay's logger name (docs/outbox.md)",
    **{
        f"hybridq.{name}": "an OpenTelemetry span or attribute name (docs/observability.md)"
        for name in ("enqueue", "push", "run", "task", "attempt", "outcome", "final")
    },
}

#: Paths stored where no refactoring reaches, each with where it is stored.
STORED = {
    "hybridq.worker.execute": "every RQ job hash the forwarder pushed names it (protocol.ENTRY_POINT)",
    "hybridq.worker.Job": "rq worker --job-class, RQ_JOB_CLASS",
    "hybridq.rqworker.Worker": "rq worker -w, deploy files",
    "hybridq.rqworker.SimpleWorker": "rq worker -w, deploy files",
    "hybridq.testing.pytest_plugin": "the pytest11 entry point of installed copies",
    "hybridq.cli.main": "the hybridq console script of installed copies",
    "hybridq.errors.HybridqError": "exception paths in stored results and users' except clauses",
}

_DOTTED = re.compile(r"(?<![\w./-])hybridq(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
_FROM = re.compile(r"^\s*from (hybridq(?:\.\w+)*) import \(?([\w, ]+)\)?", re.MULTILINE)
_RUN_AS = re.compile(r"-m (hybridq(?:\.\w+)*)")


def _documented() -> dict[str, str]:
    """Each dotted path the docs name, with the first file naming it."""
    found: dict[str, str] = {}
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        where = str(path.relative_to(ROOT))
        for m in _DOTTED.finditer(text):
            found.setdefault(m.group(0), where)
        for m in _FROM.finditer(text):
            for name in (n.strip() for n in m.group(2).split(",")):
                if name:
                    found.setdefault(f"{m.group(1)}.{name.split(' as ')[0]}", where)
    return {name: where for name, where in found.items() if name not in NOT_PYTHON}


def resolve(dotted: str) -> Any:
    """What ``dotted`` names: its longest importable module, then attributes (as RQ resolves one)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module.startswith(exc.name):
                continue  # not a module: a shorter prefix may be one
            raise
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


DOCUMENTED = _documented()


def test_the_docs_name_the_api() -> None:
    """The scan finds what the docs show (an empty scan would pass every case below)."""
    for name in (
        "hybridq.worker.Job",
        "hybridq.outbox.Outbox",
        "hybridq.testing.eager",
        "hybridq.fetch_job",
        "hybridq.testing.torture",
    ):
        assert name in DOCUMENTED, name


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_every_documented_path_imports(name: str) -> None:
    assert resolve(name) is not None, f"{name} (named in {DOCUMENTED[name]})"


@pytest.mark.parametrize("name", sorted(STORED))
def test_every_stored_path_imports(name: str) -> None:
    assert resolve(name) is not None, f"{name}: {STORED[name]}"


def test_the_entry_point_rq_job_hashes_name_is_the_worker_s_execute() -> None:
    from hybridq.protocol import ENTRY_POINT
    from hybridq.worker.run import execute

    assert ENTRY_POINT == "hybridq.worker.execute"
    assert resolve(ENTRY_POINT) is execute


def test_every_entry_point_of_the_package_imports() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    targets = [*project["scripts"].values()]
    for group in project["entry-points"].values():
        targets += group.values()
    assert targets
    for target in targets:
        module, _, attr = target.partition(":")
        assert resolve(f"{module}.{attr}" if attr else module) is not None, target


def _run_as_programs() -> list[str]:
    """Each ``python -m hybridq...`` module the docs and the commands in scripts/ and bench/ run."""
    paths = [*DOCS, *sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file())]
    paths += sorted((ROOT / "bench").rglob("*.py"))
    return sorted({m for path in paths for m in _RUN_AS.findall(path.read_text(encoding="utf-8"))})


def test_the_docs_and_scripts_run_modules() -> None:
    """The scan finds the programs (an empty one would pass the case below)."""
    assert {"hybridq", "hybridq.testing.postgres", "hybridq.testing.torture"} <= set(_run_as_programs())


@pytest.mark.parametrize("module", _run_as_programs())
def test_every_module_run_with_python_m_answers_help(module: str) -> None:
    """``python -m hybridq.testing.torture`` (scripts/torture, docs/torture.md) and the others run."""
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "usage" in done.stdout.lower(), done.stdout
