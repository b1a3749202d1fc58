"""hybridq.worker.wire: a pipeline's bytes and replies, for less CPU; never a connection out of step."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from hybridq.testing.embedded import RedisServer
from hybridq.testing.faultproxy import FaultProxy, script_call
from hybridq.worker import scripts, wire
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

ECHO = "return {KEYS[1], ARGV[1], tonumber(ARGV[2]), ARGV[3]}"
FAIL = "return redis.error_reply('this one failed')"
LAST = "return 'last'"


def _commands(client: redis.Redis) -> list[tuple[Any, ...]]:
    for source in (ECHO, FAIL, LAST):
        client.script_load(source)
    return [
        ("EVALSHA", scripts.sha(client, ECHO), 1, "key:é", "text é", 12, 1.5),
        ("EVALSHA", scripts.sha(client, FAIL), 0),
        ("EVALSHA", "0" * 40, 0),  # a script Redis does not know: NoScriptError, its own reply
        ("EVALSHA", scripts.sha(client, LAST), 0),
    ]


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every packed write made on a redis-py connection (the handshake's too)."""
    writes: list[bytes] = []
    original = redis.Connection.send_packed_command

    def record(self: redis.Connection, command: Any, check_health: bool = True) -> None:
        writes.append(b"".join(command) if not isinstance(command, str) else command.encode())
        original(self, command, check_health)

    monkeypatch.setattr(redis.Connection, "send_packed_command", record)
    return writes


def _shape(replies: list[Any]) -> list[Any]:
    return [(type(r), str(r)) if isinstance(r, Exception) else r for r in replies]


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_bytes_sent_and_the_replies_are_the_pipelines(
    redis_server: RedisServer, sent: list[bytes], protocol: int
) -> None:
    client = redis.Redis.from_url(redis_server.url, protocol=protocol)
    commands = _commands(client)
    client.ping()  # connected: no handshake in what is compared below
    assert wire._direct(client, commands)
    del sent[:]
    direct = wire.round_trip(client, commands)
    by_wire = list(sent)
    del sent[:]
    with client.pipeline(transaction=False) as pipe:
        for args in commands:
            pipe.execute_command(*args)
        piped = pipe.execute(raise_on_error=False)
    assert by_wire == sent
    assert _shape(direct) == _shape(piped)
    assert direct[0] == [b"key:\xc3\xa9", "text é".encode(), 12, b"1.5"]
    assert isinstance(direct[1], ResponseError)
    assert isinstance(direct[2], NoScriptError)
    assert direct[3] == b"last"
    assert client.ping()  # the connection is in step: one, back in the pool
    assert len(client.connection_pool._available_connections) == 1


def test_a_connection_cut_mid_batch_is_never_used_again(redis_server: RedisServer) -> None:
    """The first reply is read, the connection is reset before the others: it is dropped."""
    assert redis_server.port is not None
    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        client = redis.Redis.from_url(proxy.url, protocol=2, socket_timeout=5)
        try:
            commands = _commands(client)
            proxy.cut_replies(1, script_call(LAST))
            with pytest.raises(RedisConnectionError):
                wire.round_trip(client, commands)
            (conn,) = client.connection_pool._available_connections
            assert not conn.is_connected
            again = wire.round_trip(client, commands)
            assert again[0][0] == b"key:\xc3\xa9"
            assert again[3] == b"last"
            assert proxy.stats.cuts == 1
        finally:
            client.close()


def test_a_batch_that_timed_out_leaves_no_late_reply_for_the_next(redis_server: RedisServer) -> None:
    """Its replies arrive after the timeout: the next batch reads its own, not those."""
    assert redis_server.port is not None
    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        client = redis.Redis.from_url(proxy.url, protocol=2, socket_timeout=0.3)
        try:
            commands = _commands(client)
            proxy.latency(0.0, 0.6)
            with pytest.raises(RedisTimeoutError):
                wire.round_trip(client, commands)
            proxy.latency(0.0, 0.0)
            mine = [("EVALSHA", scripts.sha(client, LAST), 0), ("EVALSHA", scripts.sha(client, LAST), 0)]
            assert wire.round_trip(client, mine) == [b"last", b"last"]
            assert client.ping()
        finally:
            client.close()


@pytest.mark.parametrize(
    "options",
    [{"decode_responses": True}, {"encoding": "latin-1"}, {"retry_on_timeout": True}],
    ids=["decoded", "latin-1", "retries"],
)
def test_a_client_it_cannot_treat_as_the_pipeline_does_gets_the_pipeline(
    redis_server: RedisServer, options: dict[str, Any]
) -> None:
    client = redis.Redis.from_url(redis_server.url, **options)
    commands = _commands(client)
    assert not wire._direct(client, commands)
    replies = wire.round_trip(client, commands)
    assert isinstance(replies[1], ResponseError)
    assert isinstance(replies[2], NoScriptError)
    assert replies[3] in (b"last", "last")


def test_other_commands_a_callback_for_a_script_call_or_an_argument_hiredis_refuses_get_the_pipeline(
    redis_server: RedisServer,
) -> None:
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    client.script_load(ECHO)
    client.script_load(LAST)
    echo = ("EVALSHA", scripts.sha(client, ECHO), 1, "k", memoryview(b"view"), 1, "x")
    assert wire._direct(client, [echo, ("EVAL", LAST, 0)])
    assert not wire._direct(client, [echo, ("SET", "x", "1")])  # its reply callback, among others
    assert wire.round_trip(client, [("SET", "x", "1"), ("GET", "x")]) == [True, b"1"]
    assert wire.round_trip(client, [echo]) == [[b"k", b"view", 1, b"x"]]  # hiredis: no memoryview
    mine = redis.Redis.from_url(redis_server.url, protocol=2)
    mine.set_response_callback("EVALSHA", lambda reply, **_: ("parsed", reply))
    assert not wire._direct(mine, [echo])
    assert wire.round_trip(mine, [("EVALSHA", scripts.sha(client, LAST), 0)]) == [("parsed", b"last")]


def test_an_interrupt_between_two_replies_leaves_no_reply_for_the_next_batch(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py's read did not fail (the first reply read whole): the batch's later replies are
    still on the connection, which must not go back to the pool as it is."""
    client = redis.Redis.from_url(redis_server.url)
    a, b = client.script_load("return 'A'"), client.script_load("return 'B'")
    original = redis.Connection.read_response
    reads = []

    def interrupted(self: redis.Connection, *args: Any, **kwargs: Any) -> Any:
        reply = original(self, *args, **kwargs)
        reads.append(reply)
        if len(reads) == 1:
            raise KeyboardInterrupt
        return reply

    disconnected: list[redis.Connection] = []
    real_disconnect = redis.Connection.disconnect

    def disconnect(self: redis.Connection, *args: Any) -> None:
        disconnected.append(self)
        real_disconnect(self, *args)

    monkeypatch.setattr(redis.Connection, "read_response", interrupted)
    monkeypatch.setattr(redis.Connection, "disconnect", disconnect)
    with pytest.raises(KeyboardInterrupt):
        wire.round_trip(client, [("EVALSHA", a, 0), ("EVALSHA", b, 0)])
    # Disconnected by round_trip itself, before the pool has it back (redis-py's own check at
    # the next checkout would find B's reply buffered only by luck of timing).
    assert len(disconnected) == 1
    monkeypatch.setattr(redis.Connection, "read_response", original)
    assert wire.round_trip(client, [("EVALSHA", b, 0)]) == [b"B"]
    assert client.ping()
    assert not client.connection_pool._in_use_connections


def test_a_pool_whose_get_connection_needs_the_commands_name_gets_the_pipeline(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py before 5.3 (the floor allows 5.0.1): ``get_connection()`` with no name raised
    TypeError, which no caller catches: every pool process would have died at its first turn."""
    commands = [("EVALSHA", "0" * 40, 0)]
    assert wire._direct(redis.Redis.from_url(redis_server.url), commands)
    original = redis.ConnectionPool.get_connection

    def get_connection(self: redis.ConnectionPool, command_name: str, *keys: Any, **options: Any) -> Any:
        return original(self, command_name, *keys, **options)

    monkeypatch.setattr(redis.ConnectionPool, "get_connection", get_connection)  # redis-py 5.2's
    assert not wire._direct(redis.Redis.from_url(redis_server.url), commands)
