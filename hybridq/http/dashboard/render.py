"""HTML for the dashboard, built from strings: every value from a job goes through :func:`esc`.

Task arguments, errors, results, queue and worker names are user data: they are escaped where
they are put in a page (text and attribute values alike), never trusted to be plain.
"""

from __future__ import annotations

import html
import json
import time
import urllib.parse
from collections.abc import Iterable
from typing import Any

__all__ = ["age", "error_cell", "esc", "job_link", "page", "page_number", "pager", "table", "when"]

_NAV = (("/", "Overview"), ("/jobs", "Jobs"), ("/failed", "Failed jobs"))


def esc(value: object) -> str:
    """``value`` as text, escaped for HTML text and quoted attribute values."""
    return html.escape(str(value), quote=True)


def url_id(job_id: str) -> str:
    """A job id as a path segment (ids are hex, but a typed search may be anything)."""
    return urllib.parse.quote(job_id, safe="")


def job_link(job_id: str) -> str:
    """A job's id as a link to its trace (HTML)."""
    return f'<a class="job" href="/jobs/{esc(url_id(job_id))}">{esc(job_id)}</a>'


def error_cell(error: str | None, width: int = 300) -> str:
    """An error's last line, cut to ``width`` characters (HTML; a task wrote it: escaped)."""
    last = (error or "").strip().splitlines()[-1:] or [""]
    return f'<span class="error">{esc(last[0][:width])}</span>'


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


def pager(path: str, total: int, at: int, pages: int, noun: str) -> str:
    """Where page ``at`` of a list at ``path`` is, and links to its neighbours."""
    links = []
    if at > 1:
        links.append(f'<a class="newer" href="{esc(path)}?page={at - 1}">newer</a>')
    if at < pages:
        links.append(f'<a class="older" href="{esc(path)}?page={at + 1}">older</a>')
    return (
        f'<p class="pager">{esc(total)} {esc(noun)}, newest first: page {esc(at)} of {esc(pages)} '
        f"{' '.join(links)}</p>"
    )


def table(headers: Iterable[str], rows: Iterable[Iterable[str]], *, cls: str = "") -> str:
    """A table; ``rows`` hold HTML already escaped (built with :func:`esc`)."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{esc(cls)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def page(title: str, body: str, *, active: str = "", search: str = "", refresh: bool = False) -> str:
    """A whole page: header, navigation, the job-id search box, and ``body`` (HTML)."""
    nav = "".join(
        f'<a href="{href}"{" class=active" if href == active else ""}>{esc(label)}</a>'
        for href, label in _NAV
    )
    live = ' data-refresh="5000"' if refresh else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(title)} · hybridq</title>
<link rel="stylesheet" href="/_dashboard/dashboard.css">
<script src="/_dashboard/dashboard.js" defer></script>
</head><body>
<header><span class="brand">hybridq</span><nav>{nav}</nav>
<form class="search" action="/jobs" method="get" role="search">
<input name="id" placeholder="job id" aria-label="job id" value="{esc(search)}" required>
<button type="submit">Trace</button></form></header>
<main id="main"{live}>
<h1>{esc(title)}</h1>
{body}
</main></body></html>
"""
