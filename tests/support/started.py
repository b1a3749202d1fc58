"""A forwarder's state as a start leaves it, its reader placed where a test needs it.

The tests of harvest, compaction, the punches and the failures list build one over a journal
they wrote, without a forwarder loop or a transport: loaded, its pending jobs counted (the stats
tracker counts what was read before this start), and its checkpoint past the segments named.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from hybridq.journal.records import ChainPosition


def started_state(journal: Path | str, through: Mapping[str, int]) -> ForwarderState:
    """The state of ``journal``, its reader at segment ``through[writer]`` of each chain named."""
    state = ForwarderState(str(journal), ForwarderConfig())
    state.load()
    for writer, segment in through.items():
        state.checkpoint.positions[writer] = ChainPosition(segment, 64, 1)
    while not state.pending_ready:
        state.count_pending(10.0)
    return state


def open_state(journal: Path | str, writer: str, read_through: int = 2) -> ForwarderState:
    """The state of ``journal``, its one chain ``writer`` read through segment ``read_through`` - 1."""
    return started_state(journal, {writer: read_through})
