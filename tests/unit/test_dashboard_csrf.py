"""The dashboard's CSRF secret: made atomically, once, whatever races it (review M3)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from hybridq.http.dashboard import csrf


def _race(directory: str, racers: int = 4) -> tuple[list[str], list[BaseException]]:
    barrier = threading.Barrier(racers)
    tokens: list[str] = []
    errors: list[BaseException] = []

    def go() -> None:
        barrier.wait()
        try:
            tokens.append(csrf.token(directory, "a" * 32))
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tokens, errors


def test_concurrent_first_requests_agree_on_one_secret(tmp_path: Path) -> None:
    failed = 0
    for n in range(60):
        directory = tmp_path / str(n)
        directory.mkdir()
        tokens, errors = _race(str(directory))
        failed += bool(errors) or len(set(tokens)) != 1
    assert failed == 0
    secret = directory / csrf.SECRET_NAME
    assert secret.stat().st_mode & 0o777 == 0o600
    assert len(secret.read_bytes()) == 64
    assert [p.name for p in directory.iterdir()] == [csrf.SECRET_NAME]  # no temp file left


def test_a_damaged_secret_is_replaced(tmp_path: Path) -> None:
    secret = tmp_path / csrf.SECRET_NAME
    secret.write_bytes(b"")  # a crash between create and write (the old code)
    os.chmod(secret, 0o600)
    first = csrf.token(str(tmp_path), "a" * 32)
    assert len(secret.read_bytes()) == 64
    assert csrf.token(str(tmp_path), "a" * 32) == first


def test_a_deleted_secret_invalidates_the_forms(tmp_path: Path) -> None:
    first = csrf.token(str(tmp_path), "a" * 32)
    (tmp_path / csrf.SECRET_NAME).unlink()
    time.sleep(0.05)  # the cache tells files apart by inode and ctime (an operator is not faster)
    assert csrf.token(str(tmp_path), "a" * 32) != first
