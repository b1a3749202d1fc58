"""What enqueue refuses or changes in a call's arguments, and jobs that share a job id."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hybridq import NotSerializable, Queue
from hybridq.envelope.model import Envelope
from hybridq.journal import JournalReader


@pytest.mark.parametrize(
    ("args", "kwargs", "meta"),
    [
        (({1: "a"},), {}, None),
        ((), {"x": {"ok": [{None: 1}]}}, None),
        ((), {"x": {True: 1}}, None),
        (([{1.5: "a"}],), {}, None),
        ((), {}, {"m": {2: "b"}}),
        (({1: "a", "1": "b"},), {}, None),  # JSON would even keep only one of them
    ],
)
def test_non_string_dict_keys_are_refused_and_nothing_is_written(
    journal_dir: Path, args: tuple[Any, ...], kwargs: dict[str, Any], meta: dict[str, Any] | None
) -> None:
    queue = Queue("default", journal_dir)
    with pytest.raises(NotSerializable, match="not a string"):
        queue.enqueue_call("tests.tasks.add", args, kwargs, meta=meta)
    assert list(JournalReader(str(journal_dir)).records()) == []


def test_tuples_arrive_as_tuples_as_documented(journal_dir: Path) -> None:
    """Tagged since issue 33 (docs/enqueue.md); a record written before reads them as lists."""
    queue = Queue("default", journal_dir)
    queue.enqueue("tests.tasks.add", (1, 2), {"k": (3, (4,))})
    [record] = list(JournalReader(str(journal_dir)).records())
    env = Envelope.from_bytes(record.payload)
    assert env.call_args() == (((1, 2), {"k": (3, (4,))}), {})


def test_a_cycle_is_still_refused(journal_dir: Path) -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(NotSerializable):
        Queue("default", journal_dir).enqueue("tests.tasks.add", loop)
