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
