"""The remote queue: ``hybridq.Queue(name, url=..., token=...)`` over ingest nodes' HTTP API.

A host with no journal (a container on an ephemeral disk) enqueues through one or more
``hybridq serve`` / ``hybridq forward --serve`` nodes (docs/api.md, "A remote queue";
docs/http.md, "Several nodes"):

* :mod:`~hybridq.client.ids` -- the shape of the job ids nodes make (``http-<node>-<hash>``),
  shared with the server;
* :mod:`~hybridq.client.nodes` -- the connection pool (urllib3) and the failover: a call goes to
  the next node on a refused connection, a timeout, a broken connection or a 5xx;
* :mod:`~hybridq.client.remote` -- enqueue, look up and cancel over ``/v1/jobs``;
* :mod:`~hybridq.client.job` -- :class:`RemoteJob`, the :class:`~hybridq.Job` it returns.

Needs the ``client`` extra (urllib3); without it the first remote call raises
:class:`~hybridq.errors.MissingExtra`. Never imports redis, rq or the journal.
"""

from __future__ import annotations
