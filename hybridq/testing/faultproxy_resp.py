"""The Redis protocol's framing, as the fault proxy reads it: where a command or a reply ends.

Apart from :mod:`hybridq.testing.faultproxy` because it is pure functions over bytes, with
tests of their own (``tests/integration/test_network_faults.py``); the proxy re-exports its
public names. RESP2 and RESP3; only the standard library.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

#: A command as the client sent it: its name, then its arguments.
Command = Sequence[bytes]
#: What :meth:`FaultProxy.cut_replies` cuts: a command name (any case), or a predicate.
CommandMatch = bytes | Callable[[Command], bool]


class _Garbled(ValueError):
    """Bytes that are not the Redis protocol: stop reading this connection's commands."""


def _int(buf: bytearray, start: int, end: int) -> int:
    try:
        return int(buf[start:end])
    except ValueError as exc:
        raise _Garbled(bytes(buf[start:end])) from exc


def parse_command(buf: bytearray, pos: int) -> tuple[list[bytes], int] | None:
    """The command starting at ``buf[pos]`` and the index after it, or ``None`` if incomplete.

    Clients send arrays of bulk strings; an inline command (``PING\\r\\n``) is split on spaces.
    """
    if pos >= len(buf):
        return None
    if buf[pos] != ord("*"):
        end = buf.find(b"\n", pos)
        return None if end < 0 else (bytes(buf[pos:end]).split(), end + 1)
    line = buf.find(b"\r\n", pos)
    if line < 0:
        return None
    args: list[bytes] = []
    p = line + 2
    for _ in range(_int(buf, pos + 1, line)):
        line = buf.find(b"\r\n", p)
        if line < 0:
            return None
        if buf[p] != ord("$"):
            raise _Garbled(bytes(buf[p : p + 16]))
        start = line + 2
        end = start + _int(buf, p + 1, line)
        if end + 2 > len(buf):
            return None
        args.append(bytes(buf[start:end]))
        p = end + 2
    return args, p


def reply_end(buf: bytearray, pos: int) -> int | None:
    """The index just after the complete reply starting at ``buf[pos]``, or ``None`` if incomplete."""
    need, p = 1, pos
    while need:
        line = buf.find(b"\r\n", p)
        if line < 0:
            return None
        kind = buf[p]
        need -= 1
        if kind in b"$=!":  # bulk string, verbatim string, bulk error: a length, then the bytes
            size = _int(buf, p + 1, line)
            p = line + 2 + (size + 2 if size >= 0 else 0)
            if p > len(buf):
                return None
        elif kind in b"*~>":  # array, set, push: that many replies follow
            need += max(0, _int(buf, p + 1, line))
            p = line + 2
        elif kind in b"%|":  # map, attribute: that many pairs (an attribute precedes a reply)
            need += 2 * _int(buf, p + 1, line) + (kind == ord("|"))
            p = line + 2
        elif kind in b"+-:_,#(":  # one line
            p = line + 2
        else:
            raise _Garbled(bytes(buf[p : p + 16]))
    return p


def script_call(source: str) -> Callable[[Command], bool]:
    """A :class:`CommandMatch` for calls of one Lua script (``EVALSHA`` of its SHA1, or ``EVAL``)."""
    sha = hashlib.sha1(source.encode()).hexdigest().encode()  # noqa: S324 - Redis names scripts so

    def match(command: Command) -> bool:
        name = command[0].upper() if command else b""
        return len(command) > 1 and (
            (name == b"EVALSHA" and command[1].lower() == sha)
            or (name == b"EVAL" and command[1] == source.encode())
        )

    return match
