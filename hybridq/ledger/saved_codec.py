"""The saved ledger index's payload: what the state file holds, and how it is read back.

:mod:`hybridq.ledger.saved_index` decides when the file is written and whether a start may trust
it; this module owns only its format (JSON, its versions, and what each version leaves to the key
table's file), so a change of the format is one module's change.

This module must not import redis or rq.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridq.journal import ChainPosition
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex, shared
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.outcomes import SegmentOutcomes

__all__ = ["READ_VERSIONS", "VERSION", "Saved", "decode", "encode"]

#: 2: the key owners left out (they are in the key table), its id and generation in. 3: the
#: listed failures and requeue marks left out too (rows of the same file: issue 29). 4: the
#: pending duplicates left out too (rows of the same file). Files of versions 2 and 3 still
#: load (:func:`decode` writes what they hold of those into the table). 5: the punched ranges of
#: each segment (``punched``), whose succeeded jobs the offsets leave out: a version that would
#: read the offsets alone must not load it (it would push those jobs again).
VERSION = 5
READ_VERSIONS = (2, 3, 4, 5)


@dataclass
class Saved:
    """A saved index and what it covers."""

    index: LedgerIndex
    #: Per ledger chain, the position up to which every record is folded into :attr:`index`.
    covered: dict[str, ChainPosition]
    #: The compaction state's ``through`` it was made under.
    through: dict[str, int]
    #: Per ledger chain it covers, the chain's first segment when it was made: a segment deleted
    #: since (ledger compaction) may have held keys the index still has without their window.
    first: dict[str, int]
    #: The key table (:mod:`hybridq.ledger.keytable`) holding the key owners it covers: its id
    #: and the generation it was marked with before this was written.
    keys_table: tuple[str, int] = ("", 0)


def encode(
    index: LedgerIndex,
    covered: Mapping[str, ChainPosition],
    through: Mapping[str, int],
    first: Mapping[str, int],
    keys_table: tuple[str, int] = ("", 0),
) -> bytes:
    """The state file's payload: JSON, the terminal outcomes as lists of offsets per outcome.

    The key owners, the listed failures and the pending duplicates are left out: they are in
    the key table's file
    ``keys_table`` names (its id and the generation it was marked with), which must be found
    again to trust this file. Its size is therefore O(jobs in the window), not O(failures).
    """
    terminal, punched = [], []
    for (writer, segment), done in index.terminal.items():
        terminal.append([writer, segment, done.groups()])
        spans = done.punched()
        if spans:
            punched.append([writer, segment, [n for span in spans for n in span]])
    body: dict[str, Any] = {
        "v": VERSION,
        "covered": {w: p.to_json() for w, p in covered.items()},
        "through": dict(through),
        "first": dict(first),
        "terminal": terminal,
        "punched": punched,
        "dups": [[w, s, n] for (w, s), n in index.dups.items()],
        "dup_events": [[w, s, sorted(ids)] for (w, s), ids in index.dup_events.items()],
        "retries": [[*loc, run_at, n] for loc, (run_at, n) in index.retries.items()],
        "lost": [[*loc, n, times] for loc, (n, times) in index.lost.items()],
        "later": [[*loc, n, since] for loc, (n, since) in index.later.items()],
        "keys_table": list(keys_table),
        "cancels": [body_of(e) for e in index.cancels.values()],
    }
    return json.dumps(body, separators=(",", ":")).encode()


def decode(raw: bytes, keys: KeyTable | None = None) -> Saved:
    """Inverse of :func:`encode`; raises ``ValueError`` (or ``KeyError``/``TypeError``) if malformed.

    ``keys``: the key table the index gets (a new one in memory without it).
    """
    body = json.loads(raw)
    if body["v"] not in READ_VERSIONS:
        raise ValueError(f"version {body['v']!r}")
    index = LedgerIndex() if keys is None else LedgerIndex(keys=keys)
    for writer, segment, by_outcome in body["terminal"]:
        groups: dict[str, list[int]] = {}
        for outcome, offsets in by_outcome.items():
            # Two names may read back as one ("" is "failed"): keep the offsets of both.
            groups.setdefault(shared(str(outcome)), []).extend(map(int, offsets))
        index.terminal[str(writer), int(segment)] = SegmentOutcomes.from_groups(groups)
    for writer, segment, flat in body.get("punched", ()):
        spans = [(int(flat[i]), int(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)]
        index.terminal.setdefault((str(writer), int(segment)), SegmentOutcomes()).drop_ranges(spans)
    for done in index.terminal.values():
        index.terminal_count += len(done)
        for name, n in done.tally().items():
            if name in index.totals:
                index.totals[name] += n
    for writer, segment, n in body["dups"]:
        index.dups[str(writer), int(segment)] = int(n)
        index.totals["dups"] += int(n)
    for writer, segment, ids in body["dup_events"]:
        index.dup_events[str(writer), int(segment)] = set(map(str, ids))
    for w, s, o, run_at, n in body["retries"]:
        index.retries[str(w), int(s), int(o)] = (float(run_at), int(n))
    for w, s, o, n, times in body["lost"]:
        index.lost[str(w), int(s), int(o)] = (int(n), int(times))
    for w, s, o, n, since in body["later"]:
        index.later[str(w), int(s), int(o)] = (int(n), float(since))
    if body["v"] == 2:  # an upgrade: its failures into the table (a table it does not trust is emptied)
        # Only these: rows an earlier upgrade left (no format 3 save vouched for them) may be
        # stale, and no start would drop them.
        index.failed.drop_all()
        for e in map(Entry.from_body, body["failed"]):
            index.failed[e.loc] = e
        for w, s, o in body["requeued"]:
            index.failed.requeue((str(w), int(s), int(o)))
    if body["v"] in (2, 3):  # an upgrade: its pending duplicates into the table, emptied first
        # (rows an earlier upgrade left, that no format 4 save vouched for, may be stale).
        index.duplicates.drop_all()
        for e in map(Entry.from_body, body["duplicates"]):
            index.duplicates.add(e)
    index.cancels = {e.loc: e for e in map(Entry.from_body, body["cancels"])}
    covered = {str(w): ChainPosition.from_json(p) for w, p in body["covered"].items()}
    through = {str(w): int(i) for w, i in body["through"].items()}
    table_id, generation = body["keys_table"]
    first = {str(w): int(i) for w, i in body["first"].items()}
    return Saved(index, covered, through, first, (str(table_id), int(generation)))


def body_of(entry: Entry) -> Any:
    """The entry as the JSON value the payload holds (cancels are kept whole)."""
    return json.loads(entry.to_bytes())
