"""The multihost tier: producer and worker hosts in network namespaces (tests/support/netns.py).

Its tests are marked ``multihost`` and left out of the default run (they take minutes and need
root): run them with ``pytest -m multihost tests/multihost``. Each one gets a fresh
:class:`~tests.support.netns.Network` (removed at teardown, pass or fail) and a private
redis-server listening on the network's bridge, and skips with the reason where namespaces
cannot be made (not root, no ``ip``, refused).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import netns
from tests.support.multihost import Cluster
from tests.support.redis import MakeRedisServer

MARKER = "multihost"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect ``multihost`` tests unless the ``-m`` expression names the marker."""
    if MARKER in (config.option.markexpr or ""):
        return
    keep = [item for item in items if item.get_closest_marker(MARKER) is None]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker(MARKER) is not None])
        items[:] = keep


@pytest.fixture
def network() -> Iterator[netns.Network]:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)
    netns.sweep_stale()
    net = netns.Network()
    try:
        yield net
    finally:
        net.close()


@pytest.fixture
def cluster(
    tmp_path: Path, subprocess_env: dict[str, str], network: netns.Network, make_redis_server: MakeRedisServer
) -> Iterator[Cluster]:
    # Reachable from every host through the bridge; 127.0.0.1 too, for the test's own reads.
    server = make_redis_server(extra_args=("--bind", "127.0.0.1", network.gateway, "--protected-mode", "no"))
    yield Cluster(tmp_path, subprocess_env, network, server)
    network.close()  # the hosts' processes go before their Redis does
