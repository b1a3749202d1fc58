"""``journal repair`` keeps a segment's punched ranges off the disk, in the cut segment and its backup.

Finished records punched out of a pinned segment free their blocks (docs/journal.md, "Finished
records punched out of pinned segments"); the repair copies the segment into its backup and
replaces it by a sealed copy of its good prefix. Copied byte by byte, each punched range came
back as written zeros, on disk until the forwarder's next start punched it again, and the
backup held it too: a repair on a nearly full disk could fail for blocks the journal had freed.
"""

from __future__ import annotations

import os
from pathlib import Path

from hybridq.journal import JournalReader, JournalWriter
from hybridq.journal.format import segment_name
from hybridq.journal.holes import Hole, add_holes, read_holes
from hybridq.journal.recovery import verify
from hybridq.journal.repair import repair

SEGMENT = 256 << 10
#: Blocks a file may hold past its data: the partial blocks at a range's two ends (a page each
#: at least: 64 KiB on an arm64 tmpfs), and what the filesystem keeps (ext4 held 16 KiB more
#: than the sizes here, with 4 KiB blocks).
SLACK = 4 * max(os.sysconf("SC_PAGE_SIZE"), 4096) + (16 << 10)


def _punched_then_rotted(journal: Path) -> tuple[list, str, int]:
    """Segment 0 of 256 KiB with records 1-900 punched, then bit rot in record 1000."""
    with JournalWriter(journal, max_segment_bytes=SEGMENT) as writer:
        for start in range(0, 2400, 10):  # one call is one append: it never spans segments
            writer.append_many([b"%06d" % i + b"x" * 200 for i in range(start, start + 10)])
    seg0 = [r for r in JournalReader(journal).records() if r.segment_index == 0]
    assert len(seg0) > 1010
    writer_id = seg0[0].writer_id
    a, b = seg0[1], seg0[900]
    freed = add_holes(str(journal), writer_id, 0, [Hole(a.offset, b.end, a.seq, b.seq + 1, 900)])
    path = journal / segment_name(writer_id, 0)
    os.chmod(path, 0o600)  # made writable for it, then sealed again
    with open(path, "r+b") as f:
        f.seek(seg0[1000].offset + 30)
        f.write(b"\xff\xff")
    os.chmod(path, 0o400)
    return seg0, writer_id, freed


def _disk(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_a_repaired_segment_keeps_its_punched_ranges_off_the_disk(journal_dir: Path) -> None:
    seg0, writer_id, freed = _punched_then_rotted(journal_dir)
    path = journal_dir / segment_name(writer_id, 0)
    assert _disk(path) <= os.stat(path).st_size - freed + SLACK  # punched: about the range freed
    original = path.read_bytes()  # the punched range reads as zeros
    report = repair(journal_dir, accept_loss=True)
    assert report.applied
    assert report.backup is not None
    verify(journal_dir)  # the map still falls on the records, the new seals after it
    assert read_holes(str(journal_dir), writer_id, 0) == (
        Hole(seg0[1].offset, seg0[900].end, seg0[1].seq, seg0[901].seq, 900),
    )
    size = os.stat(path).st_size
    assert size > seg0[900].end  # the cut is past the range, at the rotten record
    # Main wrote the range back as zeros: size and blocks were then about equal.
    assert _disk(path) <= size - freed + SLACK
    backup = Path(report.backup) / segment_name(writer_id, 0)
    assert _disk(backup) <= os.stat(backup).st_size - freed + SLACK
    assert backup.read_bytes() == original  # the segment as it was, byte for byte
    assert path.read_bytes()[: seg0[1000].offset] == original[: seg0[1000].offset]
    kept = [r.payload for r in JournalReader(journal_dir).records() if r.segment_index == 0]
    assert kept == [seg0[0].payload] + [r.payload for r in seg0[901:1000]]
