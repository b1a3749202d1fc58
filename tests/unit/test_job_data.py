"""A job hash's fields as the push writes them and the worker reads them (rq_codec, rq_push)."""

from __future__ import annotations

import json
import os
import tempfile
import zlib
from datetime import UTC, datetime
from random import Random

from hybridq.envelope.limits import MAX_TIMESTAMP
from hybridq.transport.base import MemoryInfo
from hybridq.transport.rq_codec import DATA_PLAIN_BYTES, _data, memory_info, plain_data
from hybridq.transport.rq_push import utc_text
from rq.utils import utcformat


def call(size: int) -> bytes:
    return json.dumps(["hybridq.worker.execute", None, [{"pad": "x" * size}], {}]).encode()


def test_small_data_is_stored_as_it_is_and_read_back_as_it_is() -> None:
    raw = call(10)
    assert _data(raw) is raw
    assert plain_data(_data(raw)) == raw


def test_large_data_is_compressed_and_read_back_whole() -> None:
    raw = call(DATA_PLAIN_BYTES * 4)
    stored = _data(raw)
    assert stored != raw
    assert plain_data(stored) == raw
    assert plain_data(zlib.compress(raw)) == raw  # as RQ itself writes it


def test_data_that_starts_like_json_is_never_zlib() -> None:
    """The shortcut for ``[`` agrees with zlib, which refuses any such header."""
    for tail in (b"", b"\x9c", os.urandom(64), zlib.compress(b"x")[1:]):
        stored = b"[" + tail
        try:
            zlib.decompress(stored)
        except zlib.error:
            pass
        else:  # pragma: no cover - would break the shortcut
            raise AssertionError(f"zlib read {stored!r}")
        assert plain_data(stored) == stored
    assert plain_data(b"not zlib") == b"not zlib"


def test_a_job_s_created_at_is_written_as_rq_writes_a_time() -> None:
    """``utc_text`` is RQ's ``utcformat`` for every time an envelope may carry (1970 to 9999)."""

    rng = Random(15)
    times = [
        0.0,
        1e-7,
        0.4999995,
        0.9999995,
        59.9999996,
        1796594297.7192724,
        MAX_TIMESTAMP,
        MAX_TIMESTAMP + 0.9,
    ]
    times += [rng.uniform(0, MAX_TIMESTAMP) for _ in range(2000)] + [
        rng.uniform(1.7e9, 1.9e9) for _ in range(2000)
    ]
    # Halves of a microsecond (rounded half to even, or carried into the next second), and many
    # times in few seconds, as a backlog's are (each second's text is kept: the same text).
    times += [
        rng.randrange(1_700_000_000, 1_700_000_003) + (rng.randrange(10**6) + 0.5) / 1e6 for _ in range(2000)
    ]
    times += [float(rng.randrange(0, int(MAX_TIMESTAMP))) + 0.9999995 for _ in range(200)]
    # Before 1970 (an envelope refuses them; the borrow from the second before is kept right anyway).
    times += [-0.5, -1e-7, -0.9999995, -86400.25] + [rng.uniform(-1e9, 0) for _ in range(500)]
    for ts in times:
        assert utc_text(ts) == utcformat(datetime.fromtimestamp(ts, tz=UTC)), ts


_INFO_MEMORY = (
    "# Memory\r\nused_memory:988320\r\nused_memory_human:965.16K\r\nused_memory_rss:7340032\r\n"
    "used_memory_peak:1048576\r\nmaxmemory:67108864\r\nmaxmemory_human:64.00M\r\n"
    "maxmemory_policy:allkeys-lru\r\nmem_allocator:jemalloc-5.1.0\r\n"
)


def test_info_memory_s_three_fields_are_read() -> None:
    """The transport reads INFO memory's three fields itself (against a live server's
    ``info("memory")``: tests/integration/test_rq_memory.py)."""
    want = MemoryInfo(988320, 67108864, "allkeys-lru")
    assert memory_info(_INFO_MEMORY.encode()) == want == memory_info(_INFO_MEMORY)
    assert memory_info(b"# Memory\r\n") == MemoryInfo(0, 0, "noeviction")  # a field missing: as before


def test_the_meta_is_written_as_the_encoder_writes_it() -> None:
    """``_meta_json`` is ``dumps_ascii(_meta(...))`` whether it writes it or the encoder does."""
    import dataclasses

    from hybridq import Queue
    from hybridq.envelope.codec import dumps_ascii
    from hybridq.envelope.model import Envelope
    from hybridq.protocol import Delivery
    from hybridq.transport.rq_codec import _meta, _meta_json

    made = Queue("q", tempfile.mkdtemp()).prepare("tests.tasks.add", (1, 2))
    plain = Envelope.from_bytes(made.to_bytes())
    envelopes = [
        plain,
        dataclasses.replace(plain, meta={"team": "x", "hybridq": "theirs"}),
        dataclasses.replace(plain, created_at=1796680390),
        dataclasses.replace(plain, created_at=float("inf")),
        dataclasses.replace(plain, func="caf\u00e9.t\udcff", idempotency_key='k\u00e9y \x00\n"'),
    ]
    for env in envelopes:
        for delivery in (
            Delivery(env, "o", ("w", 0, 64)),
            Delivery(env, "o", ("w", 0, 64), attempt=5, later=2, later_since=1.0),
        ):
            assert _meta_json(delivery) == dumps_ascii(_meta(delivery)).encode()


def test_a_job_s_argument_is_each_field_behind_its_length() -> None:
    """The lengths from the table and from ``pack`` are the same big-endian four bytes."""
    import struct

    from hybridq.transport.rq_push import _argument

    for sizes in ((0, 1, 255, 256), (2047, 2048, 2049), (70000,)):
        fields = tuple("x" * n if i % 2 else b"y" * n for i, n in enumerate(sizes))
        expected = b"".join(
            struct.pack(">I", len(f)) + (f.encode() if isinstance(f, str) else f) for f in fields
        )
        assert _argument(fields, b"k:1") == expected + struct.pack(">I", 3) + b"k:1"


def test_a_call_s_description_and_a_failed_job_s_ttl() -> None:
    from hybridq.transport.rq_codec import _describe, _failure_ttl

    assert _describe("tasks.noop", (), {}) == "tasks.noop()"
    assert _describe("t" * 199, (), {}) == "t" * 197 + "..."
    assert _describe("t" * 198, (), {}) == "t" * 198 + "()"
    assert _describe("tasks.add", (1, "a"), {"b": None}) == "tasks.add(1, 'a', b=None)"
    for ttl in (86400.0, 86400.0, 1.0, 100.0, 0.5, 30):
        assert _failure_ttl(ttl) == str(max(1, int(ttl - min(60.0, ttl / 2))))
