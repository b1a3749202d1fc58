"""The dashboard's HTML: Jinja2 templates (``templates/``), escaping every value by default.

Task arguments, errors, results, queue, task and worker names, and whatever an operator typed
into a filter are user data: autoescape is on for every template, so a value is escaped where it
is put in a page (text and attribute values alike) unless a template says otherwise, and none
does. The helpers below are the templates' filters; they return plain text, never markup.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from pathlib import Path
from typing import Any

import jinja2

__all__ = ["age", "as_json", "page_number", "render", "url_id", "when"]

_TEMPLATES = Path(__file__).parent / "templates"


def url_id(job_id: str) -> str:
    """A job id as a path segment (ids are hex, but a typed search may be anything)."""
    return urllib.parse.quote(job_id, safe="")


def last_line(error: str | None, width: int = 300) -> str:
    """An error's last line, cut to ``width`` characters (the exception, not its traceback)."""
    last = (error or "").strip().splitlines()[-1:] or [""]
    return last[0][:width]


def when(at: float | None) -> str:
    """A time as UTC text (``-`` when unknown)."""
    if at is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}"


def age(seconds: float | None) -> str:
    """A duration as short text (``-`` when unknown)."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def as_json(value: Any) -> str:
    """A JSON value as text (anything else: its repr), for showing arguments and results."""
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError):
        return repr(value)


def page_number(text: str | None) -> int:
    """A ``?page=`` value as a page number (1 for anything that is not one: ``"²".isdigit()``)."""
    if text is None or not (text.isascii() and text.isdigit() and 0 < len(text) < 7):
        return 1
    return max(1, int(text))


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(_TEMPLATES),
        autoescape=True,  # every template, whatever its name: no value reaches a page unescaped
        undefined=jinja2.StrictUndefined,  # a misspelt name fails the test, not the operator
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        when=when, age=age, as_json=as_json, last_line=last_line, url_id=url_id, urlencode_query=_query
    )
    return env


def _query(params: dict[str, Any]) -> str:
    """``params`` (empty ones left out) as a query string."""
    return urllib.parse.urlencode({k: v for k, v in params.items() if v not in (None, "")})


_ENV = _environment()


def render(name: str, **context: Any) -> str:
    """The template ``name`` filled with ``context`` (a whole page: it extends ``base.html``)."""
    return _ENV.get_template(name).render(**context)
