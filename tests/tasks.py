"""Importable task functions for tests (workers import jobs by dotted path)."""

from __future__ import annotations

import os
import time
import weakref


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


# -- tasks for tests/integration/test_worker_redis.py ------------------------------------------
# Each appends one line per event to an effects file (fsync'd), so a test counts runs without
# trusting hybridq. The attempt comes from hybridq.current_job() (0 outside a hybridq job).


def _attempt() -> int:
    from hybridq import current_job

    job = current_job()
    return job.attempt if job is not None else 0


def traced(path: str, token: str, sleep_s: float = 0.0) -> str:
    """``start <token> <attempt> <pid> <time>``, sleep, then ``done <token> <attempt> <pid> <time>``."""
    import time

    attempt = _attempt()
    record(path, f"start {token} {attempt} {os.getpid()} {time.time():.6f}")
    if sleep_s:
        time.sleep(sleep_s)
    record(path, f"done {token} {attempt} {os.getpid()} {time.time():.6f}")
    return token


def traced_fail(path: str, token: str, sleep_s: float) -> None:
    """:func:`traced`, then fail (its ``done`` line is the moment it failed)."""
    traced(path, token, sleep_s)
    raise RuntimeError(f"{token}: planned failure")


def flaky(path: str, token: str, failures: int) -> str:
    """Fail the first ``failures`` runs of ``token`` (counted in the effects file), then succeed.

    Each run appends ``run <token> <attempt> <run number>``; the successful one also appends
    ``ok <token> <attempt>``.
    """
    try:
        with open(path, encoding="utf-8") as f:
            runs = sum(1 for line in f if line.startswith(f"run {token} "))
    except FileNotFoundError:
        runs = 0
    attempt = _attempt()
    record(path, f"run {token} {attempt} {runs + 1}")
    if runs + 1 <= failures:
        raise RuntimeError(f"planned failure {runs + 1} of {failures}")
    record(path, f"ok {token} {attempt}")
    return token


def fail_unless(path: str, token: str, switch: str) -> str:
    """Append ``run <token> <attempt>``; raise unless the file ``switch`` exists, else ``ok ...``."""
    attempt = _attempt()
    record(path, f"run {token} {attempt}")
    if not os.path.exists(switch):
        raise RuntimeError(f"{switch} does not exist")
    record(path, f"ok {token} {attempt}")
    return token


def fail() -> None:
    """Always fails."""
    raise RuntimeError("this task always fails")


def race_a_success_then_fail() -> None:
    """Store a success under this job's key (as a concurrent run would), then fail."""
    import json

    from hybridq import current_job
    from hybridq.envelope.model import idempotency_id
    from hybridq.protocol import keys
    from rq import get_current_job

    job = current_job()
    rq_job = get_current_job()
    assert job is not None
    assert rq_job is not None
    stored = {"outcome": "succeeded", "result": "other run", "job_id": job.id, "attempt": 1, "final": True}
    rq_job.connection.set(keys.result(idempotency_id(job.idempotency_key)), json.dumps(stored))
    raise RuntimeError("this run failed, but another run of the key succeeded")


# -- tasks for tests/integration/test_worker_pool.py -------------------------------------------

_HELD: list[bytearray] = []


def crash(path: str, token: str) -> None:
    """``start ...``, then kill the process running it (a task that crashes the interpreter)."""
    import signal
    import time

    record(path, f"start {token} {_attempt()} {os.getpid()} {time.time():.6f}")
    os.kill(os.getpid(), signal.SIGKILL)


def stuck(path: str, token: str) -> None:
    """``start ...``, then block in one C call no exception interrupts (for an hour)."""
    import time

    record(path, f"start {token} {_attempt()} {os.getpid()} {time.time():.6f}")
    time.sleep(3600)


def spin(path: str, token: str) -> None:
    """``start ...``, then loop in Python forever (an exception raised in the thread ends it)."""
    import time

    record(path, f"start {token} {_attempt()} {os.getpid()} {time.time():.6f}")
    while True:
        time.monotonic()


def hog(path: str, token: str, mb: int) -> str:
    """Keep ``mb`` MB allocated for the life of the process (a task that leaks), then ``done ...``."""
    import time

    block = bytearray(mb * 2**20)
    block[::4096] = b"x" * len(block[::4096])  # touched: resident, not just reserved
    _HELD.append(block)
    record(path, f"done {token} {_attempt()} {os.getpid()} {time.time():.6f}")
    return token


async def atraced(path: str, token: str, sleep_s: float = 0.0) -> str:
    """``traced`` as an ``async def``: the sleep is the event loop's."""
    import asyncio
    import time

    attempt = _attempt()
    record(path, f"start {token} {attempt} {os.getpid()} {time.time():.6f}")
    await asyncio.sleep(sleep_s)
    record(path, f"done {token} {attempt} {os.getpid()} {time.time():.6f}")
    return token


def not_yet(path: str, token: str, laters: int, failures: int = 0, seconds: float = 0.5) -> str:
    """Raise ``hybridq.RetryLater(seconds)`` in the first ``laters`` runs of ``token``, then fail
    the next ``failures`` runs (RuntimeError), then succeed.

    Each run appends ``run <token> <attempt> <run number>``; the successful one also ``ok``.
    """
    import hybridq

    try:
        with open(path, encoding="utf-8") as f:
            runs = sum(1 for line in f if line.startswith(f"run {token} "))
    except FileNotFoundError:
        runs = 0
    attempt = _attempt()
    record(path, f"run {token} {attempt} {runs + 1}")
    if runs + 1 <= laters:
        raise hybridq.RetryLater(seconds, f"{token} is not committed yet")
    if runs + 1 <= laters + failures:
        raise RuntimeError(f"planned failure of {token}")
    record(path, f"ok {token} {attempt}")
    return token


def not_until(path: str, token: str, switch: str, seconds: float, deadline_s: float = 3600.0) -> str:
    """``run <token> <attempt>``; ``RetryLater(seconds, deadline_s=...)`` until ``switch`` exists."""
    import hybridq

    attempt = _attempt()
    record(path, f"run {token} {attempt}")
    if not os.path.exists(switch):
        raise hybridq.RetryLater(seconds, f"{switch} does not exist yet", deadline_s=deadline_s)
    record(path, f"ok {token} {attempt}")
    return token


async def not_yet_async(path: str, token: str, laters: int, seconds: float = 0.3) -> str:
    """:func:`not_yet` as an ``async def`` task (the pool runs it on its event loop)."""
    return not_yet(path, token, laters, 0, seconds)


def cooperative(path: str, token: str, limit_s: float = 60.0) -> str:
    """``start ...``, then check ``current_job().check_cancelled()`` every 50 ms for ``limit_s``.

    Cancelled: appends ``stopped <token> ...`` and lets :class:`hybridq.Cancelled` propagate.
    """
    import time

    from hybridq import Cancelled, current_job

    record(path, f"start {token} {_attempt()} {os.getpid()} {time.time():.6f}")
    job = current_job()
    assert job is not None
    end = time.monotonic() + limit_s
    try:
        while time.monotonic() < end:
            job.check_cancelled()
            time.sleep(0.05)
    except Cancelled:
        record(path, f"stopped {token} {_attempt()} {os.getpid()} {time.time():.6f}")
        raise
    record(path, f"done {token} {_attempt()} {os.getpid()} {time.time():.6f}")
    return token


def gil(path: str, token: str, seconds: int) -> str:
    """``start ...``, then hold the GIL for ``seconds`` in one C call, then ``done ...``.

    A C call made through ``ctypes.PyDLL`` keeps the GIL (as a regex backtracking, or any tight
    C loop, does): no other thread of the process runs meanwhile, its lease renewer included.
    """
    import ctypes
    import time

    attempt = _attempt()
    record(path, f"start {token} {attempt} {os.getpid()} {time.time():.6f}")
    libc = ctypes.PyDLL(None)
    libc.sleep.argtypes = [ctypes.c_uint]
    left = seconds
    while left > 0:  # sleep(3) returns early (what is left) only if a signal arrives
        left = libc.sleep(left)
    record(path, f"done {token} {attempt} {os.getpid()} {time.time():.6f}")
    return token


# -- tasks for tests/integration/test_tagged_worker.py (issue 33) -------------------------------


def types_echo(path: str, *args: object, **kwargs: object) -> tuple[object, ...]:
    """Write the repr of what the task got (types and time zones show) and return it."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(repr((args, kwargs)) + "\n")
    return (args, kwargs)


async def types_echo_async(path: str, *args: object, **kwargs: object) -> tuple[object, ...]:
    """:func:`types_echo` as an ``async def`` task (the pool awaits it on its loop)."""
    return types_echo(path, *args, **kwargs)


def traced_task(fail: bool = False) -> str:
    """Open a span of its own inside the run (a child of the run span) and maybe fail."""
    from hybridq import tracing
    from opentelemetry import trace

    # The unit tests' tracer is a private provider's (the global one is set once per process).
    with (tracing.tracer() or trace.get_tracer("tests")).start_as_current_span("inside"):
        if fail:
            raise ValueError("asked to fail")
    return "traced"


# -- tasks for tests/unit/test_workflows.py and tests/integration/test_workflows_faults.py --------


def total(values: list[int]) -> int:
    """A chord's callback: the sum of its members' results."""
    return sum(values)


def total_once(values: list[int], path: str) -> int:
    """:func:`total`, appending the sum to ``path`` (fsync'd): a test counts the callback's runs."""
    result = sum(values)
    record(path, str(result))
    return result


def add_noted(a: int, b: int, path: str) -> int:
    """``a + b``, appending a line to ``path`` first: a test counts the step's runs."""
    record(path, f"{a}+{b}")
    return a + b


def add_slow(a: int, b: int, path: str, sleep_s: float = 0.0) -> int:
    """``a + b`` after ``sleep_s``, appending ``a+b`` to ``path`` as it starts (runs are counted)."""
    record(path, f"{a}+{b}")
    time.sleep(sleep_s)
    return a + b


def same(value: object) -> object:
    """Its argument, as it came (a chain's first step passing a value of a tagged type)."""
    return value


def type_name(value: object) -> str:
    """The name of its argument's type (what a chain's step received)."""
    return type(value).__name__


def big(size: int) -> str:
    """A result of ``size`` characters (a workflow whose results are large together)."""
    return "x" * size


def count(values: list[object]) -> int:
    """A chord's callback taking a list it only counts."""
    return len(values)


def gc_pace(path: str) -> None:
    """Write this process's collector settings: the youngest generation's threshold, what is frozen."""
    import gc

    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{gc.get_threshold()[0]} {gc.get_freeze_count()}")


# -- tasks for tests/integration/test_worker_failed_data.py ----------------------------------
# Each keeps a weak reference to an object only its own frame holds, then fails: the test, with
# the cyclic collector off, finds whether the failure freed it.

#: Weak references to the data of the tasks below, newest last.
DATA: list[weakref.ref[object]] = []


class Data:
    """What a failing task holds in its frame (a weak reference can point at it)."""


def fail_holding(*_args: object, **_kwargs: object) -> None:
    """Fail, holding a :class:`Data` in a local of the frame the error's traceback holds."""
    data = Data()
    DATA.append(weakref.ref(data))
    raise RuntimeError("failed, holding data")


async def afail_holding(*_args: object, **_kwargs: object) -> None:
    """:func:`fail_holding` as an ``async def`` task."""
    data = Data()
    DATA.append(weakref.ref(data))
    raise RuntimeError("failed, holding data")
