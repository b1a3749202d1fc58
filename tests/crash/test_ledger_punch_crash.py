"""A forwarder killed at each step of punching the ledger loses nothing and runs nothing twice.

A child writes jobs in small segments, the first one delayed (it pins its journal segment and so
every later ledger segment), a few that fail for good and some with an idempotency key; it
forwards and runs them with small ledger segments until the journal's finished records are
punched (the ledger puncher held back), saves the index a start builds then, and only then lets
the ledger puncher run (``hybridq.forwarder.ledger_punch``) with a crash point armed: before the
hole map (the keys in the key store, the index saved, the ids of the successes kept), after it,
after the punch. The parent checks the index a
start builds now (outcomes, counts, failures listed, key owners) against the saved one, then
restarts on an empty transport and drains: nothing finished is delivered again, every job
finishes once, the failures stay listed, and every job whose id was kept in place of its
success answers ``succeeded`` to ``cancel()``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hybridq.cancels import cancel
from hybridq.crashpoints import LEDGER_PUNCH_NAMES, PUNCH_NAMES
from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from hybridq.journal.holes import HOLES_SUFFIX
from hybridq.journal.recovery import verify
from hybridq.ledger import saved_index
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.punched_ids import find_punched
from hybridq.ledger.store import ledger_dir, load_index, read_ledger
from hybridq.ops.status import collect_status

from tests.crash.test_punch_crash import _drain

JOBS = 1200
FAILS = (7, 300, 900)
KEYED = 5  # every fifth job has an idempotency key
PIN_DELAY_S = 20.0  # the child's run is over long before; the drain's clock is this far ahead

CHILD = f"""
import json, os, sys
from hybridq import Queue, crashpoints
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.ledger import store
from hybridq.transport import MemoryTransport
from tests.crash.test_ledger_punch_crash import view
store.LEDGER_SEGMENT_BYTES = 32 << 10
journal, point, mode = sys.argv[1], sys.argv[2], sys.argv[3]
queue = Queue(journal=journal)
pin = queue.prepare("tests.tasks.add", ("a", "b"), delay={PIN_DELAY_S}, idempotency_key="pin").to_bytes()
if mode not in ("done", "ids"):  # the pinning job in a chain of its own: the others' segments are compacted
    with JournalWriter(journal, max_segment_bytes=256 << 10) as writer:
        writer.append_many([pin])
def write(lo, hi):
    with JournalWriter(journal, max_segment_bytes=256 << 10) as writer:
        if mode in ("done", "ids"):
            writer.append_many([pin])
        for start in range(lo, hi, 10):
            writer.append_many(
                queue.prepare(
                    "tests.tasks.fail" if i in {FAILS} else "tests.tasks.add",
                    () if i in {FAILS} else ("y" * 400, str(i)),
                    idempotency_key="k%d" % i if i % {KEYED} == 0 else None,
                ).to_bytes()
                for i in range(start, min(start + 10, hi))
            )
split = {JOBS} // 2 if mode == "saved" else {JOBS}
write(1, split)
transport = MemoryTransport()
forwarder = Forwarder(journal, transport, reconcile_interval_s=0.0, lease_s=0.0, max_lost=100)
forwarder.open()
compactor = forwarder.completions.compactor
held = compactor.ledger_puncher.step
# "done": the most it may punch (the successes of punched jobs too, no ids kept); "ids": as
# shipped, the pinning job in the others' chain (their successes go, their ids kept); "gone": as
# shipped; "saved": as shipped, with a saved index older than half the keyed jobs (their entries
# after its mark).
compactor.ledger_puncher.done_in_ranges = mode == "done"
compactor.ledger_puncher.step = lambda *a: 0
def task(env, attempt):
    if env.func == "tests.tasks.fail":
        raise RuntimeError("fails for good")
def turns(n):
    for _ in range(n):
        forwarder.step()
        transport.work(func=task)
        forwarder.completions.hurry()
        compactor.hurry()
        forwarder.step()
if mode == "saved":  # a periodic save, then jobs whose key entries only the ledger holds
    turns(10)
    forwarder.state.save_index_soon()
    forwarder.step()
    write(split, {JOBS})
turns(30)
with open(os.path.join(journal, "..", "before.json"), "w") as f:
    json.dump(view(journal, forwarder.state.index), f)
os.environ["HYBRIDQ_CRASH_POINT"] = point
crashpoints._loaded = False
compactor.ledger_puncher.step = held
turns(20)
forwarder.close()
"""


def view(journal: str, index: LedgerIndex | None = None, *, until: bool = False) -> dict[str, object]:
    """What ``status`` says, and the forwarder's index (``index``, else a start's): failures, key owners.

    ``until``: each owner's window too (a punch stamps the owners it moves to the key store).
    """
    out = collect_status(journal)
    state = None
    if index is None:
        state = ForwarderState(journal, ForwarderConfig())
        state.load()
        index = state.index
    try:
        return {
            "counts": [out["accepted"], out["succeeded"], out["failed"], out["pending"]],
            "totals": index.totals,
            "failed": sorted(json.dumps(loc) for loc in index.failed),
            "keys": sorted(
                json.dumps([e.key, list(e.loc), *([e.until] if until else [])]) for _, e in index.keys.items()
            ),
        }
    finally:
        if state is not None:
            state.close(by_path=False)


def _run(journal: Path, point: str, mode: str) -> int:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("HYBRIDQ_CRASH_POINT", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(journal), point, mode],
        env=env,
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert done.returncode in (0, -signal.SIGKILL), done.stderr.decode()[-3000:]
    return done.returncode


def _same_as_a_full_replay(journal: Path) -> None:
    """A start from the saved index builds what a start that replays the whole ledger does (windows too)."""
    started = view(str(journal), until=True)
    saved_index.forget(str(journal))
    assert view(str(journal), until=True) == started


@pytest.mark.parametrize("mode", ["done", "ids", "gone", "saved"])
@pytest.mark.parametrize("point", [*LEDGER_PUNCH_NAMES, *(p for p in PUNCH_NAMES if p != "punch_writable")])
def test_a_crash_at_each_step_of_the_ledger_punch_loses_nothing(
    tmp_path: Path, point: str, mode: str
) -> None:
    journal = tmp_path / "journal"
    assert _run(journal, f"{point}:1", mode) == -signal.SIGKILL
    before = json.loads((tmp_path / "before.json").read_text())
    assert [
        n for n in os.listdir(ledger_dir(str(journal))) if HOLES_SUFFIX in n
    ] or point in LEDGER_PUNCH_NAMES
    verify(journal)
    verify(Path(ledger_dir(str(journal))))
    compacted = load_compacted(str(journal))
    finished = load_index(str(journal), compacted)
    assert view(str(journal)) == before  # nothing lost, nothing counted twice
    _kept_ids_answer_succeeded(journal, mode, point)
    if point != "ledger_punch_after_keys":  # before the save, the next start's punch stamps them again
        _same_as_a_full_replay(journal)
    again = _drain(journal, JOBS - len(FAILS), ahead_s=PIN_DELAY_S)  # the pinning job due at once
    for loc in again:  # nothing finished before the crash was delivered again
        assert not finished.is_terminal(loc), loc
        assert not compacted.is_compacted((loc[0], loc[1])), loc
    out = collect_status(str(journal))
    assert (out["accepted"], out["succeeded"], out["failed"]) == (JOBS, JOBS - len(FAILS), len(FAILS))
    assert len(load_index(str(journal), load_compacted(str(journal))).failed) == len(FAILS)
    _same_as_a_full_replay(journal)


@pytest.mark.parametrize("mode", ["done", "ids", "gone", "saved"])
def test_without_a_crash_the_ledger_is_punched(tmp_path: Path, mode: str) -> None:
    journal = tmp_path / "journal"
    assert _run(journal, "compact_after_unlink:100000", mode) == 0
    before = json.loads((tmp_path / "before.json").read_text())
    holes = [n for n in os.listdir(ledger_dir(str(journal))) if HOLES_SUFFIX in n]
    assert holes
    verify(Path(ledger_dir(str(journal))))
    assert view(str(journal)) == before
    _same_as_a_full_replay(journal)
    assert before["counts"] == [JOBS, JOBS - 1 - len(FAILS), len(FAILS), 1]
    assert len(before["failed"]) == len(FAILS)
    _kept_ids_answer_succeeded(journal, mode, "")


def _kept_ids_answer_succeeded(journal: Path, mode: str, point: str) -> None:
    """``cancel()`` of each job whose id the ledger punch kept says ``succeeded``, entry punched or not."""
    kept = [p.job_id for _, p in find_punched(ledger_dir(str(journal)))]
    if mode == "ids" and point in ("", "ledger_punch_after_ids"):
        assert kept
    if mode == "ids" and not point:  # their successes punched out of the ledger
        left = {e.job_id for _, e in read_ledger(str(journal)) if e.kind == "done"}
        assert sum(1 for i in kept if i not in left) > len(kept) // 2
    if kept:
        assert {r.state for r in cancel(kept[:: max(1, len(kept) // 50)], str(journal))} == {"succeeded"}
