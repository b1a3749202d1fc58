"""A transport stub with completion events waiting: all a forwarder's ``Harvester`` asks of it.

The harvest's tests hand it the events a worker would have written (the ledger's side is what
they check), so the stub only gives them out once and records which ones were acknowledged.
"""

from __future__ import annotations

from hybridq.transport.base import Event


class Events:
    """Completion events waiting, ids ``1-0``, ``2-0``...; :attr:`acked` the ids acknowledged."""

    def __init__(self, bodies: list[dict[str, object]]) -> None:
        self.events = [Event(f"{i + 1}-0", body) for i, body in enumerate(bodies)]
        self.acked: list[str] = []

    def harvest(self, _owner: str, _limit: int) -> list[Event]:
        out, self.events = self.events, []
        return out

    def ack(self, _owner: str, event_ids: list[str]) -> None:
        self.acked += event_ids
