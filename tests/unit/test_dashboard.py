"""The dashboard's pages over real HTTP (uvicorn on a loopback port), on a fake stack's journal."""

from __future__ import annotations

import http.client
import re
import urllib.parse
from pathlib import Path

import hybridq
import pytest
from hybridq.http.config import ServeConfig
from hybridq.http.dashboard import routes
from hybridq.testing import fake_stack
from starlette.applications import Starlette

from tests.support.webserver import Reply, request, serving

EVIL = "<script>alert(1)</script>"


@hybridq.task(queue="mail", retry=hybridq.Retry(max_attempts=2, backoff_s=0, jitter=False))
def doomed(note: str) -> None:
    raise ValueError(f"bad {note}")


@hybridq.task(queue="mail")
def fine(n: int) -> int:
    return n + 1


@pytest.fixture
def site(tmp_path: Path):
    journal = tmp_path / "journal"
    with fake_stack(journal, queues=["mail"]) as stack:
        ok = fine.delay(41)
        bad = doomed.delay(EVIL)
        stack.run()
        app = Starlette(routes=routes(ServeConfig(journal=journal)))
        with serving(app) as base:
            yield base, ok.id, bad.id, journal


def _form(page: Reply) -> tuple[str, str]:
    token = re.search(r'name="csrf" value="([0-9a-f]+)"', page.body)
    job = re.search(r'name="job_id" value="([0-9a-f]+)"', page.body)
    assert token is not None
    assert job is not None
    return token.group(1), job.group(1)


def test_overview_lists_the_queue(site) -> None:
    base, *_ = site
    page = request(base + "/")
    assert page.status == 200
    assert '<span class="queue">mail</span>' in page.body
    assert "hybridq_csrf" in page.cookies
    assert "SameSite=strict" in page.headers["set-cookie"]
    assert "script-src 'self'" in page.headers["content-security-policy"]


def test_user_data_is_escaped_everywhere(site) -> None:
    base, _, bad, _ = site
    for path in ("/failed", f"/jobs/{bad}"):
        page = request(base + path)
        assert page.status == 200
        assert EVIL not in page.body
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.body
    hostile = request(base + "/jobs/" + "%3Cscript%3E")
    assert hostile.status == 404
    assert "<script>" not in hostile.body.replace(
        '<script src="/_dashboard/dashboard.js" defer></script>', ""
    )


def test_requeue_needs_a_valid_csrf_token(site) -> None:
    base, _, bad, journal = site
    page = request(base + "/failed")
    token, job_id = _form(page)
    assert job_id == bad
    cookie = {"Cookie": f"hybridq_csrf={page.cookies['hybridq_csrf']}"}
    refused = [
        request(base + "/failed/requeue", "POST", body={"job_id": bad}, headers=cookie),
        request(base + "/failed/requeue", "POST", body={"job_id": bad, "csrf": "0" * 64}, headers=cookie),
        request(base + "/failed/requeue", "POST", body={"job_id": bad, "csrf": token}),
        request(
            base + "/failed/requeue",
            "POST",
            body={"job_id": bad, "csrf": token},
            headers={**cookie, "Origin": "http://evil.example"},
        ),
    ]
    assert [r.status for r in refused] == [403, 403, 403, 403]
    huge = request(
        base + "/failed/requeue", "POST", body={"job_id": "x" * (1 << 20), "csrf": token}, headers=cookie
    )
    assert huge.status == 413
    assert [j.id for j in hybridq.failed_jobs(journal)] == [bad]
    done = request(base + "/failed/requeue", "POST", body={"job_id": bad, "csrf": token}, headers=cookie)
    assert done.status == 303
    assert done.headers["location"] == f"/failed?requeued={bad}"
    assert hybridq.failed_jobs(journal) == []
    again = request(base + "/failed/requeue", "POST", body={"job_id": bad, "csrf": token}, headers=cookie)
    assert again.status == 409


def test_the_trace_of_a_failed_job(site) -> None:
    base, ok, bad, _ = site
    page = request(base + f"/jobs/{bad}")
    kinds = re.findall(r'data-kind="(\w+)"', page.body)
    assert kinds == ["accepted", "forwarded", "claimed", "retry", "claimed", "done"]
    assert "attempt 1 failed: retried" in page.body
    assert "ValueError: bad" in page.body
    worker = re.search(r"claimed by ([^<]+)</span>", page.body)
    assert worker is not None
    assert "/" in worker.group(1)
    assert "segment" in page.body
    good = request(base + f"/jobs/{ok}")
    assert re.findall(r'data-kind="(\w+)"', good.body) == ["accepted", "forwarded", "claimed", "done"]
    assert "<code>succeeded</code>" in good.body
    assert request(base + "/jobs/nope").status == 404
    search = request(base + f"/jobs?id={ok}")
    assert (search.status, search.headers["location"]) == (303, f"/jobs/{ok}")
    assert request(base + "/_dashboard/dashboard.js").status == 200
    assert request(base + "/_dashboard/passwd").status == 404


def test_a_chunked_requeue_body_is_refused_while_it_is_read(site) -> None:
    """No Content-Length: the body is read up to the cap, then 413 (not read whole first)."""
    base, *_ = site
    parts = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
    conn.putrequest("POST", "/failed/requeue")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.putheader("Content-Type", "application/x-www-form-urlencoded")
    conn.endheaders()
    chunk = b"a" * (256 << 10)
    for _ in range(8):  # 2 MiB, over the 1 MiB cap, and the body never ends
        conn.send(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
    try:
        reply = conn.getresponse()
        assert reply.status == 413
        assert reply.getheader("x-content-type-options") == "nosniff"
    finally:
        conn.close()


def test_the_requeued_notice_only_names_a_requeued_job(site) -> None:
    base, ok, bad, _ = site
    forged = request(base + "/failed?requeued=Your+account+is+suspended")
    assert forged.status == 200
    assert "Requeued" not in forged.body
    assert "Requeued" not in request(base + f"/failed?requeued={ok}").body
    hybridq.requeue([bad], site[3])
    assert f'Requeued <a href="/jobs/{bad}">' in request(base + f"/failed?requeued={bad}").body


def test_a_503_carries_the_security_headers(site, monkeypatch: pytest.MonkeyPatch) -> None:
    base, _, bad, _ = site
    page = request(base + "/failed")
    token, _ = _form(page)
    cookie = {"Cookie": f"hybridq_csrf={page.cookies['hybridq_csrf']}"}

    def broken(*_: object, **__: object) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr("hybridq.http.dashboard.failed.requeue", broken)
    reply = request(base + "/failed/requeue", "POST", body={"job_id": bad, "csrf": token}, headers=cookie)
    assert reply.status == 503
    assert "script-src 'self'" in reply.headers["content-security-policy"]
    assert reply.headers["x-content-type-options"] == "nosniff"
