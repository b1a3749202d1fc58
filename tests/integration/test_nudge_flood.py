"""A flood of nudges on the forwarder's abstract socket (anyone on the host can send to it).

The figures are counts: forwarder passes and Redis commands while a sender floods the socket as
fast as it can, against a bound the forwarder enforces (at most one nudge-woken pass per
``MIN_INTERVAL_S``), not a timing assertion.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.protocol.nudge import MIN_INTERVAL_S, NudgeListener, address, nudge
from hybridq.testing.embedded import RedisServer
from hybridq.transport.rq import RQTransport

WINDOW_S = 1.5


def commands_processed(server: RedisServer) -> int:
    client = server.client()
    try:
        return int(client.info("stats")["total_commands_processed"])
    finally:
        client.close()


def flood(name: str, stop: threading.Event, sent: list[int]) -> None:
    """Send nudges to ``name`` as fast as possible until ``stop``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.settimeout(0.0)
        while not stop.is_set():
            try:
                sock.sendto(b"!", name)
                sent[0] += 1
            except OSError:
                time.sleep(0)  # the queue is full: the forwarder has not drained it yet


#: A flooder for another user: a child process (the test's own user cannot send as another).
FLOOD_SCRIPT = """
import socket, sys, time
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.setblocking(False)
deadline = time.monotonic() + float(sys.argv[2])
sent = 0
while time.monotonic() < deadline:
    try:
        sock.sendto(b"!", sys.argv[1].encode("latin-1").replace(b"@", b"\\0", 1))
        sent += 1
    except OSError:
        time.sleep(0)
print(sent)
"""
#: A Python the other user may run (this venv's may sit in a directory it cannot enter).
SYSTEM_PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")


def run_flooded(
    journal_dir: Path, server: RedisServer, sender: Callable[[str, threading.Event, list[int]], None] | None
) -> tuple[int, int, int]:
    """Forward for WINDOW_S while ``sender`` floods; (passes, Redis commands, nudges sent)."""
    Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 1)
    transport = RQTransport(server.url)
    forwarder = Forwarder(journal_dir, transport, idle_timeout_s=0.5)
    forwarder.open()
    passes = [0]
    step = forwarder.step

    def counted() -> int:
        passes[0] += 1
        return step()

    forwarder.step = counted  # type: ignore[method-assign]
    runner = threading.Thread(target=forwarder.run)
    runner.start()
    time.sleep(0.3)  # the first pass forwards the job
    before_passes, before_cmds = passes[0], commands_processed(server)
    stop, sent = threading.Event(), [0]
    flooder = None
    if sender is not None:
        flooder = threading.Thread(target=sender, args=(address(str(journal_dir)), stop, sent))
        flooder.start()
    time.sleep(WINDOW_S)
    stop.set()
    if flooder is not None:
        flooder.join()
    counts = passes[0] - before_passes, commands_processed(server) - before_cmds
    forwarder.stop()
    runner.join(10)
    forwarder.close()
    transport.close()
    return counts[0], counts[1], sent[0]


def test_a_nudge_flood_does_not_make_the_forwarder_work_in_proportion(
    journal_dir: Path, redis_server: RedisServer, figures
) -> None:
    idle_passes, idle_cmds, _ = run_flooded(journal_dir, redis_server, None)
    passes, cmds, sent = run_flooded(journal_dir, redis_server, flood)
    figures(
        f"NUDGE flood: {sent} nudges in {WINDOW_S} s -> {passes} passes, {cmds} Redis commands "
        f"(idle: {idle_passes} passes, {idle_cmds} commands)"
    )
    assert sent > 1000  # it was a flood
    # At most one nudge-woken pass per MIN_INTERVAL_S (+ the idle timeouts and the edges).
    bound = int(WINDOW_S / MIN_INTERVAL_S) + int(WINDOW_S / 0.5) + 3
    assert passes <= bound, (passes, bound)
    assert cmds <= (idle_cmds / max(idle_passes, 1) + 10) * bound, (cmds, idle_cmds)


@pytest.mark.skipif(
    os.geteuid() != 0 or SYSTEM_PYTHON is None,
    reason="sending as another user needs root and a system python3",
)
def test_nudges_from_another_user_are_ignored(journal_dir: Path, redis_server: RedisServer, figures) -> None:
    idle_passes, _, _ = run_flooded(journal_dir, redis_server, None)

    def as_nobody(name: str, stop: threading.Event, sent: list[int]) -> None:
        assert SYSTEM_PYTHON is not None
        proc = subprocess.run(
            [SYSTEM_PYTHON, "-c", FLOOD_SCRIPT, "@" + name[1:], str(WINDOW_S)],
            user=65534,
            group=65534,
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        sent[0] = int(proc.stdout)

    passes, cmds, sent = run_flooded(journal_dir, redis_server, as_nobody)
    figures(
        f"NUDGE flood from uid 65534: {sent} nudges -> {passes} passes, {cmds} Redis commands "
        f"(idle: {idle_passes} passes)"
    )
    assert sent > 1000
    assert passes <= idle_passes + 2  # only the idle timeouts wake it


def test_the_listener_coalesces_and_checks_the_sender(journal_dir: Path) -> None:
    journal_dir.mkdir()
    listener = NudgeListener(str(journal_dir))
    try:
        for _ in range(8):  # the kernel queues about 10 (net.unix.max_dgram_qlen)
            nudge(str(journal_dir), name=listener.name)
        assert listener.wait(1.0) is True  # one wake for all 8
        assert listener.wait(0) is False
        assert listener.accepted == 8
        assert listener.refused == 0
        # A second nudge right away: reported, but not before MIN_INTERVAL_S has passed.
        nudge(str(journal_dir), name=listener.name)
        started = time.monotonic()
        assert listener.wait(1.0) is True
        assert time.monotonic() - started >= MIN_INTERVAL_S * 0.9
    finally:
        listener.close()
