"""The worker that ran a job travels in its completion event into the ledger (the dashboard's trace)."""

from __future__ import annotations

import json

from hybridq.envelope.model import Envelope, new_job_id
from hybridq.ledger.entries import Entry, parse_event
from hybridq.protocol import CompletionEvent, Delivery
from hybridq.worker.admit import event


def _delivery(gen: int = 0) -> Delivery:
    env = Envelope(
        id=new_job_id(), func="tests.tasks.add", queue="default", idempotency_key="k", created_at=1.0
    )
    return Delivery(env, "owner1", ("w", 2, 64), 3, gen=gen)


def test_the_worker_event_names_its_worker_and_the_ledger_keeps_it() -> None:
    stored = {"outcome": "failed", "final": False, "attempt": 3, "error": "boom"}
    ev = event(_delivery(gen=4), stored, dup=False, started=5.0)
    body = json.loads(json.dumps(ev.to_json()))
    assert body["worker"] == ev.worker
    host, pid = str(ev.worker).rsplit("/", 1)
    assert host
    assert pid.isdigit()
    assert CompletionEvent.from_json(body) == ev
    entry = parse_event("1-0", body, lambda: 10.0)
    assert (entry.worker, entry.attempt, entry.started, entry.gen) == (ev.worker, 3, 5.0, 4)
    assert body["gen"] == 4
    assert json.loads(entry.to_bytes())["w"] == ev.worker
    assert json.loads(entry.to_bytes())["g"] == 4
    assert Entry.from_bytes(entry.to_bytes()) == entry


def test_an_older_event_and_an_older_ledger_record_still_read() -> None:
    d = _delivery()
    body = CompletionEvent.of(d, {"outcome": "succeeded", "attempt": 3}, dup=False, at=2.0).to_json()
    assert "worker" not in body  # nothing said: the wire is what it was
    assert "gen" not in body  # generation 0 is left out
    entry = parse_event("1-0", body, lambda: 10.0)
    assert (entry.worker, entry.gen) == (None, 0)
    old = b'{"t":"done","id":"abc","loc":["w",0,64],"n":2,"o":"succeeded","at":3.0}'
    assert (Entry.from_bytes(old).worker, Entry.from_bytes(old).gen) == (None, 0)
    assert b'"w":' not in Entry.from_bytes(old).to_bytes()


def test_an_events_json_made_without_the_event_is_the_events_json() -> None:
    """json_of (what the pool sends) is of(...).to_json(), key order included, in every case."""
    from hybridq.envelope.model import Retry

    retried = Envelope(
        id=new_job_id(),
        func="tests.tasks.add",
        queue="q",
        idempotency_key="k",
        created_at=1.0,
        retry=Retry(3, jitter=False),
    )
    deliveries = [
        _delivery(),
        _delivery(gen=4),
        Delivery(retried, "o", ("w", 0, 1), 2, later=1, later_since=3.0),
    ]
    outcomes = [
        {"outcome": "succeeded", "final": True, "attempt": 1, "result": None},
        {"outcome": "succeeded", "result": [1, "x"]},
        {"outcome": "succeeded", "result": "x" * 70_000},
        {"outcome": "failed", "final": False, "attempt": 1, "error": "Traceback\n  ...\nValueError: boom\n"},
        {"outcome": "failed", "final": True, "error": "x" * 900},
        {"outcome": "later", "final": False, "retry_delay": 5.0, "later": 2, "later_since": 4.0},
        {"outcome": "cancelled", "final": True},
        {},
    ]
    for d in deliveries:
        for outcome in outcomes:
            for kw in ({}, {"result_json": "[1]", "started": 2.5, "worker": "h/1"}):
                made = CompletionEvent.of(d, outcome, dup=False, at=9.0, **kw).to_json()  # type: ignore[arg-type]
                body = CompletionEvent.json_of(d, outcome, dup=False, at=9.0, **kw)  # type: ignore[arg-type]
                assert list(body.items()) == list(made.items())
