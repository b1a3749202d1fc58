"""Tasks for tests/integration/test_stored_outcome_json.py: a file name ``os.fsdecode`` made.

A file name that is not UTF-8 (``b"report-\\xff.csv"``) becomes text with a lone surrogate
(``"report-\\udcff.csv"``); JSON carries it as ``\\udcff``, which Redis's Lua JSON decoder
(cjson) refuses. Each run appends ``start <token> <attempt> <pid> <time>`` to the effects file
(tests.tasks.traced) before it returns that name, or fails with it in its message.
"""

from __future__ import annotations

import os

from tests.tasks import traced

#: What the task returns, or names in its error.
NAME = os.fsdecode(b"report-\xff.csv")


def fsdecoded(path: str, token: str, fail: bool = False) -> str:
    traced(path, token)
    if fail:
        raise ValueError(f"cannot read {NAME}")
    return NAME
