"""The job ids ingest nodes make: ``http-<node>-<hash>`` (docs/http.md, "Several nodes").

The node part is the journal directory's node name (``hybridq.http.node``): 8 hex digits. The
server builds ids with it; the client reads it back to ask the node that holds a job.
"""

from __future__ import annotations

import re

__all__ = ["ID_PREFIX", "NODE_NAME", "node_of"]

#: The prefix of the job ids ``POST /v1/jobs`` makes.
ID_PREFIX = "http-"
#: A node name: 8 hex digits.
NODE_NAME = re.compile(r"[0-9a-f]{8}")
_TAGGED = re.compile(r"http-([0-9a-f]{8})-")


def node_of(job_id: str) -> str | None:
    """The node name a job id carries (``None``: an id no named node made)."""
    match = _TAGGED.match(job_id)
    return match.group(1) if match else None
