"""The overview's "Every forwarder" table: what each forwarder sharing ``--redis`` last published.

The rows come from Redis (``hybridq status --all``'s view, :mod:`hybridq.ops.fleet`): anyone who
can write to Redis can write them (docs/security.md), so every cell is escaped, and a row is
only ever shown, never acted on.
"""

from __future__ import annotations

from typing import Any

from hybridq.http.dashboard.render import age, esc, table
from hybridq.ops.fleet import fleet_or_error

__all__ = ["fleet_section"]


def fleet_section(redis_url: str) -> str:
    """The section's HTML: one row per forwarder, stale ones flagged; Redis down says so."""
    out = fleet_or_error(redis_url)
    if "error" in out:
        why = f"Redis {out['redis']['url']}: {out['error']}"
        return f'<h2>Every forwarder</h2><p class="error">{esc(why)}</p>'
    rows = [_row(f) for f in out["forwarders"]]
    headers = ["state", "forwarder", "host", "journal", "accepted", "pending", "not yet forwarded"]
    headers += ["oldest pending", "forwarding lag", "last seen"]
    return (
        f"<h2>Every forwarder</h2><p>{esc(out['fresh'])} seen, {esc(out['stale'])} stale, "
        f"{esc(out['invalid'])} invalid (published to {esc(out['redis']['url'])}; display only)</p>"
        + table(headers, rows, cls="fleet")
    )


def _row(f: dict[str, Any]) -> list[str]:
    state = "INVALID" if "invalid" in f else "STALE" if f["stale"] else "ok"
    cells = [f'<span class="state-{esc(state.lower())}">{esc(state)}</span>', esc(f["owner"])]
    if state != "ok":
        why = f.get("invalid", "not seen for its TTL")
        return [*cells, esc(why), "", "", "", "", "", "", esc(age(f["last_seen_age_s"]) + " ago")]
    return [
        *cells,
        esc(f["host"]),
        esc(f["journal"]),
        esc(f["accepted"]),
        esc(f["pending"]),
        esc(f["not_yet_forwarded"]),
        esc(age(f["oldest_pending_age_s"])),
        esc(age(f["forwarding_lag_s"])),
        esc(age(f["last_seen_age_s"]) + " ago"),
    ]
