"""``hybridq serve``'s API (issue 18): every status code, idempotency, auth, OpenAPI, metrics.

The application runs under uvicorn in a thread of the test process and is spoken to over a real
socket (``tests/support/http.py``); the kill-under-load and Redis tests are in
``tests/integration/test_http_serve.py``.
"""

from __future__ import annotations

import errno
import functools
import http.client
import json
from collections import Counter
from pathlib import Path

import pytest
from hybridq.envelope.model import Envelope
from hybridq.http import api as api_module
from hybridq.http.app import create_app
from hybridq.http.auth import COOKIE, session_value
from hybridq.http.config import ServeConfig
from hybridq.journal import JournalReader, RecordType
from hybridq.journal import writer as writer_module
from hybridq.transport import MemoryTransport

from tests.support.faulty import FaultyFileOps
from tests.support.http import request, served
from tests.unit.test_forwarder import make_forwarder

ADD = {"task": "tests.tasks.add", "args": [1, 2]}
JSON = {"Content-Type": "application/json"}


def config(journal: Path, **kw: object) -> ServeConfig:
    kw.setdefault("allow", ("tests",))
    return ServeConfig(journal=journal, port=0, **kw)  # type: ignore[arg-type]


def job_ids(journal: Path) -> list[str]:
    if not journal.exists():
        return []
    return [
        Envelope.from_bytes(r.payload).id
        for r in JournalReader(journal).records()
        if r.rtype == RecordType.DATA
    ]


def test_post_answers_202_with_the_id_and_location_once_durable(journal_dir: Path) -> None:
    with served(config(journal_dir)) as base:
        got = request(base, "POST", "/v1/jobs", {**ADD, "queue": "q1", "kwargs": {}, "delay": 0, "retry": 3})
        assert got.status == 202, got
        job = got.json["id"]
        assert got.headers["location"] == f"/v1/jobs/{job}"
        assert job_ids(journal_dir) == [job]  # in the journal when the answer came
        looked = request(base, "GET", got.headers["location"])
        assert looked.status == 200
        assert looked.json["status"] == "queued"
        assert looked.json["queue"] == "q1"
        assert looked.json["attempt"] == 0


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"{not json", "JSON object"),
        (b"[1, 2]", "JSON object"),
        (b'{"task": "tests.tasks.add", "args": [NaN]}', "NaN"),
        ({**ADD, "colour": "red"}, "unknown field(s): colour"),
        ({"args": [1]}, '"task" must be a string'),
        ({"task": "os.system", "args": ["true"]}, "not registered"),
        ({"task": "nodots"}, "dotted path"),
        ({**ADD, "args": {"a": 1}}, '"args" must be a JSON array'),
        ({**ADD, "kwargs": [1]}, '"kwargs" must be a JSON object'),
        ({**ADD, "queue": "-bad"}, "invalid queue name"),
        ({**ADD, "delay": "soon"}, '"delay" must be a number'),
        ({**ADD, "delay": -1}, "delay"),
        ({**ADD, "retry": 0}, "max_attempts"),
        ({**ADD, "retry": {"tries": 2}}, "unknown field"),
    ],
)
def test_bad_input_is_400_with_a_json_error_and_nothing_written(
    journal_dir: Path, body: object, words: str
) -> None:
    with served(config(journal_dir)) as base:
        got = request(base, "POST", "/v1/jobs", body)
    assert got.status == 400, got
    assert got.json["error"] == "bad_request"
    assert words in got.json["detail"]
    assert job_ids(journal_dir) == []


def test_a_bad_idempotency_key_is_400(journal_dir: Path) -> None:
    with served(config(journal_dir)) as base:
        got = request(base, "POST", "/v1/jobs", ADD, {"Idempotency-Key": "x" * 256})
    assert got.status == 400
    assert got.json["error"] == "bad_idempotency_key"


def test_too_large_is_413_by_length_or_while_streaming(journal_dir: Path) -> None:
    big = {**ADD, "args": ["x" * 2000]}
    with served(config(journal_dir, max_body=1000)) as base:
        assert request(base, "POST", "/v1/jobs", big).status == 413
        # No Content-Length (chunked): refused once the bytes read pass the limit.
        url = base.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(url[0], int(url[1]), timeout=30)
        chunks = iter([json.dumps(big).encode()[i : i + 300] for i in range(0, 2100, 300)])
        conn.request("POST", "/v1/jobs", body=chunks, headers=JSON, encode_chunked=True)
        resp = conn.getresponse()
        assert resp.status == 413
        assert json.loads(resp.read())["error"] == "too_large"
        conn.close()
        assert request(base, "POST", "/v1/jobs", ADD).status == 202
    assert len(job_ids(journal_dir)) == 1


def test_a_full_queue_is_429_with_retry_after(journal_dir: Path) -> None:
    with served(config(journal_dir, capacity=2)) as base:
        assert [request(base, "POST", "/v1/jobs", ADD).status for _ in range(2)] == [202, 202]
        got = request(base, "POST", "/v1/jobs", ADD)
    assert got.status == 429
    assert got.headers["retry-after"] == "1"
    assert got.json["error"] == "queue_full"
    assert len(job_ids(journal_dir)) == 2


def test_the_202_waits_for_the_fsync(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the journal's fdatasync is held, the POST gets no answer; released, it gets 202."""
    import threading

    from hybridq.journal.fileops import FileOps

    entered, release = threading.Event(), threading.Event()

    class HeldSync(FileOps):
        def fdatasync(self, fd: int) -> None:
            entered.set()
            assert release.wait(30)
            super().fdatasync(fd)

    monkeypatch.setattr(
        "hybridq.producer.writers.JournalWriter",
        functools.partial(writer_module.JournalWriter, fileops=HeldSync()),
    )
    answers: list[int] = []
    with served(config(journal_dir)) as base:
        poster = threading.Thread(
            target=lambda: answers.append(request(base, "POST", "/v1/jobs", ADD).status)
        )
        poster.start()
        assert entered.wait(30)
        poster.join(0.3)
        assert answers == []  # written, not yet fsync'd: no answer
        release.set()
        poster.join(30)
    assert answers == [202]


def test_an_unwritable_journal_is_503_and_a_retry_with_the_key_gets_one_job(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every fdatasync fails (a full disk): 503; the disk back, the retried key gives one job."""
    faulty = FaultyFileOps("fdatasync", nth=1, count=1_000_000, err=errno.ENOSPC)
    real = writer_module.JournalWriter
    monkeypatch.setattr("hybridq.producer.writers.JournalWriter", functools.partial(real, fileops=faulty))
    with served(config(journal_dir)) as base:
        got = request(base, "POST", "/v1/jobs", ADD, {"Idempotency-Key": "disk-full"})
        assert got.status == 503, got
        assert got.json["error"] == "journal_unavailable"
        assert got.headers["retry-after"] == "1"
        assert faulty.injected >= 1
        faulty.count = 0  # the disk has room again
        from hybridq.producer.queue import _close_writers

        _close_writers()
        again = request(base, "POST", "/v1/jobs", ADD, {"Idempotency-Key": "disk-full"})
        assert again.status == 202, again
        third = request(base, "POST", "/v1/jobs", ADD, {"Idempotency-Key": "disk-full"})
    assert third.json["id"] == again.json["id"]
    assert set(job_ids(journal_dir)) == {again.json["id"]}


def test_unknown_job_ids_are_404(journal_dir: Path) -> None:
    with served(config(journal_dir)) as base:
        request(base, "POST", "/v1/jobs", ADD)
        for path in ("/v1/jobs/0123456789abcdef", "/v1/jobs/not%20an%20id", "/v1/jobs/" + "a" * 200):
            got = request(base, "GET", path)
            assert got.status == 404, path
            assert got.json["error"] == "not_found"


def test_idempotency_key_same_id_no_second_job_and_422_for_another_call(journal_dir: Path) -> None:
    key = {"Idempotency-Key": "order-42"}
    with served(config(journal_dir)) as base:
        first = request(base, "POST", "/v1/jobs", ADD, key)
        again = request(base, "POST", "/v1/jobs", ADD, key)
        other = request(base, "POST", "/v1/jobs", {**ADD, "args": [1, 3]}, key)
        other_queue = request(base, "POST", "/v1/jobs", {**ADD, "queue": "elsewhere"}, key)
    assert first.status == again.status == 202
    assert again.json["id"] == first.json["id"]
    assert again.headers["idempotent-replayed"] == "true"
    assert other.status == other_queue.status == 422
    assert other.json["error"] == "idempotency_key_reused"
    assert first.json["id"] in other.json["detail"]
    assert job_ids(journal_dir) == [first.json["id"]]


def test_idempotency_holds_across_a_restart_before_and_after_the_forwarder_indexed_it(
    journal_dir: Path,
) -> None:
    with served(config(journal_dir)) as base:
        first = request(base, "POST", "/v1/jobs", ADD, {"Idempotency-Key": "a"}).json["id"]
    with served(config(journal_dir)) as base:  # a new server: read from the journal's tail
        assert request(base, "POST", "/v1/jobs", ADD, {"Idempotency-Key": "a"}).json["id"] == first
        second = request(base, "POST", "/v1/jobs", ADD, {"Idempotency-Key": "b"}).json["id"]
    forwarder = make_forwarder(journal_dir, MemoryTransport())
    forwarder.step()  # both indexed: the next server finds them in the lookup index
    forwarder.close()
    with served(config(journal_dir)) as base:
        for key, job in (("a", first), ("b", second)):
            got = request(base, "POST", "/v1/jobs", ADD, {"Idempotency-Key": key})
            assert (got.status, got.json["id"]) == (202, job)
        assert request(base, "POST", "/v1/jobs", {**ADD, "args": [9]}, {"Idempotency-Key": "b"}).status == 422
    assert Counter(job_ids(journal_dir)) == {first: 1, second: 1}


def test_concurrent_posts_with_one_key_make_one_job(journal_dir: Path) -> None:
    import concurrent.futures

    with served(config(journal_dir)) as base, concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(
            pool.map(lambda _: request(base, "POST", "/v1/jobs", ADD, {"Idempotency-Key": "k"}), range(32))
        )
    assert {a.status for a in answers} == {202}
    assert len({a.json["id"] for a in answers}) == 1
    assert len(job_ids(journal_dir)) == 1


def test_concurrent_posts_share_group_commits(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import concurrent.futures

    commits: list[int] = []
    real = api_module.Api.__init__

    def spy(self: api_module.Api, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)  # type: ignore[arg-type]
        commits.append(id(self))
        spied.append(self)

    spied: list[api_module.Api] = []
    monkeypatch.setattr(api_module.Api, "__init__", spy)
    with served(config(journal_dir)) as base, concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda _: request(base, "POST", "/v1/jobs", ADD), range(200)))
        committers = list(spied[0].committer._committers.values())
    assert {a.status for a in answers} == {202}
    assert len(job_ids(journal_dir)) == 200
    (committer,) = committers
    print(f"200 POSTs from 32 clients: {committer.commits} commits")
    assert committer.commits < 200  # POSTs that arrived together shared a commit (one fsync)


def write_tokens(path: Path, *tokens: str) -> Path:
    path.write_text("# tokens\n" + "".join(t + "\n" for t in tokens))
    path.chmod(0o600)  # others may not read it (a warning otherwise)
    return path


def test_bearer_tokens_rotation_and_open_paths(journal_dir: Path, tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens", "old-token-0123456789", "new-token-0123456789")
    with served(config(journal_dir, tokens_file=tokens)) as base:
        assert request(base, "GET", "/healthz").status == 200  # never behind auth
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic b2xkLXRva2VuLTE="}):
            got = request(base, "POST", "/v1/jobs", ADD, headers)
            assert got.status == 401, headers
            assert got.headers["www-authenticate"].startswith("Bearer")
            assert got.json["error"] == "unauthorized"
        for path in ("/v1/stats", "/metrics", "/v1/openapi.json", "/v1/jobs/abc"):
            assert request(base, "GET", path).status == 401, path
        assert job_ids(journal_dir) == []
        for token in ("old-token-0123456789", "new-token-0123456789"):
            got = request(base, "POST", "/v1/jobs", ADD, {"Authorization": f"Bearer {token}"})
            assert got.status == 202
        write_tokens(tokens, "new-token-0123456789", "third-token-0123456789")  # rotated: read again
        assert (
            request(base, "GET", "/v1/stats", None, {"Authorization": "Bearer old-token-0123456789"}).status
            == 401
        )
        assert (
            request(base, "GET", "/v1/stats", None, {"Authorization": "Bearer third-token-0123456789"}).status
            == 200
        )


def test_login_form_sets_a_strict_httponly_cookie_that_authenticates(
    journal_dir: Path, tmp_path: Path
) -> None:
    tokens = write_tokens(tmp_path / "tokens", "s3cret-token-0123456789")
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    with served(config(journal_dir, tokens_file=tokens)) as base:
        page = request(base, "GET", "/login?next=/queues")
        assert page.status == 200
        assert b'name="token"' in page.raw
        assert b'value="/queues"' in page.raw
        browser = request(base, "GET", "/somewhere", None, {"Accept": "text/html"})
        assert browser.status == 303
        assert browser.headers["location"] == "/login?next=%2Fsomewhere"
        wrong = request(base, "POST", "/login", b"token=guess&next=/", form)
        assert wrong.status == 401
        assert "set-cookie" not in wrong.headers
        ok = request(base, "POST", "/login", b"token=s3cret-token-0123456789&next=//evil.example/", form)
        assert ok.status == 303
        assert ok.headers["location"] == "/"  # never to another site
        cookie = ok.headers["set-cookie"]
        issued = int(cookie.split("=", 1)[1].split(".", 1)[0])
        assert cookie.startswith(f"{COOKIE}={session_value(b's3cret-token-0123456789', issued)};")
        assert "s3cret-token-0123456789" not in cookie
        low = cookie.lower()
        assert "httponly" in low
        assert "samesite=strict" in low
        value = cookie.split(";")[0]
        # The cookie opens the dashboard (CSRF-protected), never the API (no CSRF check there).
        assert request(base, "GET", "/", None, {"Cookie": value}).status == 200
        assert request(base, "GET", "/", None, {"Cookie": f"{COOKIE}=forged"}).status == 401
        assert request(base, "GET", "/v1/stats", None, {"Cookie": value}).status == 401


def test_routes_see_request_state_authenticated(journal_dir: Path, tmp_path: Path) -> None:
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    seen: list[object] = []

    async def page(request: Request) -> JSONResponse:
        seen.append(request.state.authenticated)
        return JSONResponse({})

    tokens = write_tokens(tmp_path / "tokens", "tok-0123456789abcdef")
    app = create_app(config(journal_dir, tokens_file=tokens))
    app.router.routes.append(Route("/probe", page))
    from hybridq.http.server import Server

    cfg = config(journal_dir, tokens_file=tokens)
    server = Server(app, cfg, access_log=False)
    server.start()
    try:
        assert request(server.url, "GET", "/probe").status == 401
        assert (
            request(
                server.url, "GET", "/probe", None, {"Authorization": "Bearer tok-0123456789abcdef"}
            ).status
            == 200
        )
    finally:
        server.stop()
    assert seen == [True]


def test_without_a_tokens_file_every_request_is_authenticated(journal_dir: Path) -> None:
    with served(config(journal_dir)) as base:
        assert request(base, "GET", "/v1/stats").status == 200


def test_openapi_lists_every_route_and_status_code(journal_dir: Path) -> None:
    from hybridq.http import dashboard

    app = create_app(config(journal_dir))
    with served(config(journal_dir)) as base:
        doc = request(base, "GET", "/v1/openapi.json").json
    assert doc["openapi"].startswith("3.")
    pages = {getattr(r, "path", None) for r in dashboard.routes(config(journal_dir))}  # HTML, not API
    served_paths = {
        (route.path.replace("{job_id}", "{id}"), method.lower())
        for route in app.routes
        if getattr(route, "path", None) not in pages
        for method in getattr(route, "methods", None) or ()
        if method != "HEAD"
    }
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert served_paths == documented
    codes = set(doc["paths"]["/v1/jobs"]["post"]["responses"])
    assert codes == {"202", "400", "401", "408", "413", "415", "422", "429", "503"}
    assert set(doc["paths"]["/v1/jobs/{id}"]["get"]["responses"]) >= {"200", "401", "404"}
    assert doc["paths"]["/healthz"]["get"]["security"] == []


def test_stats_and_metrics(journal_dir: Path) -> None:
    with served(config(journal_dir, capacity=50)) as base:
        for queue in ("a", "a", "b"):
            request(base, "POST", "/v1/jobs", {**ADD, "queue": queue})
        request(base, "POST", "/v1/jobs", b"nope")
        got = request(base, "GET", "/v1/stats").json
        metrics = request(base, "GET", "/metrics")
    for field in ("queued", "capacity", "forwarded", "succeeded", "failed", "pending"):
        assert field in got, field
    assert got["capacity"] == 50
    assert got["pending_by_queue"] == {"a": 2, "b": 1}
    assert got["queued"] == 3
    assert got["oldest_pending_age_s"] >= 0
    assert got["forwarding_lag_s"] >= 0
    text = metrics.raw.decode()
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "hybridq_accepted_total 3.0" in text
    assert 'hybridq_http_posts_total{code="202"} 3.0' in text
    assert 'hybridq_http_posts_total{code="400"} 1.0' in text
    assert 'hybridq_queue_pending{queue="a"} 2.0' in text
    assert "hybridq_capacity 50.0" in text


def test_one_key_is_never_held_twice_when_a_holder_comes_back_at_once(journal_dir: Path) -> None:
    """A POST that ends and one of the same key that starts in the same loop step, while another
    waits: the waiter and the newcomer must not both hold the key (each would write the job)."""
    import asyncio

    from hybridq.http.idempotency import KeyStore

    store = KeyStore(str(journal_dir))
    inside = [0]
    most = [0]

    async def held(pause: float) -> None:
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        await asyncio.sleep(pause)
        inside[0] -= 1

    async def first() -> None:
        async with store.hold("http-x"):
            await asyncio.sleep(0.01)
        async with store.hold("http-x"):  # again at once, before the waiter below has run
            await held(0.01)

    async def waiter() -> None:
        await asyncio.sleep(0.001)
        async with store.hold("http-x"):
            await held(0.01)

    async def main() -> None:
        await asyncio.gather(first(), waiter())

    asyncio.run(main())
    assert most[0] == 1
    assert store._locks == {}


def _chains(journal: Path) -> dict[str, str]:
    """Each job's chain (writer id), by its id."""
    return {
        Envelope.from_bytes(r.payload).id: r.writer_id
        for r in JournalReader(journal).records()
        if r.rtype == RecordType.DATA
    }


def test_a_delayed_post_without_a_key_takes_the_delayed_chain_and_one_with_a_key_the_main_one(
    journal_dir: Path,
) -> None:
    # Review 2 M1: the node mints a fresh id per POST (http-<node>-...), so a delayed job needs no
    # key order and may leave the main chain (issue 29). Fails before the prepare's fresh mark:
    # the id's shape read it as the caller's, and every delayed POST pinned the main chain.
    with served(config(journal_dir)) as base:
        now = request(base, "POST", "/v1/jobs", ADD).json["id"]
        later = request(base, "POST", "/v1/jobs", {**ADD, "delay": 3600}).json["id"]
        keyed = request(
            base, "POST", "/v1/jobs", {**ADD, "delay": 3600}, headers={"Idempotency-Key": "k1"}
        ).json["id"]
    chains = _chains(journal_dir)
    assert chains[later] != chains[now]
    assert chains[keyed] == chains[now]  # a key of the caller's: ordered with its other calls
