"""The transport port: what the forwarder needs from a queue backend, and nothing more."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from hybridq.envelope import Envelope

__all__ = ["PushResult", "Transport"]


@dataclass(frozen=True, slots=True)
class PushResult:
    """What one :meth:`Transport.push` did."""

    #: Jobs now queued that were not known to the backend before.
    pushed: int
    #: Jobs the backend already knew (same job id): not queued a second time.
    already_present: int


class Transport(abc.ABC):
    """Delivers envelopes to workers.

    Contract (checked by the shared contract tests):

    * :meth:`push` is idempotent per job id: a job the backend still knows is never queued twice.
    * It either returns (every job in the batch is then known to the backend, so the caller may
      move its checkpoint past them) or raises :class:`~hybridq.errors.TransportError` (any subset
      may have been queued; the caller pushes the whole batch again).
    * Within one queue, jobs of one batch are queued in batch order.
    """

    @abc.abstractmethod
    def push(self, jobs: Sequence[Envelope]) -> PushResult:
        """Queue ``jobs`` for the workers; see the class docstring for the contract."""

    @abc.abstractmethod
    def ping(self) -> None:
        """Raise :class:`~hybridq.errors.TransportError` unless the backend answers."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release connections."""
