"""Five-field cron expressions (``minute hour day-of-month month day-of-week``), and their ticks.

A small parser of our own rather than a dependency: the syntax is tiny, the popular library
(``croniter``) has been in maintenance trouble, and how ticks map to instants across DST changes
is a decision hybridq's schedules document themselves (docs/schedules.md, "Time zones").

Syntax (Vixie cron's): each field is ``*``, a number, a range ``a-b``, any of them with a step
(``*/5``, ``1-30/2``, ``5/15`` meaning ``5-max/15``), or a comma-separated list of those.
Months accept ``jan``-``dec``, days of the week ``sun``-``sat`` (case-insensitive); day of the
week 0 and 7 are both Sunday. When both day fields are restricted, a day matches if **either**
does (cron's rule). Macros: ``@yearly`` (``@annually``), ``@monthly``, ``@weekly``, ``@daily``
(``@midnight``), ``@hourly``.

This module imports nothing of hybridq but its errors (:class:`~hybridq.errors.CronError`, a
``ScheduleError``, is re-exported here).
"""

from __future__ import annotations

import bisect
import calendar
import datetime as dt
from dataclasses import dataclass

from hybridq.errors import CronError

__all__ = ["Cron", "CronError"]

_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
#: (name, lowest, highest, names) per field.
_FIELDS = (
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day of month", 1, 31, ()),
    ("month", 1, 12, _MONTHS),
    ("day of week", 0, 7, _DAYS),
)
#: How far ahead a next tick is looked for (Feb 29 comes at least every 8 years).
_HORIZON_YEARS = 9
_MINUTE = dt.timedelta(minutes=1)


def _number(text: str, field: str, names: tuple[str, ...], expr: str) -> int:
    low = text.lower()
    if low in names:
        return names.index(low) + (1 if field == "month" else 0)
    if not text.isdigit():
        raise CronError(f"bad cron expression {expr!r}: {field} field has {text!r}, not a number")
    return int(text)


def _field(text: str, index: int, expr: str) -> tuple[list[int], bool]:
    """The sorted values a field allows, and whether it was ``*`` (unrestricted)."""
    name, lo, hi, names = _FIELDS[index]
    values: set[int] = set()
    for part in text.split(","):
        base, slash, step_text = part.partition("/")
        step = 1
        if slash:
            step = _number(step_text, name, (), expr)
            if step < 1:
                raise CronError(f"bad cron expression {expr!r}: {name} step must be at least 1")
        if base == "*":
            start, end = lo, hi
        elif "-" in base:
            a, _, b = base.partition("-")
            start, end = _number(a, name, names, expr), _number(b, name, names, expr)
        elif base:
            start = _number(base, name, names, expr)
            end = hi if slash else start  # `5/15`: from 5 to the end, every 15
        else:
            raise CronError(f"bad cron expression {expr!r}: empty item in the {name} field")
        for value in (start, end):
            if not lo <= value <= hi:
                raise CronError(f"bad cron expression {expr!r}: {name} {value} is outside {lo}-{hi}")
        if start > end:
            raise CronError(f"bad cron expression {expr!r}: {name} range {base!r} runs backwards")
        values.update(range(start, end + 1, step))
    if index == 4 and 7 in values:  # 7 is Sunday too
        values.discard(7)
        values.add(0)
    return sorted(values), text == "*"


@dataclass(frozen=True, slots=True)
class Cron:
    """A parsed five-field cron expression: :meth:`parse` it, then ask :meth:`next_after`."""

    expression: str
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days: tuple[int, ...]
    months: tuple[int, ...]
    weekdays: tuple[int, ...]  # 0 = Sunday
    any_day: bool  # day of month is `*`
    any_weekday: bool  # day of week is `*`

    @classmethod
    def parse(cls, expression: str) -> Cron:
        """Parse ``expression``; :class:`CronError` (one line) if it is not valid or never fires."""
        if not isinstance(expression, str):
            raise CronError(f"a cron expression is a string, not {type(expression).__name__}")
        text = " ".join(expression.split())
        text = _MACROS.get(text.lower(), text)
        if text.startswith("@"):
            raise CronError(f"bad cron expression {expression!r}: unknown macro (try @hourly, @daily)")
        parts = text.split(" ")
        if len(parts) != 5:
            raise CronError(
                f"bad cron expression {expression!r}: {len(parts)} fields, expected 5 "
                "(minute hour day-of-month month day-of-week)"
            )
        fields = [_field(part, i, expression) for i, part in enumerate(parts)]
        (minutes, _), (hours, _), (days, any_day), (months, _), (weekdays, any_weekday) = fields
        cron = cls(
            expression,
            tuple(minutes),
            tuple(hours),
            tuple(days),
            tuple(months),
            tuple(weekdays),
            any_day=any_day,
            any_weekday=any_weekday,
        )
        if cron.any_weekday and not any(
            day <= (29 if month == 2 else calendar.monthrange(2001, month)[1])
            for month in cron.months
            for day in cron.days
        ):
            raise CronError(f"bad cron expression {expression!r}: that day never occurs in those months")
        return cron

    def day_matches(self, day: dt.date) -> bool:
        """Whether cron's day rule lets ``day`` fire (either restricted day field, if both are)."""
        dom = day.day in self.days
        dow = (day.weekday() + 1) % 7 in self.weekdays  # Python's Monday is 0; cron's Sunday is
        if self.any_day or self.any_weekday:
            return dom and dow  # the unrestricted one matches every day
        return dom or dow

    def matches(self, when: dt.datetime) -> bool:
        """Whether the wall-clock minute ``when`` is a tick (seconds are ignored)."""
        return (
            when.minute in self.minutes
            and when.hour in self.hours
            and when.month in self.months
            and self.day_matches(when.date())
        )

    def next_after(self, when: dt.datetime) -> dt.datetime:
        """The first matching wall-clock minute strictly after ``when`` (naive; a time zone's is kept).

        Raises :class:`CronError` if none comes within nine years (cannot happen for an
        expression :meth:`parse` accepted).
        """
        t = when.replace(second=0, microsecond=0) + _MINUTE
        limit = t.year + _HORIZON_YEARS
        while t.year <= limit:
            if t.month not in self.months:
                i = bisect.bisect_left(self.months, t.month)
                if i < len(self.months):
                    t = t.replace(month=self.months[i], day=1, hour=0, minute=0)
                else:
                    t = t.replace(year=t.year + 1, month=self.months[0], day=1, hour=0, minute=0)
                continue
            if not self.day_matches(t.date()):
                t = (t + dt.timedelta(days=1)).replace(hour=0, minute=0)
                continue
            if t.hour not in self.hours:
                i = bisect.bisect_left(self.hours, t.hour)
                if i == len(self.hours):
                    t = (t + dt.timedelta(days=1)).replace(hour=0, minute=0)
                else:
                    t = t.replace(hour=self.hours[i], minute=0)
                continue
            if t.minute not in self.minutes:
                i = bisect.bisect_left(self.minutes, t.minute)
                if i == len(self.minutes):
                    t = (t + dt.timedelta(hours=1)).replace(minute=0)
                else:
                    t = t.replace(minute=self.minutes[i])
                continue
            return t
        raise CronError(f"cron expression {self.expression!r} does not fire within {_HORIZON_YEARS} years")

    def next_instant(self, after: float, tz: dt.tzinfo = dt.UTC) -> float:
        """The first tick strictly after the Unix time ``after``, read on ``tz``'s wall clock.

        Across DST changes: a wall-clock time that occurs twice (clocks go back) fires once, at
        its first occurrence; one that does not exist (clocks go forward) fires at the first
        instant after the gap, and ticks that land on that same instant are one tick.
        """
        wall = dt.datetime.fromtimestamp(after, tz).replace(tzinfo=None)
        while True:
            wall = self.next_after(wall)
            instant = _instant(wall, tz)
            if instant > after:
                return instant

    def last_ticks(self, after: float, until: float, count: int, tz: dt.tzinfo = dt.UTC) -> list[float]:
        """Up to ``count`` latest ticks in ``(after, until]``, oldest first.

        Looks back over a window that doubles (from an hour) until it holds ``count`` ticks or
        reaches ``after``: a schedule down for a year costs a few scans, not a year of ticks.
        """
        if count <= 0 or until <= after:
            return []
        span = 3600.0
        while True:
            start = max(after, until - span)
            found: list[float] = []
            t = start
            while (t := self.next_instant(t, tz)) <= until:
                found.append(t)
                if len(found) > count:
                    del found[0]
            if len(found) >= count or start <= after:
                return found
            span *= 2


def _instant(wall: dt.datetime, tz: dt.tzinfo) -> float:
    """The Unix time of the naive wall-clock ``wall`` in ``tz`` (see :meth:`Cron.next_instant`)."""
    first = wall.replace(tzinfo=tz, fold=0).timestamp()
    if dt.datetime.fromtimestamp(first, tz).replace(tzinfo=None) == wall:
        return first  # it exists; fold=0 is its first occurrence when the clocks went back
    # In a gap: fold=0 reads it with the offset before the change (an instant after the gap),
    # fold=1 with the one after (an instant before it). The gap's end lies between: the first
    # second whose wall-clock time is not before ``wall``.
    lo, hi = int(wall.replace(tzinfo=tz, fold=1).timestamp()), int(first)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if dt.datetime.fromtimestamp(mid, tz).replace(tzinfo=None) >= wall:
            hi = mid
        else:
            lo = mid
    return float(hi)
