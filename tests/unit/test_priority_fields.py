"""Issue 30's envelope fields, ``priority`` and ``limit_key``, on every producer surface.

Checked here: the envelope's validation and JSON (defaults omitted, the fast path and the
generic one byte for byte), ``Queue.enqueue``/``prepare``/``enqueue_many``, ``@task``, ``hybridq
enqueue``, the HTTP body and the remote client's. Bad input is one line and writes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from hybridq import Queue, task
from hybridq.cli import cli as main
from hybridq.client.remote import body_of
from hybridq.envelope.codec import _dumps, _fast_json
from hybridq.envelope.limits import limit_key as check_limit_key
from hybridq.envelope.model import Envelope
from hybridq.errors import EnvelopeError
from hybridq.journal import JournalReader, RecordType

from tests import tasks
from tests.support.http import request, served
from tests.unit.test_http_api import ADD, config


def envelopes(journal: Path) -> list[Envelope]:
    if not journal.exists():
        return []
    return [
        Envelope.from_bytes(r.payload) for r in JournalReader(journal).records() if r.rtype == RecordType.DATA
    ]


def test_defaults_are_left_out_of_the_record_and_set_fields_round_trip(journal_dir: Path) -> None:
    q = Queue("default", journal=journal_dir)
    plain = q.prepare(tasks.add, [1, 2])
    assert b"priority" not in plain.to_bytes()
    assert b"limit_key" not in plain.to_bytes()
    env = q.prepare(tasks.add, [1, 2], priority=7, limit_key="tenant:42")
    assert _fast_json(env) == _dumps(env.to_dict())  # the fast path writes the generic bytes
    back = Envelope.from_bytes(env.to_bytes())
    assert (back.priority, back.limit_key) == (7, "tenant:42")
    assert back.extra == {}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("priority", 10, "priority must be an integer from 0 to 9"),
        ("priority", -1, "priority must be an integer from 0 to 9"),
        ("priority", True, "priority must be an integer from 0 to 9"),
        ("priority", 1.5, "priority must be an integer from 0 to 9"),
        ("limit_key", "", "limit_key must be 1-200 printable characters"),
        ("limit_key", "a b", "limit_key must be 1-200 printable characters"),
        ("limit_key", "x" * 201, "limit_key must be 1-200 printable characters"),
        ("limit_key", "a\nb", "limit_key must be 1-200 printable characters"),
        ("limit_key", 42, "limit_key must be 1-200 printable characters"),
    ],
)
def test_bad_values_are_one_line_errors_and_nothing_is_written(
    journal_dir: Path, field: str, value: object, message: str
) -> None:
    q = Queue("default", journal=journal_dir)
    with pytest.raises(EnvelopeError, match=message) as info:
        q.enqueue(tasks.add, 1, 2, **{field: value})
    assert "\n" not in str(info.value)
    assert envelopes(journal_dir) == []
    record = json.loads(q.prepare(tasks.add, [1, 2]).to_bytes())
    record[field] = value
    with pytest.raises(EnvelopeError):  # a record holding it is invalid, not a crash
        Envelope.from_dict(record)


def test_enqueue_enqueue_many_and_the_decorator_carry_both(journal_dir: Path) -> None:
    q = Queue("default", journal=journal_dir)
    q.enqueue(tasks.add, 1, 2, priority=9, limit_key="tenant:1")
    q.enqueue_many([q.prepare(tasks.add, [3, 4], priority=3), q.prepare(tasks.add, [5, 6], limit_key="k")])
    decorated = task("default", journal=journal_dir, priority=5, limit_key="tenant:2")(tasks.add)
    decorated.delay(7, 8)
    decorated.enqueue_call([9, 10], priority=0, limit_key="tenant:3")  # per call over the decorator's
    got = [(e.args, e.priority, e.limit_key) for e in envelopes(journal_dir)]
    assert got == [
        ((1, 2), 9, "tenant:1"),
        ((3, 4), 3, None),
        ((5, 6), 0, "k"),
        ((7, 8), 5, "tenant:2"),
        ((9, 10), 0, "tenant:3"),
    ]
    with pytest.raises(EnvelopeError, match="priority"):  # at decoration, not at the first delay
        task("default", journal=journal_dir, priority=11)(tasks.add)


def test_the_cli_takes_priority_and_limit_key(journal_dir: Path) -> None:
    def enqueue(*options: str) -> Result:
        return CliRunner().invoke(
            main, ["enqueue", "--journal", str(journal_dir), *options, "tests.tasks.add", "1", "2"]
        )

    ok = enqueue("--priority", "4", "--limit-key", "t:1")
    assert ok.exit_code == 0, ok.output
    bad = enqueue("--priority", "10")
    assert bad.exit_code == 2
    assert "--priority" in bad.output
    bad_key = enqueue("--limit-key", "a b")
    assert bad_key.exit_code != 0
    assert "limit_key must be" in bad_key.output
    assert [(e.priority, e.limit_key) for e in envelopes(journal_dir)] == [(4, "t:1")]


def test_http_takes_them_and_refuses_bad_ones_with_a_400(journal_dir: Path) -> None:
    with served(config(journal_dir)) as base:
        got = request(base, "POST", "/v1/jobs", {**ADD, "priority": 8, "limit_key": "tenant:9"})
        assert got.status == 202, got
        for bad in ({"priority": 10}, {"priority": "9"}, {"limit_key": "a b"}, {"limit_key": 5}):
            refused = request(base, "POST", "/v1/jobs", {**ADD, **bad})
            assert refused.status == 400, (bad, refused)
        spec = request(base, "GET", "/v1/openapi.json").json
        props = spec["components"]["schemas"]["NewJob"]["properties"]
        assert props["priority"]["maximum"] == 9
        assert props["limit_key"]["maxLength"] == 200
    assert [(e.priority, e.limit_key) for e in envelopes(journal_dir)] == [(8, "tenant:9")]


@pytest.mark.parametrize("value", ["", None, [], {}, False, 0.0])
def test_a_falsy_priority_that_is_not_the_integer_0_is_refused(journal_dir: Path, value: object) -> None:
    q = Queue("default", journal=journal_dir)
    with pytest.raises(EnvelopeError, match="priority must be an integer from 0 to 9"):
        q.prepare(tasks.add, [1, 2], priority=value)  # type: ignore[arg-type]
    for key in ([], {}, False, 0):
        with pytest.raises(EnvelopeError, match="limit_key must be"):
            q.prepare(tasks.add, [1, 2], limit_key=key)  # type: ignore[arg-type]
    assert q.prepare(tasks.add, [1, 2], priority=0, limit_key=None).priority == 0


def test_http_refuses_a_falsy_priority_or_limit_key_with_a_400(journal_dir: Path) -> None:
    with served(config(journal_dir)) as base:
        bad = [{"priority": v} for v in ("", None, [], {}, False, 0.0)]
        bad += [{"limit_key": v} for v in ("", [], {}, False, 0)]
        for fields in bad:
            refused = request(base, "POST", "/v1/jobs", {**ADD, **fields})
            assert refused.status == 400, (fields, refused)
            assert "must be" in refused.json["detail"], refused.json
        assert request(base, "POST", "/v1/jobs", {**ADD, "priority": 0}).status == 202
    assert [e.priority for e in envelopes(journal_dir)] == [0]


def test_the_remote_client_sends_them_only_when_set(journal_dir: Path) -> None:
    q = Queue("default", journal=journal_dir)
    env = q.prepare(tasks.add, [1, 2])
    assert "priority" not in body_of(env)
    assert "limit_key" not in body_of(env)
    body = body_of(dataclasses.replace(env, priority=2, limit_key="tenant:5"))
    assert (body["priority"], body["limit_key"]) == (2, "tenant:5")


def test_a_keyed_retry_must_repeat_priority_and_limit_key(journal_dir: Path) -> None:
    key = {"Idempotency-Key": "order:7"}
    with served(config(journal_dir)) as base:
        first = request(base, "POST", "/v1/jobs", {**ADD, "priority": 3}, headers=key)
        assert first.status == 202, first
        again = request(base, "POST", "/v1/jobs", {**ADD, "priority": 3}, headers=key)
        assert (again.status, again.json["id"]) == (202, first.json["id"])
        other = request(base, "POST", "/v1/jobs", {**ADD, "priority": 4}, headers=key)
        assert other.status == 422, other
        plain = request(base, "POST", "/v1/jobs", ADD, headers={"Idempotency-Key": "order:8"})
        assert (
            request(base, "POST", "/v1/jobs", ADD, headers={"Idempotency-Key": "order:8"}).json == plain.json
        )
    assert len(envelopes(journal_dir)) == 2


def test_forward_refuses_a_bad_fair_key_from_the_option_or_the_environment(journal_dir: Path) -> None:
    args = ["forward", "--journal", str(journal_dir), "--redis", "redis://127.0.0.1:1/0"]
    bad = CliRunner().invoke(main, [*args, "--fair-key", "tenant:*=0"])
    assert bad.exit_code == 2
    assert "fair key 'tenant:*=0'" in bad.output
    from_env = CliRunner().invoke(main, args, env={"HYBRIDQ_FAIR_KEYS": "tenant:* big=x"})
    assert from_env.exit_code == 2
    assert "fair key 'big=x'" in from_env.output
    assert not journal_dir.exists()  # nothing created


@pytest.mark.parametrize("spec", ["t=\u00b2", "t=\u0663", "t=\uff13"])
@pytest.mark.timeout(30)
def test_a_fair_key_weight_of_non_ascii_digits_is_exit_2(spec: str, journal_dir: Path) -> None:
    args = ["forward", "--journal", str(journal_dir), "--redis", "redis://127.0.0.1:1/0"]
    bad = CliRunner().invoke(main, [*args, "--fair-key", spec])
    assert bad.exit_code == 2, bad.output  # '²'.isdigit() is True, and int('²') raised
    assert "the weight after '=' must be an integer" in bad.output
    assert "Traceback" not in bad.output
    assert not journal_dir.exists()


def test_a_limit_key_with_any_whitespace_is_refused() -> None:
    # The check is isprintable() and no space: every other whitespace character is not printable
    # (hybridq.envelope.limits.limit_key; one generator per key's characters before).
    spaces = [chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()]
    assert len(spaces) > 20
    for ch in spaces:
        with pytest.raises(EnvelopeError):
            check_limit_key(f"tenant{ch}42")
    assert check_limit_key("tenant:42") == "tenant:42"
