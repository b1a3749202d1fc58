"""Per-process caches: dropped in a forked child (the pool forks its workers), never stale."""

from __future__ import annotations

import os
import socket

import pytest
from hybridq.protocol import host_pid
from hybridq.security.signing import _getenv
from hybridq.worker import lease


def _in_child(fn: object) -> str:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.write(write, str(fn()).encode())  # type: ignore[operator]
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        out = pipe.read()
    os.waitpid(pid, 0)
    return f"{pid}|{out}"


def test_host_pid_names_the_forked_child_not_its_parent() -> None:
    assert host_pid() == f"{socket.gethostname()}/{os.getpid()}"
    pid, out = _in_child(host_pid).split("|")
    assert out == f"{socket.gethostname()}/{pid}"
    assert host_pid() == f"{socket.gethostname()}/{os.getpid()}"


def test_a_forked_child_starts_its_own_lease_renewer() -> None:
    parent = lease._renewer()
    assert lease._renewer() is parent

    def child() -> str:
        mine = lease._renewer()
        return f"{mine is not parent} {mine._thread.is_alive()}"

    assert _in_child(child).split("|")[1] == "True True"


def test_a_forked_child_never_makes_the_job_ids_its_parent_makes() -> None:
    from hybridq.envelope.model import new_job_id

    new_job_id()  # the parent has random parts read ahead
    child = _in_child(lambda: ",".join(new_job_id(1.0) for _ in range(300))).split("|")[1].split(",")
    parent = [new_job_id(1.0) for _ in range(300)]
    assert len(set(child)) == 300
    assert not set(child) & set(parent)


def test_threads_never_share_a_job_id() -> None:
    import threading

    from hybridq.envelope.model import new_job_id

    made: list[str] = []

    def make() -> None:
        made.extend(new_job_id(1.0) for _ in range(2000))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(made)) == len(made) == 16000


def test_the_signing_configuration_is_read_from_the_live_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """keyring() reads the environment's own dict: a variable set or unset now is seen now."""
    monkeypatch.delenv("HYBRIDQ_SIGNING_KEY", raising=False)
    assert _getenv("HYBRIDQ_SIGNING_KEY") is None
    monkeypatch.setenv("HYBRIDQ_SIGNING_KEY", "clé,k2")
    assert _getenv("HYBRIDQ_SIGNING_KEY") == "clé,k2" == os.environ["HYBRIDQ_SIGNING_KEY"]
    monkeypatch.delenv("HYBRIDQ_SIGNING_KEY")
    assert _getenv("HYBRIDQ_SIGNING_KEY") is None


def test_a_forked_child_never_makes_the_token_nonces_its_parent_makes() -> None:
    """One forked later with a pid used before must not repeat that one's tokens."""
    from hybridq.protocol.host import token_nonce

    token_nonce()
    first = _in_child(lambda: ",".join(token_nonce() for _ in range(50))).split("|")[1]
    second = _in_child(lambda: ",".join(token_nonce() for _ in range(50))).split("|")[1]
    parent = ",".join(token_nonce() for _ in range(50))
    assert len({first, second, parent}) == 3
    assert all(len(n) == 8 and int(n, 16) >= 0 for n in first.split(","))


def test_a_process_copied_without_pythons_fork_handlers_makes_other_token_nonces() -> None:
    """A copy no at-fork handler sees (fork(2) from C, a snapshot restored twice) parts at once.

    Review of the per-process generator the nonces first came from: both copies made the same
    tokens, so two runs could share one lease.
    """
    import ctypes

    from hybridq.protocol.host import token_nonce

    token_nonce()
    libc = ctypes.CDLL(None, use_errno=True)
    r, w = os.pipe()
    pid = libc.fork()
    if pid == 0:  # pragma: no cover - the copy: only writes its nonces and exits
        os.write(w, ",".join(token_nonce() for _ in range(4)).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(w)
    child = os.read(r, 200).decode()
    os.close(r)
    parent = ",".join(token_nonce() for _ in range(4))
    assert len(child.split(",")) == 4
    assert child != parent
