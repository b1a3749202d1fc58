"""Several commands in one round trip on a client's own connection, without redis-py's pipeline.

A pool process's turn sends its scripts (END, START, RECORD, TAKE: :mod:`hybridq.worker.starter`)
in one round trip. Through redis-py's pipeline that costs three times the instructions of what
is done here, for a turn of three scripts (callgrind; docs/worker.md): a pipeline object per
turn, each command queued with its options, the observability hooks, a retry wrapper, a reply
callback looked up per command. :func:`round_trip` packs the commands at once with hiredis, as
redis-py's own packer does (the same bytes: tested), sends them on a connection of the client's
pool, and reads each reply with that connection's parser (RESP2 or RESP3, push messages handled
there as in a pipeline).

What a pipeline with ``raise_on_error=False`` gives is kept:

* a command's error (``NoScriptError``, a script's error) is that command's reply, the others
  are read on, and the connection goes back to the pool in step;
* any other failure (the connection dropped, a timeout, an interrupt) mid-batch disconnects the
  connection before it goes back to the pool: replies left unread are never read by the next
  user. The error is raised, as the pipeline raises it (the caller sends each part again);
* nothing is sent again here: the clients of a worker's own calls retry nothing
  (:func:`hybridq.worker.scripts.client`), and one that would is left to the pipeline.

Only script calls go this way (:func:`_direct`); a client this cannot treat as the pipeline
would is left to the pipeline too: no hiredis, another pool or connection class (Sentinel, a
client-side cache), a text encoding other than UTF-8 (hiredis encodes text so), decoded replies,
a reply callback for the command, retries. This module imports only redis and hiredis.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import ResponseError

_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _pack
except ImportError:  # pragma: no cover - a dependency (redis[hiredis]); the pipeline then
    _pack = None

__all__ = ["round_trip"]

#: The connection classes whose sending and reading this treats as the pipeline does.
_CONNECTIONS = (redis.Connection, redis.UnixDomainSocketConnection, redis.SSLConnection)
#: The pool classes that hand out and take back connections as the pipeline's does.
_POOLS = (redis.ConnectionPool, redis.BlockingConnectionPool)
#: The commands sent this way (as redis-py spells them: its packer splits a name with a space).
_SCRIPT_CALLS = frozenset({"EVALSHA", "EVAL"})


def round_trip(client: redis.Redis, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` (each a command's arguments) in one round trip; each one's reply or error.

    As ``client.pipeline(transaction=False)`` then ``execute(raise_on_error=False)``: a command's
    own error (a ``ResponseError``) is its reply; any other error is raised, after the
    connection that met it is disconnected.
    """
    if not commands:
        return []
    pack = _pack
    if pack is None or not _direct(client, commands):
        return _pipeline(client, commands)
    try:
        data = b"".join([pack(args) for args in commands])
    except TypeError:  # an argument hiredis does not take: redis-py packs it, or says why not
        return _pipeline(client, commands)
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command((data,))  # type: ignore[no-untyped-call]
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except ResponseError as exc:  # this command's own error: read on, in step
                replies.append(exc)
    except BaseException:
        # The rest of the replies may still be coming: this connection is never used again as
        # it is (the pool connects it anew).
        conn.disconnect()  # type: ignore[no-untyped-call]
        raise
    finally:
        pool.release(conn)
    return replies


def _pipeline(client: redis.Redis, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    with client.pipeline(transaction=False) as pipe:
        for args in commands:
            pipe.execute_command(*args)  # type: ignore[no-untyped-call]
        return list(pipe.execute(raise_on_error=False))


def _direct(client: redis.Redis, commands: Sequence[tuple[Any, ...]]) -> bool:
    """Whether ``commands`` of ``client`` can go by :func:`round_trip`'s own path.

    Only script calls: redis-py parses their replies with no callback, under either protocol
    (one a client adds for them is seen here), so what the connection reads is the reply.
    """
    known = _checked.get(client)
    if known is None:
        known = _checked[client] = _suits(client)
    callbacks = client.response_callbacks
    return known and all(args[0] in _SCRIPT_CALLS and args[0] not in callbacks for args in commands)


def _suits(client: redis.Redis) -> bool:
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    retry = kwargs.get("retry")
    return (
        type(pool) in _POOLS
        and pool.connection_class in _CONNECTIONS
        and getattr(pool, "cache", None) is None
        and str(kwargs.get("encoding", "utf-8")).lower().replace("_", "-") in ("utf-8", "utf8")
        and kwargs.get("encoding_errors", "strict") == "strict"
        and not kwargs.get("decode_responses", False)
        and not kwargs.get("retry_on_error")
        and not kwargs.get("retry_on_timeout", False)
        and (retry is None or getattr(retry, "get_retries", lambda: 1)() == 0)
        and _no_command_name(pool)
    )


def _no_command_name(pool: redis.ConnectionPool) -> bool:
    """Whether ``pool.get_connection()`` takes no argument (redis-py >= 5.3).

    Before, it needs the command's name: those clients keep the pipeline, which passes it.
    """
    try:
        parameter = inspect.signature(pool.get_connection).parameters.get("command_name")
    except (TypeError, ValueError):  # pragma: no cover - a signature Python cannot read
        return False
    return parameter is None or parameter.default is not inspect.Parameter.empty


_checked: weakref.WeakKeyDictionary[redis.Redis, bool] = weakref.WeakKeyDictionary()
