"""The saved ledger index's payload: what the state file holds, and how it is read back.

:mod:`hybridq.ledger.saved_index` decides when the file is written and whether a start may trust
it; this module owns only its format (JSON, its versions, and what each version leaves to the key
table's file), so a change of the format is one module's change.

Since version 6 the payload is lines: a header (a JSON object: all but the terminal outcomes),
then one JSON line per journal segment (its offsets per outcome and its punched ranges), so
that a save and a load hold one segment's at a time, not the whole index (issue 29: the
forwarder's memory bounded at a save and a load too, docs/forwarder.md, "Memory"). Versions
2 to 5 were one JSON object; they still load (whole, as before).

This module must not import redis or rq.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from hybridq.journal import ChainPosition
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex, shared
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.outcomes import SegmentOutcomes

__all__ = [
    "READ_VERSIONS",
    "VERSION",
    "Saved",
    "body_of_payload",
    "decode",
    "decode_lines",
    "encode",
    "encode_pieces",
    "lines_of",
]

#: 2: the key owners left out (they are in the key table), its id and generation in. 3: the
#: listed failures and requeue marks left out too (rows of the same file: issue 29). 4: the
#: pending duplicates left out too (rows of the same file). Files of versions 2 and 3 still
#: load (:func:`decode` writes what they hold of those into the table). 5: the punched ranges of
#: each segment (``punched``), whose succeeded jobs the offsets leave out: a version that would
#: read the offsets alone must not load it (it would push those jobs again). 6: lines, one per
#: segment after a header (the module docstring); what they hold is version 5's.
VERSION = 6
READ_VERSIONS = (2, 3, 4, 5, 6)


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
    """The state file's payload whole: :func:`encode_pieces` joined (tests and tools)."""
    return b"".join(encode_pieces(index, covered, through, first, keys_table))


def encode_pieces(
    index: LedgerIndex,
    covered: Mapping[str, ChainPosition],
    through: Mapping[str, int],
    first: Mapping[str, int],
    keys_table: tuple[str, int] = ("", 0),
) -> Iterator[bytes]:
    """The state file's payload in pieces: the header line, then a line per segment.

    A segment's line is ``[writer, segment, {outcome: [offsets]}, [punched ranges, flat]]``,
    made when it is asked for (a spilled map read back then, one at a time): the index must not
    change until the last piece is taken. The key owners, the listed failures and the pending
    duplicates are left out: they are in the key table's file ``keys_table`` names (its id and
    the generation it was marked with), which must be found again to trust this file. Its size
    is therefore O(jobs in the window), not O(failures).
    """
    segments = list(index.terminal)
    head: dict[str, Any] = {
        "v": VERSION,
        "covered": {w: p.to_json() for w, p in covered.items()},
        "through": dict(through),
        "first": dict(first),
        "segments": len(segments),
        "dups": [[w, s, n] for (w, s), n in index.dups.items()],
        "dup_events": [[w, s, sorted(ids)] for (w, s), ids in index.dup_events.items()],
        "retries": [[*loc, run_at, n] for loc, (run_at, n) in index.retries.items()],
        "lost": [[*loc, n, times] for loc, (n, times) in index.lost.items()],
        "later": [[*loc, n, since] for loc, (n, since) in index.later.items()],
        "keys_table": list(keys_table),
        "cancels": [body_of(e) for e in index.cancels.values()],
    }
    yield _line(head)
    for writer, segment in segments:
        done = index.terminal[writer, segment]
        flat = [n for span in done.punched() for n in span]
        yield _line(
            [writer, segment, dict(sorted(done.groups().items())), flat]
        )  # the same bytes spilled or not


def _line(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode() + b"\n"


def body_of_payload(raw: bytes) -> dict[str, Any]:
    """The payload of any version as one JSON object (version 5's shape).

    With ``terminal`` and ``punched`` lists: for tests and tools that rewrite a saved index as
    an older release's.
    """
    lines = raw.split(b"\n")
    body: dict[str, Any] = json.loads(lines[0])
    if body["v"] >= 6:
        pieces = [json.loads(line) for line in lines[1:] if line]
        body["terminal"] = [[w, s, groups] for w, s, groups, _ in pieces]
        body["punched"] = [[w, s, flat] for w, s, _, flat in pieces if flat]
        del body["segments"]
    return body


def decode(raw: bytes, keys: KeyTable | None = None) -> Saved:
    """Inverse of :func:`encode`; raises ``ValueError`` (or ``KeyError``/``TypeError``) if malformed.

    ``keys``: the key table the index gets (a new one in memory without it).
    """
    return decode_lines(raw.split(b"\n"), keys)


def decode_lines(
    lines: Iterable[bytes], keys: KeyTable | None = None, spill_dir: str = "", cap: int | None = None
) -> Saved:
    """:func:`decode` of the payload's lines, read one segment at a time (version 6).

    ``cap``: the most listed offsets the index holds in memory
    (:meth:`LedgerIndex.spill_past <hybridq.ledger.index.LedgerIndex.spill_past>`, files in
    ``spill_dir``), checked after each segment read: the load holds about the cap and one
    segment's, not the whole index. Files of versions 2 to 5 are one line, read whole.
    """
    it = iter(lines)
    body = json.loads(next(it))
    if body["v"] not in READ_VERSIONS:
        raise ValueError(f"version {body['v']!r}")
    index = LedgerIndex() if keys is None else LedgerIndex(keys=keys)
    if cap is not None:
        index.spill_past(spill_dir, cap)
    if body["v"] >= 6:
        read = 0
        for line in it:
            if not line:  # the last line's end
                continue
            writer, segment, by_outcome, flat = json.loads(line)
            _add(index, (str(writer), int(segment)), by_outcome, flat)
            index.check_spill()
            read += 1
        if read != int(body["segments"]):
            raise ValueError(f"{read} segments of {body['segments']}")
    else:
        punched = {(str(w), int(s)): flat for w, s, flat in body.get("punched", ())}
        for writer, segment, by_outcome in body["terminal"]:
            seg = (str(writer), int(segment))
            _add(index, seg, by_outcome, punched.pop(seg, ()))
        for seg, flat in punched.items():  # punched, none listed
            _add(index, seg, {}, flat)
    _rest(index, body)
    covered = {str(w): ChainPosition.from_json(p) for w, p in body["covered"].items()}
    through = {str(w): int(i) for w, i in body["through"].items()}
    table_id, generation = body["keys_table"]
    first = {str(w): int(i) for w, i in body["first"].items()}
    return Saved(index, covered, through, first, (str(table_id), int(generation)))


def lines_of(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of the payload read in ``chunks`` (without their ends), one at a time."""
    pending: list[bytes] = []
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            pending.append(chunk[start:end])
            yield b"".join(pending)
            pending, start = [], end + 1
        if start < len(chunk):
            pending.append(chunk[start:])
    if pending:
        yield b"".join(pending)


def _add(index: LedgerIndex, seg: tuple[str, int], by_outcome: Mapping[str, Any], flat: Any) -> None:
    """One segment's outcomes into ``index``, counted in its totals."""
    groups: dict[str, list[int]] = {}
    for outcome, offsets in by_outcome.items():
        # Two names may read back as one ("" is "failed"): keep the offsets of both.
        groups.setdefault(shared(str(outcome)), []).extend(map(int, offsets))
    if seg in index.terminal:
        raise ValueError(f"segment {seg} twice")
    done = index.terminal[seg] = SegmentOutcomes.from_groups(groups)
    if flat:
        done.drop_ranges([(int(flat[i]), int(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)])
    index.terminal_count += len(done)
    for name, n in done.tally().items():
        if name in index.totals:
            index.totals[name] += n


def _rest(index: LedgerIndex, body: dict[str, Any]) -> None:
    """All but the terminal outcomes, from the header (version 6) or the whole body."""
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


def body_of(entry: Entry) -> Any:
    """The entry as the JSON value the payload holds (cancels are kept whole)."""
    return json.loads(entry.to_bytes())
