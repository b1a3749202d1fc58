"""Periodic jobs: ``hybridq.schedule(cron=..., func=..., key=...)`` declares one (docs/schedules.md).

Schedules are declared in a Python module that ``hybridq forward --schedules MODULE`` imports:
each ``hybridq.schedule(...)`` call there registers one. The forwarder then journals each tick
as a job whose idempotency key is ``schedule:<key>:<fire time, UTC ISO>``
(:mod:`hybridq.scheduler`), so a tick is one job however often it is appended.

Everything is checked when ``schedule`` is called (a bad expression, key, time zone or policy is
a one-line :class:`ScheduleError`); the forwarder checks the job options once more, as
``Queue.prepare`` would, before it starts.

This module must not import redis or rq.
"""

from __future__ import annotations

import datetime as dt
import importlib
import re
import zoneinfo
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridq.cron import Cron
from hybridq.envelope.limits import check_seconds
from hybridq.envelope.model import Envelope, Retry, function_path, validate_queue_name
from hybridq.envelope.tagged import tag_call
from hybridq.errors import HybridqError, ScheduleError

__all__ = [
    "CATCHUP_POLICIES",
    "Schedule",
    "ScheduleError",
    "load_schedules",
    "parse_tick_key",
    "registered",
    "schedule",
    "tick_key",
]

Catchup = Literal["all", "latest", "none"]
CATCHUP_POLICIES: tuple[str, ...] = ("all", "latest", "none")
_KEY = re.compile(r"\A[A-Za-z0-9_.-]{1,100}\Z")
_OPTIONS = frozenset({"job_timeout", "result_ttl", "description", "meta", "retry"})
#: Meta keys hybridq sets on every tick's job.
META_KEYS = ("schedule", "fire_time")


def fire_time_iso(fire: float) -> str:
    """A tick's fire time as it appears in its key: UTC, ISO 8601, to the second."""
    return dt.datetime.fromtimestamp(fire, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def tick_key(key: str, fire: float) -> str:
    """The idempotency key of schedule ``key``'s tick at Unix time ``fire``."""
    return f"schedule:{key}:{fire_time_iso(fire)}"


def parse_tick_key(idempotency_key: str) -> tuple[str, dt.datetime] | None:
    """The schedule key and fire time (UTC) of a tick's idempotency key; ``None`` if it is not one.

    In a task: ``parse_tick_key(hybridq.current_job().idempotency_key)``.
    """
    prefix, _, rest = idempotency_key.partition(":")
    key, _, when = rest.partition(":")
    if prefix != "schedule" or not _KEY.match(key):
        return None
    try:
        fired = dt.datetime.strptime(when, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    except ValueError:
        return None
    return key, fired


@dataclass(frozen=True)
class Schedule:
    """One periodic job, as :func:`schedule` declared it (see its arguments)."""

    key: str
    cron: Cron
    func: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    queue: str = "default"
    catchup: Catchup = "latest"
    max_catchup: int = 100
    grace_s: float = 60.0
    tz: str = "UTC"
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def zone(self) -> dt.tzinfo:
        """The time zone its expression is read in."""
        return dt.UTC if self.tz == "UTC" else zoneinfo.ZoneInfo(self.tz)

    def next_fire(self, after: float) -> float:
        """Its first tick strictly after the Unix time ``after``."""
        return self.cron.next_instant(after, self.zone)

    def due(self, through: float, now: float) -> tuple[list[float], bool]:
        """The ticks in ``(through, now]`` to fire under its catch-up policy; whether it skips any.

        ``all``: every one, the latest ``max_catchup`` if there are more. ``latest``: the latest
        one. ``none``: the latest one if it is at most ``grace_s`` late (a forwarder that was up
        fires each within tens of milliseconds; one that was down skips what it missed).
        """
        if now <= through:
            return [], False
        limit = self.max_catchup if self.catchup == "all" else 1
        # One more than it fires: whether older ones were due too (a count would cost a scan).
        ticks = self.cron.last_ticks(through, now, limit + 1, self.zone)
        fire = ticks[-limit:]
        if self.catchup == "none":
            fire = [t for t in fire if t >= now - self.grace_s]
        return fire, len(fire) < len(ticks)

    def same_as(self, other: Schedule) -> bool:
        """Whether ``other`` declares the same thing (a module imported twice registers it again)."""
        return self == other


_registry: dict[str, Schedule] = {}


def schedule(
    *,
    cron: str,
    func: Callable[..., Any] | str,
    key: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    queue: str = "default",
    catchup: Catchup = "latest",
    max_catchup: int = 100,
    grace_s: float = 60.0,
    tz: str = "UTC",
    **options: Any,
) -> Schedule:
    """Declare a periodic job, kept by the forwarder that loads this module (``--schedules``).

    Args:
        cron: five fields, ``minute hour day-of-month month day-of-week`` (``"*/5 * * * *"``).
        func: the task (a function or its dotted path), called as ``func(*args, **kwargs)``.
        key: names the schedule for good: its ticks' idempotency keys and the forwarder's record
            of the last tick are under it (``[A-Za-z0-9_.-]``, at most 100). Renaming it starts a
            new schedule.
        args: positional arguments (JSON values, or the types of docs/api.md, "Argument and result types").
        kwargs: keyword arguments (the same).
        queue: the queue its jobs go to.
        catchup: what a forwarder that was down does with the ticks it missed: ``"all"`` (each,
            up to ``max_catchup``, the latest kept), ``"latest"`` (the latest one only) or
            ``"none"`` (none older than ``grace_s``).
        max_catchup: the most missed ticks ``"all"`` fires at once.
        grace_s: how late a tick may be and still fire under ``"none"``.
        tz: the time zone the expression is read in (an IANA name; default UTC).
        **options: job options, as ``Queue.enqueue`` takes them: ``job_timeout``,
            ``result_ttl``, ``description``, ``meta``, ``retry``.

    Returns:
        The schedule (registered; :func:`registered` lists them).

    Raises:
        ScheduleError: a bad expression, key, time zone, policy or option (one line), or the
            key already registered for a different schedule.
    """
    try:
        declared = _build(cron, func, key, args, kwargs, queue, catchup, max_catchup, grace_s, tz, options)
    except (HybridqError, TypeError, ValueError) as exc:
        if type(exc) is ScheduleError:  # says which already (a CronError does not)
            raise
        raise ScheduleError(f"schedule {key!r}: {exc}") from None
    known = _registry.get(declared.key)
    if known is not None and not known.same_as(declared):
        raise ScheduleError(f"schedule key {key!r} is registered already, for a different schedule")
    _registry[declared.key] = declared
    return declared


def _build(
    cron: str,
    func: Callable[..., Any] | str,
    key: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    queue: str,
    catchup: str,
    max_catchup: int,
    grace_s: float,
    tz: str,
    options: Mapping[str, Any],
) -> Schedule:
    if not isinstance(key, str) or not _KEY.match(key):
        raise ScheduleError(f"bad schedule key {key!r}: use 1-100 of [A-Za-z0-9_.-]")
    parsed = Cron.parse(cron)
    if catchup not in CATCHUP_POLICIES:
        raise ValueError(f"catchup must be one of {', '.join(CATCHUP_POLICIES)}, not {catchup!r}")
    if isinstance(max_catchup, bool) or not isinstance(max_catchup, int) or not 1 <= max_catchup <= 10_000:
        raise ValueError("max_catchup must be a whole number from 1 to 10000")
    grace = check_seconds("grace_s", grace_s)
    try:
        zone_name = "UTC" if tz in {"UTC", "utc", "Etc/UTC"} else zoneinfo.ZoneInfo(tz).key
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError):
        raise ValueError(f"unknown time zone {tz!r} (an IANA name such as 'Europe/Paris')") from None
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}: use {', '.join(sorted(_OPTIONS))}")
    meta = options.get("meta")
    if meta is not None and (not isinstance(meta, Mapping) or set(META_KEYS) & set(meta)):
        raise ValueError(f"meta must be a mapping without the keys {', '.join(META_KEYS)} (hybridq's)")
    retry = options.get("retry")
    if retry is not None and not isinstance(retry, Retry):
        raise ValueError("retry must be a hybridq.Retry")
    for name in ("job_timeout", "result_ttl"):
        if options.get(name) is not None:
            check_seconds(name, options[name])
    if not isinstance(options.get("description", ""), str):
        raise TypeError("description must be a string")
    declared = Schedule(
        key=key,
        cron=parsed,
        func=function_path(func),
        args=tuple(args),
        kwargs=dict(kwargs or {}),
        queue=validate_queue_name(queue),
        catchup=catchup,  # type: ignore[arg-type]  # checked above
        max_catchup=max_catchup,
        grace_s=grace,
        tz=zone_name,
        options=dict(options),
    )
    # The arguments must survive the journal's JSON as any enqueue's do (NotSerializable now).
    args_json, kwargs_json, _ = tag_call(declared.func, declared.args, dict(declared.kwargs))
    Envelope(
        id="check",
        func=declared.func,
        queue=declared.queue,
        idempotency_key=tick_key(key, 0),
        created_at=0.0,
        args=args_json,
        kwargs=kwargs_json,
    ).to_bytes()
    return declared


def registered() -> list[Schedule]:
    """The schedules registered in this process so far, in registration order."""
    return list(_registry.values())


def load_schedules(modules: Iterable[str]) -> list[Schedule]:
    """Import ``modules``; return every schedule registered in this process (``--schedules``).

    Raises:
        ScheduleError: a module that cannot be imported, a bad schedule in one (the first
            problem, one line), or no schedule registered at all.
    """
    names = list(modules)
    for name in names:
        try:
            importlib.import_module(name)
        except ScheduleError:
            raise
        except ImportError as exc:
            raise ScheduleError(f"cannot import schedules module {name!r}: {exc}") from None
        except Exception as exc:
            raise ScheduleError(f"schedules module {name!r} failed: {type(exc).__name__}: {exc}") from None
    if not _registry:
        raise ScheduleError(f"{', '.join(names)} registered no schedule (call hybridq.schedule(...) there)")
    return registered()
