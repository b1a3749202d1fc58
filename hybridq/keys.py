"""Every Redis key hybridq reads or writes, built in one place. Its own keys start ``hybridq:``.

RQ's keys (``rq:job:<id>``, ``rq:queue:<name>``, ``rq:queues``) are RQ's; they are spelled here
only so hybridq code never builds them ad hoc.
"""

from __future__ import annotations

__all__ = ["PREFIX", "rq_job", "rq_queue", "rq_queues"]

#: Prefix of every key hybridq owns.
PREFIX = "hybridq:"


def rq_job(job_id: str) -> str:
    """RQ's hash for one job."""
    return f"rq:job:{job_id}"


def rq_queue(queue: str) -> str:
    """RQ's list of job ids waiting in ``queue``."""
    return f"rq:queue:{queue}"


def rq_queues() -> str:
    """RQ's set of queue keys (what ``rq info`` lists)."""
    return "rq:queues"
