"""``hybridq serve``: the HTTP API for producers in any language and the dashboard (docs/http.md).

``config`` holds what one server is started with; ``dashboard`` adds the operator pages under
``/`` to the API's application.
"""
