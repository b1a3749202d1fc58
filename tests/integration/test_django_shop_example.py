"""The Django example (examples/django_shop): its one command, as its README gives it.

``run.py --demo 9`` starts a private redis-server, ``manage.py hybridq_forward``,
``hybridq_worker`` and ``runserver``, places nine orders over HTTP (every third rolls back: out
of stock) and waits for every receipt job's ``get_result`` to say SUCCESSFUL. It runs in the
Django 6 tier (``scripts/test-django6``, about 7 s); the default run tests the same backend on
the backport in ``test_django_tasks.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

django = pytest.importorskip("django")
pytestmark = pytest.mark.skipif(
    django.VERSION < (6,), reason="the Django 6 tier runs it: scripts/test-django6 (Python >= 3.12)"
)


def test_the_shop_places_orders_and_sends_receipts(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/django_shop/run.py"),
            "--demo",
            "9",
            "--port",
            "0",
            "--dir",
            str(tmp_path),
        ],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    log = (
        (tmp_path / "processes.log").read_text(errors="replace")
        if (tmp_path / "processes.log").exists()
        else ""
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{log[-3000:]}"
    tally = dict(item.split("=") for item in done.stdout.split())
    assert (tally["orders"], tally["placed"], tally["rolled_back"], tally["receipts_sent"]) == (
        "9",
        "6",
        "3",
        "6",
    )
