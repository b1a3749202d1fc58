"""Named test tiers left out of the default run: each runs when the ``-m`` expression names it.

Used by the ``pytest_collection_modifyitems`` hooks of tests/integration/conftest.py and
tests/crash/conftest.py (the README lists the tiers and their commands).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest


def deselect_tiers(config: pytest.Config, items: list[pytest.Item], tiers: Sequence[str]) -> None:
    """Deselect the tests marked with one of ``tiers`` unless the ``-m`` expression names it."""
    asked = config.option.markexpr or ""
    left = [t for t in tiers if t not in asked]
    out = [i for i in items if any(i.get_closest_marker(t) is not None for t in left)]
    if out:
        config.hook.pytest_deselected(items=out)
        items[:] = [i for i in items if i not in out]
