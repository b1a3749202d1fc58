"""Tagged argument and result types (issue 33): every supported value comes back exactly.

Through the producer's envelope, the journal's JSON, the delivery a worker reads and its
``call_args()``; and a result through the worker's encoding and ``read_result``. Plain records
(no ``tags``) read as before; anything else is a one-line ``NotSerializable``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import uuid
import zoneinfo
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hybridq import Queue
from hybridq.envelope.model import Envelope
from hybridq.envelope.tagged import TAG_KEY, decode, encode, read_result
from hybridq.errors import EnvelopeError, NotSerializable
from hybridq.journal import JournalReader
from hybridq.protocol import Delivery
from hypothesis import given, settings
from hypothesis import strategies as st

FUNC = "tests.tasks.add"
_ZONES = st.sampled_from(["Europe/Paris", "America/New_York", "Asia/Kolkata", "UTC", "Australia/Lord_Howe"])
_OFFSETS = st.integers(-23 * 60, 23 * 60).map(lambda m: dt.timezone(dt.timedelta(minutes=m)))
_TZ = st.none() | _OFFSETS | _ZONES.map(zoneinfo.ZoneInfo)
_DATETIMES = st.datetimes(timezones=_TZ, allow_imaginary=True).flatmap(
    lambda d: st.sampled_from([d, d.replace(fold=1)])
)
_TIMES = st.times(timezones=st.none() | _OFFSETS)
_DECIMALS = st.decimals(allow_nan=False, allow_infinity=False) | st.sampled_from(
    [Decimal("-0"), Decimal("1.10"), Decimal("1E+3")]
)
_HASHABLE = st.recursive(
    st.integers() | st.text(max_size=5) | st.uuids() | st.dates() | st.binary(max_size=8) | _DECIMALS,
    lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=3),
    max_leaves=6,
)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | _DATETIMES
    | st.dates()
    | _TIMES
    | _DECIMALS
    | st.uuids()
    | st.binary(max_size=16)
)
_KEYS = st.text(max_size=4) | st.just(TAG_KEY) | st.just("v")
VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(_KEYS, inner, max_size=4)
        | st.tuples(inner)
        | st.lists(inner, max_size=3).map(tuple)
        | st.sets(_HASHABLE, max_size=4)
        | st.frozensets(_HASHABLE, max_size=3)
    ),
    max_leaves=12,
)


def same(a: Any, b: Any) -> bool:
    """Equal, of the same types all the way down, with the same time zones and folds."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, set | frozenset):
        return a == b and all(any(same(x, y) for y in b) for x in a)
    if isinstance(a, dt.datetime | dt.time):
        return a == b and a.tzinfo == b.tzinfo and a.fold == b.fold and a.isoformat() == b.isoformat()
    if isinstance(a, Decimal):
        return str(a) == str(b)
    return bool(a == b)


@pytest.fixture(scope="module")
def queue(tmp_path_factory: pytest.TempPathFactory) -> Queue:
    return Queue("default", tmp_path_factory.mktemp("journal"))


@settings(max_examples=150, deadline=None)
@given(args=st.lists(VALUES, max_size=3), kwargs=st.dictionaries(_KEYS, VALUES, max_size=3))
def test_arguments_round_trip_through_the_journal_and_the_delivery(
    queue: Queue, args: list[Any], kwargs: dict[str, Any]
) -> None:
    env = queue.prepare(FUNC, args, kwargs)
    stored = Envelope.from_bytes(env.to_bytes())  # the forwarder reads the journal
    wire = json.loads(json.dumps(Delivery(stored, "f", ("w", 0, 0)).to_json()))  # RQ's JSON
    got_args, got_kwargs = Delivery.from_json(wire).envelope.call_args()
    assert same(tuple(args), got_args)
    assert same(kwargs, dict(got_kwargs))


@settings(max_examples=150, deadline=None)
@given(value=VALUES)
def test_results_round_trip(value: Any) -> None:
    form, _ = encode(value)
    assert same(value, read_result(json.dumps(form)))


def test_plain_json_readers_parse_tagged_values_and_see_the_tags(queue: Queue) -> None:
    env = queue.prepare(FUNC, [dt.date(2026, 12, 5), Decimal("9.90")], {"id": uuid.UUID(int=1)})
    record = json.loads(env.to_bytes())
    assert record["tags"] == 1
    assert record["args"] == [{"$t": "date", "v": "2026-12-05"}, {"$t": "decimal", "v": "9.90"}]
    assert record["kwargs"] == {"id": {"$t": "uuid", "v": "00000000-0000-0000-0000-000000000001"}}


def test_a_dict_of_the_callers_with_the_tag_key_is_escaped_not_read_as_a_tag(queue: Queue) -> None:
    mine = {"$t": "date", "v": "2026-12-05"}
    env = queue.prepare(FUNC, [mine])
    assert json.loads(env.to_bytes())["args"] == [{"$t": "dict", "v": mine}]
    assert Envelope.from_bytes(env.to_bytes()).call_args() == ((mine,), {})


def test_plain_arguments_are_written_as_before_without_tags(queue: Queue) -> None:
    env = queue.prepare(FUNC, [1, "a", [1, {"k": None}]], {"x": 1.5})
    assert "tags" not in json.loads(env.to_bytes())


def test_an_old_record_reads_as_it_was_even_with_the_tag_key() -> None:
    """A record written before tags (no ``tags`` field) is handed to the task as it is."""
    raw = json.dumps(
        {
            "v": 1,
            "id": "a1",
            "func": FUNC,
            "args": [{"$t": "date", "v": "2026-12-05"}, [1, 2]],
            "kwargs": {"k": {"$t": "set", "v": [1]}},
            "queue": "default",
            "key": "a1",
            "created_at": 1.0,
        }
    ).encode()
    args, kwargs = Envelope.from_bytes(raw).call_args()
    assert args == ({"$t": "date", "v": "2026-12-05"}, [1, 2])
    assert kwargs == {"k": {"$t": "set", "v": [1]}}


def test_an_old_result_that_is_not_a_well_formed_tag_reads_as_it_was() -> None:
    for old in (
        {"$t": "x", "v": 1},
        {"$t": "date", "v": 1},
        {"$t": "date"},
        {"$t": "uuid", "v": "u", "w": 1},
    ):
        assert read_result(json.dumps(old)) == old


@pytest.mark.parametrize(
    "value",
    [object(), 1 + 2j, bytearray(b"x"), dt.timedelta(1), {1: "a"}, [{(1, 2): 3}], float("nan")],
    ids=["object", "complex", "bytearray", "timedelta", "int-key", "tuple-key", "nan"],
)
def test_anything_else_is_a_one_line_not_serializable(queue: Queue, value: Any) -> None:
    with pytest.raises(NotSerializable) as info:
        queue.prepare(FUNC, [value])
    assert "\n" not in str(info.value)
    assert FUNC in str(info.value)


def test_a_cycle_is_not_serializable(queue: Queue) -> None:
    loop: list[Any] = []
    loop.append((loop,))
    with pytest.raises(NotSerializable):
        queue.prepare(FUNC, [loop])


@pytest.mark.parametrize(
    "bad",
    [
        {"$t": "nope", "v": 1},
        {"$t": "date", "v": "2026-13-01"},
        {"$t": "bytes", "v": "!!"},
        {"$t": "uuid", "v": 1},
        {"$t": "datetime", "v": "2026-01-01T00:00", "tz": "../etc/passwd"},
        {"$t": "set", "v": [[1]]},
        {"$t": "decimal", "v": "x"},
        {"$t": "date"},
    ],
)
def test_a_malformed_tag_in_a_tagged_record_is_a_one_line_error(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="malformed tagged value"):
        decode([bad])
    env = Envelope("a1", FUNC, "default", "a1", 1.0, (bad,), {}, tags=1)
    with pytest.raises(EnvelopeError, match="a1"):
        env.call_args()


def test_sets_give_the_same_bytes_in_every_process() -> None:
    """What a retried enqueue's fingerprint compares: string hashes differ between processes."""
    code = (
        "import json, uuid; from hybridq.envelope.tagged import encode; "
        "print(json.dumps(encode({'b', 'a', 'c', 'dd', 3, uuid.UUID(int=7), frozenset({'x', 'y'})})))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(outputs) == 1


def test_a_newer_tag_version_is_refused_by_name() -> None:
    env = Envelope("a1", FUNC, "default", "a1", 1.0, (1,), {}, tags=2)
    with pytest.raises(EnvelopeError, match="newer"):
        env.call_args()


def test_signed_tagged_envelopes_verify_after_the_round_trip(
    queue: Queue, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from hybridq.security import signing

    monkeypatch.setenv(signing.ENV_KEY, "k" * 32)
    monkeypatch.delenv(signing.ENV_KEY_FILE, raising=False)
    ring = signing.keyring()
    assert ring is not None
    env = ring.sign(queue.prepare(FUNC, [{"x", "y", "z"}, dt.datetime.now(dt.UTC)]))
    ring.verify(Envelope.from_bytes(env.to_bytes()))


def test_http_clients_send_tagged_values_and_a_malformed_one_is_400(journal_dir: Path) -> None:
    from tests.support.http import request, served
    from tests.unit.test_http_api import config, job_ids

    body = {
        "task": "tests.tasks.add",
        "args": [{"$t": "date", "v": "2026-12-05"}, {"$t": "dict", "v": {"$t": 1}}],
        "kwargs": {"n": {"$t": "decimal", "v": "1.10"}},
    }
    with served(config(journal_dir)) as base:
        assert request(base, "POST", "/v1/jobs", body).status == 202
        bad = request(
            base, "POST", "/v1/jobs", {"task": "tests.tasks.add", "args": [{"$t": "date", "v": "x"}]}
        )
        assert bad.status == 400, bad
        assert "malformed tagged value" in bad.json["detail"]
    assert len(job_ids(journal_dir)) == 1  # the malformed one wrote nothing
    [record] = JournalReader(str(journal_dir)).records()
    assert Envelope.from_bytes(record.payload).call_args() == (
        (dt.date(2026, 12, 5), {"$t": 1}),
        {"n": Decimal("1.10")},
    )


def test_http_answers_a_result_in_its_tagged_form() -> None:
    from hybridq.http.api import job_state

    class Finished:  # what job_state reads of a Job
        id, status, attempt, enqueued_at, started_at, ended_at = "a1", "finished", 1, 1.0, 2.0, 3.0
        envelope = Envelope("a1", FUNC, "default", "a1", 1.0)
        result = (dt.date(2026, 12, 5), {"$t": "mine"})

    assert job_state(Finished())["result"] == {  # type: ignore[arg-type]
        "$t": "tuple",
        "v": [{"$t": "date", "v": "2026-12-05"}, {"$t": "dict", "v": {"$t": "mine"}}],
    }


def test_the_cli_takes_tagged_values_as_the_http_api(journal_dir: Path) -> None:
    from click.testing import CliRunner
    from hybridq.cli import cli

    runner = CliRunner()
    ok = runner.invoke(
        cli,
        [
            "enqueue",
            "--journal",
            str(journal_dir),
            "tests.tasks.add",
            '{"$t": "uuid", "v": "' + str(uuid.UUID(int=5)) + '"}',
            "2",
        ],
    )
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(
        cli, ["enqueue", "--journal", str(journal_dir), "tests.tasks.add", '{"$t": "uuid", "v": 5}', "2"]
    )
    assert bad.exit_code == 2
    assert "malformed tagged value" in bad.output
    [record] = JournalReader(str(journal_dir)).records()
    assert Envelope.from_bytes(record.payload).call_args() == ((uuid.UUID(int=5), 2), {})
