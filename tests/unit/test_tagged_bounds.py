"""The bounds of tagged values (issue 33's review): refused in one line, before the work they cost.

A set of members sharing one hash (numbers hash modulo ``2**61 - 1``) cost its count squared;
a value nested past the record's 100 levels raised ``RecursionError`` (a 500 over HTTP, a
result stored that no read could decode); a directory as a time zone raised an ``OSError``; a
decimal could be ``NaN`` or ``1e999999999``. Each is a one-line ``ValueError`` (400 over HTTP,
``NotSerializable`` to a producer), written and read alike, so whatever is written reads back.
"""

from __future__ import annotations

import builtins
import datetime as dt
import json
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hybridq import Queue
from hybridq.envelope import limits, tagged_read
from hybridq.envelope.limits import MAX_SAME_HASH, MAX_SET_MEMBERS
from hybridq.envelope.model import Envelope
from hybridq.envelope.tagged import decode, encode, has_tags, read_result
from hybridq.errors import NotSerializable
from hybridq.worker.values import jsonable

from tests.support.http import request, served
from tests.unit.test_http_api import config, job_ids

FUNC = "tests.tasks.add"
M = (1 << 61) - 1  # every multiple of it hashes to 0


def colliding(count: int) -> dict[str, Any]:
    return {"$t": "set", "v": [k * M for k in range(1, count + 1)]}


def nested_tuples(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"$t": "tuple", "v": [value]}
    return value


def post(journal: Path, *args: Any) -> Any:
    with served(config(journal)) as base:
        return request(base, "POST", "/v1/jobs", {"task": FUNC, "args": list(args)})


def test_http_refuses_a_set_of_20k_colliding_members_as_400_before_reading_them(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: 202 after ~7 s of one core (the event loop stalled: every request waited)."""
    hashed: list[int] = []
    real_hash = builtins.hash
    monkeypatch.setattr(limits, "hash", lambda v: hashed.append(1) or real_hash(v), raising=False)
    got = post(journal_dir, colliding(20_000))
    assert got.status == 400, got
    assert f"at most {MAX_SET_MEMBERS}" in got.json["detail"]
    assert "\n" not in got.json["detail"]
    assert job_ids(journal_dir) == []
    assert hashed == []  # refused by its length alone: no member read, no set built


def test_a_set_whose_members_share_a_hash_is_refused_before_it_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[int] = []
    monkeypatch.setattr(
        tagged_read, "set", lambda v=(): built.append(len(v)) or builtins.set(v), raising=False
    )
    with pytest.raises(ValueError, match=f"share one hash \\(at most {MAX_SAME_HASH}\\)"):
        decode(colliding(1000))
    assert max(built, default=0) < 1000  # the key check's small sets only
    decode(colliding(MAX_SAME_HASH))  # as many as allowed: fine
    frozen = {
        "$t": "frozenset",
        "v": [[{"$t": "uuid", "v": str(uuid.UUID(int=k * M))}] for k in range(1, 100)],
    }
    with pytest.raises(ValueError, match="malformed"):
        decode(frozen)  # lists do not hash: malformed anyway


def test_writing_applies_the_same_set_bounds(queue: Queue) -> None:
    for bad in (
        {k * M for k in range(1, 100)},
        {uuid.UUID(int=k * M) for k in range(1, 100)},
        set(range(10_001)),
    ):
        with pytest.raises(NotSerializable, match=FUNC):
            queue.prepare(FUNC, [bad])
    assert decode(encode(set(range(MAX_SET_MEMBERS)))[0]) == set(range(MAX_SET_MEMBERS))


@pytest.fixture(scope="module")
def queue(tmp_path_factory: pytest.TempPathFactory) -> Queue:
    return Queue("default", tmp_path_factory.mktemp("journal"))


@pytest.mark.parametrize("levels", [51, 150, 250, 400])
def test_http_refuses_a_value_nested_past_100_levels_as_400(journal_dir: Path, levels: int) -> None:
    """Before: 250 and 400 nested tuples were 500s (RecursionError, not a ValueError)."""
    got = post(journal_dir, nested_tuples(levels))
    assert got.status == 400, got
    assert "nested deeper than 100 levels" in got.json["detail"]
    assert job_ids(journal_dir) == []


def test_nesting_is_bounded_alike_both_ways() -> None:
    deepest: Any = 1
    for _ in range(50):  # 100 levels: a tuple is its object and its array
        deepest = (deepest,)
    assert decode(encode(deepest)[0]) == deepest
    for too_deep in ((deepest,), [deepest], {"k": deepest}):
        with pytest.raises(ValueError, match="nested deeper"):
            encode(too_deep)
    with pytest.raises(ValueError, match="nested deeper"):
        decode([nested_tuples(50)])


def test_a_deep_result_is_stored_as_its_repr_and_reads_back() -> None:
    """Before: stored as tagged JSON that ``read_result`` (``Job.result``) raised RecursionError on."""
    value: Any = 1
    for _ in range(200):
        value = (value,)
    env = Envelope("a1", FUNC, "default", "a1", 1.0)
    form, text = jsonable(value, env)
    assert form == repr(value)
    assert read_result(text) == repr(value)


def test_a_stored_result_nested_past_the_bound_reads_without_recursion_error() -> None:
    """A result written before the bound: read leniently, left as JSON past 100 levels."""
    text = json.dumps([nested_tuples(300), {"$t": "date", "v": "2026-12-05"}])
    got = read_result(text)  # before: RecursionError, on every read
    assert got[1] == dt.date(2026, 12, 5)


@pytest.mark.parametrize("zone", ["America", "Etc", "__pycache__"])
def test_a_directory_of_zones_as_a_time_zone_is_400(journal_dir: Path, zone: str) -> None:
    """Before: 500 (IsADirectoryError is an OSError, not a ValueError)."""
    got = post(journal_dir, {"$t": "datetime", "v": "2026-01-01T00:00", "tz": zone})
    assert got.status == 400, got
    assert f"no time zone {zone!r}" in got.json["detail"]
    assert job_ids(journal_dir) == []


def test_the_cli_refuses_a_directory_as_a_time_zone_with_exit_2(journal_dir: Path) -> None:
    from click.testing import CliRunner
    from hybridq.cli import cli

    arg = json.dumps({"$t": "date" + "time", "v": "2026-01-01T00:00", "tz": "America"})
    got = CliRunner().invoke(cli, ["enqueue", "--journal", str(journal_dir), FUNC, arg, "2"])
    assert got.exit_code == 2, got.output
    assert "no time zone 'America'" in got.output
    assert "Traceback" not in got.output


@pytest.mark.parametrize(
    "text", ["1e999999999", "-1e-4301", "1" * 4301, "NaN", "-NaN", "sNaN", "Infinity", "-Infinity"]
)
def test_a_decimal_must_be_finite_and_within_4300_digits_and_exponent(text: str) -> None:
    with pytest.raises(ValueError, match="malformed tagged value"):
        decode({"$t": "decimal", "v": text})
    with pytest.raises(ValueError, match="decimal"):
        encode(Decimal(text))


def test_a_decimal_at_the_bounds_round_trips_and_nan_over_http_is_400(journal_dir: Path) -> None:
    for text in ("1e4300", "-1e-4300", "9" * 4300, "-0"):
        assert str(decode(encode(Decimal(text))[0])) == str(Decimal(text))
    got = post(journal_dir, {"$t": "decimal", "v": "NaN"})  # as JSON's NaN is
    assert got.status == 400, got
    assert "not finite" in got.json["detail"]


def test_an_offset_other_than_the_zones_is_refused() -> None:
    """Before: ``+05:00`` with ``tz`` UTC read as UTC, the offset silently dropped."""
    with pytest.raises(ValueError, match="offset"):
        decode({"$t": "datetime", "v": "2020-01-01T00:00+05:00", "tz": "UTC"})
    with pytest.raises(ValueError, match="offset"):
        decode({"$t": "time", "v": "01:00+01:00", "tz": "Europe/Paris"})  # a zone gives a time none
    paris = {"$t": "datetime", "v": "2026-10-25T02:30:00+01:00", "tz": "Europe/Paris", "fold": 1}
    assert decode(paris).fold == 1  # what the encoder writes: the zone's own offset
    assert decode({"$t": "datetime", "v": "2026-10-25T02:30:00", "tz": "Europe/Paris"}).fold == 0


@pytest.mark.parametrize("key", ["\\u0024\\u0074", "$\\u0074", "\\u0024t"])
def test_a_tag_key_written_with_escapes_is_decoded_from_a_result(key: str) -> None:
    """Before: ``"\\u0024\\u0074"`` and ``"$\\u0074"`` were not looked for: read as plain dicts."""
    text = '{"' + key + '": "uuid", "v": "' + str(uuid.UUID(int=3)) + '"}'
    assert has_tags(text)
    assert read_result(text) == uuid.UUID(int=3)
    assert not has_tags('{"a": "caf\\u00e9"}')
