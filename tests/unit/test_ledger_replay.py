"""The ledger's replay at start folds successes in without building entries: the same index.

``load_index`` applies ``done``/``succeeded`` entries from their parsed JSON
(``LedgerIndex.apply_succeeded``); every other entry as before. Over ledgers of every kind of
entry, in random orders, over live and compacted segments, it must give exactly the index that
applying each decoded entry gives.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from hybridq.journal import JournalWriter
from hybridq.journal.reader import list_chains
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.store import load_index, open_ledger_writer, read_ledger, read_ledger_of


def reference(journal: str, compacted: Compacted) -> LedgerIndex:
    """``load_index`` as it was: every entry decoded, then applied (or its compacted rule)."""
    index = LedgerIndex()
    first = {writer: indices[0] for writer, indices in list_chains(journal).items()}
    for _, entry in read_ledger(journal):
        if compacted.is_compacted((entry.loc[0], entry.loc[1])) or entry.loc[1] < first.get(
            entry.loc[0], sys.maxsize
        ):
            if entry.kind == "done" and entry.outcome == "failed" and entry.dup_of is None:
                index.failed.setdefault(entry.loc, entry)
            elif entry.kind == "requeued":
                index.failed.requeue(entry.loc)
            elif entry.kind == "key":
                index.apply(entry)
            continue
        index.apply(entry)
    return index


def entries(rng: random.Random, writer: str, n: int) -> list[Entry]:
    out: list[Entry] = []
    for i in range(n):
        loc = (writer, rng.choice([0, 1, 2]), 32 + 100 * rng.randrange(12))
        kind = rng.choice(["done"] * 6 + ["retry", "lost", "cancel", "requeued", "key", "duplicate"])
        outcome = (
            rng.choice(["succeeded"] * 3 + ["failed", "cancelled", "invalid"]) if kind == "done" else None
        )
        out.append(
            Entry(
                kind,
                f"job{loc[2]}",
                loc,
                outcome=outcome,
                attempt=rng.randrange(1, 4),
                dup=rng.random() < 0.15,
                event_id=f"1-{rng.randrange(5)}" if rng.random() < 0.5 else None,
                run_at=1.0 if kind == "retry" else None,
                at=float(i),
                key=f"k{rng.randrange(3)}" if kind == "key" else None,
                later=rng.randrange(2) if kind == "retry" else 0,
                later_since=1.0,
                dup_of="x" if rng.random() < 0.1 else None,
            )
        )
    return out


def journal_of_three_segments(tmp_path: Path) -> tuple[str, str]:
    """A journal of one chain of three small segments; its path and its writer id."""
    journal = tmp_path / "journal"
    with JournalWriter(journal, max_segment_bytes=4096) as jw:  # small segments: three of them
        for _ in range(3):
            jw.append_many([b'{"x": "' + b"y" * 3000 + b'"}'])
    [(writer, segments)] = list_chains(str(journal)).items()
    assert len(segments) == 3
    return str(journal), writer


@pytest.mark.parametrize("seed", range(12))
def test_the_replay_gives_the_index_of_every_entry_applied(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    journal, writer = journal_of_three_segments(tmp_path)
    ledger = open_ledger_writer(str(journal))
    ledger.append_many(e.to_bytes() for e in entries(rng, writer, 300))
    ledger.append_many(e.to_bytes() for e in entries(rng, "gone-writer", 40))  # a chain compacted away
    ledger.append_many([b"[1, 2]", b'"text"', b'{"t": "done", "o": "succeeded"}'])  # garbled: skipped
    ledger.close()
    compacted = Compacted(through={writer: 0}) if seed % 2 else Compacted()
    assert load_index(str(journal), compacted) == reference(str(journal), compacted)


@pytest.mark.parametrize(
    "fields",
    [
        '"id":"j","at":"x"',
        '"at":1.0',
        '"id":"j","n":"one"',
        '"id":"j","lt":[]',
        '"id":"j","g":{}',
        '"id":"j","ol":[]',  # an IndexError before: every reader and the replay crashed
        '"id":"j","ol":["w",1]',
        '"id":"j","ol":7',
        '"id":"j","ol":["w",1e400,0]',  # OverflowError (an infinity to int) crashed every reader
        '"id":"j","n":1e400',  # (as on main, before this)
    ],
)
def test_a_success_the_entry_path_would_skip_is_skipped(tmp_path: Path, fields: str) -> None:
    """A success record that passed its checksum but is malformed: skipped, as Entry.from_body skips
    it (the lookup index never shows it done, so the forwarder must not count it finished)."""
    journal = tmp_path / "journal"
    with JournalWriter(journal) as writer:
        writer.append_many([b'{"x": 1}'])
    [(chain, _)] = list_chains(str(journal)).items()
    ledger = open_ledger_writer(str(journal))
    ledger.append_many([f'{{"t":"done","o":"succeeded","loc":["{chain}",0,32],{fields}}}'.encode()])
    ledger.close()
    assert load_index(str(journal), Compacted()) == reference(str(journal), Compacted())


@pytest.mark.parametrize("ol", ["[]", '["w",0]', '{"c":1}', '["w",1e400,0]'])
def test_a_duplicate_entry_with_a_malformed_owner_is_skipped(tmp_path: Path, ol: str) -> None:
    """Fails before with ``[]`` and ``["w",0]``: an IndexError no reader caught (issue 29's second review)."""
    journal = tmp_path / "journal"
    with JournalWriter(journal) as writer:
        writer.append_many([b'{"x": 1}'])
    [(chain, _)] = list_chains(str(journal)).items()
    ledger = open_ledger_writer(str(journal))
    ledger.append_many(
        [f'{{"t":"duplicate","id":"d","loc":["{chain}",0,2],"k":"k","of":"o","ol":{ol},"at":1.0}}'.encode()]
    )
    ledger.close()
    index = load_index(str(journal), Compacted(), keys=False)
    assert len(index.duplicates) == 0


def test_the_entries_of_a_few_ids_are_those_of_every_entry_read(tmp_path: Path) -> None:
    """``read_ledger_of`` (cancel() of a punched job) skips undecoded what names none of its ids."""
    rng = random.Random(29)
    journal, writer = journal_of_three_segments(tmp_path)
    ledger = open_ledger_writer(journal)
    ledger.append_many(e.to_bytes() for e in entries(rng, writer, 300))
    ledger.close()
    ids = {"job32", "job132", "job13", "nobody"}  # job13 is a prefix of job132's id: not it
    assert list(read_ledger_of(journal, ids)) == [e for _, e in read_ledger(journal) if e.job_id in ids]
    assert any(e.job_id == "job132" for _, e in read_ledger(journal))
