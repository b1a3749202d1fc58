"""Tasks of the dashboard's browser test (tests/integration/test_dashboard_browser.py)."""

from __future__ import annotations

import os
import time


def hold(switch: str, limit_s: float = 60.0) -> str:
    """Run until the file ``switch`` exists (at most ``limit_s``): a claim in flight to look at."""
    end = time.monotonic() + limit_s
    while not os.path.exists(switch) and time.monotonic() < end:
        time.sleep(0.05)
    return "released"
