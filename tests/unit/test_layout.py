"""What a process loads: a worker does not load the producer or the journal (issue 14.5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import hybridq
import pytest


def _loaded_after(statement: str) -> set[str]:
    """The hybridq modules a fresh interpreter has in ``sys.modules`` after ``statement``."""
    code = f"{statement}; import sys, json; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return {name for name in json.loads(out) if name == "hybridq" or name.startswith("hybridq.")}


def _loaded_by_command(argv: list[str], *, returncode: int) -> set[str]:
    """Every module in ``sys.modules`` at the exit of ``hybridq *argv`` (run in a fresh interpreter)."""
    code = (
        "import atexit, json, os, sys; "
        "atexit.register(lambda: os.write(3, json.dumps(sorted(sys.modules)).encode())); "
        "from hybridq.cli import main; "
        f"sys.argv = ['hybridq', *{argv!r}]; main()"
    )
    read, write = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.dup2({write}, 3); {code}"],
        pass_fds=(write,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    os.close(write)
    with os.fdopen(read) as pipe:
        loaded = set(json.loads(pipe.read()))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == returncode, err
    return loaded


def test_importing_the_worker_loads_neither_the_producer_nor_the_journal() -> None:
    loaded = _loaded_after("import hybridq.worker")
    assert "hybridq.worker" in loaded
    assert "hybridq.journal.writer" not in loaded
    assert "hybridq.producer" not in loaded
    assert not any(name == "hybridq.journal" or name.startswith("hybridq.journal.") for name in loaded)


def test_the_worker_command_loads_no_other_command() -> None:
    """``hybridq worker`` starts without the forwarder, the status code or the HTTP server."""
    loaded = _loaded_after(
        "import hybridq.cli as c, click; c.cli.get_command(click.Context(c.cli), 'worker')"
    )
    assert "hybridq.cli.worker" in loaded
    for heavy in ("hybridq.forwarder", "hybridq.ops.status", "hybridq.http", "hybridq.cli.forward"):
        assert heavy not in loaded, heavy
    every = _loaded_after("import hybridq.cli as c, click; c.cli.list_commands(click.Context(c.cli))")
    assert "hybridq.cli.worker" not in every  # listing names loads nothing


def test_starting_the_worker_command_loads_neither_the_journal_nor_the_status_code() -> None:
    """``hybridq worker``'s start (options parsed, Redis checked) loads what a worker runs, no more.

    Every module loaded before the pool forks delays the first job (issue 15's burn-down): the
    status code and the journal's reader, writer and CRC library once cost ~130 ms of ~300 ms;
    the forwarder's transport port (``transport.base``, nine dataclasses) ~5 ms, ``zoneinfo``
    (only a date-time with a zone needs it) ~3 ms (issue 26).
    """
    loaded = _loaded_by_command(["worker", "--burst", "--redis", "redis://127.0.0.1:1/0", "q"], returncode=1)
    assert "hybridq.worker.pool" in loaded
    for heavy in (
        "hybridq.ops.status",
        "hybridq.journal.reader",
        "hybridq.journal.writer",
        "crc32c",
        "hybridq.forwarder",
        "hybridq.producer",
        "hybridq.transport.base",
        "zoneinfo",
    ):
        assert heavy not in loaded, heavy


def test_the_status_command_loads_neither_the_outbox_class_nor_the_producer(tmp_path) -> None:
    """``hybridq status`` reads the outbox's table only with ``--outbox``, and never enqueues: the
    package's ``Outbox`` (it imports the producer's queue, the remote client, the workflows'
    checks), once imported with the package by ``--outbox``'s default table name, cost ~200 ms
    of its start (``python -X importtime``)."""
    journal = tmp_path / "journal"
    journal.mkdir(mode=0o700)
    loaded = _loaded_by_command(["status", "--journal", str(journal), "--json"], returncode=0)
    assert "hybridq.ops.status" in loaded
    for heavy in ("hybridq.producer", "hybridq.client", "hybridq.outbox.enqueue", "hybridq.outbox.once"):
        assert heavy not in loaded, heavy


def test_importing_the_package_root_loads_nothing_else() -> None:
    assert _loaded_after("import hybridq") == {"hybridq", "hybridq.lazy"}  # lazy: PEP 562's hooks


@pytest.mark.parametrize("name", hybridq.__all__)
def test_every_public_name_is_importable_from_the_root(name: str) -> None:
    assert getattr(hybridq, name) is not None
    assert name in dir(hybridq)


def test_the_memory_transport_is_still_importable_from_hybridq_transport() -> None:
    from hybridq.testing.memory import MemoryTransport
    from hybridq.transport import MemoryTransport as Reexported

    assert Reexported is MemoryTransport
    with pytest.raises(AttributeError):
        _ = hybridq.transport.NoSuchTransport  # type: ignore[attr-defined]


def test_nothing_outside_hybridq_testing_imports_it() -> None:
    loaded = _loaded_after("import hybridq.cli, hybridq.forwarder.loop, hybridq.transport.rq, hybridq.worker")
    assert not any(name.startswith("hybridq.testing") for name in loaded)


def test_a_packages_submodules_and_lazy_names_are_its_attributes() -> None:
    """``hybridq.journal`` loads on first use, yet reads as a package that imported everything."""
    code = (
        "import hybridq.journal as j, json, sys; "
        "print(json.dumps([j.reader.JournalReader is j.JournalReader, j.writer.__name__, "
        "j.crashpoints.__name__, hasattr(j, 'nope'), hasattr(j, '_nope'), 'RecordType' in dir(j)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert json.loads(out) == [True, "hybridq.journal.writer", "hybridq.crashpoints", False, False, True]
