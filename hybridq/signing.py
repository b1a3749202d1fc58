"""Envelope signing: an HMAC that workers check before they import or claim anything.

Without it, whoever can write to Redis chooses what an allowed function runs with (and, by
editing a job's ``func``, which allowed function runs). With a key configured, producers sign
every envelope they enqueue and workers refuse, for good, any job whose envelope is unsigned or
does not match its signature.

**Keys** are read when first needed, never at import: ``HYBRIDQ_SIGNING_KEY_FILE=/path``
(preferred: one key per line, blank lines and ``#`` comments ignored; a warning if group or other
may read it) or ``HYBRIDQ_SIGNING_KEY=key[,key...]``; the file wins when both are set. The first
key signs and every key verifies, so a key is rotated in three steps: add the new key as a
second line everywhere, move it to the first line, and drop the old one once no job signed with
it is left. A key is at least :data:`MIN_KEY_BYTES` bytes of text; keys never appear in a log,
an error or a ``repr``.

**What is signed** is :func:`canonical`: every field of the envelope except
:data:`UNSIGNED_FIELDS`, in the form any reader of the record decodes it to, as sorted, compact
JSON, after a domain prefix. So it covers the id, function, arguments, queue, idempotency key,
creation time, timeout, result lifetime, run time, retry policy, description, meta and fields a
newer version adds. Not signed: the delivery around the envelope (owner, journal location,
attempt, lease), which the forwarder writes and which decides bookkeeping, not what runs.

This module must not import redis, rq, click or the journal (producers and workers both use it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import threading
from dataclasses import dataclass, field

from hybridq.envelope import Envelope
from hybridq.errors import HybridqError
from hybridq.secretfile import read_secret_file

__all__ = [
    "ENV_KEY",
    "ENV_KEY_FILE",
    "MIN_KEY_BYTES",
    "SCHEME",
    "UNSIGNED_FIELDS",
    "Keyring",
    "SignatureError",
    "SigningKeyError",
    "canonical",
    "keyring",
]

log = logging.getLogger("hybridq")

#: A file holding the signing keys, one per line (the first signs).
ENV_KEY_FILE = "HYBRIDQ_SIGNING_KEY_FILE"
#: The signing keys themselves, comma-separated (the first signs); the file is preferred.
ENV_KEY = "HYBRIDQ_SIGNING_KEY"
#: The prefix of every signature: the algorithm, so that it can change without ambiguity.
SCHEME = "hmac-sha256"
#: The shortest key accepted (bytes of UTF-8 text): a short key could be guessed offline from
#: any signed envelope in Redis. ``secrets.token_hex(32)`` gives 64.
MIN_KEY_BYTES = 16
#: Envelope fields outside the signature: ``sig`` itself; ``v``, which every writer sets to its
#: own version (the forwarder re-encodes each envelope); and ``requeue``, which ``hybridq failed
#: requeue`` raises on a host that need not hold the key. A changed ``requeue`` can only run a
#: job that failed for good once more, with the function and arguments its producer signed.
UNSIGNED_FIELDS = frozenset({"sig", "v", "requeue"})

#: Bumped with any change to :func:`canonical`'s form (old signatures then stop verifying).
_DOMAIN = b"hybridq-envelope-signature-v1\n"
_dumps = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=True, allow_nan=False).encode


class SigningKeyError(HybridqError):
    """The signing keys are configured but unusable (missing file, no key, a key too short)."""


class SignatureError(HybridqError):
    """A job's envelope is unsigned, or does not match its signature: a worker refuses it.

    Attributes:
        job_id: the job refused.
        reason: what is wrong, in a few words (never the key, never the expected signature).
    """

    def __init__(self, job_id: str, reason: str) -> None:
        self.job_id = job_id
        self.reason = reason
        super().__init__(
            f"job {job_id}: {reason}: this worker runs only jobs signed with one of its keys "
            f"({ENV_KEY_FILE}); nothing was imported or run (see docs/security.md)"
        )


def canonical(env: Envelope) -> bytes:
    """The bytes an envelope's signature covers (see the module docstring)."""
    return _canonical_of(_normalised(env))


def _normalised(env: Envelope) -> Envelope:
    """``env`` as any reader of its record decodes it.

    The forwarder decodes each record and encodes it again before a worker sees it, so the
    producer must sign (and store) that form: a tuple and a list, ``1`` and ``1.0`` in a retry
    policy, or an integer dict key and its string, must not differ between signer and verifier.
    """
    return Envelope.from_dict(json.loads(env.to_bytes()))


def _canonical_of(normalised: Envelope) -> bytes:
    obj = normalised.to_dict()
    for name in UNSIGNED_FIELDS:
        obj.pop(name, None)
    return _DOMAIN + _dumps(obj).encode("ascii")


def _mac(key: bytes, message: bytes) -> str:
    return f"{SCHEME}:{hmac.new(key, message, hashlib.sha256).hexdigest()}"


@dataclass(frozen=True, slots=True)
class Keyring:
    """Signing keys: the first signs, every one verifies.

    Args:
        keys: the keys, as bytes (never shown by ``repr``).
        source: where they came from (``HYBRIDQ_SIGNING_KEY_FILE=/path``), for messages.
    """

    keys: tuple[bytes, ...] = field(repr=False)
    source: str = "keys given in code"

    def __post_init__(self) -> None:
        if not self.keys:
            raise SigningKeyError(f"{self.source}: no signing key")
        for n, key in enumerate(self.keys, 1):
            if len(key) < MIN_KEY_BYTES:
                raise SigningKeyError(
                    f"{self.source}: key {n} is shorter than {MIN_KEY_BYTES} bytes; make one with "
                    "python -c 'import secrets; print(secrets.token_hex(32))'"
                )

    @classmethod
    def from_text(cls, text: str, *, source: str, separator: str | None = None) -> Keyring:
        """Keys from ``text``: one per line (or per ``separator``); blanks and ``#`` lines skipped."""
        parts = text.split(separator) if separator is not None else text.splitlines()
        keys = [p.strip() for p in parts]
        return cls(tuple(k.encode("utf-8") for k in keys if k and not k.startswith("#")), source)

    def sign(self, env: Envelope) -> Envelope:
        """``env`` signed with the first key, in the form every reader decodes it to.

        Stored in that form too: a reader that does not know a field keeps it verbatim, so the
        signed bytes and the stored ones must not differ even in how a number is written.
        """
        normalised = _normalised(env)
        return dataclasses.replace(normalised, signature=_mac(self.keys[0], _canonical_of(normalised)))

    def verify(self, env: Envelope) -> int:
        """Which key signed ``env`` (0 is the current one); :class:`SignatureError` if none did."""
        given = env.signature
        if given is None:
            raise SignatureError(env.id, "the job is not signed")
        if not given.startswith(f"{SCHEME}:"):
            raise SignatureError(env.id, f"the signature is not {SCHEME}")
        message = canonical(env)
        matched = -1
        for n, key in enumerate(self.keys):
            # Constant time, and every key tried: the time taken says nothing about the key.
            if hmac.compare_digest(_mac(key, message).encode(), given.encode()) and matched < 0:
                matched = n
        if matched < 0:
            raise SignatureError(
                env.id,
                "the signature does not match: the job was changed after it was signed, or signed "
                "with a key this worker does not hold",
            )
        return matched


_cache: tuple[object, Keyring] | None = None
_cache_lock = threading.Lock()


def keyring() -> Keyring | None:
    """The configured keys (see the module docstring), or ``None`` when signing is off.

    Read from the environment on each call, and from the key file again whenever the file
    changes (so a rotated file needs no restart); raises :class:`SigningKeyError` when a key is
    configured but unusable: a worker must not fall back to running unsigned jobs.
    """
    global _cache
    path = os.environ.get(ENV_KEY_FILE) or None
    raw = os.environ.get(ENV_KEY) or None
    if path is None and raw is None:
        return None
    if path is not None:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise SigningKeyError(f"{ENV_KEY_FILE}={path}: {exc.strerror}") from exc
        tag: object = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, raw)
    else:
        tag = raw
    with _cache_lock:
        if _cache is not None and _cache[0] == tag:
            return _cache[1]
        ring = _load(path, raw)
        _cache = (tag, ring)
        return ring


def _load(path: str | None, raw: str | None) -> Keyring:
    if path is None:
        assert raw is not None
        return Keyring.from_text(raw, source=ENV_KEY, separator=",")
    if raw is not None:
        log.warning("both %s and %s are set: using the file", ENV_KEY_FILE, ENV_KEY)
    try:
        text = read_secret_file(path)
    except OSError as exc:
        raise SigningKeyError(f"{ENV_KEY_FILE}={path}: cannot read it: {exc.strerror}") from exc
    except UnicodeDecodeError:  # its message would quote a byte of the key
        raise SigningKeyError(f"{ENV_KEY_FILE}={path}: not UTF-8 text") from None
    return Keyring.from_text(text, source=f"{ENV_KEY_FILE}={path}")


def _after_fork_in_child() -> None:
    # Only the forking thread exists in the child: a cache lock another thread held at the fork
    # would stay held, and every enqueue (which reads the keys) would hang (a preforking server).
    global _cache_lock
    _cache_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
