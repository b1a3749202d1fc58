"""S5: torn tails. Truncate at every byte of the last three records, append zeros, append garbage.

Every case must open cleanly (a torn tail is repaired, never an error) and give back exactly the
records that were complete, and a second recovery must find nothing to do.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

from hybridq.journal import JournalReader, JournalWriter
from hybridq.journal.recovery import recover

from tests.support.writers import abandon_writer

PAYLOADS = [b"payload-%02d-" % i + b"x" * (i * 7 % 50) for i in range(12)]


def make_dead_journal(path: Path) -> tuple[Path, list[int]]:
    """A journal whose only writer died; returns its segment and each record's end offset."""
    writer = JournalWriter(path)
    ends = []
    for payload in PAYLOADS:
        writer.append(payload)
        assert writer._segment is not None
        ends.append(writer._segment.size)
    abandon_writer(writer)
    (segment,) = path.glob("*.wal")
    return segment, ends


def check_case(pristine: Path, work: Path, damage, expect: int) -> bool:
    """Copy the journal, damage its tail, recover, and compare with the expected prefix."""
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(pristine, work)
    (segment,) = work.glob("*.wal")
    damage(segment)
    recover(work)
    got = [r.payload for r in JournalReader(work).records()]
    again = recover(work)
    return got == PAYLOADS[:expect] and not again.repaired and not again.sealed


def test_s5_torn_tail(tmp_path: Path, figures) -> None:
    pristine = tmp_path / "pristine"
    segment, ends = make_dead_journal(pristine)
    size = segment.stat().st_size
    work = tmp_path / "work"
    rng = random.Random(5)
    cases = wrong = 0
    failures: list[str] = []

    def run(label: str, damage, expect: int) -> None:
        nonlocal cases, wrong
        cases += 1
        if not check_case(pristine, work, damage, expect):
            wrong += 1
            failures.append(label)

    start = ends[-4]  # the last three records start here
    for cut in range(start, size + 1):
        complete = sum(1 for end in ends if end <= cut)
        run(f"truncate at {cut}", lambda seg, cut=cut: os.truncate(seg, cut), complete)
    zero_runs = [1, 7, 19, 20, 21, 512, 4096]
    for n in zero_runs:
        run(f"{n} zeros", lambda seg, n=n: _append(seg, b"\0" * n), len(PAYLOADS))
        run(f"cut + {n} zeros", lambda seg, n=n: _cut_and_append(seg, ends[-1] - 5, b"\0" * n), 11)
    garbage_runs = 40
    for i in range(garbage_runs):
        junk = rng.randbytes(rng.randint(1, 3000))
        run(f"garbage #{i}", lambda seg, junk=junk: _append(seg, junk), len(PAYLOADS))
        cut = rng.randint(start, size - 1)
        expect = sum(1 for end in ends if end <= cut)
        run(f"cut + garbage #{i}", lambda seg, cut=cut, junk=junk: _cut_and_append(seg, cut, junk), expect)
    figures(
        f"S5 torn-tail cases={cases} truncations={size + 1 - start} zero_runs={2 * len(zero_runs)} "
        f"garbage_runs={2 * garbage_runs} wrong={wrong}"
    )
    assert wrong == 0, failures[:10]


def _append(segment: Path, data: bytes) -> None:
    with segment.open("ab") as f:
        f.write(data)


def _cut_and_append(segment: Path, cut: int, data: bytes) -> None:
    os.truncate(segment, cut)
    _append(segment, data)
