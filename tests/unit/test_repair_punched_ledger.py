"""`journal repair --accept-loss` over a ledger segment the ledger punch punched.

The ledger punch maps and punches runs of a sealed ledger segment; the repair
copies a cut segment sparsely and trims its hole map. Damage a record after the punched runs,
repair the ledger directory, then start: every key whose entry was punched keeps its owner (from
the key store: the repair forgets the saved index, so the start replays all of it), the cut
segment keeps its holes, and the backup reads with its map.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import pytest
from hybridq.errors import JournalCorruption
from hybridq.forwarder.dead_segments import Compactor
from hybridq.journal import JournalReader, JournalWriter
from hybridq.journal.format import segment_name
from hybridq.journal.holes import Hole, _encode, _name, read_holes
from hybridq.journal.reader import list_chains
from hybridq.journal.recovery import verify
from hybridq.journal.statefile import write_state
from hybridq.ledger.store import ledger_dir, read_keys
from hybridq.ops.journal_repair import repair

from tests.support.started import started_state
from tests.unit.test_ledger_punch import _two_chains_journal_punched


class PunchedLedger(NamedTuple):
    """A ledger segment the ledger punch punched, then damaged after its punched runs."""

    ldir: str
    chain: str
    seg: int
    holes: tuple[Hole, ...]  # its map's ranges before the damage: what a repair keeps
    all_holes: tuple[Hole, ...]
    path: str
    owners: dict[str, tuple[object, float | None]]  # the keys the punch moved to the key store
    through: dict[str, int]


def punched_ledger_damaged(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> PunchedLedger:
    """The ledger punch's runs in sealed ledger segments; a bit flipped in a record after one's runs."""
    state, _, _, through, _, _ = _two_chains_journal_punched(journal_dir, monkeypatch)
    compactor = Compactor(state)
    compactor.ledger_puncher.min_bytes = 500
    freed = sum(compactor.ledger_puncher.step(1) for _ in range(10))
    assert freed > 0
    moved = {e.key for _, e in read_keys(str(journal_dir))}
    owners = {k: (state.index.keys.get(k).loc, state.index.keys.get(k).until) for k in moved}
    state.close()
    ldir = ledger_dir(str(journal_dir))
    ((chain, segs),) = list_chains(ldir).items()
    punched = [s for s in segs if read_holes(ldir, chain, s)]
    seg = victim = None
    for s in punched:
        hs = read_holes(ldir, chain, s)
        rs = list(JournalReader(ldir).segment_records(chain, s))
        after = [r for r in rs[:-1] if r.offset >= hs[0].end]
        if after:
            seg, victim = s, after[len(after) // 2]
            break
    assert seg is not None
    assert victim is not None
    all_holes = read_holes(ldir, chain, seg)
    holes = tuple(h for h in all_holes if h.end <= victim.offset)
    path = os.path.join(ldir, segment_name(chain, seg))
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.seek(victim.offset + 20)
        byte = f.read(1)
        f.seek(victim.offset + 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    return PunchedLedger(ldir, chain, seg, holes, all_holes, path, owners, through)


def keys_lost(journal_dir: Path, damaged: PunchedLedger) -> list[str]:
    """The moved keys a start no longer finds with their owner (a start of the forwarder's state)."""
    state = started_state(journal_dir, damaged.through)
    after = {
        k: (e.loc, e.until) if (e := state.index.keys.get(k)) is not None else None for k in damaged.owners
    }
    state.close()
    return [k for k in damaged.owners if after[k] is None or after[k][0] != damaged.owners[k][0]]


def test_repair_of_a_punched_ledger_segment(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ldir, chain, seg, holes, all_holes, path, _, _ = damaged = punched_ledger_damaged(
        journal_dir, monkeypatch
    )
    report = repair(ldir, accept_loss=True)
    assert report.applied
    assert tuple(read_holes(ldir, chain, seg)) == holes, (
        read_holes(ldir, chain, seg),
        holes,
        all_holes,
    )  # ranges before the cut kept
    assert os.stat(path).st_blocks * 512 < os.path.getsize(path) - sum(h.end - h.start for h in holes) + 8192
    backup = report.backup
    assert backup is not None
    assert os.path.exists(
        os.path.join(backup, segment_name(chain, seg) + ".holes.state")
    )  # its map kept beside it
    assert not keys_lost(journal_dir, damaged)


def test_a_hole_map_range_past_the_seal_is_reported_and_a_repair_trims_it(tmp_path: Path) -> None:
    """A map range past a sealed segment's end (restored by hand) would make every later punch
    of the segment refuse; verify() reports it, and a repair trims it losing no record."""
    d = tmp_path / "j"
    d.mkdir(mode=0o700)
    with JournalWriter(d, max_segment_bytes=64 << 10) as w:
        for s in range(0, 1000, 10):
            w.append_many([b"%06d" % i + b"x" * 100 for i in range(s, s + 10)])
    before = [r.payload for r in JournalReader(d).records()]
    seg0 = [r for r in JournalReader(d).records() if r.segment_index == 0]
    size = (d / f"{seg0[0].writer_id}-00000000.wal").stat().st_size
    stale = Hole(size + 10, size + 1000, seg0[-1].seq + 5, seg0[-1].seq + 16, 11)
    write_state(str(d), _name(seg0[0].writer_id, 0), _encode([stale]))
    with pytest.raises(JournalCorruption, match="hole map range past the segment's seal"):
        verify(d)
    assert repair(d, accept_loss=True).applied
    verify(d)
    assert [r.payload for r in JournalReader(d).records()] == before
    assert read_holes(str(d), seg0[0].writer_id, 0) == ()
