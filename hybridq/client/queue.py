"""What a :class:`~hybridq.Queue` made with ``url=`` (or ``$HYBRIDQ_URL``) does instead of the journal.

:class:`Remote` is the queue's remote side: :meth:`Remote.enqueue` posts the envelopes
``Queue.prepare`` built and returns :class:`~hybridq.client.job.RemoteJob`\\ s, and
:meth:`Remote.fetch` looks a job up. :func:`remote_for` resolves the settings
(``url=`` and ``token=``, else ``$HYBRIDQ_URL`` and ``$HYBRIDQ_TOKEN`` when no journal is
configured) and shares one connection pool per process for the same nodes and token.
:func:`fetch_job` is ``hybridq.fetch_job``: the journal's lookup, or the nodes'.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterable, Sequence

from hybridq.client.job import RemoteJob
from hybridq.client.nodes import Nodes, parse_urls
from hybridq.client.remote import RemoteClient, enqueue_all
from hybridq.envelope.model import Envelope
from hybridq.errors import ConfigError
from hybridq.job import Job
from hybridq.job import fetch_job as fetch_local

__all__ = ["Remote", "fetch_job", "remote_for"]

_shared: dict[tuple[int, tuple[str, ...], str | None], Remote] = {}
_shared_lock = threading.Lock()


class Remote:
    """A remote queue's calls (see the module docstring)."""

    def __init__(self, nodes: Nodes) -> None:
        self.client = RemoteClient(nodes)

    @property
    def urls(self) -> list[str]:
        """The nodes' URLs."""
        return self.client.nodes.urls

    def enqueue(self, jobs: Iterable[Envelope]) -> list[Job]:
        """Post each job (one ``POST /v1/jobs`` each, in order); each returned job is durable.

        Not all-or-none, unlike a local ``enqueue_many``: on an error, the ids of the jobs
        acknowledged before it are on the error's ``acknowledged``.
        """
        envelopes = list(jobs)
        for env in envelopes:
            if not isinstance(env, Envelope):
                raise TypeError("enqueue_many takes envelopes from Queue.prepare(...)")
        return [
            RemoteJob(dataclasses.replace(env, id=job_id, idempotency_key=key), self.client)
            for env, job_id, key in enqueue_all(self.client, envelopes)
        ]

    def fetch(self, job_id: str) -> Job | None:
        """The job with this id, from the node that holds it; ``None`` if none does."""
        state = self.client.state(job_id)
        return None if state is None else RemoteJob.found(state, self.client)


def remote_for(url: str | Sequence[str] | None, token: str | None, journal: object = None) -> Remote | None:
    """The remote side for these settings; ``None``: a journal is configured (or nothing is)."""
    if url is None:
        if journal is not None or os.environ.get("HYBRIDQ_JOURNAL") or not os.environ.get("HYBRIDQ_URL"):
            return None
        url = os.environ["HYBRIDQ_URL"]
    elif journal is not None:
        raise ConfigError("give a queue journal= or url=, not both")
    if token is None:
        token = os.environ.get("HYBRIDQ_TOKEN") or None
    urls = tuple(parse_urls(url))
    key = (os.getpid(), urls, token)  # a forked child opens its own connections
    with _shared_lock:
        remote = _shared.get(key)
        if remote is None:
            remote = _shared[key] = Remote(Nodes(urls, token))
        return remote


def fetch_job(
    job_id: str,
    journal: str | os.PathLike[str] | None = None,
    *,
    url: str | Sequence[str] | None = None,
    token: str | None = None,
) -> Job | None:
    """The job with id ``job_id``, or ``None`` if there is none (docs/api.md, "Looking a job up").

    With a journal (``journal=``, else ``$HYBRIDQ_JOURNAL``), read from its files; with ingest
    nodes (``url=``, else ``$HYBRIDQ_URL``), asked of the node that holds it
    (:class:`~hybridq.errors.NodeUnavailable` if that node does not answer).
    """
    remote = remote_for(url, token, journal)
    if remote is None:
        return fetch_local(job_id, journal)
    return remote.fetch(job_id)
