"""The dashboard under ``/`` (docs/http.md): queues, failed jobs with requeue, one job's trace."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.routing import BaseRoute

    from hybridq.http.config import ServeConfig

__all__ = ["routes"]


def routes(config: ServeConfig) -> list[BaseRoute]:
    """The dashboard's routes, mounted by the server's application (none yet)."""
    del config
    return []
