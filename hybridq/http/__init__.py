"""``hybridq serve``: the HTTP API for producers in any language and the dashboard (docs/http.md).

``config`` holds what one server is started with; ``dashboard`` adds the operator pages under
``/`` to the API's application.

It needs the ``web`` extra (Starlette and uvicorn): without it, importing this package raises
``MissingExtra``, one line saying ``pip install 'hybridq[web]'``.
"""

from hybridq.extras import require

require("web", "hybridq serve (the HTTP API and the dashboard)")
