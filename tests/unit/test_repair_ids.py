"""A damaged ids file: ``journal verify`` reports it, ``journal repair --accept-loss`` moves it aside.

docs/journal.md, "Entries punched out of pinned ledger segments": the jobs it named then answer
as compacted ones (``cancel()`` unknown, no lookup row after a rebuild); none runs again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import hybridq
import pytest
from click.testing import CliRunner
from hybridq.cancels import cancel
from hybridq.cli import cli
from hybridq.envelope.model import Envelope
from hybridq.errors import StateFileCorrupt
from hybridq.journal.format import segment_name
from hybridq.journal.statefile import STATE_SUFFIX
from hybridq.ledger import store
from hybridq.ledger.punched_ids import IDS_SUFFIX, find_punched, read_ids
from hybridq.ledger.store import ledger_dir
from hybridq.ops.trace import job_trace

from tests.unit.test_punch_lookup import _punched_journal, _run


def _damaged_ids_file(journal: Path) -> tuple[Path, list[str]]:
    """Flip the last byte of the first ids file; returns it and the ids it named."""
    ledger = ledger_dir(str(journal))
    (seg, _), *_ = list(find_punched(ledger))
    named = [p.job_id for p in read_ids(ledger, *seg)]
    path = Path(ledger) / (segment_name(*seg) + IDS_SUFFIX + STATE_SUFFIX)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    return path, named


def test_a_damaged_ids_file_is_reported_and_moved_aside_by_repair(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed before this fix: verify said ok, repair --accept-loss changed nothing, the forwarder stayed stopped."""
    monkeypatch.setattr(store, "LEDGER_SEGMENT_BYTES", 32 << 10)  # sealed ledger segments to punch
    _queue, _ids, transport = _punched_journal(journal_dir)
    _run(journal_dir, transport, 20).close()
    path, named = _damaged_ids_file(journal_dir)
    assert named
    stopped = _run(journal_dir, transport, 0)
    try:
        with pytest.raises(StateFileCorrupt, match="journal repair --accept-loss"):
            _run(journal_dir, transport, 5, stopped)
    finally:
        stopped.close()

    runner = CliRunner()
    verified = runner.invoke(cli, ["journal", "verify", "--journal", str(journal_dir)])
    assert verified.exit_code == 3, verified.output
    assert path.name in verified.output
    dry = runner.invoke(cli, ["journal", "repair", "--journal", str(journal_dir)])
    assert dry.exit_code == 3, dry.output
    assert path.exists()
    done = runner.invoke(cli, ["journal", "repair", "--accept-loss", "--json", "--journal", str(journal_dir)])
    assert done.exit_code == 0, done.output
    assert not path.exists()
    (ledger_report,) = [r for r in json.loads(done.output) if r["repairs"]]
    (drop,) = ledger_report["repairs"][0]["dropped"]
    assert drop["kind"] == "ids"
    backup = Path(ledger_report["backup"])
    assert (backup / path.name).read_bytes()[-1:] != b""  # kept, as it was
    assert runner.invoke(cli, ["journal", "verify", "--journal", str(journal_dir)]).exit_code == 0

    # The forwarder runs on; its jobs answer as compacted ones, and none runs again.
    shutil.rmtree(journal_dir / "lookup")  # a rebuild: the lookup index is a cache
    ran: list[str] = []

    def task(env: Envelope, _attempt: int) -> None:
        ran.append(env.id)

    forwarder = _run(journal_dir, transport, 10, task=task)
    try:
        probe = named[len(named) // 2]
        assert [r.state for r in cancel([probe], str(journal_dir))] == ["unknown"]
        assert hybridq.fetch_job(probe, str(journal_dir)) is None
        assert not set(ran) & set(named), "a job the damaged ids file named ran again"
    finally:
        forwarder.close()


def test_a_damaged_ids_file_stops_the_trace_only_of_jobs_it_may_name(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose records are all on disk is in no ids file: its trace answers; one punched says the repair.

    Failed on main: every trace raised (find_punched read the damaged file before the job's bytes).
    """
    monkeypatch.setattr(store, "LEDGER_SEGMENT_BYTES", 32 << 10)
    queue, ids, transport = _punched_journal(journal_dir)
    _run(journal_dir, transport, 20).close()
    _path, named = _damaged_ids_file(journal_dir)
    assert named
    # The pinning delayed job and one enqueued since: their records are whole, no ids file names them.
    late = queue.enqueue("tests.tasks.add", 1, 2)
    pinning = _first_id(journal_dir)
    assert pinning not in ids
    for job_id in (pinning, late.id):
        trace = job_trace(str(journal_dir), job_id)
        assert trace is not None, job_id
        assert trace.status in {"pending", "forwarded"}, trace
    with pytest.raises(StateFileCorrupt, match="journal repair --accept-loss"):
        job_trace(str(journal_dir), named[0])


def _first_id(journal: Path) -> str:
    """The journal's first job: the delayed one that pins its segment (``_punched_journal``)."""
    from hybridq.journal import JournalReader

    first = next(iter(JournalReader(str(journal)).records()))
    return Envelope.from_bytes(first.payload).id
