"""A run its limit key refused at its claim comes back through the run table (hybridq.forwarder.refusals).

Against the memory transport: the refusal is the event the claim script adds (the run's started
event with the ``r`` field), put in the transport's stream by hand.
"""

from __future__ import annotations

import time
from pathlib import Path

from hybridq import Queue
from hybridq.protocol import StartedEvent
from hybridq.transport import MemoryTransport
from hybridq.transport.base import Event

from tests import tasks
from tests.unit.test_completions import make_forwarder


def refuse(transport: MemoryTransport, job_id: str, *, attempt: int = 1) -> None:
    """What the claim script adds when the job's limit key has no room."""
    d = transport.deliveries[job_id]
    body = StartedEvent(job_id, d.loc, attempt, 0, time.time()).to_json()
    transport.events.setdefault(d.owner, []).append(Event(f"{900 + attempt}-0", body, "limited: concurrency"))


def test_a_refused_job_goes_back_to_the_run_table_once_and_its_event_changes_no_outcome(
    journal_dir: Path,
) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 2, 3, limit_key="k")
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    harvester = forwarder.completions.harvester
    harvester.takes_back = lambda: True  # (the memory transport's gate is open: see below)
    loc = transport.deliveries[job.id].loc
    refuse(transport, job.id, attempt=0)  # an older run's: a later attempt is out
    transport.queues["default"].clear()  # the refusing worker took the copy, and RQ ended it
    transport.status[job.id] = "finished"
    refuse(transport, job.id)
    refuse(transport, job.id)  # the same refusal harvested twice: one row
    assert harvester.harvest() == 0, "not an outcome"
    assert harvester.refused_back == 1
    assert forwarder.state.runs.contains(loc)
    assert transport.events.get(forwarder.state.checkpoint.owner) == []
    assert (harvester.dropped_events, harvester.late_events) == (0, 0)
    assert job.status == "forwarded"
    forwarder.step()  # the refill pushes it again: the same attempt, and the row goes
    assert not forwarder.state.runs.contains(loc)
    assert transport.deliveries[job.id].attempt == 1
    assert transport.work() == 1
    forwarder.step()
    assert job.status == "finished"
    forwarder.close()


def test_without_a_key_gate_that_reads_a_refused_job_is_left_to_the_reconcile_pass(journal_dir: Path) -> None:
    # Several Redis (or a transport that cannot report the keys' use): every key is open, and a
    # job taken back would be pushed, and refused, again at every step.
    job = Queue(journal=journal_dir).enqueue(tasks.add, 2, 3, limit_key="k")
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, limits={"k": "concurrency:1"})
    forwarder.step()
    forwarder.step()
    assert not forwarder.key_limits.reads
    refuse(transport, job.id)
    forwarder.step()
    assert forwarder.completions.harvester.refused_back == 0
    assert not forwarder.state.runs.contains(transport.deliveries[job.id].loc)
    forwarder.close()
