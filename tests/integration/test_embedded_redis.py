"""The private redis-server the test suite and ``hybridq demo`` run (hybridq/testing/embedded.py)."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import time

import pytest
import redis
from hybridq.errors import HybridqError
from hybridq.testing import embedded, embedded_find
from hybridq.testing.embedded import RedisServer, RedisServerFailed, RedisServerNotFound, find_redis_server


@pytest.fixture
def bare_path(tmp_path, monkeypatch):
    """PATH is one empty directory and HYBRIDQ_REDIS_SERVER is unset: a fresh machine."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv(embedded.ENV_REDIS_SERVER, raising=False)
    return empty


def test_binary_is_found_with_nothing_on_path(bare_path, make_redis_server):
    path = find_redis_server()
    assert os.path.isabs(path)
    assert os.access(path, os.X_OK)
    assert not path.startswith(str(bare_path))
    server = make_redis_server()
    assert server.executable == path
    with contextlib.closing(server.client()) as client:
        assert client.ping()


def test_binary_from_environment_variable_wins(bare_path, monkeypatch, tmp_path):
    real = find_redis_server()
    link = tmp_path / "my-redis-server"
    link.symlink_to(real)
    monkeypatch.setenv(embedded.ENV_REDIS_SERVER, str(link))
    assert find_redis_server() == str(link)


def test_unknown_binary_in_environment_variable_is_a_clear_error(monkeypatch, tmp_path):
    missing = tmp_path / "no-such-redis-server"
    monkeypatch.setenv(embedded.ENV_REDIS_SERVER, str(missing))
    with pytest.raises(RedisServerNotFound) as caught:
        find_redis_server()
    message = str(caught.value)
    assert embedded.ENV_REDIS_SERVER in message
    assert str(missing) in message
    assert "pip install 'hybridq[embedded]'" in message
    assert isinstance(caught.value, HybridqError)
    with pytest.raises(RedisServerNotFound):
        RedisServer(directory=tmp_path / "redis")


def test_non_executable_binary_in_environment_variable_is_refused(monkeypatch, tmp_path):
    not_executable = tmp_path / "redis-server"
    not_executable.write_text("#!/bin/sh\n")
    not_executable.chmod(stat.S_IRUSR | stat.S_IWUSR)
    monkeypatch.setenv(embedded.ENV_REDIS_SERVER, str(not_executable))
    with pytest.raises(RedisServerNotFound, match="not an executable"):
        find_redis_server()


def test_no_binary_anywhere_names_the_fix(bare_path, monkeypatch, tmp_path):
    monkeypatch.setattr(embedded_find.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(sys, "executable", str(bare_path / "python"))
    with pytest.raises(RedisServerNotFound, match=r"hybridq\[embedded\]") as caught:
        find_redis_server()
    assert caught.value.searched[0] == "PATH"


def test_start_and_ping(redis_server):
    assert redis_server.running
    assert redis_server.pid is not None
    assert redis_server.port not in (None, 6379)
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    with contextlib.closing(redis_server.client()) as client:
        assert client.ping()
        assert client.info("server")["process_id"] == redis_server.pid
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert client.dbsize() == 0


def test_kill_then_restart_keeps_the_port_and_loses_the_data(redis_server):
    port, pid = redis_server.port, redis_server.pid
    with contextlib.closing(redis_server.client()) as client:
        client.set("hybridq:key", "value")
    redis_server.kill()
    assert not redis_server.running
    assert redis_server.pid is None
    with contextlib.closing(redis_server.client(retry=None)) as client, pytest.raises(redis.ConnectionError):
        client.ping()
    redis_server.start()
    assert redis_server.port == port
    assert redis_server.pid != pid
    with contextlib.closing(redis_server.client()) as client:
        assert client.get("hybridq:key") is None
        client.set("hybridq:key", "again")
    redis_server.restart()
    assert redis_server.port == port
    with contextlib.closing(redis_server.client()) as client:
        assert client.dbsize() == 0


def test_paused_server_times_out_then_answers_after_resume(redis_server):
    with contextlib.closing(redis_server.client(socket_timeout=0.2, retry=None)) as client:
        assert client.ping()
        redis_server.pause()
        try:
            assert redis_server.running
            with pytest.raises(redis.TimeoutError):
                client.ping()
        finally:
            redis_server.resume()
    with contextlib.closing(redis_server.client(socket_timeout=2)) as client:
        assert client.ping()


def test_client_pause_holds_commands(redis_server):
    with contextlib.closing(redis_server.client(socket_timeout=5)) as client:
        client.ping()  # connected before the pause
        redis_server.client_pause(0.4)
        began = time.monotonic()
        client.set("hybridq:key", "value")
        assert time.monotonic() - began >= 0.3
        assert client.get("hybridq:key") == b"value"


def test_flushall_deletes_every_database(redis_server):
    with contextlib.closing(redis_server.client()) as client:
        client.set("hybridq:a", 1)
        client.execute_command("SELECT", 3)
        client.set("hybridq:b", 2)
    redis_server.flushall()
    with contextlib.closing(redis_server.client()) as client:
        assert client.dbsize() == 0
        client.execute_command("SELECT", 3)
        assert client.dbsize() == 0


def test_unix_socket_mode(make_redis_server):
    server = make_redis_server(unix_socket=True)
    assert server.port is None
    assert server.url == f"unix://{server.unix_socket}?db=0"
    assert stat.S_ISSOCK(os.stat(server.unix_socket).st_mode)
    with contextlib.closing(server.client()) as client:
        assert client.ping()
        client.set("hybridq:key", "value")
        assert client.config_get("port") == {"port": "0"}
    server.restart()
    with contextlib.closing(server.client()) as client:
        assert client.get("hybridq:key") is None


def test_stop_is_idempotent_even_when_paused(redis_server):
    redis_server.pause()
    began = time.monotonic()
    redis_server.stop()
    assert time.monotonic() - began < 3  # SIGTERM reached it: no wait for the SIGKILL fallback
    assert not redis_server.running
    redis_server.stop()
    redis_server.kill()
    assert redis_server.pid is None


def test_context_manager_stops_the_server(tmp_path):
    with RedisServer(directory=tmp_path / "redis") as server:
        pid = server.pid
        assert pid is not None
        with contextlib.closing(server.client()) as client:
            assert client.ping()
    assert not server.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_several_servers_are_independent(make_redis_server):
    first, second = make_redis_server(), make_redis_server()
    assert first.port != second.port
    with contextlib.closing(first.client()) as a, contextlib.closing(second.client()) as b:
        a.set("hybridq:key", "first")
        assert b.get("hybridq:key") is None


def test_a_server_that_cannot_start_reports_its_log(make_redis_server):
    with pytest.raises(RedisServerFailed) as caught:
        make_redis_server(extra_args=["--no-such-directive", "yes"])
    assert caught.value.returncode not in (None, 0)
    assert "no-such-directive" in caught.value.log_tail
    assert "no-such-directive" in str(caught.value)


def test_a_fixed_port_that_is_taken_is_not_silently_replaced(redis_server, make_redis_server):
    with pytest.raises(RedisServerFailed, match="Address already in use"):
        make_redis_server(port=redis_server.port)


def test_secrets_are_refused_on_the_command_line(tmp_path):
    with pytest.raises(ValueError, match="command line"):
        RedisServer(directory=tmp_path, extra_args=["--requirepass", "hunter2"])


def test_a_forgotten_running_server_warns_and_is_killed(tmp_path):
    server = RedisServer(directory=tmp_path / "redis")
    server.start()
    pid = server.pid
    with pytest.warns(ResourceWarning, match="never stopped"):
        del server  # CPython finalizes at once: the last reference is gone
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_picked_port_taken_before_the_bind_is_replaced(redis_server, make_redis_server, monkeypatch):
    # The race _free_port() cannot close: someone binds the port between the pick and the start.
    ports = iter([redis_server.port, embedded._free_port()])
    monkeypatch.setattr(embedded, "_free_port", lambda: next(ports))
    server = make_redis_server()
    assert server.port not in (None, redis_server.port)
    with contextlib.closing(server.client()) as client:
        assert client.info("server")["process_id"] == server.pid
