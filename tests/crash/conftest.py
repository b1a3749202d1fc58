"""The crash tests' tier left out of the default run (as tests/integration/conftest.py's)."""

from __future__ import annotations

import pytest

from tests.support.tiers import deselect_tiers

#: Tiers of this directory left out of the default run: each runs when ``-m`` names it.
TIERS = ("repair_sweep",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the ``repair_sweep`` tier's tests unless the ``-m`` expression names it."""
    deselect_tiers(config, items, TIERS)
