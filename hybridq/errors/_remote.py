"""Errors of ``hybridq serve`` (answered with a 4xx) and of the remote queue's nodes.

Apart from the other roles' errors only to keep each module short; they are shown, pickled and
documented as ``hybridq.errors.<Name>`` (the package's ``__init__`` sets ``__module__``).
"""

from __future__ import annotations

from ._base import HybridqError

# -- hybridq serve (hybridq.http) ---------------------------------------------------------------


class BadRequest(HybridqError, ValueError):
    """A body the API refuses (400); nothing is written."""


class BodyTooLarge(HybridqError):
    """The request body is over the cap (413)."""


class BodyTimeout(HybridqError):
    """The request body did not arrive within the deadline (408)."""


class KeyReused(HybridqError, ValueError):
    """The key was used before for another call; its job's id is :attr:`job_id`."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        super().__init__(
            f"this Idempotency-Key was used for another call (job {job_id}): "
            "a retry must send the same task, queue, args, kwargs, delay and retry"
        )


class TokensError(HybridqError, ValueError):
    """A tokens file that cannot be used (missing, unreadable, empty, a bad line)."""


class Forbidden(HybridqError):
    """``POST /v1/jobs/{id}/cancel`` of a job the request's token did not enqueue (a 403)."""


class NodeDown(HybridqError):
    """The node that holds a job did not answer a lookup through Redis (:mod:`hybridq.http.peers`)."""


class OutcomeUnknown(HybridqError):
    """A remote enqueue whose job a node may have written, though no node acknowledged it.

    A try was sent and got no answer (a timeout, a broken connection, a 5xx), and then the
    next node refused the job or none answered: the first node may hold it (durably). Enqueue
    it again under the same key to run it once: ``idempotency_key=key``, or ``enqueue_many``
    of the same prepared envelopes (docs/api.md, "A remote queue").

    Attributes:
        key: the ``Idempotency-Key`` every try was sent with.
        envelope_id: the id of the envelope ``Queue.prepare`` made (its key is ``hq-<id>``
            when it has no explicit key).
        tried: each node's URL and why it gave no acknowledgement, in order.
    """

    def __init__(self, key: str, envelope_id: str, tried: list[tuple[str, str]]) -> None:
        self.key = key
        self.envelope_id = envelope_id
        self.tried = tried
        nodes = "; ".join(f"{url}: {why}" for url, why in tried)
        super().__init__(
            f"the job may have been written though no node acknowledged it ({nodes}): enqueue it "
            f"again with idempotency_key={key!r} (or the same prepared envelopes) to run it once"
        )


class NodeUnavailable(HybridqError):
    """No ingest node could take or answer a remote call (docs/api.md, "A remote queue").

    Raised by a remote :class:`~hybridq.Queue` (``url=``) when every node was tried and none
    gave an answer: each refused the connection, timed out, broke it, or answered 5xx. An
    enqueue raises it only when no try reached a node that may have written the job (each
    connection refused or not made); one that may have been written raises
    :class:`OutcomeUnknown` instead. Also raised by a lookup whose job is held by a node that
    did not answer (never "no such job" for it).

    Attributes:
        tried: each node's URL and why it did not answer, in the order they were tried.
        job_id: the job looked up, for a lookup.
        unsure: the tries of ``tried`` that were sent and got no answer (the node may have
            taken the call).
    """

    def __init__(
        self,
        tried: list[tuple[str, str]],
        *,
        job_id: str | None = None,
        node: str | None = None,
        unsure: list[tuple[str, str]] | None = None,
    ) -> None:
        self.tried = tried
        self.unsure = unsure or []
        self.job_id = job_id
        self.node = node
        nodes = "; ".join(f"{url}: {why}" for url, why in tried) or "no node answered"
        if job_id is None:
            head = "no ingest node took the call"
        elif node is None:
            head = f"job {job_id} was not found on the nodes that answered, and some did not"
        else:
            head = f"job {job_id} is held by node {node}, which did not answer"
        super().__init__(f"{head} ({nodes})")
