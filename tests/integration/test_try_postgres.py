"""docs/outbox.md's "Trying it on PostgreSQL", run as written (issue 27).

The two shell blocks of that section are taken from the document, their paths pointed into the
test's directory, and run: ``python -m hybridq.testing.postgres DIR`` prints the DSN the second
block names, ``hybridq outbox init`` creates the table there, ``hybridq forward --outbox`` relays
a row committed through psycopg into the journal; Ctrl-C stops the server and keeps its data.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.postgres import find_bin

DOC = Path(__file__).parents[2] / "docs" / "outbox.md"
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.skipif(find_bin() is None, reason="no PostgreSQL binaries (hybridq[postgres])")


def _blocks() -> list[list[str]]:
    """The commands of the section's ``sh`` blocks, without comments."""
    text = DOC.read_text()
    section = text.split("### Trying it on PostgreSQL", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    return [[line.split("  #")[0].strip() for line in block.splitlines() if line.strip()] for block in blocks]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory (PostgreSQL's socket path must fit in 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="hq-try-", dir="/tmp") as d:
        os.chmod(d, 0o755)  # as root the server runs as nobody: it must reach its directory
        yield Path(d)


def _wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_documented_commands_start_postgresql_and_relay_a_job(short_dir: Path) -> None:
    start, use = _blocks()
    assert start == [
        "pip install 'hybridq[postgres]'",
        "python -m hybridq.testing.postgres /tmp/hq-pg",
    ]
    pg_dir, journal = short_dir / "pg", short_dir / "journal"
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "HYBRIDQ_REDIS_URL": "redis://127.0.0.1:1/0",  # no Redis needed to relay: the forwarder waits
    }
    command = shlex.split(start[1].replace("/tmp/hq-pg", str(pg_dir)))
    log = short_dir / "log"
    with open(log, "w") as err:
        server = subprocess.Popen(
            [sys.executable, *command[1:]], stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
    forward = None
    try:
        assert server.stdout is not None
        dsn = server.stdout.readline().strip()
        documented = use[0].replace("/tmp/hq-pg", str(pg_dir))
        assert documented == f"DSN='{dsn}'"
        env["DSN"] = dsn
        init = subprocess.run(
            ["bash", "-c", use[1]], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert init.returncode == 0, init.stderr
        assert "created table hybridq_outbox" in init.stdout
        forward = subprocess.Popen(
            ["bash", "-c", "exec " + use[2].replace("/tmp/hq-journal", str(journal))],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import psycopg
        from hybridq.outbox import Outbox

        with psycopg.connect(dsn) as conn, conn.transaction():
            Outbox().enqueue(conn, "tests.tasks.add", 1, 2, idempotency_key="try:1")

        def relayed() -> bool:
            status = subprocess.run(
                [BIN / "hybridq", "status", "--json", "--journal", str(journal)],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            return status.returncode == 0 and json.loads(status.stdout)["accepted"] == 1

        _wait_for(relayed, "the outbox row relayed into the journal")
    finally:
        if forward is not None:
            forward.send_signal(signal.SIGTERM)
            forward.wait(timeout=30)
        server.send_signal(signal.SIGINT)  # Ctrl-C
        server.wait(timeout=60)
        server.stdout.close()
    assert server.returncode == 0, log.read_text()
    assert "fsync off: for trying, not for production" in log.read_text()
    assert (pg_dir / "data" / "PG_VERSION").exists()  # kept: the next start reuses it
    assert not (pg_dir / ".s.PGSQL.5432").exists()  # stopped
