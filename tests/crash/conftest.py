"""The crash tests' tier left out of the default run (as tests/integration/conftest.py's)."""

from __future__ import annotations

import pytest

#: Tiers of this directory left out of the default run: each runs when ``-m`` names it.
TIERS = ("repair_sweep",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the ``repair_sweep`` tier's tests unless the ``-m`` expression names it."""
    asked = config.option.markexpr or ""
    left = [t for t in TIERS if t not in asked]
    out = [i for i in items if any(i.get_closest_marker(t) is not None for t in left)]
    if out:
        config.hook.pytest_deselected(items=out)
        items[:] = [i for i in items if i not in out]
