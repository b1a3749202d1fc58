"""The failed-jobs filter of the dashboard: by task, error text and time range (what bulk actions act on).

Parsed from a query string or a form, where anything may be typed or forged: a value that is not
one is refused with a one-line reason (the page answers 400 and nothing is done), text is capped
at :data:`MAX_TEXT` characters, and times are UTC. A filter only selects; how many jobs one
action may touch is capped by the caller (:data:`hybridq.http.dashboard.failed.BULK_MAX`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hybridq.errors import BadRequest

__all__ = ["MAX_TEXT", "Filter", "selection"]

#: The longest task or error text a filter takes (characters).
MAX_TEXT = 200
#: The longest time a filter takes (``2026-12-05T19:46:29.123456``, or with an offset).
_MAX_TIME = 32


@dataclass(frozen=True, slots=True)
class Filter:
    """Which failed jobs: a part of the task's path, a part of the error, failed in ``[since, until)``."""

    task: str = ""
    error: str = ""
    since: float | None = None
    until: float | None = None

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> Filter:
        """The filter ``params`` give (``task``, ``error``, ``since``, ``until``; missing: any).

        Raises:
            BadRequest: a text too long, a time that is not one, or ``since`` after ``until``.
        """
        task, error = _text(params, "task"), _text(params, "error")
        since, until = _time(params, "since"), _time(params, "until")
        if since is not None and until is not None and since > until:
            raise BadRequest("since is after until: nothing could match")
        return cls(task, error, since, until)

    @property
    def active(self) -> bool:
        """Whether it narrows anything."""
        return bool(self.task or self.error) or self.since is not None or self.until is not None

    def matches(self, task: str | None, error: str | None, at: float) -> bool:
        """Whether a job of ``task`` that failed with ``error`` at ``at`` is selected."""
        return (
            (not self.task or self.task in (task or ""))
            and (not self.error or self.error.casefold() in (error or "").casefold())
            and (self.since is None or at >= self.since)
            and (self.until is None or at < self.until)
        )

    def params(self) -> dict[str, str]:
        """The filter as the form fields it came from (links, hidden fields, the confirmation)."""
        return {
            "task": self.task,
            "error": self.error,
            "since": _iso(self.since),
            "until": _iso(self.until),
        }


def selection(jobs: Iterable[tuple[object, ...]]) -> str:
    """A short digest of a selection: the confirmation carries it, the action checks it.

    Each job is its id and where its current run is recorded (a failed job: its record's location,
    which a requeue changes, as it writes a new record; a retrying one: its record and attempt).
    The action recomputes what its filter selects; a different digest means the list changed
    since the operator saw the count (a job failed, was requeued, or failed again meanwhile): it
    asks again. So a confirmation acts once: replayed (a reload, a second tab) after its jobs
    failed again under the same ids, it no longer matches.
    """
    lines = sorted("\t".join(map(str, job)) for job in jobs)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def _text(params: Mapping[str, str], name: str) -> str:
    value = params.get(name, "").strip()
    if len(value) > MAX_TEXT:
        raise BadRequest(f"{name} is longer than {MAX_TEXT} characters")
    return value


def _time(params: Mapping[str, str], name: str) -> float | None:
    """A time as the form's ``datetime-local`` gives it (or ISO 8601), UTC unless it says otherwise."""
    value = params.get(name, "").strip()
    if not value:
        return None
    if len(value) > _MAX_TIME:
        raise BadRequest(f"{name} is not a time (YYYY-MM-DDTHH:MM, UTC)")
    try:
        at = dt.datetime.fromisoformat(value)
    except ValueError:
        raise BadRequest(f"{name} is not a time (YYYY-MM-DDTHH:MM, UTC)") from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=dt.UTC)
    try:  # in UTC too, it must be a time the form can show (years 1 to 9999): an offset may move it out
        return at.astimezone(dt.UTC).timestamp()
    except (OverflowError, ValueError):
        raise BadRequest(f"{name} is out of range") from None


def _iso(at: float | None) -> str:
    """A time as the form's ``datetime-local`` shows it (UTC, to the second)."""
    if at is None:
        return ""
    moment = dt.datetime.fromtimestamp(at, dt.UTC).replace(tzinfo=None)
    return moment.isoformat(timespec="seconds" if moment.microsecond == 0 else "microseconds")
