"""The overview's "Every forwarder" section: what each forwarder sharing ``--redis`` last published.

The rows come from Redis (``hybridq status --all``'s view, :mod:`hybridq.ops.fleet`): anyone who
can write to Redis can write them (docs/security.md), so they are only ever shown, never acted
on, through a template that escapes every cell (``sections/fleet.html``).
"""

from __future__ import annotations

from typing import Any

from hybridq.ops.fleet import fleet_or_error

__all__ = ["fleet_section"]


def fleet_section(redis_url: str) -> dict[str, Any]:
    """The section's values: one row per forwarder, stale ones flagged; Redis down says so."""
    out = fleet_or_error(redis_url)
    if "error" in out:
        return {"template": "sections/fleet.html", "error": f"Redis {out['redis']['url']}: {out['error']}"}
    return {
        "template": "sections/fleet.html",
        "counts": (out["fresh"], out["stale"], out["invalid"]),
        "url": out["redis"]["url"],
        "rows": [_row(f) for f in out["forwarders"]],
    }


def _row(f: dict[str, Any]) -> dict[str, Any]:
    state = "INVALID" if "invalid" in f else "STALE" if f["stale"] else "ok"
    row: dict[str, Any] = {"state": state, "owner": f["owner"], "seen": f["last_seen_age_s"]}
    if state != "ok":
        row["why"] = f.get("invalid", "not seen for its TTL")
        return row
    row["cells"] = [f["host"], f["journal"], f["accepted"], f["pending"], f["not_yet_forwarded"]]
    row["ages"] = [f["oldest_pending_age_s"], f["forwarding_lag_s"]]
    return row
