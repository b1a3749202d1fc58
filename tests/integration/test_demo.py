"""`hybridq demo` end to end: private Redis, forwarder, RQ workers, an outage and a kill."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import PYTHON


def test_demo_loses_nothing(tmp_path: Path, subprocess_env: dict[str, str], figures) -> None:
    proc = subprocess.run(
        [PYTHON, "-m", "hybridq", "demo", "--jobs", "200", "--dir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tally = proc.stdout.splitlines()[0]
    assert tally.startswith("accepted=200 succeeded=200 ran=200 lost=0 duplicate_deliveries="), tally
    assert "Redis stopped" in proc.stderr
    assert "restarted EMPTY" in proc.stderr
    assert "forwarder killed with SIGKILL" in proc.stderr
    figures(f"DEMO {tally}")
