"""S3 power loss and S13 crash during rotation / close / recovery (docs/reliability.md).

A writer runs over :class:`PowerLossFileOps`; the power goes out at a random moment (or after
each step of a small workload); then, with plain OS file operations, ``recover()`` runs and the
journal is read back. Every acknowledged record must be there exactly once with its payload, and
a crash must only ever leave a torn tail, never ``JournalCorruption``.

The round functions (:func:`journal_round`, :func:`state_round`) return what they found instead
of asserting, so that S4 (``test_s4_harness_catches_bugs.py``) runs the very same functions
against deliberately broken writers and checks that they report the damage.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest
from hybridq.errors import JournalCorruption, JournalError, StateFileCorrupt
from hybridq.journal.fileops import FileOps
from hybridq.journal.format import encode_record
from hybridq.journal.reader import JournalReader
from hybridq.journal.recovery import recover
from hybridq.journal.statefile import read_state, write_state
from hybridq.journal.writer import JournalWriter

from tests.support.powerloss import MODES, PowerLossFileOps

SEED = int(os.environ.get("HYBRIDQ_TEST_SEED", "20240611"))
WORKLOADS = ("single", "batch", "threads")
STATE = "ckpt"

# Factories the broken builds of S4 replace; S3 uses the real ones.
MakeWriter = Callable[[str, FileOps, int], JournalWriter]
WriteState = Callable[..., None]


def real_writer(path: str, ops: FileOps, max_segment_bytes: int) -> JournalWriter:
    return JournalWriter(path, max_segment_bytes=max_segment_bytes, fileops=ops)


@dataclass
class Outcome:
    """What one or more crash rounds found. Everything but ``rounds`` and ``acked`` must be 0."""

    rounds: int = 0
    acked: int = 0
    lost: int = 0  # acknowledged, then missing or with other bytes
    duplicated: int = 0  # returned more than once (same payload or same chain/seq)
    unknown: int = 0  # returned but never appended
    corrupt: int = 0  # JournalCorruption / StateFileCorrupt after a crash
    unsealed_after_close: int = 0  # close() returned, yet recovery had to repair or seal the chain
    repaired_twice: int = 0  # a second recover() still found something to repair
    operations: int = 0  # file operations the writer made before the power went out
    notes: list[str] = field(default_factory=list)  # what went wrong, round by round

    def add(self, other: Outcome) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def damage(self) -> int:
        """Everything that must never happen, summed."""
        bad = ("lost", "duplicated", "unknown", "corrupt", "unsealed_after_close", "repaired_twice")
        return sum(getattr(self, name) for name in bad)


# -- checking a journal after the crash ----------------------------------------------------------


def check_journal(path: str, attempted: set[bytes], acked: set[bytes], closed: bool) -> Outcome:
    """Recover and read ``path`` with plain OS file operations; compare with what was acked."""
    out = Outcome(rounds=1, acked=len(acked))
    try:
        report = recover(path)
        records = list(JournalReader(path).records())
        again = recover(path)
    except JournalCorruption as exc:
        out.corrupt = 1
        out.lost = len(acked)  # refused to start: nothing can be delivered
        out.notes.append(f"{os.path.basename(path)}: {exc}")
        return out
    if closed and (report.repaired or report.sealed):
        out.unsealed_after_close = 1
    out.repaired_twice = int(bool(again.repaired or again.sealed or again.removed))
    payloads = Counter(r.payload for r in records)
    ids = Counter((r.writer_id, r.seq) for r in records)
    out.duplicated = sum(n - 1 for n in payloads.values()) + sum(n - 1 for n in ids.values())
    out.unknown = sum(1 for p in payloads if p not in attempted)
    out.lost = sum(1 for p in acked if p not in payloads)
    if out.damage:
        out.notes.append(f"{os.path.basename(path)}: {out}")
    return out


def _payload(rng: random.Random, tag: str, size: int | None = None) -> bytes:
    body = rng.randbytes(rng.randrange(0, 400) if size is None else size)
    return f"{tag}|".encode() + body


# -- the journal round ---------------------------------------------------------------------------


def journal_round(
    directory: Path,
    seed: int,
    mode: str,
    workload: str,
    *,
    make_writer: MakeWriter = real_writer,
    crash_at: int | None = None,
    ops_class: type[PowerLossFileOps] = PowerLossFileOps,
) -> Outcome:
    """Run ``workload`` over a power-loss file system, cut the power, check what is left.

    Workloads: ``single`` (one append at a time), ``batch`` (append_many mixed with appends),
    ``threads`` (four threads sharing the writer, group commit; the power is cut from the main
    thread while they run), ``close`` (a fixed small workload with rotations, then close: its
    operation sequence is deterministic, for sweeping ``crash_at``). Without ``crash_at`` the
    single/batch workloads crash at a random operation.
    """
    rng = random.Random(seed)
    path = str(directory)
    os.mkdir(path, 0o700)
    max_bytes = 4096 if workload == "close" else rng.choice((4096, 8192, 16384))
    if crash_at is None and workload in {"single", "batch"}:
        crash_at = rng.randrange(0, 700)
    ops = ops_class(crash_at=crash_at, crash_mode=mode, rng=random.Random(seed + 1))
    attempted: set[bytes] = set()
    acked: set[bytes] = set()
    closed = False
    writer = None
    try:
        writer = make_writer(path, ops, max_bytes)
        if workload == "threads":
            _run_threads(writer, ops, rng, mode, attempted, acked)
        else:
            closed = _run_serial(writer, rng, workload, attempted, acked)
    except (JournalError, OSError):
        pass  # the power went out under the writer: whatever was acked must survive
    finally:
        if writer is not None:
            with contextlib.suppress(JournalError, OSError):
                writer.close()
    if not ops.crashed:
        ops.crash(mode, random.Random(seed + 2))  # the workload finished: cut the power now
    ops.release()
    out = check_journal(path, attempted, acked, closed)
    out.operations = ops.op_count
    out.notes = [f"seed={seed} mode={mode} workload={workload} crash_at={crash_at}: {n}" for n in out.notes]
    return out


def _run_serial(writer, rng, workload, attempted, acked) -> bool:
    """Append until the power fails (or the workload ends). Returns True if close() returned."""
    count = 14 if workload == "close" else 300
    for i in range(count):
        if workload == "close":
            batch = (
                [_payload(rng, f"c{i}", 1500)]
                if i % 5
                else [_payload(rng, f"c{i}.{j}", 90) for j in range(3)]
            )
        elif workload == "batch" and rng.random() < 0.5:
            batch = [_payload(rng, f"b{i}.{j}") for j in range(rng.randrange(1, 9))]
        else:
            batch = [_payload(rng, f"s{i}")]
        attempted.update(batch)
        if len(batch) == 1:
            writer.append(batch[0])
        else:
            writer.append_many(batch)
        acked.update(batch)  # the append returned: acknowledged
    if workload == "close":
        writer.close()
        return True
    return False


def _run_threads(writer, ops, rng, mode, attempted, acked) -> None:
    target = rng.randrange(1, 250)
    lock = threading.Lock()
    seeds = [rng.random() for _ in range(4)]

    def work(t: int) -> None:
        trng = random.Random(seeds[t])
        for i in range(150):
            batch = [_payload(trng, f"t{t}.{i}.{j}") for j in range(trng.choice((1, 1, 1, 4)))]
            with lock:
                attempted.update(batch)
            try:
                writer.append_many(batch)
            except (JournalError, OSError):
                return
            with lock:
                acked.update(batch)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 10
    while len(acked) < target and any(th.is_alive() for th in threads) and time.monotonic() < deadline:
        time.sleep(0.0002)
    ops.crash(mode, rng)  # from this thread, while the appenders run
    for th in threads:
        th.join()


# -- the state-file round ------------------------------------------------------------------------


def state_round(
    directory: Path, seed: int, mode: str, *, crash_at: int | None = None, write: WriteState = write_state
) -> Outcome:
    """Replace a state file a few times over a power-loss file system; cut the power; read it.

    After ``write`` returned, the new value must survive; if the power went out during it, the
    file must hold the old or the new value, whole.
    """
    rng = random.Random(seed)
    path = str(directory)
    os.mkdir(path, 0o700)
    old = b"initial|" + rng.randbytes(rng.randrange(0, 300))
    write_state(path, STATE, old)  # the starting point, written with the real implementation
    ops = PowerLossFileOps(
        crash_at=rng.randrange(0, 30) if crash_at is None else crash_at, crash_mode=mode, rng=rng
    )
    allowed = {old}
    out = Outcome(rounds=1)
    for i in range(4):
        new = f"v{i}|".encode() + rng.randbytes(rng.randrange(0, 300))
        allowed = {old, new}
        try:
            write(path, STATE, new, fileops=ops)
        except (JournalError, OSError):
            break
        out.acked += 1
        old = new
        allowed = {new}
    if not ops.crashed:
        ops.crash(mode, rng)
    ops.release()
    try:
        value = read_state(path, STATE)
    except StateFileCorrupt as exc:
        out.corrupt = out.lost = 1
        out.notes.append(f"seed={seed} mode={mode} crash_at={crash_at}: {exc}")
        return out
    out.lost = int(value not in allowed)
    if out.lost:
        out.notes.append(f"seed={seed} mode={mode} crash_at={crash_at}: old value lost")
    return out


# -- S3 (the drivers are shared with S4) ---------------------------------------------------------


def run_journal_rounds(tmp_path: Path, rounds: int, **broken) -> Outcome:
    """``rounds`` seeded crash rounds per workload and mode; ``broken`` goes to journal_round."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    total = Outcome()
    n = 0
    for workload in WORKLOADS:
        for mode in MODES:
            for _ in range(rounds if workload != "threads" else max(1, rounds // 2)):
                n += 1
                total.add(journal_round(tmp_path / f"j{n}", SEED + n, mode, workload, **broken))
    return total


def run_state_rounds(tmp_path: Path, random_rounds: int, **broken) -> Outcome:
    """Per mode: a crash after every step of four state writes, then ``random_rounds`` more."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    total = Outcome()
    n = 0
    for mode in MODES:
        for crash_at in [*range(26), *([None] * random_rounds)]:
            n += 1
            total.add(state_round(tmp_path / f"s{n}", SEED + n, mode, crash_at=crash_at, **broken))
    return total


def test_s3_journal_power_loss(tmp_path, figures):
    total = run_journal_rounds(tmp_path, 40)
    figures(
        f"S3 power-loss rounds={total.rounds} modes={','.join(MODES)} workloads={','.join(WORKLOADS)} "
        f"acked={total.acked} lost={total.lost} corrupt={total.corrupt} dup={total.duplicated} "
        f"unknown={total.unknown} seed={SEED}"
    )
    assert total.acked > 1000  # the rounds really acknowledged records before the crash
    assert total.lost == 0, "\n".join(total.notes)
    assert total.damage == 0, "\n".join(total.notes)


def test_s3_state_file_power_loss(tmp_path, figures):
    total = run_state_rounds(tmp_path, 10)
    figures(
        f"S3 power-loss-state rounds={total.rounds} modes={','.join(MODES)} acked={total.acked} "
        f"lost={total.lost} corrupt={total.corrupt} seed={SEED}"
    )
    assert total.acked > 100
    assert total.lost == 0, "\n".join(total.notes)
    assert total.damage == 0, "\n".join(total.notes)


# -- S13 -----------------------------------------------------------------------------------------


def _count_ops(tmp_path: Path, seed: int) -> int:
    """How many file operations the ``close`` workload makes when nothing fails."""
    out = journal_round(tmp_path / "count", seed, "drop", "close", crash_at=10**9)
    assert out.acked == 20, out
    assert out.damage == 0, out
    return out.operations


def test_s13_crash_after_every_step_of_rotation_and_close(tmp_path, figures):
    seed = SEED + 13
    steps = _count_ops(tmp_path, seed)
    assert steps > 40  # several segment creations and seals, then close
    total = Outcome()
    for crash_at in range(steps + 1):
        for mode in MODES:
            total.add(journal_round(tmp_path / f"r{crash_at}{mode}", seed, mode, "close", crash_at=crash_at))
    figures(
        f"S13 crash-during-rotation-and-close steps={steps} modes={','.join(MODES)} "
        f"rounds={total.rounds} acked={total.acked} lost={total.lost} corrupt={total.corrupt} "
        f"unsealed_after_close={total.unsealed_after_close} seed={seed}"
    )
    assert total.damage == 0, "\n".join(total.notes)


def test_s13_crash_during_recovery(tmp_path, figures):
    """Power loss at every step of recover() (backup, truncate, seal) must not lose or corrupt."""
    seed = SEED + 113
    template = tmp_path / "template"
    rng = random.Random(seed)
    os.mkdir(template, 0o700)
    writer = JournalWriter(template, max_segment_bytes=4096)
    acked = set()
    for i in range(20):
        p = _payload(rng, f"r{i}", 300)
        writer.append(p)
        acked.add(p)
    # The writer dies mid-append: the first 40 bytes of its next record, then its lock is gone.
    seg, writer._segment, writer._closed = writer._segment, None, True
    os.write(seg.fd, encode_record(seg.seed, seg.next_seq, 1, b"x" * 100)[:40])
    os.close(seg.fd)
    total = Outcome()
    steps = None
    crash_at = 0
    while steps is None or crash_at <= steps:
        for mode in MODES:
            work = tmp_path / f"w{crash_at}{mode}"
            shutil.copytree(template, work)
            ops = PowerLossFileOps(crash_at=crash_at, crash_mode=mode, rng=random.Random(crash_at))
            with contextlib.suppress(JournalError, OSError):
                recover(work, fileops=ops)
            if not ops.crashed:
                steps = ops.op_count if steps is None else steps
                ops.crash(mode, random.Random(crash_at))
            ops.release()
            total.add(check_journal(str(work), acked, acked, closed=False))
        crash_at += 1
    figures(
        f"S13 crash-during-recovery steps={steps} modes={','.join(MODES)} rounds={total.rounds} "
        f"acked={total.acked} lost={total.lost} corrupt={total.corrupt} seed={seed}"
    )
    assert steps is not None
    assert steps > 10
    assert total.damage == 0, "\n".join(total.notes)


@pytest.mark.parametrize("mode", MODES)
def test_powerloss_model_drops_unsynced_and_undoes_unsynced_rename(tmp_path, mode):
    """The model itself: synced bytes and fsync_dir'd names survive, nothing else is promised."""
    d = str(tmp_path)
    ops = PowerLossFileOps()
    fd = ops.open(os.path.join(d, "a"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    ops.write(fd, b"durable")
    ops.fsync(fd)
    ops.fsync_dir(d)
    ops.write(fd, b"+volatile" * 50)
    ops.close(fd)
    fd2 = ops.open(os.path.join(d, "b.tmp"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    ops.write(fd2, b"new")
    ops.fsync(fd2)
    ops.replace(os.path.join(d, "b.tmp"), os.path.join(d, "b"))
    ops.fsync_dir(d)  # b is durable now, with its contents
    fd = ops.open(os.path.join(d, "c"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)  # create not durable
    fd3 = ops.open(os.path.join(d, "d.tmp"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    ops.write(fd3, b"newer")
    ops.fsync(fd3)
    ops.replace(os.path.join(d, "d.tmp"), os.path.join(d, "b"))  # overwrites b; no fsync_dir
    ops.crash(mode, random.Random(1))
    assert sorted(os.listdir(d)) == ["a", "b"]  # c and d.tmp gone, the rename over b undone
    assert Path(d, "b").read_bytes() == b"new"
    data = Path(d, "a").read_bytes()
    assert data[:7] == b"durable"
    if mode == "drop":
        assert data == b"durable"
    elif mode == "tear":
        assert b"durable+volatile+volatile".startswith(data[:25])
        assert len(data) <= 457
    else:
        assert len(data) == 457
        assert data != b"durable" + b"+volatile" * 50
    for call in (lambda: ops.write(fd, b"x"), lambda: ops.close(fd), lambda: ops.fsync_dir(d)):
        with pytest.raises(OSError, match="power loss"):
            call()
