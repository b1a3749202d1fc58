"""The delivery, forwarder → worker (part of :mod:`hybridq.protocol`).

A :class:`Delivery` is the single argument of the RQ job whose function is :data:`ENTRY_POINT`,
as :meth:`Delivery.to_json` makes it and :meth:`Delivery.from_json` reads it; with it the
defaults of its lease and key lifetime, and :data:`Loc`, where its job's record is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _str
from math import isfinite
from typing import Any, cast

from hybridq.envelope.codec import dumps_ascii
from hybridq.envelope.limits import opt_finite
from hybridq.envelope.model import Envelope
from hybridq.protocol.enums import Overwrite

__all__ = ["DEFAULT_KEY_TTL_S", "DEFAULT_LEASE_S", "DELIVERY_VERSION", "ENTRY_POINT", "Delivery", "Loc"]

#: The function of every RQ job the forwarder pushes. RQ imports it by this path from job
#: hashes already in Redis: it never changes.
ENTRY_POINT = "hybridq.worker.execute"
#: The version field of a delivery (``"v"``).
DELIVERY_VERSION = 1
#: How long a worker's claim on an idempotency key lasts without renewal (seconds).
DEFAULT_LEASE_S = 10.0
#: How long an outcome stays stored under its idempotency key (seconds).
DEFAULT_KEY_TTL_S = 86400.0

#: Where a job's record is in the journal: ``(writer id, segment index, offset)`` (a requeued
#: job has a new one). Spelled here, not imported, so the wire does not depend on the journal.
Loc = tuple[str, int, int]


@dataclass(slots=True, init=False, unsafe_hash=True)
class Delivery:
    """One job to deliver: the envelope plus what the worker needs to report back.

    Treat it as immutable (use ``dataclasses.replace``). Not ``frozen``: each field set through
    ``object.__setattr__`` cost about 1,000 instructions, 13 per delivery, one made per job by
    the forwarder's push and the pool's take (docs/benchmarks.md, "The forwarder's JSON per job").
    """

    envelope: Envelope
    #: The forwarder that owns the job: completion events go to its stream.
    owner: str
    loc: Loc
    #: 1 for the first run; more after a failure (retry) or a lost worker (redelivery).
    attempt: int
    #: What the push does if the backend holds the job already (not sent to the worker).
    overwrite: Overwrite
    #: How long a worker's claim on the idempotency key lasts without renewal (seconds).
    lease_s: float
    #: How long the outcome stays stored under the idempotency key (seconds).
    key_ttl_s: float
    #: The forwarder's epoch generation when it made this delivery: a worker refuses a delivery
    #: older than the generation in the owner's epoch key (Redis brought it back from before
    #: its state was lost or rolled back; see ``Reconciler.check_epoch``).
    gen: int
    #: How many runs of this job vanished (their worker died, or lost its lease) before this
    #: delivery: a pool worker runs such a delivery alone in its process (it may be what kills it).
    lost: int
    #: How many runs of this job said ``RetryLater`` before this delivery. Each such run took an
    #: ``attempt`` number (a run's identity on the wire) but used no attempt: the job's own
    #: attempt is :attr:`job_attempt`.
    later: int
    #: When the first of those said it (the worker's clock): the RetryLater deadline counts from it.
    later_since: float | None
    #: The forwarder takes ``started`` events (:class:`StartedEvent`): the worker's claim adds
    #: one to the owner's stream. An older forwarder does not ask, and gets none.
    report_start: bool
    #: The policy of the job's limit key (:meth:`hybridq.protocol.keylimits.Limit.wire`), which
    #: the worker's claim enforces; ``None``: not limited.
    limit: str | None

    def __init__(
        self,
        envelope: Envelope,
        owner: str,
        loc: Loc,
        attempt: int = 1,
        *,
        overwrite: Overwrite = Overwrite.NEVER,
        lease_s: float = DEFAULT_LEASE_S,
        key_ttl_s: float = DEFAULT_KEY_TTL_S,
        gen: int = 0,
        lost: int = 0,
        later: int = 0,
        later_since: float | None = None,
        force: bool = False,
        replace: bool = False,
        report_start: bool = False,
        limit: str | None = None,
    ) -> None:
        """``force`` and ``replace`` are the older spellings of ``overwrite`` EARLIER and ALWAYS."""
        if replace:
            overwrite = Overwrite.ALWAYS
        elif force and overwrite is Overwrite.NEVER:
            overwrite = Overwrite.EARLIER
        self.envelope = envelope
        self.owner = owner
        self.loc = loc
        self.attempt = attempt
        self.overwrite = overwrite
        self.lease_s = lease_s
        self.key_ttl_s = key_ttl_s
        self.gen = gen
        self.lost = lost
        self.later = later
        self.later_since = later_since if later else None
        self.report_start = report_start
        self.limit = limit

    def to_json(self) -> dict[str, Any]:
        """The single argument of the worker's entry point (:data:`ENTRY_POINT`)."""
        return {"job": self.envelope.to_dict(), **self._own()}

    def encoded(self) -> bytes:
        """:meth:`to_json` as ASCII JSON; the envelope's record spliced in as it is when it has one.

        Encoding the envelope again cost the forwarder's push about as much as decoding it
        (docs/benchmarks.md, "The push path, this stop"); its record decodes to the same envelope.
        """
        source = self.envelope.source
        if source is None:
            return dumps_ascii(self.to_json()).encode()
        own = self._own_text()
        return b'{"job": ' + source + b", " + (dumps_ascii(self._own())[1:] if own is None else own).encode()

    def _own_text(self) -> str | None:
        """``dumps_ascii(self._own())`` less its ``{``, written field by field; ``None``: not the usual types.

        The encoder's walk of the dict, and the dict, cost the push about 15,000 instructions a
        job (docs/benchmarks.md, "The forwarder's JSON per job"); this is the same text
        (``tests/unit/test_delivery_encoded.py``) for the fields of the types the forwarder makes
        (finite floats: the encoder writes the others as ``NaN``/``Infinity``, not ``repr``).
        """
        owner, (chain, seg, off), lease, key_ttl = self.owner, self.loc, self.lease_s, self.key_ttl_s
        if (
            type(owner) is not str
            or type(chain) is not str
            or type(seg) is not int
            or type(off) is not int
            or type(self.attempt) is not int
            or type(self.gen) is not int
            or type(lease) is not float
            or type(key_ttl) is not float
            or not isfinite(lease)
            or not isfinite(key_ttl)
            or self.lost
            or self.later
            or (self.limit is not None and type(self.limit) is not str)
        ):
            return None
        text = (
            f'"v": {DELIVERY_VERSION}, "owner": {_str(owner)}, "loc": [{_str(chain)}, {seg}, {off}], '
            f'"attempt": {self.attempt}, "lease": {lease!r}, "key_ttl": {key_ttl!r}, "gen": {self.gen}'
        )
        if self.report_start:
            text += ', "report_start": 1'
        if self.limit:
            text += f', "lim": {_str(self.limit)}'
        return text + "}"

    def _own(self) -> dict[str, Any]:
        """What the delivery says besides its envelope."""
        return {
            "v": DELIVERY_VERSION,
            "owner": self.owner,
            "loc": list(self.loc),
            "attempt": self.attempt,
            "lease": self.lease_s,
            "key_ttl": self.key_ttl_s,
            "gen": self.gen,
            **({"lost": self.lost} if self.lost else {}),
            **({"later": self.later, "later_since": self.later_since} if self.later else {}),
            **({"report_start": 1} if self.report_start else {}),
            **({"lim": self.limit} if self.limit else {}),
        }

    @property
    def job_attempt(self) -> int:
        """The job's attempt: runs that said ``RetryLater`` do not count (``current_job().attempt``)."""
        return max(1, self.attempt - self.later)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Delivery:
        """The delivery :meth:`to_json` made (fields an older forwarder omits take their defaults).

        Raises:
            KeyError, TypeError, ValueError: ``raw`` is not a delivery.
        """
        return cls(
            Envelope.from_dict(raw["job"]),
            str(raw["owner"]),
            cast("Loc", tuple(raw["loc"])),
            int(raw.get("attempt", 1)),
            lease_s=float(raw.get("lease", DEFAULT_LEASE_S)),
            key_ttl_s=float(raw.get("key_ttl", DEFAULT_KEY_TTL_S)),
            gen=int(raw.get("gen", 0)),
            lost=int(raw.get("lost", 0)),
            later=int(raw.get("later", 0)),
            later_since=opt_finite("later_since", raw.get("later_since")),
            report_start=bool(raw.get("report_start", False)),
            limit=_limit(raw.get("lim")),
        )


def _limit(value: Any) -> str | None:
    """A delivery's ``lim``: a limit's wire text (the claim script parses it); else unlimited.

    Anything but short text (a Redis writer's) is no limit: the run is never failed for it.
    """
    if isinstance(value, str) and 0 < len(value) <= 260:  # 200 chars of key + the numbers
        return value
    return None
