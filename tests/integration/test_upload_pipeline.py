"""The intent-first upload pipeline (examples/upload_pipeline, docs/recipes/intent-first.md).

Real processes: a private redis-server, ``python -m hybridq forward``, ``python -m hybridq worker
--allow uploads`` and four uploader processes (``examples/upload_pipeline/uploader.py``), each
SIGKILLed four times between its enqueue and its move (``UPLOADS_DIE_AFTER_ENQUEUE``) and
restarted: after odd crashes its client sends the unacknowledged upload again (the same key is
enqueued a second time), after even ones it gives up (only the job can finish that upload).
What happened is counted from the pipeline's own files: ``processed.log`` has a line per
processing, ``ready/`` and ``incoming/`` hold the files.

The same harness with the uploader's two steps swapped (move, then enqueue: what users write
first) loses exactly the files whose clients gave up: the test can fail. The example's own
command (``run.py``, its README) runs too, smaller.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hybridq.journal.paths import ensure_journal_dir
from hybridq.testing.embedded import RedisServer

from tests.conftest import ROOT
from tests.integration.test_worker_redis import wait_status
from tests.support.processes import ForwarderProcess, WorkerProcess

EXAMPLE = ROOT / "examples" / "upload_pipeline"
UPLOADERS, FILES, CRASHES = 4, 60, 4

#: The uploader with its steps in the order users write first: publish, then enqueue.
MOVE_FIRST = """
import sys
import uploader, uploads

def upload(root, name, data):
    uploads._write_durably(f"{root}/incoming/{name}", data)
    uploads.publish(root, name)
    uploads._crash_point(name)
    uploads.process_upload.enqueue_call((root, name), idempotency_key=f"upload:{name}")

uploads.upload = upload
uploader.main(sys.argv[1:])
"""


class Uploader:
    """One uploader's files, run to the end through its crashes (see the module docstring)."""

    def __init__(
        self, prefix: str, die_at: set[str], root: Path, env: dict[str, str], code: str | None
    ) -> None:
        self.prefix, self.die_at, self.root, self.env, self.code = prefix, die_at, root, env, code
        self.first = self.crashes = self.gave_up = 0
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        script = ["-c", self.code] if self.code else [str(EXAMPLE / "uploader.py")]
        args = [str(self.root), self.prefix, str(self.first), str(FILES - self.first)]
        env = {**self.env, "UPLOADS_DIE_AFTER_ENQUEUE": ",".join(sorted(self.die_at))}
        self.proc = subprocess.Popen(
            [sys.executable, *script, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def step(self) -> bool:
        """Reap the process if it exited (restarting it when files remain); True once all are done."""
        assert self.proc is not None
        if self.proc.poll() is None:
            return False
        out, err = self.proc.communicate()
        self.first += sum(1 for line in out.splitlines() if line.startswith("acked "))
        if self.proc.returncode != -9:
            assert self.proc.returncode == 0, err[-2000:]
            return True
        self.crashes += 1
        self.die_at.discard(f"{self.prefix}-{self.first:04d}")
        if self.crashes % 2 == 0:  # the client gives up; otherwise it sends the upload again
            self.gave_up += 1
            self.first += 1
        if self.first >= FILES:
            return True
        self.start()
        return False


def pipeline(tmp_path: Path, env: dict[str, str]) -> tuple[Path, Path, dict[str, str]]:
    """The pipeline's root, its journal (created) and the environment its processes get."""
    root, journal = tmp_path / "pipeline", tmp_path / "journal"
    ensure_journal_dir(journal)
    env = {
        **env,
        "HYBRIDQ_JOURNAL": str(journal),
        "PYTHONPATH": os.pathsep.join([str(EXAMPLE), env["PYTHONPATH"]]),
    }
    return root, journal, env


def services(
    tmp_path: Path, journal: Path, server: RedisServer, env: dict[str, str]
) -> tuple[ForwarderProcess, WorkerProcess]:
    """``hybridq forward`` and ``hybridq worker --allow uploads`` (one process) for the pipeline."""
    forwarder = ForwarderProcess(journal, server.url, env=env, log_path=tmp_path / "forwarder.log")
    worker_args = ["-m", "hybridq", "worker", "--redis", server.url, "--allow", "uploads"]
    worker = WorkerProcess(
        [sys.executable, *worker_args, "--processes", "1", "uploads"],
        env=env,
        log_path=tmp_path / "worker.log",
        cwd=tmp_path,
    )
    return forwarder, worker


def run_pipeline(
    tmp_path: Path, server: RedisServer, env: dict[str, str], code: str | None = None
) -> dict[str, int]:
    """Run every uploader to the end with a forwarder and a worker; the figures, from the files."""
    root, journal, env = pipeline(tmp_path, env)
    forwarder, worker = services(tmp_path, journal, server, env)
    rng = random.Random(16)
    uploaders = []
    for u in range(UPLOADERS):
        names = [f"u{u}-{i:04d}" for i in range(FILES)]
        uploaders.append(Uploader(f"u{u}", set(rng.sample(names, CRASHES)), root, env, code))
    try:
        for uploader in uploaders:
            uploader.start()
        running = list(uploaders)
        deadline = time.monotonic() + 60
        while running:
            assert time.monotonic() < deadline, "the uploaders took over 60 s"
            forwarder.assert_alive()
            worker.assert_alive()
            running = [u for u in running if not u.step()]
            time.sleep(0.02)
        status = wait_status(journal, env, lambda s: s["pending"] == 0, what="every job finished", timeout=30)
    finally:
        for uploader in uploaders:
            if uploader.proc is not None and uploader.proc.poll() is None:
                uploader.proc.kill()
                uploader.proc.communicate()
        worker.kill()
        forwarder.kill()
    runs = collections.Counter(line.split()[0] for line in (root / "processed.log").read_text().splitlines())
    files = {f"u{u}-{i:04d}" for u in range(UPLOADERS) for i in range(FILES)}
    assert set(runs) <= files
    return {
        "files": len(files),
        "crashes": sum(u.crashes for u in uploaders),
        "gave_up": sum(u.gave_up for u in uploaders),
        "jobs": status["accepted"],
        "suppressed": status["duplicates_suppressed"],
        "failed": status["failed"],
        "never_processed": len(files - set(runs)),
        "processed_twice": sum(n - 1 for n in runs.values()),
        "in_incoming": sum(1 for name in (root / "incoming").iterdir() if not name.name.startswith(".")),
        "in_ready": sum(1 for _ in (root / "ready").iterdir()),
    }


def line(name: str, f: dict[str, int], seconds: float) -> str:
    return (
        f"{name} uploaders={UPLOADERS} files={f['files']} crashes={f['crashes']} gave_up={f['gave_up']} "
        f"jobs={f['jobs']} suppressed={f['suppressed']} never_processed={f['never_processed']} "
        f"processed_twice={f['processed_twice']} seconds={seconds:.1f}"
    )


def test_uploaders_killed_between_enqueue_and_move_lose_no_file_and_process_none_twice(
    tmp_path: Path, redis_server: RedisServer, subprocess_env: dict[str, str], figures: Callable[[str], None]
) -> None:
    started = time.monotonic()
    f = run_pipeline(tmp_path, redis_server, subprocess_env)
    figures(line("upload-pipeline intent-first", f, time.monotonic() - started))
    assert f["crashes"] == UPLOADERS * CRASHES
    assert (f["never_processed"], f["processed_twice"], f["failed"]) == (0, 0, 0)
    assert f["jobs"] <= f["files"] + f["crashes"]
    # Every client that sent its upload again enqueued its key a second time: one run, one suppressed.
    assert f["jobs"] - f["files"] == f["crashes"] - f["gave_up"]
    assert f["suppressed"] >= f["jobs"] - f["files"]
    assert (f["in_incoming"], f["in_ready"]) == (0, f["files"])


def test_the_same_crashes_with_move_then_enqueue_lose_the_files_whose_clients_gave_up(
    tmp_path: Path, redis_server: RedisServer, subprocess_env: dict[str, str], figures: Callable[[str], None]
) -> None:
    started = time.monotonic()
    f = run_pipeline(tmp_path, redis_server, subprocess_env, MOVE_FIRST)
    figures(line("upload-pipeline move-then-enqueue", f, time.monotonic() - started))
    assert f["crashes"] == UPLOADERS * CRASHES
    assert f["never_processed"] == f["gave_up"] > 0
    assert f["processed_twice"] == 0


def test_the_examples_one_command_runs_and_tallies(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    options = ["--uploaders", "2", "--files", "10", "--crashes", "2", "--dir", str(tmp_path / "run")]
    done = subprocess.run(
        [sys.executable, str(EXAMPLE / "run.py"), *options],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    tally = done.stdout.splitlines()[-1]
    assert tally.startswith("files=20 crashes=4 jobs=22 (at most 24) "), tally
    assert " processed=20 never_processed=0 processed_twice=0 left_in_incoming=0 " in tally


def test_a_file_stored_by_an_uploader_that_died_before_its_enqueue_is_swept_and_processed(
    tmp_path: Path, redis_server: RedisServer, subprocess_env: dict[str, str]
) -> None:
    """The recipe's sweep of incoming/ (docs/recipes/intent-first.md, "What it does not guarantee")."""
    root, journal, env = pipeline(tmp_path, subprocess_env)

    def uploader(*args: str, die: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(EXAMPLE / "uploader.py"), str(root), *args],
            env={**env, "UPLOADS_DIE_AFTER_ENQUEUE": die},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    # Died after its enqueue, before its move: in incoming/ with a job.
    assert uploader("crashed", "1", "1", die="crashed-0001").returncode == -9
    # Died before its enqueue returned: in incoming/ with no job, its client gave up.
    incoming = root / "incoming"
    (incoming / "lost-0001").write_bytes(b"an upload nobody enqueued\n")
    (incoming / ".lost-0002.4242.tmp").write_bytes(b"a write cut short")  # not an upload
    old = time.time() - 600
    for name in ("crashed-0001", "lost-0001", ".lost-0002.4242.tmp"):
        os.utime(incoming / name, (old, old))
    (incoming / "fresh-0001").write_bytes(b"an upload in flight\n")  # its uploader is still at it
    started = uploader("next", "0", "0")  # an uploader starting: it sweeps first
    assert started.returncode == 0, started.stderr
    assert sorted(started.stdout.split()) == ["crashed-0001", "lost-0001", "swept", "swept"]
    forwarder, worker = services(tmp_path, journal, redis_server, env)
    try:
        status = wait_status(journal, env, lambda s: s["pending"] == 0, what="every job finished", timeout=30)
    finally:
        worker.kill()
        forwarder.kill()
    runs = collections.Counter(line.split()[0] for line in (root / "processed.log").read_text().splitlines())
    assert runs == {"crashed-0001": 1, "lost-0001": 1}
    assert (status["accepted"], status["duplicates_suppressed"]) == (3, 1)  # crashed-0001 twice, once run
    assert sorted(p.name for p in incoming.iterdir()) == [".lost-0002.4242.tmp", "fresh-0001"]


def test_a_sweep_skips_a_file_another_uploader_moves_while_it_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several uploaders sweep at once: a file listed by one and moved by another is not an error.

    Seen in CI: an uploader's sweep died with FileNotFoundError on ``stat()`` of a file that a
    second uploader had just published.
    """
    monkeypatch.syspath_prepend(str(EXAMPLE))
    uploads = importlib.import_module("uploads")
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    (incoming / "moved-0001").write_bytes(b"published by another uploader while listed\n")
    listing = os.scandir

    def moved_while_listed(path: str) -> Iterator[os.DirEntry[str]]:
        with listing(path) as entries:
            listed = list(entries)
        (incoming / "moved-0001").unlink()  # another uploader's publish, between listing and stat
        return contextlib.nullcontext(iter(listed))  # type: ignore[return-value]

    monkeypatch.setattr(uploads.os, "scandir", moved_while_listed)
    assert uploads.sweep(str(tmp_path), older_than_s=0) == []
