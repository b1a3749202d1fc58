"""The job envelope: ids, validation, JSON round trips that keep unknown fields."""

from __future__ import annotations

import errno
import json
import os
import re

import pytest
from hybridq.envelope.model import (
    Envelope,
    Retry,
    function_path,
    idempotency_id,
    new_job_id,
    validate_job_id,
    validate_queue_name,
)
from hybridq.errors import EnvelopeError, NotSerializable
from hypothesis import given
from hypothesis import strategies as st

from tests import tasks

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)


def make(**overrides) -> Envelope:
    fields = {
        "id": new_job_id(),
        "func": "tests.tasks.add",
        "queue": "default",
        "idempotency_key": "key",
        "created_at": 1.5,
        "args": (1, 2),
    }
    fields.update(overrides)
    return Envelope(**fields)


def test_job_ids_are_valid_rq_ids_and_sort_by_time() -> None:
    ids = [new_job_id(now=t) for t in (1_700_000_000.0, 1_700_000_000.001, 1_800_000_000.0)]
    for job_id in ids:
        assert re.fullmatch(r"[A-Za-z0-9_-]+", job_id)
        assert len(job_id) == 32
    assert ids == sorted(ids)
    assert len({new_job_id() for _ in range(1000)}) == 1000


def test_job_ids_take_their_random_part_from_getrandom_without_blocking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hybridq.envelope import names as envelope

    if hasattr(os, "getrandom"):  # Linux: the real call, never blocking
        assert envelope._getrandom is os.getrandom
        assert envelope._GRND_NONBLOCK == os.GRND_NONBLOCK != 0
    calls: list[tuple[int, int]] = []

    def getrandom(n: int, flags: int) -> bytes:
        calls.append((n, flags))
        return bytes(range(n))

    monkeypatch.setattr(envelope, "_getrandom", getrandom)
    assert new_job_id(now=0.0) == "000000000000" + bytes(range(10)).hex()
    assert calls == [(10, envelope._GRND_NONBLOCK)]


@pytest.mark.parametrize(
    ("failure", "kept"),
    [
        (BlockingIOError(errno.EAGAIN, "not seeded yet"), True),
        (OSError(errno.ENOSYS, "no getrandom in this kernel"), False),
        (PermissionError(errno.EPERM, "refused by a seccomp filter"), False),
        (b"short", True),
        (None, False),
    ],
)
def test_job_ids_fall_back_to_urandom_where_getrandom_would_block_or_is_refused(
    monkeypatch: pytest.MonkeyPatch, failure: OSError | bytes | None, kept: bool
) -> None:
    from hybridq.envelope import names as envelope

    def getrandom(n: int, flags: int) -> bytes:
        if isinstance(failure, bytes):
            return failure[:n]  # a short read
        assert failure is not None
        raise failure

    monkeypatch.setattr(envelope, "_getrandom", None if failure is None else getrandom)
    monkeypatch.setattr(envelope.os, "urandom", lambda n: b"\xab" * n)
    assert new_job_id(now=0.0) == "000000000000" + "ab" * 10
    assert (envelope._getrandom is getrandom) is kept  # a refusing kernel is not asked again


@pytest.mark.parametrize("bad", ["", "a b", "a/b", "x" * 129, "é", "a:b"])
def test_invalid_job_ids_are_refused(bad: str) -> None:
    with pytest.raises(EnvelopeError):
        validate_job_id(bad)


@pytest.mark.parametrize("bad", ["", ".hidden", "-x", "a b", "a/b", "q" * 129, "a*"])
def test_invalid_queue_names_are_refused(bad: str) -> None:
    with pytest.raises(EnvelopeError, match="invalid queue name"):
        validate_queue_name(bad)


def test_function_paths() -> None:
    assert function_path(tasks.add) == "tests.tasks.add"
    assert function_path("pkg.mod.func") == "pkg.mod.func"
    assert function_path(tasks.Holder.static) == "tests.tasks.Holder.static"


def _nested() -> object:
    def inner() -> None:
        pass

    return inner


@pytest.mark.parametrize(
    ("func", "message"),
    [
        (lambda: None, "lambda"),
        (_nested(), "inside a function"),
        (tasks.Holder().method, "bound to an instance"),
        ("not_dotted", "dotted path"),
        ("os..path", "dotted path"),
        ("1os.path", "dotted path"),
        (42, "neither a callable"),
    ],
)
def test_functions_a_worker_could_not_import_are_refused(func: object, message: str) -> None:
    with pytest.raises(EnvelopeError, match=message):
        function_path(func)


def test_functions_from_main_are_refused() -> None:
    def f() -> None:
        pass

    f.__module__ = "__main__"
    f.__qualname__ = "f"
    with pytest.raises(EnvelopeError, match="__main__"):
        function_path(f)


def test_idempotency_keys_of_any_text_map_to_rq_safe_ids() -> None:
    for key in ["order:42", "naïve ☃ key", "", "a" * 10_000, "\udcff"]:
        assert re.fullmatch(r"[a-z0-9]+", idempotency_id(key))
    assert idempotency_id("x") == idempotency_id("x")
    assert idempotency_id("x") != idempotency_id("y")


@given(
    args=st.lists(json_values, max_size=5),
    kwargs=st.dictionaries(st.text(max_size=8), json_values, max_size=4),
)
def test_round_trip(args: list[object], kwargs: dict[str, object]) -> None:
    env = make(
        args=tuple(args), kwargs=kwargs, retry=Retry(4, 0.5, 10, jitter=False), meta={"m": 1}, run_at=9.0
    )
    assert Envelope.from_bytes(env.to_bytes()) == env
    traced = make(args=tuple(args), tags=1, trace={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    assert Envelope.from_bytes(traced.to_bytes()) == traced


@pytest.mark.parametrize(
    "bad", [{"tags": -1}, {"tags": True}, {"tags": "1"}, {"trace": "x"}, {"trace": {"a": 1}}]
)
def test_malformed_tags_or_trace_make_an_invalid_record(bad: dict[str, object]) -> None:
    raw = {**json.loads(make().to_bytes()), **bad}
    with pytest.raises(EnvelopeError):
        Envelope.from_bytes(json.dumps(raw).encode())


_numbers = st.none() | st.integers(0, 10**6) | st.floats(0, 1e9, allow_nan=False) | st.just(True)  # noqa: FBT003 - a bool where a number belongs


@given(
    args=st.lists(json_values, max_size=4),
    kwargs=st.dictionaries(st.text(max_size=8), json_values, max_size=3),
    meta=st.dictionaries(st.text(max_size=8), json_values, max_size=2),
    text=st.text(max_size=12),
    created_at=st.floats(0, 4e9, allow_nan=False) | st.integers(0, 4 * 10**9),
    timeout=_numbers,
    run_at=_numbers,
    requeue=st.integers(0, 3),
    retry=st.none() | st.just(Retry(4, 0.5, 10, jitter=False)),
    extra=st.sampled_from([{}, {"later": [1, {"x": None}]}]),
    tags=st.sampled_from([0, 1]),
    trace=st.none() | st.dictionaries(st.text(max_size=12), st.text(max_size=60), max_size=2),
)
def test_the_fast_encoding_is_the_generic_one_byte_for_byte(
    args, kwargs, meta, text, created_at, timeout, run_at, requeue, retry, extra, tags, trace
) -> None:
    # to_bytes builds the common envelope field by field; what it writes must stay exactly what
    # the generic encoder writes for to_dict() (the journal, signing and readers rely on it).
    from hybridq.envelope.codec import _dumps

    env = make(
        args=tuple(args),
        kwargs=kwargs,
        meta=meta,
        idempotency_key=text,
        description=text or None,
        signature=text or None,
        created_at=created_at,
        timeout_s=timeout,
        result_ttl_s=timeout,
        run_at=run_at,
        requeue=requeue,
        retry=retry,
        extra=extra,
        tags=tags,
        trace=trace,
    )
    try:
        expected = _dumps(env.to_dict()).encode()
    except (TypeError, ValueError):
        with pytest.raises(NotSerializable):
            env.to_bytes()
        return
    assert env.to_bytes() == expected


def test_the_fast_encoding_refuses_what_the_generic_one_refuses() -> None:
    cycle: list[object] = []
    cycle.append(cycle)
    for bad in ({"args": (cycle,)}, {"kwargs": {"k": {1: "int key"}}}, {"meta": {"m": float("inf")}}):
        with pytest.raises(NotSerializable):
            make(**bad).to_bytes()
    with pytest.raises(NotSerializable):
        make(kwargs={"k": [{"deep": {2: 0}}]}).to_bytes()


def test_unknown_fields_survive_a_round_trip() -> None:
    raw = json.loads(make().to_bytes())
    raw["priority_from_the_future"] = {"level": 3}
    env = Envelope.from_bytes(json.dumps(raw).encode())
    assert env.extra == {"priority_from_the_future": {"level": 3}}
    assert json.loads(env.to_bytes())["priority_from_the_future"] == {"level": 3}


def test_non_json_arguments_raise_a_type_error() -> None:
    with pytest.raises(NotSerializable) as info:
        make(args=(object(),)).to_bytes()
    assert isinstance(info.value, TypeError)
    with pytest.raises(NotSerializable):
        make(args=(float("nan"),)).to_bytes()


@pytest.mark.parametrize("raw", [b"not json", b"[1]", b'{"v": 99999999999999999999.5}', b'{"v": 1}', b"\xff"])
def test_malformed_records_are_envelope_errors(raw: bytes) -> None:
    with pytest.raises(EnvelopeError):
        Envelope.from_bytes(raw)


def test_retry_policy_backoff_is_exponential_capped_and_validated() -> None:
    policy = Retry(max_attempts=5, backoff_s=1.0, backoff_max_s=5.0, jitter=False)
    assert [policy.delay_s(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    jittered = Retry(max_attempts=5, backoff_s=2.0)
    assert all(0 <= jittered.delay_s(2) <= 4.0 for _ in range(50))
    with pytest.raises(EnvelopeError):
        Retry(max_attempts=0)
    with pytest.raises(EnvelopeError):
        Retry(backoff_s=float("inf"))


def test_an_unknown_field_nested_too_deep_is_refused_even_with_scalar_arguments() -> None:
    """Scalar arguments skip the nesting count; a field of a newer version read back does not."""
    deep: list[object] = []
    for _ in range(150):
        deep = [deep]
    env = Envelope("j1", "m.f", "default", "j1", 1.0, (1, "a"), {"k": 2}, extra={"later": deep})
    with pytest.raises(EnvelopeError, match="nested deeper"):
        env.to_bytes()


def test_arguments_nested_deeper_than_the_reader_accepts_are_refused_at_enqueue(tmp_path) -> None:
    from hybridq import Queue
    from hybridq.ops.status import collect_status

    deep: list[object] = []
    for _ in range(150):
        deep = [deep]
    queue = Queue(journal=tmp_path / "journal")
    with pytest.raises(EnvelopeError, match="nested deeper"):
        queue.enqueue("tests.tasks.add", deep, 1)
    assert collect_status(str(tmp_path / "journal"))["accepted"] == 0  # nothing written
    shallow: list[object] = []
    for _ in range(50):
        shallow = [shallow]
    job = queue.enqueue("tests.tasks.add", shallow, 1)
    assert Envelope.from_bytes(job.envelope.to_bytes()).args == (shallow, 1)


def test_a_record_without_its_optional_fields_decodes_to_their_defaults() -> None:
    """from_dict checks only the fields a record has: an absent one is what its check makes of it."""
    minimal = {
        "v": 1,
        "id": new_job_id(),
        "func": "tests.tasks.add",
        "queue": "q",
        "key": "k",
        "created_at": 1.5,
    }
    env = Envelope.from_dict(minimal)
    spelled = dict(minimal, args=[], kwargs={}, timeout=None, result_ttl=None, run_at=None, retry=None)
    spelled |= {"description": None, "meta": {}, "requeue": 0, "sig": None, "tags": 0, "trace": None}
    spelled |= {"priority": 0, "limit_key": None}
    assert env == Envelope.from_dict(spelled) == Envelope(minimal["id"], "tests.tasks.add", "q", "k", 1.5)
    assert env.kwargs is not Envelope.from_dict(minimal).kwargs  # a dict of its own each time
    for name, bad in (("args", None), ("meta", None), ("requeue", None), ("priority", None), ("tags", "1")):
        with pytest.raises(EnvelopeError):
            Envelope.from_dict({**minimal, name: bad})


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": 1}',
        b"{",
        b"{}",
        b'{"\xed\xb3\xbf": 1}',  # a lone surrogate, as surrogatepass writes it
        '{"a": "é"}'.encode(),
        '{"a": 1}'.encode("utf-16-le"),
        '{"a": 1}'.encode("utf-16"),
        b'\xef\xbb\xbf{"a": 1}',
        b"[1]",
        b"{\x00\x00\x00",
        b"",
        b"\xff\xfe{\x00",
    ],
)
def test_json_text_decodes_bytes_as_json_loads_does(raw: bytes) -> None:
    from hybridq.envelope.codec import json_text

    def decoded(fn: object) -> tuple[str, str]:
        try:
            return ("ok", fn(raw))  # type: ignore[operator]
        except ValueError as exc:
            return ("error", type(exc).__name__)

    assert decoded(json_text) == decoded(lambda b: b.decode(json.detect_encoding(b), "surrogatepass"))


def test_every_known_field_is_read_by_from_dict() -> None:
    # A field added to _KNOWN only would be dropped silently by from_dict, which reads the
    # optional ones from _OPTIONAL and these by name (review of b1pool, LOW 4).
    from hybridq.envelope import model

    assert set(model._OPTIONAL) | {"v", "id", "func", "queue", "key", "created_at"} == model._KNOWN
