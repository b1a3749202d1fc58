"""Hosts as Linux network namespaces on this machine, for the multihost scenarios.

Each :class:`Host` is a network namespace ``hqnet-<pid>-<seq>-<role>`` holding one end of a veth
pair (``eth0`` inside); the other end is a port of a bridge in the root namespace. The bridge
holds ``10.A.B.1/24`` (a /24 picked at random from 10.200.0.0-10.254.255.0 that no local address
or route uses), which the shared redis-server binds besides 127.0.0.1; host *n* is ``10.A.B.(10+n)``.
A process runs on a host through ``ip netns exec NS ...`` in a session of its own, so
:meth:`Network.close` kills it, and the children it forked, by its process group.

Faults, as between real machines: :meth:`Host.cut` sets the host's switch port down (its TCP
connections hang, then time out; nothing is reset), :meth:`Host.heal` brings it back, and
:meth:`Host.shape` puts a ``tc`` qdisc (``netem`` delay/loss, or ``tbf``) on both ends of the
host's link.

Names are unique per run: namespaces carry the creating process's pid and a counter, links
``hqn<pid:06x><seq:02x>`` and ``br`` (the bridge) or the role's first letter and the host's index
(at most 15 bytes). :meth:`Network.close` removes everything, also after a failed or interrupted
(Ctrl-C) test (the fixture's teardown) and at interpreter exit (``atexit``);
:func:`sweep_stale` removes what runs whose process died (SIGKILL, a killed CI job) left behind.
:func:`unavailable` says why the harness cannot run here (not root, no ``ip``, namespaces refused),
for a ``pytest.skip``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["Host", "NetnsError", "Network", "netem_missing", "sweep_stale", "unavailable"]

#: Prefix of every namespace this harness creates: ``hqnet-<pid>-<seq>-<role>``.
NS_PREFIX = "hqnet-"
#: Prefix of every link it creates in the root namespace: ``hqn<pid:06x><seq:02x><role>``.
LINK_PREFIX = "hqn"
_NS_RE = re.compile(rf"^{NS_PREFIX}(\d+)-")
_LINK_RE = re.compile(rf"^{LINK_PREFIX}([0-9a-f]{{6}})[0-9a-f]{{2}}")
_seq = 0


class NetnsError(RuntimeError):
    """An ``ip`` or ``tc`` command failed (its command line and stderr in the message)."""


def _run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unavailable() -> str | None:
    """Why namespaces cannot be used here (a skip reason), or ``None`` when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on PATH"
    probe = f"{NS_PREFIX}{os.getpid()}-probe"
    done = _run(["ip", "netns", "add", probe], check=False)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def netem_missing() -> str | None:
    """Why ``tc ... netem`` cannot be used here (a skip reason), or ``None``."""
    if shutil.which("tc") is None:
        return "no `tc` command (iproute2) on PATH"
    probe = f"{NS_PREFIX}{os.getpid()}-netem"
    _run(["ip", "netns", "add", probe])
    try:
        done = _run(
            ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem"], check=False
        )
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return (
        None if done.returncode == 0 else f"this kernel has no netem qdisc (sch_netem): {done.stderr.strip()}"
    )


def sweep_stale() -> list[str]:
    """Remove namespaces and links of this harness whose creating process is gone; return them."""
    removed: list[str] = []
    for line in _run(["ip", "netns", "list"]).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NS_RE.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)  # left running by a dead run of this harness
        if _run(["ip", "netns", "del", name], check=False).returncode == 0:
            removed.append(name)
    for line in _run(["ip", "-o", "link", "show"]).stdout.splitlines():
        fields = line.split(": ")
        name = fields[1].split("@")[0] if len(fields) > 1 else ""
        match = _LINK_RE.match(name)
        if match is None or _alive(int(match.group(1), 16)):
            continue
        if _run(["ip", "link", "del", name], check=False).returncode == 0:
            removed.append(name)
    return removed


def _free_subnet() -> str:
    """``10.A.B`` of a /24 no local address or route touches (another run's bridge included)."""
    used = _run(["ip", "-4", "route", "show", "table", "all"]).stdout + _run(["ip", "-4", "addr"]).stdout
    taken = set(re.findall(r"\b10\.(\d+)\.(\d+)\.", used))
    for _ in range(1000):
        a, b = random.randint(200, 254), random.randint(0, 255)
        if (str(a), str(b)) not in taken:
            return f"10.{a}.{b}"
    raise NetnsError("no free 10.x.y.0/24 subnet for the bridge")


class Host:
    """One host: a network namespace behind one switch port (see the module docstring)."""

    def __init__(self, network: Network, role: str, index: int) -> None:
        self.network = network
        self.role = role
        self.ns = f"{NS_PREFIX}{network.tag}-{role}"
        #: The switch port: this host's veth end in the root namespace, on the bridge.
        self.link = f"{network.link_tag}{role[:1]}{index}"
        self.address = f"{network.subnet}.{10 + index}"
        _run(["ip", "netns", "add", self.ns])
        network.namespaces.append(self.ns)
        _run(["ip", "link", "add", self.link, "type", "veth", "peer", "name", "eth0", "netns", self.ns])
        network.links.append(self.link)
        self.exec_("ip", "link", "set", "lo", "up")
        self.exec_("ip", "addr", "add", f"{self.address}/24", "dev", "eth0")
        self.exec_("ip", "link", "set", "eth0", "up")
        _run(["ip", "link", "set", self.link, "master", network.bridge, "up"])

    def exec_(self, *args: str) -> str:
        """Run a command in this host's namespace; its stdout."""
        return _run(["ip", "netns", "exec", self.ns, *args]).stdout

    def popen(
        self, args: Sequence[str], *, env: Mapping[str, str], log_path: Path, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``args`` on this host, output to ``log_path``; :meth:`Network.close` kills it."""
        with open(log_path, "ab") as log:  # the child keeps its own copy of the fd
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, *args],
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed with its children
            )
        self.network.procs.append(proc)
        return proc

    def cut(self) -> None:
        """Partition the host: its switch port goes down (packets vanish; no reset)."""
        _run(["ip", "link", "set", self.link, "down"])

    def heal(self) -> None:
        """Bring the switch port back up."""
        _run(["ip", "link", "set", self.link, "up"])

    def shape(self, *qdisc: str) -> None:
        """Put ``tc qdisc add ... root QDISC...`` on both ends of the host's link (both directions)."""
        self.exec_("tc", "qdisc", "add", "dev", "eth0", "root", *qdisc)
        _run(["tc", "qdisc", "add", "dev", self.link, "root", *qdisc])

    def unshape(self) -> None:
        """Remove what :meth:`shape` added."""
        _run(["ip", "netns", "exec", self.ns, "tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
        _run(["tc", "qdisc", "del", "dev", self.link, "root"], check=False)


class Network:
    """A bridge in the root namespace and the hosts plugged into it (see the module docstring)."""

    def __init__(self) -> None:
        global _seq
        _seq += 1
        self.tag = f"{os.getpid()}-{_seq}"
        self.link_tag = f"{LINK_PREFIX}{os.getpid():06x}{_seq % 256:02x}"
        self.namespaces: list[str] = []
        self.links: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.hosts: list[Host] = []
        self.subnet = _free_subnet()
        #: The bridge's address: where the shared Redis listens for the hosts.
        self.gateway = f"{self.subnet}.1"
        self.bridge = f"{self.link_tag}br"
        atexit.register(self.close)
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            self.links.append(self.bridge)
            _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
        except BaseException:
            self.close()
            raise

    def add_host(self, role: str) -> Host:
        """A new host named ``role`` (its first letter and index name its switch port)."""
        host = Host(self, role, len(self.hosts))
        self.hosts.append(host)
        return host

    def kill(self, proc: subprocess.Popen[bytes]) -> int:
        """SIGKILL a process this network started, and its process group; reap it."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()

    def close(self) -> None:
        """Kill every process started on the hosts, then delete the namespaces and links. Idempotent."""
        for proc in self.procs:
            self.kill(proc)
        self.procs.clear()
        for ns in reversed(self.namespaces):
            _run(["ip", "netns", "del", ns], check=False)  # takes its end of the veth with it
        self.namespaces.clear()
        for link in reversed(self.links):
            if _run(["ip", "link", "show", link], check=False).returncode == 0:
                _run(["ip", "link", "del", link], check=False)
        self.links.clear()
        atexit.unregister(self.close)
