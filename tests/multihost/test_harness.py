"""The namespace harness itself (fast; in the default run, skipped where namespaces cannot be made)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import netns

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _needs_namespaces() -> None:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()}


def links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(": ")[1].split("@")[0] for line in out.splitlines()}


def test_close_removes_namespaces_links_and_processes_even_after_a_failure(tmp_path: Path) -> None:
    net = netns.Network()
    host = net.add_host("p0")
    proc = host.popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={}, log_path=tmp_path / "log"
    )
    try:
        with pytest.raises(ZeroDivisionError):
            _ = 1 / 0  # a failing test body
    finally:
        net.close()
    assert proc.poll() == -signal.SIGKILL
    assert host.ns not in namespaces()
    assert not {net.bridge, host.link} & links()


def test_a_dead_runs_namespaces_are_swept(subprocess_env: dict[str, str]) -> None:
    # A run SIGKILLed with its hosts up (no teardown, no atexit) leaves them behind.
    code = "from tests.support import netns; import time; n = netns.Network(); h = n.add_host('p0')\n"
    code += "print(h.ns, n.bridge, h.link, flush=True); time.sleep(60)"
    child = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=subprocess_env, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    ns, bridge, link = child.stdout.readline().split()
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    assert ns in namespaces()
    assert {bridge, link} <= links()
    removed = netns.sweep_stale()
    assert {ns, bridge} <= set(removed)
    assert ns not in namespaces()
    assert not {bridge, link} & links()


def test_a_live_runs_namespaces_are_not_swept() -> None:
    net = netns.Network()
    try:
        host = net.add_host("w0")
        assert host.ns not in netns.sweep_stale()
        assert host.ns in namespaces()
    finally:
        net.close()


def test_hosts_reach_each_other_and_a_cut_host_does_not(tmp_path: Path) -> None:
    net = netns.Network()
    try:
        a, b = net.add_host("p0"), net.add_host("w1")
        probe = f"import socket; socket.create_connection(('{b.address}', 9), timeout=1)"
        reached = subprocess.run(
            ["ip", "netns", "exec", a.ns, sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            check=False,
        )
        assert "ConnectionRefusedError" in reached.stderr  # b answered: nothing listens on 9
        b.cut()
        cut = subprocess.run(
            ["ip", "netns", "exec", a.ns, sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            check=False,
        )
        assert "ConnectionRefusedError" not in cut.stderr  # a timeout or no route: no answer
    finally:
        net.close()


def test_skip_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns.unavailable() == "network namespaces need root (ip netns add)"
    monkeypatch.undo()
    monkeypatch.setattr(netns.shutil, "which", lambda _: None)
    assert netns.unavailable() == "no `ip` command (iproute2) on PATH"
