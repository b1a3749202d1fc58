"""Envelope signing: what is signed, what breaks a signature, rotation, keys, and who signs.

No sockets: the worker's side, against a real Redis, is in tests/integration/test_signing.py.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hybridq import EnvelopeError, Queue, Retry
from hybridq.cli import cli
from hybridq.envelope.model import Envelope
from hybridq.errors import SignatureError, SigningKeyError
from hybridq.journal import JournalReader
from hybridq.security.signing import ENV_KEY, ENV_KEY_FILE, Keyring, canonical, keyring
from hybridq.transport.base import Delivery

NEW = "n" * 40
OLD = "o" * 40


@pytest.fixture(autouse=True)
def _no_key_from_the_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KEY, raising=False)
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)


def ring(*keys: str) -> Keyring:
    return Keyring(tuple(k.encode() for k in keys), source="test")


def envelope(**overrides: Any) -> Envelope:
    fields: dict[str, Any] = {
        "id": "0190aa00000000000000000000000001",
        "func": "tests.tasks.record",
        "queue": "default",
        "idempotency_key": "order 42 ☃",
        "created_at": 1700000000.25,
        "args": ("/tmp/effects", "token", {"1": "str key"}, (1, 2)),  # int keys: refused (NotSerializable)
        "kwargs": {"z": 1, "a": [1.5, None]},
        "timeout_s": 30.0,
        "result_ttl_s": 60.0,
        "run_at": 1700000100.0,
        "retry": Retry(max_attempts=3, backoff_s=1, jitter=False),  # 1, not 1.0: normalised
        "description": "record a token",
        "meta": {"tenant": "t1"},
        "extra": {"priority": 5},  # a field from a newer version
    }
    fields.update(overrides)
    return Envelope(**fields)


def through_the_forwarder(env: Envelope) -> Envelope:
    """What a worker decodes: journal bytes -> forwarder -> RQ's JSON -> the delivery's envelope."""
    forwarded = Envelope.from_bytes(env.to_bytes())
    wire = json.loads(json.dumps(Delivery(forwarded, "owner", ("w", 0, 64), attempt=2).to_json()))
    return Envelope.from_dict(wire["job"])


def write_key_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text, encoding="utf-8")
    os.chmod(path, mode)
    return path


# -- sign and verify ----------------------------------------------------------------------------


def test_a_signed_envelope_verifies_after_the_forwarders_round_trip() -> None:
    signed = ring(NEW).sign(envelope())
    assert signed.signature is not None
    assert signed.signature.startswith("hmac-sha256:")
    assert ring(NEW).verify(through_the_forwarder(signed)) == 0


def test_the_signature_is_stored_as_a_named_field_and_old_records_still_decode() -> None:
    signed = ring(NEW).sign(envelope())
    raw = json.loads(signed.to_bytes())
    assert raw["sig"] == signed.signature
    decoded = Envelope.from_bytes(signed.to_bytes())
    assert decoded.signature == signed.signature
    assert "sig" not in decoded.extra
    old = json.loads(envelope().to_bytes())  # written before signing existed: no "sig"
    assert "sig" not in old
    assert Envelope.from_dict(old).signature is None
    with pytest.raises(EnvelopeError):
        Envelope.from_dict({**raw, "sig": 12})


TAMPERINGS: dict[str, tuple[str, Any]] = {
    "id": ("id", "0190aa00000000000000000000000002"),
    "func": ("func", "tests.tasks.add"),
    "args": ("args", ["/tmp/effects", "other token", {"1": "int key"}, [1, 2]]),
    "kwargs": ("kwargs", {"z": 2, "a": [1.5, None]}),
    "queue": ("queue", "emails"),
    "idempotency key": ("key", "order 43"),
    "created_at": ("created_at", 1700000000.5),
    "timeout": ("timeout", 3000.0),
    "result_ttl": ("result_ttl", 1.0),
    "run_at": ("run_at", 1700000200.0),
    "retry": ("retry", {"max_attempts": 100, "backoff": 1.0, "backoff_max": 300.0, "jitter": False}),
    "description": ("description", "something else"),
    "meta": ("meta", {"tenant": "t2"}),
    "a newer version's field": ("priority", 9),
    "a field added": ("admin", True),
}


@pytest.mark.parametrize("name", TAMPERINGS)
def test_changing_any_signed_field_breaks_the_signature(name: str) -> None:
    field, value = TAMPERINGS[name]
    raw = json.loads(ring(NEW).sign(envelope()).to_bytes())
    assert raw.get(field) != value
    raw[field] = value
    with pytest.raises(SignatureError, match="does not match"):
        ring(NEW).verify(through_the_forwarder(Envelope.from_dict(raw)))


def test_a_requeue_and_another_writers_version_keep_the_signature() -> None:
    """``hybridq failed requeue`` raises ``requeue`` without the key; the forwarder rewrites ``v``."""
    signed = ring(NEW).sign(envelope())
    requeued = dataclasses.replace(signed, requeue=signed.requeue + 1)
    assert ring(NEW).verify(through_the_forwarder(requeued)) == 0
    raw = json.loads(signed.to_bytes())
    raw["v"] = 2
    assert ring(NEW).verify(Envelope.from_dict(raw)) == 0


def test_an_unsigned_or_malformed_or_foreign_signature_is_refused() -> None:
    env = envelope()
    with pytest.raises(SignatureError, match="not signed") as unsigned:
        ring(NEW).verify(env)
    assert unsigned.value.job_id == env.id
    with pytest.raises(SignatureError, match="not hmac-sha256"):
        ring(NEW).verify(dataclasses.replace(env, signature="md5:abc"))
    with pytest.raises(SignatureError, match="does not match"):
        ring(NEW).verify(ring(OLD).sign(env))


def test_the_first_key_signs_and_every_key_verifies() -> None:
    rotated = ring(NEW, OLD)
    signed_before = ring(OLD).sign(envelope())
    signed_after = rotated.sign(envelope())
    assert rotated.verify(through_the_forwarder(signed_before)) == 1
    assert rotated.verify(through_the_forwarder(signed_after)) == 0
    assert ring(NEW).verify(signed_after) == 0  # signed with the first key
    with pytest.raises(SignatureError):
        ring(NEW).verify(signed_before)  # the old key dropped: its jobs no longer run


def test_the_canonical_form_is_pinned() -> None:
    """Sorted compact JSON of the normalised envelope minus sig, v and requeue, after a prefix.

    Changing it makes every signature already in a journal fail: bump the prefix's version.
    """
    env = Envelope(
        id="j1",
        func="m.f",
        queue="q",
        idempotency_key="k",
        created_at=1.0,
        args=(1, (2,)),
        retry=Retry(max_attempts=2, backoff_s=1, backoff_max_s=9),
        requeue=3,
    )
    assert canonical(env) == (
        b"hybridq-envelope-signature-v1\n"
        b'{"args":[1,[2]],"created_at":1.0,"func":"m.f","id":"j1","key":"k","kwargs":{},"queue":"q",'
        b'"retry":{"backoff":1.0,"backoff_max":9.0,"jitter":true,"max_attempts":2}}'
    )
    # Signing adds the expiry (created_at + 7 days by default), and signs it with the rest.
    signed = ring(NEW).sign(env)
    assert signed.extra == {"not_after": 1.0 + 7 * 86400}
    assert canonical(signed) == canonical(env).replace(b',"queue"', b',"not_after":604801.0,"queue"')
    expected = hmac.new(NEW.encode(), canonical(signed), "sha256").hexdigest()
    assert signed.signature == f"hmac-sha256:{expected}"


def test_signatures_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    signed = ring(NEW).sign(envelope())
    ring(OLD, NEW).verify(signed)
    assert len(calls) == 2  # every key tried, each with compare_digest


# -- keys ---------------------------------------------------------------------------------------


def test_keys_never_appear_in_reprs_or_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = ring(NEW, OLD)
    assert NEW not in repr(keys)
    assert NEW not in str(keys)
    with pytest.raises(SignatureError) as refused:
        keys.verify(ring("x" * 40).sign(envelope()))
    assert NEW not in str(refused.value)
    assert OLD not in str(refused.value)
    short = write_key_file(tmp_path / "keys", f"{NEW}\nshort-secret\n")
    monkeypatch.setenv(ENV_KEY_FILE, str(short))
    with pytest.raises(SigningKeyError, match="key 2 is shorter than 16 bytes") as bad:
        keyring()
    assert "short-secret" not in str(bad.value)
    assert NEW not in str(bad.value)
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff" * 40)
    os.chmod(binary, 0o600)
    monkeypatch.setenv(ENV_KEY_FILE, str(binary))
    with pytest.raises(SigningKeyError, match="not UTF-8") as garbled:
        keyring()
    assert "xff" not in str(garbled.value)


def test_no_key_configured_means_no_signing() -> None:
    assert keyring() is None


def test_a_key_file_holds_one_key_per_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_key_file(tmp_path / "keys", f"# rotated 2026-01\n\n  {NEW}  \n{OLD}\n")
    monkeypatch.setenv(ENV_KEY_FILE, str(path))
    keys = keyring()
    assert keys is not None
    assert keys.keys == (NEW.encode(), OLD.encode())
    assert keys.source == f"{ENV_KEY_FILE}={path}"


def test_a_rewritten_key_file_applies_without_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_key_file(tmp_path / "keys", f"{OLD}\n")
    monkeypatch.setenv(ENV_KEY_FILE, str(path))
    first = keyring()
    assert first is not None
    assert keyring() is first  # cached while the file is unchanged
    write_key_file(tmp_path / "keys.new", f"{NEW}\n{OLD}\n")
    os.replace(tmp_path / "keys.new", path)
    rotated = keyring()
    assert rotated is not None
    assert rotated.keys == (NEW.encode(), OLD.encode())


def test_a_key_file_others_may_read_is_used_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_key_file(tmp_path / "keys", f"{NEW}\n", mode=0o640)
    monkeypatch.setenv(ENV_KEY_FILE, str(path))
    with caplog.at_level(logging.WARNING, logger="hybridq"):
        keys = keyring()
    assert keys is not None
    assert "readable by group/other (mode 640): make it 0600" in caplog.text
    assert NEW not in caplog.text


@pytest.mark.parametrize("text", ["", "\n# only a comment\n\n"])
def test_a_key_file_without_a_key_is_an_error(
    text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_KEY_FILE, str(write_key_file(tmp_path / "keys", text)))
    with pytest.raises(SigningKeyError, match="no signing key"):
        keyring()


def test_a_missing_key_file_is_an_error_not_signing_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_KEY_FILE, str(tmp_path / "absent"))
    with pytest.raises(SigningKeyError, match="No such file"):
        keyring()


def test_keys_from_the_environment_and_the_file_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ENV_KEY, f"{NEW},{OLD}")
    keys = keyring()
    assert keys is not None
    assert keys.keys == (NEW.encode(), OLD.encode())
    monkeypatch.setenv(ENV_KEY_FILE, str(write_key_file(tmp_path / "keys", f"{OLD}\n")))
    with caplog.at_level(logging.WARNING, logger="hybridq"):
        keys = keyring()
    assert keys is not None
    assert keys.keys == (OLD.encode(),)
    assert "using the file" in caplog.text


# -- producers sign -----------------------------------------------------------------------------


def journal_envelopes(journal: Path) -> list[Envelope]:
    return [Envelope.from_bytes(r.payload) for r in JournalReader(journal).records()]


def test_queue_enqueue_and_enqueue_many_sign_when_a_key_is_configured(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = Queue("default", journal_dir)
    unsigned = queue.enqueue("tests.tasks.add", 1, 2)
    monkeypatch.setenv(ENV_KEY, NEW)
    job = queue.enqueue("tests.tasks.add", 1, 2, retry=Retry(max_attempts=2, backoff_s=1))
    many = queue.enqueue_many([queue.prepare("tests.tasks.add", (i, i)) for i in range(3)])
    written = journal_envelopes(journal_dir)
    assert [e.id for e in written] == [unsigned.id, job.id, *(j.id for j in many)]
    assert written[0].signature is None
    for env in written[1:]:
        assert ring(NEW).verify(through_the_forwarder(env)) == 0
    assert job.envelope.signature == written[1].signature  # the Job holds what was written


def test_hybridq_enqueue_signs_when_a_key_is_configured(journal_dir: Path, tmp_path: Path) -> None:
    keys = write_key_file(tmp_path / "keys", f"{NEW}\n")
    result = CliRunner().invoke(
        cli,
        ["enqueue", "--journal", str(journal_dir), "tests.tasks.add", "1", "2"],
        env={ENV_KEY_FILE: str(keys)},
    )
    assert result.exit_code == 0, result.output
    [env] = journal_envelopes(journal_dir)
    assert env.id == result.output.strip()
    assert ring(NEW).verify(through_the_forwarder(env)) == 0


def test_a_misconfigured_key_fails_the_enqueue_and_writes_nothing(
    journal_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = Queue("default", journal_dir)
    monkeypatch.setenv(ENV_KEY_FILE, str(tmp_path / "absent"))
    with pytest.raises(SigningKeyError):
        queue.enqueue("tests.tasks.add", 1, 2)
    assert journal_envelopes(journal_dir) == []


def test_hybridq_worker_with_an_unusable_key_file_exits_before_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_KEY_FILE, "")  # the command sets it: restored after the test
    result = CliRunner().invoke(
        cli,
        ["worker", "--redis", "redis://127.0.0.1:1/0", "--signing-key-file", str(tmp_path / "absent"), "q"],
    )
    assert result.exit_code == 1, result.output
    assert "hybridq: error:" in result.output
    assert "HYBRIDQ_SIGNING_KEY_FILE=" in result.output
