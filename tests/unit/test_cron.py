"""The five-field cron parser and its ticks (hybridq.cron), time zones and DST included."""

from __future__ import annotations

import datetime as dt
import zoneinfo

import pytest
from hybridq.cron import Cron, CronError

UTC = dt.UTC
PARIS = zoneinfo.ZoneInfo("Europe/Paris")
NEW_YORK = zoneinfo.ZoneInfo("America/New_York")


def ts(*args: int, tz: dt.tzinfo = UTC) -> float:
    return dt.datetime(*args, tzinfo=tz).timestamp()


def wall(*args: int) -> dt.datetime:
    """A naive wall-clock time (what the cron fields match)."""
    return dt.datetime(*args)  # noqa: DTZ001


def walk(expr: str, start: dt.datetime, count: int) -> list[dt.datetime]:
    cron, out, t = Cron.parse(expr), [], start
    for _ in range(count):
        t = cron.next_after(t)
        out.append(t)
    return out


def test_steps_ranges_lists_and_names() -> None:
    start = wall(2026, 1, 1, 0, 0)  # a Thursday
    assert [t.minute for t in walk("*/15 * * * *", start, 4)] == [15, 30, 45, 0]
    assert [t.minute for t in walk("5/20 * * * *", start, 3)] == [5, 25, 45]
    assert [(t.hour, t.minute) for t in walk("0,30 9-10 * * *", start, 5)] == [
        (9, 0),
        (9, 30),
        (10, 0),
        (10, 30),
        (9, 0),
    ]
    assert [t.day for t in walk("0 0 * * MON-FRI", start, 5)] == [2, 5, 6, 7, 8]  # Fri, Mon..Thu
    assert [t.month for t in walk("0 0 1 jan,Jul *", start, 3)] == [7, 1, 7]
    assert walk("0 0 * * 7", start, 1) == walk("0 0 * * sun", start, 1) == [wall(2026, 1, 4)]
    assert walk("@hourly", start, 1) == [wall(2026, 1, 1, 1)]
    assert walk("@weekly", start, 1) == [wall(2026, 1, 4)]


def test_both_day_fields_restricted_match_either_like_cron() -> None:
    # The 13th, or any Friday: Jan 2 (Fri), 9 (Fri), 13, 16 (Fri).
    assert [t.day for t in walk("0 0 13 * 5", wall(2026, 1, 1), 4)] == [2, 9, 13, 16]


def test_next_after_is_strictly_after_and_finds_leap_days() -> None:
    cron = Cron.parse("0 12 29 2 *")
    assert cron.next_after(wall(2026, 3, 1)) == wall(2028, 2, 29, 12)
    every = Cron.parse("* * * * *")
    assert every.next_after(wall(2026, 1, 1, 0, 0)) == wall(2026, 1, 1, 0, 1)
    assert every.next_after(wall(2026, 1, 1, 0, 0, 59)) == wall(2026, 1, 1, 0, 1)
    assert every.next_after(wall(2026, 12, 31, 23, 59)) == wall(2027, 1, 1)


@pytest.mark.parametrize(
    ("expr", "says"),
    [
        ("* * * *", "4 fields, expected 5"),
        ("60 * * * *", "minute 60 is outside 0-59"),
        ("* 24 * * *", "hour 24 is outside 0-23"),
        ("* * 0 * *", "day of month 0 is outside 1-31"),
        ("* * * 13 *", "month 13 is outside 1-12"),
        ("* * * * 8", "day of week 8 is outside 0-7"),
        ("*/0 * * * *", "step must be at least 1"),
        ("5-1 * * * *", "runs backwards"),
        ("a * * * *", "'a', not a number"),
        ("1,,2 * * * *", "empty item"),
        ("0 0 30 2 *", "never occurs"),
        ("0 0 31 4,6 *", "never occurs"),
        ("@reboot", "unknown macro"),
        ("* * * * * *", "6 fields"),
    ],
)
def test_a_bad_expression_is_one_line(expr: str, says: str) -> None:
    with pytest.raises(CronError) as info:
        Cron.parse(expr)
    assert says in str(info.value)
    assert "\n" not in str(info.value)


def test_next_instant_in_utc() -> None:
    cron = Cron.parse("*/5 * * * *")
    assert cron.next_instant(ts(2026, 1, 1, 10, 3)) == ts(2026, 1, 1, 10, 5)
    assert cron.next_instant(ts(2026, 1, 1, 10, 5)) == ts(2026, 1, 1, 10, 10)  # strictly after
    assert cron.next_instant(ts(2026, 1, 1, 10, 4) + 59.9) == ts(2026, 1, 1, 10, 5)


def test_spring_forward_gap_fires_once_at_the_gap_end() -> None:
    # Paris, 2026-03-29: 02:00 CET becomes 03:00 CEST (01:00 UTC).
    daily = Cron.parse("30 2 * * *")
    fired = [daily.next_instant(ts(2026, 3, 28, 12, 0), PARIS)]
    for _ in range(2):
        fired.append(daily.next_instant(fired[-1], PARIS))
    assert fired == [ts(2026, 3, 29, 1, 0), ts(2026, 3, 30, 0, 30), ts(2026, 3, 31, 0, 30)]
    every5 = Cron.parse("*/5 * * * *")
    t, seen = ts(2026, 3, 29, 0, 50), []
    while t < ts(2026, 3, 29, 1, 10):
        t = every5.next_instant(t, PARIS)
        seen.append(dt.datetime.fromtimestamp(t, PARIS).strftime("%H:%M%z"))
    # 02:00-02:55 do not exist: they and 03:00 are one tick; instants strictly increase.
    assert seen == ["01:55+0100", "03:00+0200", "03:05+0200", "03:10+0200"]


def test_fall_back_repeated_hour_fires_once() -> None:
    # New York, 2026-11-01: 02:00 EDT becomes 01:00 EST; 01:30 happens twice.
    daily = Cron.parse("30 1 * * *")
    first = daily.next_instant(ts(2026, 11, 1, 0, 0), NEW_YORK)
    assert first == ts(2026, 11, 1, 5, 30)  # 01:30 EDT, the first occurrence
    assert daily.next_instant(first, NEW_YORK) == ts(2026, 11, 2, 6, 30)  # not 01:30 EST again
    hourly = Cron.parse("0 * * * *")
    t, seen = ts(2026, 11, 1, 4, 30), []
    for _ in range(4):
        t = hourly.next_instant(t, NEW_YORK)
        seen.append(t)
    # 01:00 EDT, then 02:00 EST (01:00 EST is the repeated wall time): no double, no gap of 2 h.
    assert seen == [
        ts(2026, 11, 1, 5, 0),
        ts(2026, 11, 1, 7, 0),
        ts(2026, 11, 1, 8, 0),
        ts(2026, 11, 1, 9, 0),
    ]


def test_last_ticks_is_bounded_and_exact() -> None:
    cron = Cron.parse("*/5 * * * *")
    assert cron.last_ticks(ts(2026, 1, 1, 10, 0), ts(2026, 1, 1, 11, 0), 100) == [
        ts(2026, 1, 1, 10, m) for m in range(5, 60, 5)
    ] + [ts(2026, 1, 1, 11, 0)]
    assert cron.last_ticks(ts(2026, 1, 1, 10, 0), ts(2026, 1, 1, 11, 0), 2) == [
        ts(2026, 1, 1, 10, 55),
        ts(2026, 1, 1, 11, 0),
    ]
    # A year down, every minute: the latest three, without walking the year.
    assert Cron.parse("* * * * *").last_ticks(ts(2025, 1, 1), ts(2026, 1, 1, 0, 0, 30), 3) == [
        ts(2025, 12, 31, 23, 58),
        ts(2025, 12, 31, 23, 59),
        ts(2026, 1, 1),
    ]
    assert Cron.parse("0 0 1 1 *").last_ticks(ts(2020, 6, 1), ts(2026, 6, 1), 1) == [ts(2026, 1, 1)]
    assert cron.last_ticks(ts(2026, 1, 1, 10, 0), ts(2026, 1, 1, 10, 4), 5) == []
