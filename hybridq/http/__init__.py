"""``hybridq serve``: the HTTP API for producers in any language and the dashboard (docs/http.md).

It owns the endpoints (``api``, ``idempotency``, ``body``, ``openapi``, ``metrics``), their
tokens and login cookie (``auth``), the server (``app``, ``server``, ``config``, ``connections``) and the
operator's pages (``dashboard``). It may use Starlette and any package below it (the producer,
the reads of :mod:`hybridq.job`, :mod:`hybridq.lookup` and :mod:`hybridq.ops`, the journal and
the ledger for the dashboard's views); only the command line imports it.

``config`` holds what one server is started with; ``dashboard`` adds the operator pages under
``/`` to the API's application.

It needs the ``web`` extra (Starlette and uvicorn): without it, importing this package raises
``MissingExtra``, one line saying ``pip install 'hybridq[web]'``.
"""

from hybridq.extras import require

require("web", "hybridq serve (the HTTP API and the dashboard)")
