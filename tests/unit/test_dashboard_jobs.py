"""The dashboard's list of recent jobs, and the trace of a compacted job (issue 27's paper cuts).

The trace of a job whose journal segment was compacted showed task ``-``, args ``[]`` and no
result, while ``GET /v1/jobs/ID`` still had them; and there was no list of recent jobs. Real
HTTP (uvicorn on a loopback port), as in test_dashboard.py.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import hybridq
import pytest
from hybridq.http.config import ServeConfig
from hybridq.http.dashboard import routes
from hybridq.testing import fake_stack
from starlette.applications import Starlette

from tests.support.http import request as api_request
from tests.support.http import served
from tests.support.webserver import request, serving
from tests.unit.test_http_api import config, write_tokens
from tests.unit.test_lookup import compacted_jobs

EVIL = "<script>alert(1)</script>"


@hybridq.task(queue="mail")
def ok(n: int) -> int:
    return n + 1


@hybridq.task(queue="mail")
def broken(note: str) -> None:
    raise ValueError(f"bad {note}")


def test_the_trace_of_a_compacted_job_keeps_its_task_and_result(journal_dir: Path) -> None:
    job_id = compacted_jobs(journal_dir, 40)[0]
    with served(config(journal_dir)) as base:
        api = api_request(base, "GET", f"/v1/jobs/{job_id}").json
        page = api_request(base, "GET", f"/jobs/{job_id}").raw.decode()
    assert (api["task"], api["status"]) == ("tests.tasks.add", "finished")
    summary = dict(re.findall(r'<dt>([^<]+)</dt><dd class="[^"]*"><code>([^<]*)</code>', page))
    assert summary["task"] == "tests.tasks.add"  # before: -
    assert summary["queue"] == "default"
    assert summary["args"] == "not kept (its journal segment was compacted)"  # before: []
    assert summary["result"] == str(api["result"])  # before: no result at all


@pytest.fixture
def site(tmp_path: Path):
    journal = tmp_path / "journal"
    with fake_stack(journal, queues=["mail"]) as stack:
        made = [ok.delay(n) for n in range(55)]
        bad = broken.delay(EVIL)
        stack.run()
        app = Starlette(routes=routes(ServeConfig(journal=journal)))
        with serving(app) as base:
            yield base, [j.id for j in made], bad.id


def _listed(body: str) -> list[str]:
    return re.findall(r'<a class="job" href="/jobs/([^"]+)">', body)


def test_recent_jobs_newest_first_paged_and_escaped(site) -> None:
    base, made, bad = site
    first = request(base + "/jobs")
    assert first.status == 200
    assert "script-src 'self'" in first.headers["content-security-policy"]
    listed = _listed(first.body)
    assert listed[0] == bad  # the newest
    assert listed[1:] == made[::-1][:49]
    assert "56 jobs" in first.body
    assert EVIL not in first.body
    assert html.escape(f"ValueError: bad {EVIL}") in first.body
    assert re.search(r'<td><span class="status status-failed">failed</span></td>', first.body)
    second = request(base + "/jobs?page=2")
    assert _listed(second.body) == made[::-1][49:]
    assert 'href="/jobs?page=1"' in second.body
    for odd in ("%C2%B2", "0", "-1", "999999", "x"):
        assert request(base + f"/jobs?page={odd}").status == 200
    assert _listed(request(base + "/jobs?page=999999").body) == made[::-1][49:]  # the last page
    assert request(base + f"/jobs?id={bad}").headers["location"] == f"/jobs/{bad}"  # the search box
    assert 'href="/jobs"' in request(base + "/").body  # in the navigation


def test_recent_jobs_need_the_same_auth_as_every_page(journal_dir: Path, tmp_path: Path) -> None:
    hybridq.Queue(journal=journal_dir).enqueue("tests.tasks.add", 1, 2)
    tokens = write_tokens(tmp_path / "tokens", "a-good-token-0123456789")
    with served(config(journal_dir, tokens_file=tokens)) as base:
        assert api_request(base, "GET", "/jobs").status == 401
        browser = api_request(base, "GET", "/jobs", None, {"Accept": "text/html"})
        assert (browser.status, browser.headers["location"]) == (303, "/login?next=%2Fjobs")
        good = api_request(base, "GET", "/jobs", None, {"Authorization": "Bearer a-good-token-0123456789"})
        assert good.status == 200
        assert "no forwarder has read" in good.raw.decode()  # no index yet: said, not a 500


def test_the_trace_of_a_workflow_lists_its_steps_and_their_states(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    with fake_stack(journal, queues=["mail"]) as stack:
        flow = ok.queue.enqueue(hybridq.chain(ok.s(1), ok.s(), hybridq.group(ok.s(), ok.s())))
        stack.run()
        assert flow.wait(timeout=5) == [4, 4]
        app = Starlette(routes=routes(ServeConfig(journal=journal)))
        with serving(app) as base:
            page = request(base + f"/jobs/{flow.id}").body
    rows = re.findall(
        r'<tr class="step-(\w+)"><td>(\d)</td><td><a href="/jobs/([^"]+)">.*?<td>([^<]*)</td></tr>', page
    )
    assert [(state, n, after) for state, n, _, after in rows] == [
        ("succeeded", "0", "-"),
        ("succeeded", "1", "0"),
        ("succeeded", "2", "1"),
        ("succeeded", "3", "1"),
    ]
    assert [job for *_, job, _ in rows] == [f"{flow.id}__{n}" for n in range(4)]
