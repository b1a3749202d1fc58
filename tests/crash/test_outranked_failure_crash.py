"""A success over a failure under SIGKILL: the failure never comes back to ``failed list``.

docs/reliability.md, "A success outranks a failure": the success's own record carries the mark
(``"over":"failed"``), so the outcome path has one write; ledger compaction appends the mark
again before it deletes the ledger segment that had it. A child SIGKILLs itself right after the
success's ledger append (before its index applied it), or between compaction's append of the
mark and the deletion of its segment. The parent then lists the failures as ``failed list``
does, and as a fresh forwarder does (with no saved index, or the one before), compacts again,
and lists again: the succeeded job is never listed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hybridq.journal import Record
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.store import read_ledger

from tests.support.started import open_state
from tests.unit.test_outranked_failure import (
    compact,
    failed_beside_a_live_job,
    listed_ids,
    loc_of,
    success,
)

CHILD = """
import os, signal, sys
from pathlib import Path
from hybridq.forwarder import dead_segments
from hybridq.journal import JournalReader
from tests.support.started import open_state
from tests.unit.test_outranked_failure import compact, success

journal, point = Path(sys.argv[1]), sys.argv[2]
records = list(JournalReader(journal).records())
writer = records[0].writer_id
state = open_state(journal, writer)
if point == "after_success_append":
    state.index.apply = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    state.append([success(r) for r in records if r.segment_index == 0])
else:
    real = dead_segments.remove_oldest_segment

    def remove(path, writer_id, index):
        if path.endswith("ledger"):
            os.kill(os.getpid(), signal.SIGKILL)
        real(path, writer_id, index)

    dead_segments.remove_oldest_segment = remove
    compact(state)
print("not killed")
"""


def run_killed_child(child: str, args: list[str], env: dict[str, str]) -> None:
    """Run ``child`` (a ``python -c`` program) with ``args``: it must die of its own SIGKILL."""
    proc = subprocess.run(
        [sys.executable, "-c", child, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr


def never_listed_again(journal: Path, writer: str, x: Record, finish: list[Record] | None = None) -> None:
    """Started from the saved index, then without one: x is not failed; compacted, it is not listed.

    ``finish``: the jobs of segment 0 to succeed first when it is not compacted yet.
    """
    for saved in (True, False):
        if not saved:
            (journal / "ledger-index.state").unlink(missing_ok=True)
        state = open_state(journal, writer)
        assert loc_of(x) not in state.index.failed
        if finish is not None and not load_compacted(str(journal)).is_compacted((writer, 0)):
            state.append([success(r) for r in finish])  # the rest finish: compacted
        compact(state)
        assert load_compacted(str(journal)).is_compacted((writer, 0))
        state.close()
        assert listed_ids(journal) == []


@pytest.mark.parametrize("point", ["after_success_append", "before_ledger_segment_deleted"])
def test_a_killed_forwarder_never_lists_the_succeeded_job_again(
    journal_dir: Path, subprocess_env: dict[str, str], point: str
) -> None:
    writer, seg0, x = failed_beside_a_live_job(journal_dir)
    if point == "before_ledger_segment_deleted":
        second = open_state(journal_dir, writer)
        second.append([success(r) for r in seg0])
        second.close()
    run_killed_child(CHILD, [str(journal_dir), point], subprocess_env)
    marks = [e for _, e in read_ledger(str(journal_dir)) if e.over is not None]
    assert {e.loc for e in marks} == {loc_of(x)}
    assert listed_ids(journal_dir) == []
    never_listed_again(journal_dir, writer, x)
