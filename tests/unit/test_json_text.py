"""JSON written once per job without ``json.dumps`` (its encoder is built per call) is its text.

The worker's result (``values.jsonable``) and its outcome script's arguments, and the lookup
index's result column, use ``dumps_ascii``: the same text, character for character, as what was
written before (the ledger, the index and RQ's tools read it back).
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hybridq.envelope.model import Envelope
from hybridq.ledger.entries import Entry
from hybridq.lookup.store import _SCHEMA, _UPSERT_JOB, _apply, _connect
from hybridq.worker.values import jsonable

VALUES: list[Any] = [
    None,
    True,
    0,
    -(10**30),
    1.5,
    1e300,
    float("nan"),
    float("-inf"),
    "caf\u00e9 \udcff \u2028 \x00 \"'\\",
    os.fsdecode(b"report-\xff.csv"),
    [1, "a", None, [], {}],
    {"a": {"b": [1.25, {"c": "d"}]}, "": 0},
    (1, 2),
    {1, 2},
    dt.datetime(2026, 12, 6, 22, 15, tzinfo=dt.UTC),
    decimal.Decimal("1.10"),
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_a_result_s_text_is_json_dumps_of_its_form(value: Any) -> None:
    form, text = jsonable(value, Envelope("a1", "tests.tasks.add", "default", "a1", 1.0))
    assert text == json.dumps(form)


def test_a_value_with_a_cycle_is_stored_as_its_repr() -> None:
    cycle: list[Any] = [1]
    cycle.append(cycle)
    form, text = jsonable(cycle, Envelope("a1", "tests.tasks.add", "default", "a1", 1.0))
    assert form == repr(cycle)
    assert text == json.dumps(repr(cycle))


def test_the_lookup_index_keeps_a_result_as_json_dumps_wrote_it(tmp_path: Path) -> None:
    db = _connect(str(tmp_path / "index.sqlite"))
    try:
        db.executescript(_SCHEMA)
        # Results as a harvested event carries them: JSON, decoded.
        results = [
            json.loads(json.dumps(v))
            for v in VALUES
            if not isinstance(v, set | dt.datetime | decimal.Decimal)
        ]
        loc = ("w" * 16, 0)
        with db:
            db.executemany(
                _UPSERT_JOB,
                [(f"j{i}", *loc, i, i, 0, 1.0, "f.g", "q", f"j{i}") for i in range(len(results))],
            )
            _apply(
                db,
                [
                    Entry("done", f"j{i}", (*loc, i), outcome="succeeded", at=2.0, result=r, result_kept=True)
                    for i, r in enumerate(results)
                ],
            )
        stored = dict(db.execute("SELECT id, result FROM jobs"))
        assert stored == {f"j{i}": json.dumps(r) for i, r in enumerate(results)}
    finally:
        db.close()


class _BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.parametrize("value", [10**5000, _BadRepr()], ids=["an int of 5,001 digits", "a raising repr"])
def test_a_result_whose_repr_fails_too_is_stored_as_a_description(value: Any) -> None:
    # Its repr() raised out of the worker's conclusion: no outcome was recorded, the lease
    # lapsed, and the job that had finished was run again at every delivery.
    form, text = jsonable(value, Envelope("a1", "tests.tasks.add", "default", "a1", 1.0))
    assert form == f"<{type(value).__qualname__}: no JSON form and no repr()>"
    assert text == json.dumps(form)
