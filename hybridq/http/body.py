"""Reading a request body with a size cap and a deadline (``POST /v1/jobs``, ``POST /login``).

A client that sends its headers and then a body slowly (or never) must not hold a connection
and a task for ever, and a body over the cap must not be read at all: :func:`read_body` refuses
from ``Content-Length`` first, stops as soon as a streamed body passes the cap, and gives up
when the whole body has not arrived within the deadline.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from hybridq.errors import BodyTimeout, BodyTooLarge

__all__ = ["BodyTimeout", "BodyTooLarge", "read_body"]


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body of ``request``, at most ``limit`` bytes, read within ``timeout_s`` seconds.

    Raises:
        BodyTooLarge: ``Content-Length`` or the bytes received pass ``limit`` (the rest is not read).
        BodyTimeout: the body was not complete after ``timeout_s``.
        starlette.requests.ClientDisconnect: the client went away mid-body.
    """
    length = request.headers.get("content-length")
    if length is not None and length.isascii() and length.isdigit() and int(length) > limit:
        raise BodyTooLarge

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        raise BodyTimeout from None
