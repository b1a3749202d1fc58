"""A ledger punch never forgets a finished job's key while its journal segment is on disk.

docs/enqueue.md: the keys of finished jobs whose segment is still in the journal are always
remembered; a key entry moved to the key store gets its window (``until``), after which it is
forgotten. So a ``key`` entry is punched only once its job's journal segment is gone, never for
its record being in a punched range (the second review of the ledger punch: a new job with the
key of a finished one ran once the window ended, its segment still pinned).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from hybridq.forwarder.dead_segments import Compactor
from hybridq.journal.format import segment_name
from hybridq.journal.holes import HoleMaps
from hybridq.journal.reader import list_chains

from tests.unit.test_ledger_punch import _two_chains_journal_punched


def test_a_key_whose_journal_segment_is_on_disk_is_never_given_a_window_by_the_punch(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, a, _, _, of_a, _ = _two_chains_journal_punched(journal_dir, monkeypatch)
    wa = a[0].writer_id
    keys_a = [
        (e.key, e.loc) for e in of_a if e.kind == "key" and e.loc[0] == wa and e.job_id != "a" + str(a[0].seq)
    ]
    compactor = Compactor(state)
    compactor.ledger_puncher.min_bytes = 500
    assert sum(compactor.ledger_puncher.step(1) for _ in range(10)) > 0  # the punch ran
    maps = HoleMaps(str(journal_dir))
    assert any(maps.hole_at(*loc) is not None for _, loc in keys_a)  # keyed jobs in punched ranges
    after = {k: state.index.keys.get(k) for k, _ in keys_a}
    assert not [k for k, e in after.items() if e is None or e.until is not None]  # no window given
    # Past the window, the journal segment still there (pinned by the waiting job): all remembered.
    now = state.config.clock() + state.config.key_window_s + 1
    state.config = dataclasses.replace(state.config, clock=lambda: now)
    state.forget_keys()
    state.index.forget_keys(now, 1)  # and a key_window_max of 1
    assert os.path.exists(journal_dir / segment_name(wa, 0))
    assert 0 in list_chains(str(journal_dir))[wa]
    gone = [k for k, _ in keys_a if state.index.keys.get(k) is None]
    state.close()
    assert not gone
