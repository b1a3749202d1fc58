"""A feature whose extra is not installed says which, in one line: exit 1, no traceback (issue 27).

Each case runs in a fresh interpreter where the extra's module cannot be imported
(``sys.modules[name] = None``, as Python does for a module it must not find).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hybridq import extras
from hybridq.errors import HybridqError, MissingExtra

#: Blocks the modules named in argv[1] (comma-separated), then runs the hybridq command argv[2:].
_CLI = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from hybridq.cli import main
sys.argv = ["hybridq", *sys.argv[2:]]
main()
"""

#: Blocks the modules named in argv[1], then runs the Python in argv[2].
_PYTHON = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
exec(sys.argv[2])
"""

_PG = "postgresql://app@127.0.0.1:1/shop"


def _run(script: str, blocked: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, blocked, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=cwd,
    )


@pytest.mark.parametrize(
    ("blocked", "args", "extra"),
    [
        ("starlette", ["serve", "--bind", "127.0.0.1:0"], "web"),
        ("uvicorn", ["serve", "--bind", "127.0.0.1:0"], "web"),
        ("starlette", ["forward", "--serve", "127.0.0.1:0"], "web"),
        ("psycopg", ["outbox", "init", "--dsn", _PG], "postgres"),
        ("psycopg", ["relay", "--outbox", _PG, "--once"], "postgres"),
        ("psycopg", ["forward", "--outbox", _PG], "postgres"),
        ("psycopg", ["status", "--outbox", _PG], "postgres"),
    ],
)
def test_a_command_without_its_extra_is_one_line_and_exit_1(
    tmp_path: Path, blocked: str, args: list[str], extra: str
) -> None:
    journal = tmp_path / "journal"
    if args[0] == "status":
        journal.mkdir(mode=0o700)
    if args[0] != "outbox":
        args = [*args, "--journal", str(journal)]
    result = _run(_CLI, blocked, *args, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.endswith(f"is not installed): pip install 'hybridq[{extra}]'\n")
    assert f"needs the {extra} extra ({blocked} is not installed)" in result.stderr
    assert "Traceback" not in result.stderr
    if args[0] != "status":
        assert not journal.exists()  # refused before anything was created


def test_help_needs_no_extra(tmp_path: Path) -> None:
    result = _run(_CLI, "starlette,uvicorn,psycopg", "serve", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--bind" in result.stdout


@pytest.mark.parametrize(
    ("blocked", "code", "extra"),
    [
        ("starlette", "import hybridq.http.app", "web"),
        ("uvicorn", "from hybridq.http.server import Server", "web"),
        ("fakeredis", "import hybridq.testing as t; t.fake_stack('j')", "testing"),
        ("lupa", "import hybridq.testing as t; t.fake_stack('j')", "testing"),
        ("psycopg", f"from hybridq.outbox.relay import Relay; Relay({_PG!r}, 'j')", "postgres"),
        ("psycopg", f"from hybridq.outbox.schema import connect; connect({_PG!r})", "postgres"),
        ("django", "from hybridq.contrib.django import HybridqBackend", "django"),
    ],
)
def test_an_import_without_its_extra_says_which(tmp_path: Path, blocked: str, code: str, extra: str) -> None:
    script = f"""
from hybridq.errors import MissingExtra
try:
    {code}
except MissingExtra as exc:
    assert isinstance(exc, ImportError) and exc.name == {blocked!r}, exc.name
    print(exc)
"""
    result = _run(_PYTHON, blocked, script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(f"({blocked} is not installed): pip install 'hybridq[{extra}]'\n")


def test_the_error_is_an_import_error_and_a_hybridq_error() -> None:
    error = extras.missing("web", "hybridq serve")
    assert isinstance(error, ModuleNotFoundError)
    assert isinstance(error, HybridqError)
    assert (error.name, error.extra, error.feature) == ("starlette", "web", "hybridq serve")
    assert (
        str(error)
        == "hybridq serve needs the web extra (starlette is not installed): pip install 'hybridq[web]'"
    )


def test_require_passes_when_installed_and_names_the_missing_module() -> None:
    extras.require("web", "x")  # the dev extra installs it
    with pytest.raises(
        MissingExtra, match=r"no_such_module_here is not installed\): pip install 'hybridq\[web\]'"
    ):
        extras.require("web", "x", "starlette", "no_such_module_here")


def test_every_extra_named_exists_in_pyproject() -> None:
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    for extra in extras.EXTRAS:
        assert f"\n{extra} = [" in pyproject
