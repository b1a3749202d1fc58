"""A job hash's ``data`` read back (transport.rq_codec.plain_data): compressed or as it is."""

from __future__ import annotations

import json
import os
import zlib

from hybridq.transport.rq_codec import DATA_PLAIN_BYTES, _data, plain_data


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
