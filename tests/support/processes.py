"""Child processes for integration tests: ``hybridq forward``, workers and ``hybridq status``.

Every process started here is reaped by its owner (``ForwarderProcess.kill``/``terminate`` or the
test's fixture): a ``Popen`` that is never waited for raises ``ResourceWarning``, which the test
suite turns into an error.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from hybridq.errors import HybridqError
from hybridq.ops.status import stats
from hybridq.testing.chaos import children_of

__all__ = [
    "ForwarderProcess",
    "WorkerProcess",
    "children_of",
    "kill_when_ready",
    "run_status",
    "wait_for_status",
    "wait_until",
]

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"
) -> T:
    """Poll ``predicate`` until it returns something truthy; return it, or fail after ``timeout``.

    An ``AssertionError`` raised by the predicate (e.g. "the forwarder died") fails at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def run_status(journal: str | os.PathLike[str], env: Mapping[str, str]) -> dict[str, Any]:
    """``hybridq status --json --journal J`` in a child process, parsed."""
    done = subprocess.run(
        [sys.executable, "-m", "hybridq", "status", "--json", "--journal", str(journal)],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"status exited {done.returncode}: {done.stderr}"
    out: dict[str, Any] = json.loads(done.stdout)
    return out


#: Seconds between two ``hybridq status`` children while the status read here does not hold yet.
CLI_EVERY_S = 2.0


def wait_for_status(
    journal: str | os.PathLike[str],
    env: Mapping[str, str],
    predicate: Callable[[dict[str, Any]], bool],
    *,
    what: str,
    timeout: float = 60.0,
    interval: float = 0.2,
    alive: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Until ``hybridq status --json`` (a child process) satisfies ``predicate``; that status.

    Each poll reads the status in this process first (``hybridq.stats``, what the command prints,
    without Redis or the outbox) and starts the child only once that holds (or every
    :data:`CLI_EVERY_S`, should the two ever differ): a child per poll cost about 0.3 s of CPU, on
    2 cores shared with the forwarder and workers under test, and a poll period of its start-up
    under load. What is returned, and asserted on, is still the command's output.
    """
    last: list[dict[str, Any]] = [{}]
    cli_at = [time.monotonic() + CLI_EVERY_S]

    def check() -> dict[str, Any]:
        alive()
        here = _status_here(journal)
        if not (here is not None and predicate(here)) and time.monotonic() < cli_at[0]:
            return {}
        cli_at[0] = time.monotonic() + CLI_EVERY_S
        last[0] = run_status(journal, env)
        return last[0] if predicate(last[0]) else {}

    try:
        return wait_until(check, timeout=timeout, interval=interval, what=what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last status: {last[0]}") from None


def _status_here(journal: str | os.PathLike[str]) -> dict[str, Any] | None:
    """What ``hybridq status --json --journal J`` counts, read in this process; None: not readable yet."""
    try:
        return stats(str(journal), redis_url=None, outbox=None, redis_for=None)
    except (HybridqError, OSError):
        return None


def kill_when_ready(argv: list[str], env: Mapping[str, str], logs: Path, cycle: int, pause_s: float) -> str:
    """Run ``argv``, SIGKILL it ``pause_s`` after it wrote ``ready`` to stderr; its stdout.

    For the crash tests whose child reports what was acknowledged on stdout (a line cut by the
    kill has no newline). It must die of the kill, without a traceback.
    """
    out, err = logs / f"{cycle}.out", logs / f"{cycle}.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(argv, env=dict(env), stdout=stdout, stderr=stderr)
    try:
        deadline = time.monotonic() + 30
        while b"ready" not in err.read_bytes():
            assert proc.poll() is None, f"cycle {cycle}: child exited early: {err.read_text()}"
            assert time.monotonic() < deadline, f"cycle {cycle}: child never got ready"
            time.sleep(0.005)
        time.sleep(pause_s)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, f"cycle {cycle}: exit {proc.returncode}: {err.read_text()}"
    assert b"Traceback" not in err.read_bytes(), f"cycle {cycle}: {err.read_text()}"
    return out.read_text()


class ForwarderProcess:
    """``python -m hybridq forward --journal J --redis URL [extra...]``, its stderr in ``log_path``."""

    def __init__(
        self,
        journal: str | os.PathLike[str],
        redis_url: str,
        *,
        env: Mapping[str, str],
        log_path: str | os.PathLike[str],
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.log_path = Path(log_path)
        self.args = [
            sys.executable,
            "-m",
            "hybridq",
            "forward",
            "--journal",
            str(journal),
            "--redis",
            redis_url,
            *extra_args,
        ]
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the fd
            self._offset = log.tell()
            self.proc = subprocess.Popen(
                self.args, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        """What this process wrote to stderr so far."""
        with open(self.log_path, "rb") as log:
            log.seek(self._offset)
            return log.read().decode("utf-8", "replace")

    def assert_alive(self) -> None:
        rc = self.proc.poll()
        assert rc is None, f"forwarder pid {self.pid} exited with {rc}:\n{self.log()[-3000:]}"

    def kill(self) -> int:
        """SIGKILL (if still running) and reap; return the exit status."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    def terminate(self, timeout: float = 30.0) -> tuple[int, float]:
        """SIGTERM and wait; return (exit status, seconds it took). SIGKILL after ``timeout``."""
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"forwarder pid {self.pid} ignored SIGTERM for {timeout:g} s") from None
        return rc, time.monotonic() - start

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit by itself; SIGKILL and fail after ``timeout``."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"forwarder pid {self.pid} still running after {timeout:g} s") from None


class WorkerProcess:
    """A worker child process (``hybridq worker`` or ``rq worker``), its output in ``log_path``."""

    def __init__(
        self,
        args: list[str],
        *,
        env: dict[str, str],
        log_path: Path,
        cwd: Path,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self.args = args
        self.log_path = log_path
        with open(log_path, "ab") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                args,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=pass_fds,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def assert_alive(self) -> None:
        rc = self.proc.poll()
        assert rc is None, f"worker pid {self.pid} exited with {rc}:\n{self.log()[-3000:]}"

    def children(self) -> list[int]:
        """Pids of this worker's live child processes (a forking worker's work-horse)."""
        return children_of(self.pid) if self.alive else []

    def kill(self) -> int:
        """SIGKILL the worker's children (its work-horse), then the worker; reap it."""
        if self.alive:
            for pid in self.children():  # still its children: these pids are not reused yet
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.kill()
        return self.proc.wait()
