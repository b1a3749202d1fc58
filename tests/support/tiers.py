"""Named test tiers left out of the default run: each runs when the ``-m`` expression names it.

:func:`deselect_tiers` is used by the ``pytest_collection_modifyitems`` hooks of
tests/integration/conftest.py and tests/crash/conftest.py; :func:`skip_unless_asked` by the
tests whose full form is the ``slow`` tier, skipped (not deselected) so that the default run
says how to run it (the README lists the tiers and their commands).
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


def tier_asked(config: pytest.Config, tier: str) -> bool:
    """Whether the run's ``-m`` expression asks for ``tier`` (``not TIER`` does not)."""
    expr = config.option.markexpr or ""
    return tier in expr and f"not {tier}" not in expr


def skip_unless_asked(request: pytest.FixtureRequest, command: str, tier: str = "slow") -> None:
    """Skip the running test if it is marked ``tier`` and the run does not ask for the tier.

    ``command`` (the line that runs it) ends the skip's reason.
    """
    if request.node.get_closest_marker(tier) is not None and not tier_asked(request.config, tier):
        pytest.skip(f"the {tier} tier: {command}")
