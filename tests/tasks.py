"""Importable task functions for tests (workers import jobs by dotted path)."""

from __future__ import annotations

import os


def add(a: int, b: int) -> int:
    return a + b


def record(path: str, token: str) -> str:
    """Append ``token`` to the file at ``path`` (an effect the test can count independently)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())
    return token


class Holder:
    @staticmethod
    def static(x: int) -> int:
        return x

    def method(self, x: int) -> int:
        return x
