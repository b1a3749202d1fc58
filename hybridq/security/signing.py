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

import collections
import dataclasses
import hashlib
import hmac
import json
import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any

from hybridq.envelope.model import Envelope
from hybridq.errors import SignatureError, SigningKeyError
from hybridq.security.secretfile import read_secret_file

__all__ = [
    "DEFAULT_TTL_S",
    "ENV_KEY",
    "ENV_KEY_FILE",
    "ENV_TTL",
    "EVENT_MAC",
    "MIN_KEY_BYTES",
    "NOT_AFTER",
    "SCHEME",
    "UNSIGNED_FIELDS",
    "Keyring",
    "SignatureError",
    "SigningKeyError",
    "admit_event",
    "canonical",
    "expiry_refusal",
    "keyring",
    "refused_events",
    "sign_event",
    "signature_ttl",
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

#: How long a signed job stays valid, in seconds after it was created (or due, for a delayed
#: job): the variable holding it, and its default (7 days). Producers write the expiry into
#: each envelope they sign (``not_after``, signed with the rest); workers refuse a job past it.
ENV_TTL = "HYBRIDQ_SIGNATURE_TTL"
DEFAULT_TTL_S = 7 * 86400.0
#: The envelope field holding a signed job's expiry (Unix seconds), in :attr:`Envelope.extra`.
NOT_AFTER = "not_after"

#: Bumped with any change to :func:`canonical`'s form (old signatures then stop verifying).
_DOMAIN = b"hybridq-envelope-signature-v1\n"
_dumps = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=True, allow_nan=False).encode


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
        signed bytes and the stored ones must not differ even in how a number is written. An
        envelope without an expiry gets one (``not_after``: :func:`_implicit_not_after`), signed
        with the rest.
        """
        normalised = _normalised(env)
        if NOT_AFTER not in normalised.extra:
            extra = {**normalised.extra, NOT_AFTER: round(_implicit_not_after(normalised), 3)}
            normalised = _normalised(dataclasses.replace(normalised, extra=extra))
        return dataclasses.replace(normalised, signature=_mac(self.keys[0], _canonical_of(normalised)))

    def sign_event(self, owner: str, event: dict[str, Any]) -> dict[str, Any]:
        """A completion event for ``owner``'s stream, with a MAC by the first key."""
        return {**event, EVENT_MAC: _mac(self.keys[0], _event_message(owner, event))}

    def verify_event(self, owner: str, event: Mapping[str, Any]) -> bool:
        """Whether ``event`` carries a MAC one of the keys made for ``owner`` (constant time)."""
        given = event.get(EVENT_MAC)
        if not isinstance(given, str):
            return False
        try:
            message = _event_message(owner, event)
        except (TypeError, ValueError, RecursionError):  # not JSON this side could have signed
            return False
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(_mac(key, message).encode(), given.encode())
        return matched

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


def signature_ttl() -> float:
    """How long a signed job stays valid (``HYBRIDQ_SIGNATURE_TTL`` seconds, default 7 days)."""
    raw = os.environ.get(ENV_TTL)
    if raw is None:
        return DEFAULT_TTL_S
    try:
        ttl = float(raw)
    except ValueError:
        ttl = math.nan
    if not math.isfinite(ttl) or ttl <= 0:
        raise SigningKeyError(f"{ENV_TTL}={raw!r}: expected a number of seconds > 0")
    return ttl


def _implicit_not_after(env: Envelope) -> float:
    """The expiry of ``env`` from its signed times: created (or due, if later), plus the TTL."""
    return max(env.created_at, env.run_at or 0.0) + signature_ttl()


def expiry_refusal(env: Envelope, now: float | None = None) -> SignatureError | None:
    """Why a signed ``env`` may no longer run (it expired), or ``None``; call it once verified.

    The expiry is the envelope's signed ``not_after``. An envelope signed before that field
    existed has the same bound from its signed creation (or run) time and this process's
    :func:`signature_ttl`, so an old capture cannot be replayed forever either.
    """
    value = env.extra.get(NOT_AFTER)
    if value is None:
        not_after = _implicit_not_after(env)
    elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        not_after = float(value)
    else:
        return SignatureError(env.id, f"its {NOT_AFTER} is not a time")
    if (time.time() if now is None else now) > not_after:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(not_after))
        return SignatureError(env.id, f"the signed job expired at {when} ({ENV_TTL}, see docs/security.md)")
    return None


# -- completion events ---------------------------------------------------------------------------

#: The event field holding its MAC.
EVENT_MAC = "mac"
_EVENT_DOMAIN = b"hybridq-event-mac-v1\n"

#: Events the forwarder dropped since this process started, by reason (``forged``: a MAC that
#: does not match; ``unauthenticated``: none, with signing on; ``not forwarded``: a success for
#: a job this forwarder has not forwarded).
refused_events: collections.Counter[str] = collections.Counter()


def _event_message(owner: str, event: Mapping[str, Any]) -> bytes:
    """What an event's MAC covers: its fields but the MAC, and the stream's owner."""
    body = {k: v for k, v in event.items() if k != EVENT_MAC}
    return _EVENT_DOMAIN + _dumps([owner, body]).encode("ascii")


def sign_event(owner: str, event: dict[str, Any]) -> dict[str, Any]:
    """``event`` with a MAC by the first key, when this process holds keys (else as it is)."""
    ring = keyring()
    return event if ring is None else ring.sign_event(owner, event)


def admit_event(
    owner: str,
    event_id: str,
    event: Mapping[str, Any],
    forwarded: Mapping[str, Sequence[int]],
    *,
    ring: Keyring | EllipsisType | None = ...,
) -> bool:
    """Whether the forwarder of ``owner`` may take this completion event (logs and counts if not).

    With signing keys, only an event whose MAC one of them made, for this owner. With or without:
    a ``succeeded`` event only for a job this forwarder has forwarded (``forwarded``: each
    chain's position, as in the checkpoint); an event whose ``loc`` does not parse is left to
    the caller's own checks. ``ring``: the keys, when the caller looked them up once for a
    batch (by default they are looked up here).
    """
    if ring is ...:
        ring = keyring()
    reason = None
    if ring is not None:
        given = event.get(EVENT_MAC)
        if not isinstance(given, str):
            reason = "unauthenticated"
        elif not ring.verify_event(owner, event):
            reason = "forged"
    if (
        reason is None
        and event.get("outcome") == "succeeded"
        and not _was_forwarded(event.get("loc"), forwarded)
    ):
        reason = "not forwarded"
    if reason is None:
        return True
    refused_events[reason] += 1
    log.error(
        "dropping completion event %s (job %.40r): %s; %d dropped so far (see docs/security.md)",
        event_id,
        event.get("id"),
        reason,
        sum(refused_events.values()),
    )
    return False


def _was_forwarded(loc: object, forwarded: Mapping[str, Sequence[int]]) -> bool:
    if not isinstance(loc, list) or len(loc) != 3:
        return True  # garbled: the caller drops it as such
    writer, segment, offset = loc
    position = forwarded.get(writer) if isinstance(writer, str) else None
    if position is None or not isinstance(segment, int) or not isinstance(offset, int):
        return True  # an unknown chain or a garbled place: the caller's checks decide
    return (segment, offset) < (position[0], position[1])


_cache: tuple[object, Keyring] | None = None
_cache_lock = threading.Lock()


def _getenv(name: str) -> str | None:
    """``os.environ.get(name)``, fast when ``name`` is unset (the usual case: no signing).

    Reads the environment's own dict (bytes to bytes on POSIX), which ``os.environ`` updates: a
    miss costs 20 ns there against 0.7 us through ``os.environ.get`` (asked twice per job).
    """
    data = getattr(os.environ, "_data", None)  # looked up each time: a test may replace os.environ
    if type(data) is not dict or os.name != "posix":
        return os.environ.get(name)
    raw = data.get(name.encode())
    return None if raw is None else os.fsdecode(raw)


def keyring() -> Keyring | None:
    """The configured keys (see the module docstring), or ``None`` when signing is off.

    Read from the environment on each call, and from the key file again whenever the file
    changes (so a rotated file needs no restart); raises :class:`SigningKeyError` when a key is
    configured but unusable, a variable set but empty included: a worker must not fall back to
    running unsigned jobs.
    """
    global _cache
    path = _getenv(ENV_KEY_FILE)
    raw = _getenv(ENV_KEY)
    for name, value in ((ENV_KEY_FILE, path), (ENV_KEY, raw)):
        # Set but empty (``VAR=`` in an env file, ``${VAR:-}`` in compose): a typo or a secret
        # that did not arrive, not a wish to turn verification off (unset the variable for that).
        if value is not None and not value.strip():
            raise SigningKeyError(f"{name} is set but empty: name the keys, or unset it to turn signing off")
    if path is None and raw is None:
        return None
    signature_ttl()  # a bad HYBRIDQ_SIGNATURE_TTL is a configuration error too, found early
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
