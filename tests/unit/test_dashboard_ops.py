"""The operator's dashboard (issue 33): the queues page, the last hour's chart, search, bulk actions.

Real HTTP (uvicorn on a loopback port) over a fake stack's journal, as in test_dashboard.py; an
attack-minded pass over the new surface: CSRF on the bulk POST, hostile task names and error
text in filters and pages, ranges and texts out of bounds, the count a confirmation showed.
"""

from __future__ import annotations

import datetime as dt
import re
import time
import urllib.parse
from pathlib import Path

import hybridq
import pytest
from hybridq.http.config import ServeConfig
from hybridq.http.dashboard import routes
from hybridq.testing import fake_stack
from markupsafe import escape
from starlette.applications import Starlette

from tests.support.http import request as api_request
from tests.support.http import served
from tests.support.webserver import Reply, request, serving
from tests.unit.test_dashboard import fine
from tests.unit.test_http_api import config, write_tokens

EVIL = "<script>alert(1)</script>"
EVIL_ATTR = '"><img src=x onerror=alert(1)>'
Q_EVIL, Q_ATTR = urllib.parse.quote(EVIL), urllib.parse.quote(EVIL_ATTR)


@hybridq.task(queue="mail", retry=hybridq.Retry(max_attempts=1))
def doomed(note: str) -> None:
    raise ValueError(f"bad {note}")


@hybridq.task(queue="bulk", retry=hybridq.Retry(max_attempts=1))
def flaky(n: int) -> None:
    raise RuntimeError(f"flaky {n}")


@hybridq.task(queue="slow", retry=hybridq.Retry(max_attempts=5, backoff_s=3600, jitter=False))
def stubborn(n: int) -> None:
    raise OSError(f"stubborn {n}")


@pytest.fixture
def site(tmp_path: Path):
    journal = tmp_path / "journal"
    with fake_stack(journal, queues=["mail", "bulk", "slow"]) as stack:
        ok = [fine.delay(n) for n in range(3)]
        bad = doomed.delay(EVIL)
        many = [flaky.delay(n) for n in range(4)]
        stack.run()
        retrying = [stubborn.delay(n) for n in range(2)]
        time.sleep(0.01)
        accepted = time.time()  # after the retrying jobs' acceptance, before their failure
        time.sleep(0.01)
        stack.forwarder.step()  # one attempt each, then the retry an hour away: retrying
        stack.worker.work(burst=True, logging_level="WARNING")
        stack.forwarder.step()
        served = routes(ServeConfig(journal=journal))
        app = Starlette(routes=served)
        with serving(app) as base:
            yield {
                "base": base,
                "journal": journal,
                "ok": ok,
                "bad": bad,
                "many": many,
                "retrying": retrying,
                "stack": stack,
                "accepted": accepted,
                "pages": served[0].endpoint.__self__,  # type: ignore[attr-defined]
            }


def _session(base: str, path: str = "/failed") -> tuple[Reply, dict[str, str], str]:
    page = request(base + path)
    token = re.search(r'name="csrf" value="([0-9a-f]+)"', page.body)
    assert token is not None
    return page, {"Cookie": f"hybridq_csrf={page.cookies['hybridq_csrf']}"}, token.group(1)


def _count(page: Reply) -> int:
    found = re.search(r'class="[^"]*count[^"]*" data-count="(\d+)"', page.body)
    assert found is not None, page.body
    return int(found.group(1))


def _digest(page: Reply) -> str:
    found = re.search(r'name="confirm" value="([0-9a-f]+)"', page.body)
    assert found is not None
    return found.group(1)


def _cells(page: Reply, queue: str) -> dict[str, str]:
    row = re.search(rf'<tr data-queue="{queue}">(.*?)</tr>', page.body)
    assert row is not None, page.body
    return dict(re.findall(r'<td data-key="(\w+)">([^<]*)</td>', row.group(1)))


def test_the_queues_page_and_its_chart(site) -> None:
    page = request(site["base"] + "/queues")
    assert page.status == 200
    assert page.headers["content-security-policy"].startswith("default-src 'none'; script-src 'self';")
    mail, slow = _cells(page, "mail"), _cells(page, "slow")
    assert (mail["pending"], mail["running"], mail["done_per_min"]) == ("0", "0", "0.6")  # 3 in 5 min
    assert mail["failed_per_min"] == "0.2"
    assert (slow["pending"], slow["retrying"], slow["waiting"]) == ("2", "2", "0")
    assert mail["in_redis"] == "-"  # no Redis given to this server: said, not a 0
    assert "no Redis given to this server" in page.body
    chart = re.search(r'<figure class="chart throughput" data-total="(\d+)" data-failed="(\d+)"', page.body)
    assert chart is not None
    assert (int(chart.group(1)), int(chart.group(2))) == (8, 5)  # 3 successes, 1 + 4 failures
    assert page.body.count('<g class="minute">') == 60
    assert '<path class="line mean" d="M' in page.body
    # What the CSP refuses is not there: no inline script, no style attribute or element.
    assert not re.search(r"<script(?![^>]*\bsrc=)", page.body)
    assert not re.search(r"\sstyle=|<style", page.body)


def test_search_by_task_and_status(site) -> None:
    base, bad = site["base"], site["bad"].id
    found = request(base + "/jobs?task=doomed&status=failed")
    assert re.findall(r'<a class="job" href="/jobs/([^"]+)">', found.body) == [bad]
    flaky_ones = request(base + "/jobs?task=tests.unit.test_dashboard_ops.f")  # flaky, not fine
    assert len(re.findall(r'class="job"', flaky_ones.body)) == 4
    assert len(re.findall(r'class="job"', request(base + "/jobs?status=finished").body)) == 3
    assert "No job matches." in request(base + "/jobs?task=nothing-like-it").body
    assert 'href="/jobs?page=2&amp;task=x' not in found.body  # one page: no pager links
    hostile = request(base + "/jobs?task=" + Q_ATTR)
    assert hostile.status == 200
    assert EVIL_ATTR not in hostile.body
    assert str(escape(EVIL_ATTR)) in hostile.body
    assert request(base + "/jobs?status=" + Q_EVIL).status == 400
    assert request(base + "/jobs?task=" + "x" * 201).status == 400


def test_a_bulk_requeue_asks_with_the_count_then_acts(site) -> None:
    base, journal = site["base"], site["journal"]
    listed = request(base + "/failed?task=flaky&error=FLAKY")  # error text: any case
    assert len(re.findall(r'<button type="submit" class="requeue"', listed.body)) == 4
    assert "Requeue the 4 jobs selected" in listed.body
    _, cookie, token = _session(base)
    fields = {"csrf": token, "action": "requeue", "task": "flaky", "error": "FLAKY", "since": "", "until": ""}
    ask = request(base + "/failed/bulk", "POST", body=fields, headers=cookie)
    assert (ask.status, _count(ask)) == (200, 4)
    assert len(hybridq.failed_jobs(journal)) == 5  # asking changed nothing
    done = request(base + "/failed/bulk", "POST", body={**fields, "confirm": _digest(ask)}, headers=cookie)
    assert done.status == 200
    assert "Requeued 4 jobs" in done.body
    assert [j.id for j in hybridq.failed_jobs(journal)] == [site["bad"].id]
    site["stack"].run()  # the requeued jobs fail again: the same ids are listed again
    failed_again = {j.id for j in hybridq.failed_jobs(journal)}
    assert {j.id for j in site["many"]} <= failed_again
    # The same confirmation again (a reload, a second tab): it acted once, it asks again.
    again = request(base + "/failed/bulk", "POST", body={**fields, "confirm": _digest(ask)}, headers=cookie)
    assert (again.status, _count(again)) == (409, 4)
    assert "changed since the count you saw" in again.body
    assert {j.id for j in hybridq.failed_jobs(journal)} == failed_again  # nothing requeued twice


def test_a_bulk_action_needs_the_csrf_token_and_its_cookie(site) -> None:
    base, journal = site["base"], site["journal"]
    _, cookie, token = _session(base)
    fields = {"action": "requeue", "task": "flaky"}
    ask = request(base + "/failed/bulk", "POST", body={**fields, "csrf": token}, headers=cookie)
    digest = _digest(ask)
    forged = [
        request(base + "/failed/bulk", "POST", body={**fields, "confirm": digest}, headers=cookie),
        request(
            base + "/failed/bulk",
            "POST",
            body={**fields, "confirm": digest, "csrf": "0" * 64},
            headers=cookie,
        ),
        request(base + "/failed/bulk", "POST", body={**fields, "confirm": digest, "csrf": token}),
        request(
            base + "/failed/bulk",
            "POST",
            body={**fields, "confirm": digest, "csrf": token},
            headers={**cookie, "Origin": "http://evil.example"},
        ),
    ]
    assert [r.status for r in forged] == [403, 403, 403, 403]
    assert len(hybridq.failed_jobs(journal)) == 5
    assert (
        request(
            base + "/failed/bulk", "POST", body={**fields, "csrf": "x" * (1 << 20)}, headers=cookie
        ).status
        == 413
    )


def test_hostile_filters_are_text_and_bad_ones_a_one_line_400(site) -> None:
    base, journal = site["base"], site["journal"]
    shown = request(base + f"/failed?task={Q_ATTR}&error={Q_EVIL}")
    assert shown.status == 200
    assert EVIL not in shown.body
    assert EVIL_ATTR not in shown.body
    assert str(escape(EVIL_ATTR)) in shown.body
    mine = request(base + "/failed?error=" + Q_EVIL)  # the failure whose error holds the script
    assert [site["bad"].id] == re.findall(r'name="job_id" value="([0-9a-f]+)"', mine.body)
    assert EVIL not in mine.body
    _, cookie, token = _session(base)
    ask = request(
        base + "/failed/bulk",
        "POST",
        body={"csrf": token, "action": "requeue", "task": EVIL_ATTR},
        headers=cookie,
    )
    assert (ask.status, _count(ask)) == (200, 0)
    assert EVIL_ATTR not in ask.body
    for query, says in [
        ("since=yesterday", "since is not a time"),
        ("until=99999-01-01T00:00", "until is not a time"),
        ("since=2026-01-02T00:00&until=2026-01-01T00:00", "since is after until"),
        ("task=" + "x" * 201, "task is longer than 200 characters"),
        ("list=" + Q_EVIL, "list is failed or retrying"),
        ("since=0001-01-01T00:00:00%2B14:00", "since is out of range"),  # before year 1 in UTC
        ("until=9999-12-31T23:59:59-14:00", "until is out of range"),  # after year 9999 in UTC
    ]:
        bad = request(base + "/failed?" + query)
        assert bad.status == 400, query
        assert says in bad.body
        assert bad.headers["x-content-type-options"] == "nosniff"
    odd = request(base + "/failed/bulk", "POST", body={"csrf": token, "action": EVIL}, headers=cookie)
    assert odd.status == 400
    late = {"csrf": token, "action": "requeue", "until": "9999-12-31T23:59:59-14:00"}
    beyond = request(base + "/failed/bulk", "POST", body=late, headers=cookie)
    assert (beyond.status, beyond.body.count("until is out of range")) == (400, 1)
    assert EVIL not in odd.body
    assert len(hybridq.failed_jobs(journal)) == 5  # nothing done by any of them


def test_the_widest_range_selects_everything_and_one_action_is_capped(
    site, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, journal = site["base"], site["journal"]
    wide = request(base + "/failed?since=0001-01-01T00:00&until=9999-12-31T23:59:59")
    assert len(re.findall(r'name="job_id"', wide.body)) == 5
    monkeypatch.setattr("hybridq.http.dashboard.failed.BULK_MAX", 2)
    _, cookie, token = _session(base)
    fields = {"csrf": token, "action": "requeue", "since": "0001-01-01T00:00", "until": "9999-12-31T23:59:59"}
    ask = request(base + "/failed/bulk", "POST", body=fields, headers=cookie)
    assert _count(ask) == 2
    assert "3 more match" in ask.body
    done = request(base + "/failed/bulk", "POST", body={**fields, "confirm": _digest(ask)}, headers=cookie)
    assert "Requeued 2 jobs" in done.body
    assert len(hybridq.failed_jobs(journal)) == 3
    oldest = {site["bad"].id, site["many"][0].id}  # the oldest two went
    assert not oldest & {j.id for j in hybridq.failed_jobs(journal)}


def test_a_bulk_cancel_stops_retrying_jobs(site) -> None:
    base, journal = site["base"], site["journal"]
    listed = request(base + "/failed?list=retrying&error=stubborn")
    assert sorted(re.findall(r'<a class="job" href="/jobs/([^"]+)">', listed.body)) == sorted(
        j.id for j in site["retrying"]
    )
    _, cookie, token = _session(base)
    fields = {"csrf": token, "action": "cancel", "error": "stubborn"}
    ask = request(base + "/failed/bulk", "POST", body=fields, headers=cookie)
    assert _count(ask) == 2
    done = request(base + "/failed/bulk", "POST", body={**fields, "confirm": _digest(ask)}, headers=cookie)
    assert "Asked to cancel 2 jobs" in done.body
    for _ in range(5):  # the forwarder takes the requests in: never pushed again, cancelled at once
        site["stack"].forwarder.step()
    assert site["stack"].forwarder.cancels.cancelled == 2
    assert hybridq.stats(journal, redis_url=None)["cancelled"] == 2  # the ledger's (the index lags a step)


def test_the_retrying_list_is_by_the_last_failure_and_acts_once(site) -> None:
    """Its time is the failed attempt's, not the acceptance; a cancel's confirmation acts once."""
    base = site["base"]
    since = urllib.parse.quote(_utc(site["accepted"]))
    listed = request(base + f"/failed?list=retrying&since={since}")  # accepted before, failed after
    assert sorted(re.findall(r'<a class="job" href="/jobs/([^"]+)">', listed.body)) == sorted(
        j.id for j in site["retrying"]
    )
    assert "No job is retrying" in request(base + f"/failed?list=retrying&until={since}").body
    _, cookie, token = _session(base)
    fields = {"csrf": token, "action": "cancel", "since": _utc(site["accepted"])}
    ask = request(base + "/failed/bulk", "POST", body=fields, headers=cookie)
    assert _count(ask) == 2
    done = request(base + "/failed/bulk", "POST", body={**fields, "confirm": _digest(ask)}, headers=cookie)
    assert "Asked to cancel 2 jobs" in done.body
    for _ in range(3):  # the forwarder takes the cancel in; the index learns it (at once, not idle)
        site["stack"].forwarder.step()
    site["stack"].forwarder.lookup.catch_up()
    again = request(base + "/failed/bulk", "POST", body={**fields, "confirm": _digest(ask)}, headers=cookie)
    assert (again.status, _count(again)) == (409, 0)


def test_a_bulk_action_waits_its_turn_like_every_page(site, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bulk POST is built one page at a time too: while another is built, 503 Busy."""
    monkeypatch.setattr("hybridq.http.dashboard.pages.HEAVY_WAIT_S", 0.05)
    base, heavy = site["base"], site["pages"]._heavy
    _, cookie, token = _session(base)
    fields = {"csrf": token, "action": "requeue", "task": "flaky"}
    ask = request(base + "/failed/bulk", "POST", body=fields, headers=cookie)
    assert heavy.acquire(timeout=5)
    try:
        busy = request(
            base + "/failed/bulk", "POST", body={**fields, "confirm": _digest(ask)}, headers=cookie
        )
    finally:
        heavy.release()
    assert (busy.status, busy.headers.get("retry-after")) == (503, "2")
    assert len(hybridq.failed_jobs(site["journal"])) == 5  # nothing done


def _utc(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).replace(tzinfo=None).isoformat()


def test_the_new_pages_need_the_same_auth_as_every_page(journal_dir: Path, tmp_path: Path) -> None:
    hybridq.Queue(journal=journal_dir).enqueue("tests.tasks.add", 1, 2)
    tokens = write_tokens(tmp_path / "tokens", "a-good-token-0123456789")
    with served(config(journal_dir, tokens_file=tokens)) as base:
        assert api_request(base, "GET", "/queues").status == 401
        assert api_request(base, "POST", "/failed/bulk", b"action=requeue").status == 401
        good = api_request(base, "GET", "/queues", None, {"Authorization": "Bearer a-good-token-0123456789"})
        assert good.status == 200
        assert "no forwarder has built here yet" in good.raw.decode()  # no index yet: said, not a 500


def test_the_login_form_is_a_template_that_escapes_next(journal_dir: Path, tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens", "a-good-token-0123456789")
    with served(config(journal_dir, tokens_file=tokens)) as base:
        page = api_request(base, "GET", "/login?next=/" + Q_ATTR)
        body = page.raw.decode()
        assert page.status == 200
        assert EVIL_ATTR not in body
        assert 'name="next" value="/&#34;&gt;&lt;img src=x onerror=alert(1)&gt;"' in body
        assert "style-src 'sha256-" in page.headers["content-security-policy"]  # its one style, by hash


def test_a_requeue_by_someone_else_meanwhile_writes_nothing(site, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the digest's check and the requeue, another operator requeues one of the jobs."""
    from hybridq.http.dashboard import failed as failed_module

    base, journal = site["base"], site["journal"]
    real = failed_module.requeue

    def racing(job_ids: list[str], path: str, **kw: object) -> object:
        real([job_ids[0]], path)  # the other operator, first
        return real(job_ids, path, **kw)  # type: ignore[arg-type]

    _, cookie, token = _session(base)
    fields = {"csrf": token, "action": "requeue", "task": "flaky"}
    ask = request(base + "/failed/bulk", "POST", body=fields, headers=cookie)
    monkeypatch.setattr(failed_module, "requeue", racing)
    done = request(base + "/failed/bulk", "POST", body={**fields, "confirm": _digest(ask)}, headers=cookie)
    assert (done.status, _count(done)) == (409, 3)  # the new count, to confirm again
    assert len(hybridq.failed_jobs(journal)) == 4  # only the other operator's requeue happened


def test_a_filter_reads_utc_offsets_and_survives_its_own_round_trip() -> None:
    from hybridq.errors import BadRequest
    from hybridq.http.dashboard.filters import Filter

    utc = Filter.parse({"since": "2026-12-05T10:00", "until": "2026-12-05T12:00:00.250000+02:00"})
    assert (utc.since, utc.until) == (1796464800.0, 1796464800.25)
    assert Filter.parse(utc.params()) == utc  # what the confirmation carries selects the same
    assert utc.matches("app.send", "x", 1796464800.0)
    assert not utc.matches("app.send", "x", 1796464800.25)  # until is excluded
    assert not Filter(task="send").matches(None, None, 0.0)
    for bad in ({"since": "2026-13-01"}, {"until": "1" * 33}, {"error": "e" * 201}):
        with pytest.raises(BadRequest):
            Filter.parse(bad)


def test_no_template_turns_escaping_off() -> None:
    """Autoescape holds only if no template marks a value safe or switches it off."""
    from hybridq.http.dashboard import templating

    templates = sorted((Path(templating.__file__).parent / "templates").rglob("*.html"))
    assert len(templates) > 10
    for template in templates:
        text = template.read_text()
        assert not re.search(r"\|\s*safe\b|autoescape\s+false|Markup", text), template.name
    assert templating._ENV.autoescape is True


def test_the_queues_page_lists_the_limit_keys_escaped(site, monkeypatch: pytest.MonkeyPatch) -> None:
    pages = site["pages"]
    figures = dict(pages.figures())
    figures["limit_keys"] = {
        EVIL: {
            "policy": "concurrency:2",
            "running": 2,
            "queued": 1,
            "waiting": 40,
            "started_in_period": 0,
            "quarantine_s": 0.0,
            "waiting_on_limit_s": 75.0,
        }
    }
    monkeypatch.setattr(pages, "figures", lambda: figures)
    page = request(site["base"] + "/queues")
    assert page.status == 200
    assert EVIL not in page.body
    row = re.search(
        r'<tr data-limit-key="[^"]*"><td>[^<]*</td><td>concurrency:2</td>(.*?)</tr>', page.body, re.DOTALL
    )
    assert row is not None, page.body
    assert re.findall(r"<td>([^<]*)</td>", row.group(1)) == ["2", "1", "40", "0", "75 s"]


def test_the_queues_page_lists_the_fair_keys_escaped(site, monkeypatch: pytest.MonkeyPatch) -> None:
    pages = site["pages"]
    figures = dict(pages.figures())
    figures["fair_keys"] = {EVIL: {"waiting": 40, "running": None}, "tenant:2": {"waiting": 3, "running": 1}}
    monkeypatch.setattr(pages, "figures", lambda: figures)
    page = request(site["base"] + "/queues")
    assert page.status == 200
    assert EVIL not in page.body
    rows = re.findall(r'<tr data-fair-key="[^"]*"><td>[^<]*</td>(.*?)</tr>', page.body, re.DOTALL)
    assert [re.findall(r"<td>([^<]*)</td>", row) for row in rows] == [["40", ""], ["3", "1"]]
