"""The error codes docs/http.md documents are the ones ``hybridq serve`` sends, status and all.

Every ``{"error": CODE}`` the document names beside a status (``**400**``) must be sent with that
status by a call of a function ``f(status, error, ...)`` in hybridq/http (``_error``, ``_json``),
and every such call must be documented (issue 27: a bad ``Idempotency-Key`` was documented as
``bad_request`` and answered ``bad_idempotency_key``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _documented() -> set[tuple[int, str]]:
    pairs = set()
    for line in (ROOT / "docs" / "http.md").read_text().splitlines():
        statuses = re.findall(r"\*\*(\d{3})\*\*", line)
        codes = re.findall(r'\{"error": "([a-z_]+)"', line)
        assert len(statuses) <= 1 or not codes, line  # one status per line that names codes
        pairs |= {(int(statuses[0]), code) for code in codes} if statuses else set()
    return pairs


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _sent() -> set[tuple[int, str]]:
    """(status, code) of every call to a ``f(status, error, ...)`` of hybridq/http (``error``, ``_json``)."""
    pairs = set()
    trees = {p: ast.parse(p.read_text(), str(p)) for p in (ROOT / "hybridq" / "http").rglob("*.py")}
    own = {  # each module's f(status, error, ...)
        _module(path): {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef)
            and [a.arg for a in node.args.args[:2]] == ["status", "error"]
        }
        for path, tree in trees.items()
    }
    for path, tree in trees.items():
        senders = own[_module(path)] | {  # and those it imports (answers.error)
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
            if alias.name in own.get(node.module or "", set())
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in senders
                and len(node.args) >= 2
            ):
                status, code = node.args[0], node.args[1]
                assert isinstance(status, ast.Constant), (
                    f"{path}:{node.lineno}: a status the test cannot read"
                )
                assert isinstance(code, ast.Constant), (
                    f"{path}:{node.lineno}: an error code the test cannot read"
                )
                pairs.add((status.value, code.value))
    return pairs


def test_every_documented_error_code_is_sent_with_its_status() -> None:
    documented = _documented()
    assert len(documented) >= 10
    assert sorted(documented - _sent()) == []


def test_every_error_code_sent_is_documented() -> None:
    sent = _sent()
    assert len(sent) >= 10
    assert sorted(sent - _documented()) == []
