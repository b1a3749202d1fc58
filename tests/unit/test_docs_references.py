"""The repository stands alone: no comment or doc cites a design file that is not in it.

The numbered rules and the fault scenarios live in ``docs/reliability.md``; code cites them there.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = re.compile(r"RELIABILITY\.md|DESIGN\.md|PERFORMANCE\.md|STYLE\.md|\.\./shared")


def _tracked() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.toml", "*.sh", "scripts/*", "deploy/*"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [ROOT / line for line in out.splitlines() if line]


def test_no_file_cites_a_design_file_outside_the_repository() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in _tracked()
        if path.name != Path(__file__).name
        if path.is_file()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert offenders == []


def test_every_cited_rule_exists_in_docs_reliability() -> None:
    rules = set(re.findall(r"^(\d+)\. \*\*", (ROOT / "docs/reliability.md").read_text(), re.MULTILINE))
    cited = {
        n
        for path in _tracked()
        if path.name != Path(__file__).name
        if path.is_file()
        for n in re.findall(r"reliability\.md rules? (\d+)", path.read_text(errors="replace"))
    }
    assert cited, "no code cites docs/reliability.md's rules any more: drop this test"
    assert cited <= rules


def test_every_module_path_the_docs_name_exists() -> None:
    """A module the docs name is a real file: ``hybridq/forwarder/loop.py`` anywhere, and in the pages
    that map the code (README, docs/architecture.md) a backticked ``forwarder/delivery.py`` or
    ``job.py``, relative to the repository or to ``hybridq/``."""
    named = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        named |= {m.group(0) for m in re.finditer(r"(?<![\w/.-])hybridq/[\w/]+\.py\b", text)}
        if path.name in {"README.md", "architecture.md"}:
            named |= set(re.findall(r"`([\w/]+\.py)`", text))
    assert len(named) > 50, "the docs name no module paths any more: drop this test"
    missing = [n for n in named if not (ROOT / n).is_file() and not (ROOT / "hybridq" / n).is_file()]
    assert sorted(missing) == []
