"""The OpenAPI 3 document of ``hybridq serve``'s API (``GET /v1/openapi.json``, docs/http.md).

Written by hand next to the routes it describes: ``tests/unit/test_http_api.py`` checks that it
lists every route and every status code the API answers with.
"""

from __future__ import annotations

from typing import Any

__all__ = ["document"]


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERROR = {"$ref": "#/components/schemas/Error"}
_TAGGED = (
    "JSON values; a date, time, datetime, decimal, UUID, bytes, set or tuple as a tagged object "
    '{"$t": tag, "v": ...} (docs/http.md, "Argument and result types")'
)
_RETRY_AFTER = {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait."}}
_UNAUTHORIZED = _json(_ERROR, "No valid bearer token (the login cookie opens the dashboard only).")


def document(version: str) -> dict[str, Any]:
    """The OpenAPI document, for the server of hybridq ``version``."""
    # The API takes the bearer header only: the session cookie (a browser sends it cross-site)
    # authenticates the dashboard's pages, which check a CSRF token on their POST.
    secured: list[dict[str, list[str]]] = [{"bearer": []}]
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "hybridq serve",
            "version": version,
            "description": "Enqueue jobs into a hybridq journal over HTTP; see docs/http.md. "
            "Without a tokens file, a request whose Host is not this machine's gets 421.",
        },
        "security": secured,
        "paths": {
            "/v1/jobs": {
                "post": {
                    "summary": "Enqueue a job; answered once it is durable in the journal.",
                    "parameters": [
                        {
                            "name": "Idempotency-Key",
                            "in": "header",
                            "required": False,
                            "schema": {"type": "string", "minLength": 1, "maxLength": 255},
                            "description": "Retries with the same key get the same job id, never a "
                            "second job (across server restarts).",
                        }
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/NewJob"}}},
                    },
                    "responses": {
                        "202": {
                            **_json({"$ref": "#/components/schemas/Accepted"}, "Durable in the journal."),
                            "headers": {
                                "Location": {"schema": {"type": "string"}, "description": "/v1/jobs/{id}"}
                            },
                        },
                        "400": _json(_ERROR, "Bad input (nothing was written)."),
                        "401": _UNAUTHORIZED,
                        "408": _json(_ERROR, "The body did not arrive in time (nothing was written)."),
                        "413": _json(
                            _ERROR,
                            "The body is over --max-body, or the job's record over 1 MiB (nothing written).",
                        ),
                        "415": _json(
                            _ERROR, "The Content-Type is not application/json (nothing was written)."
                        ),
                        "422": _json(_ERROR, "The Idempotency-Key was used for another call."),
                        "429": {
                            **_json(
                                _ERROR,
                                "The journal holds --capacity pending jobs (queue_full), or this "
                                "client failed too many authentications (too_many_failures).",
                            ),
                            "headers": _RETRY_AFTER,
                        },
                        "503": {
                            **_json(
                                _ERROR,
                                "The journal cannot be written (outcome unknown: retry "
                                "with the same Idempotency-Key).",
                            ),
                            "headers": _RETRY_AFTER,
                        },
                    },
                }
            },
            "/v1/jobs/{id}": {
                "get": {
                    "summary": "A job's status, attempt, result or error (from durable state).",
                    "parameters": [
                        {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
                    ],
                    "responses": {
                        "200": _json({"$ref": "#/components/schemas/Job"}, "The job."),
                        "401": _UNAUTHORIZED,
                        "404": _json(
                            _ERROR, "No job with this id here; `node` names the node that holds it."
                        ),
                        "503": _json(
                            _ERROR,
                            "The journal cannot be read, or the node that holds the job is down "
                            "(node_unavailable).",
                        ),
                    },
                }
            },
            "/v1/jobs/{id}/cancel": {
                "post": {
                    "summary": "Cancel a job (hybridq.cancel): its state, as `hybridq cancel` says it.",
                    "parameters": [
                        {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
                    ],
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {"id": {"type": "string"}, "state": {"type": "string"}},
                            },
                            "requested, cancelled, succeeded or failed.",
                        ),
                        "401": _UNAUTHORIZED,
                        "403": _json(
                            _ERROR,
                            "Not a job this token enqueued with an Idempotency-Key (forbidden).",
                        ),
                        "404": _json(
                            _ERROR, "No job with this id here; `node` names the node that holds it."
                        ),
                        "415": _json(_ERROR, "Not Content-Type: application/json."),
                        "503": _json(_ERROR, "The journal cannot be read or the request written."),
                    },
                }
            },
            "/v1/stats": {
                "get": {
                    "summary": "The journal's counts (hybridq.stats) and the server's capacity.",
                    "responses": {
                        "200": _json({"type": "object", "additionalProperties": True}, "The counts."),
                        "401": _UNAUTHORIZED,
                        "503": _json(_ERROR, "The journal cannot be read."),
                    },
                }
            },
            "/v1/openapi.json": {
                "get": {
                    "summary": "This document.",
                    "responses": {"200": _json({"type": "object"}, "OpenAPI 3."), "401": _UNAUTHORIZED},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics (text exposition format).",
                    "responses": {
                        "200": {
                            "description": "Metrics.",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                        "401": _UNAUTHORIZED,
                    },
                }
            },
            "/healthz": {
                "get": {
                    "summary": "Liveness (never authenticated).",
                    "security": [],
                    "responses": {
                        "200": _json({"type": "object"}, '{"ok": true, "node": "<its node name>"}')
                    },
                }
            },
            "/login": {
                "get": {
                    "summary": "The login form (browsers).",
                    "security": [],
                    "responses": {"200": {"description": "HTML form.", "content": {"text/html": {}}}},
                },
                "post": {
                    "summary": "Log in with a token: sets the HttpOnly, SameSite=Strict session cookie.",
                    "security": [],
                    "requestBody": {
                        "content": {
                            "application/x-www-form-urlencoded": {
                                "schema": {
                                    "type": "object",
                                    "properties": {"token": {"type": "string"}, "next": {"type": "string"}},
                                }
                            }
                        }
                    },
                    "responses": {
                        "303": {"description": "Logged in: to `next`."},
                        "401": {"description": "Wrong token.", "content": {"text/html": {}}},
                        "408": _json(_ERROR, "The body did not arrive within 10 s."),
                        "413": _json(_ERROR, "The body is over 4 KiB (refused before it is read)."),
                    },
                },
            },
            "/logout": {
                "post": {
                    "summary": "Clear the session cookie.",
                    "security": [],
                    "responses": {"303": {"description": "To the login form."}},
                }
            },
        },
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "session": {"type": "apiKey", "in": "cookie", "name": "hybridq_session"},
            },
            "schemas": {
                "NewJob": {
                    "type": "object",
                    "required": ["task"],
                    "additionalProperties": False,
                    "properties": {
                        "task": {
                            "type": "string",
                            "description": "A registered task or a path under --allow.",
                        },
                        "args": {"type": "array", "default": [], "description": _TAGGED},
                        "kwargs": {"type": "object", "default": {}, "description": _TAGGED},
                        "queue": {"type": "string", "default": "default"},
                        "delay": {"type": "number", "minimum": 0, "description": "Seconds before it runs."},
                        "priority": {
                            "type": "integer",
                            "minimum": 0,
                            "maximum": 9,
                            "default": 0,
                            "description": "Among a queue's waiting jobs, higher is forwarded first.",
                        },
                        "limit_key": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 200,
                            "description": "The key the forwarder's limits and fairness count the job "
                            "under (printable, no whitespace), e.g. tenant:42.",
                        },
                        "retry": {
                            "oneOf": [
                                {"type": "integer", "minimum": 1, "description": "Total attempts."},
                                {
                                    "type": "object",
                                    "properties": {
                                        "max_attempts": {"type": "integer"},
                                        "backoff": {"type": "number"},
                                        "backoff_max": {"type": "number"},
                                        "jitter": {"type": "boolean"},
                                    },
                                },
                            ]
                        },
                    },
                },
                "Accepted": {"type": "object", "properties": {"id": {"type": "string"}}},
                "Job": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "status": {
                            "type": "string",
                            "enum": [
                                "queued",
                                "scheduled",
                                "forwarded",
                                "started",
                                "retrying",
                                "merged",
                                "finished",
                                "failed",
                            ],
                        },
                        "attempt": {"type": "integer"},
                        "task": {"type": "string"},
                        "queue": {"type": "string"},
                        "enqueued_at": {"type": "number"},
                        "started_at": {"type": "number", "nullable": True},
                        "ended_at": {"type": "number", "nullable": True},
                        "result": {"description": "The task's return value (finished jobs), tagged as args."},
                        "result_not_kept": {"type": "string"},
                        "error": {"type": "string", "nullable": True},
                    },
                },
                "Error": {
                    "type": "object",
                    "properties": {"error": {"type": "string"}, "detail": {"type": "string"}},
                },
            },
        },
    }
