"""``hybridq.Queue(url=...)``: enqueue, look up and cancel through two ingest nodes (docs/api.md).

Two ``hybridq serve`` applications in threads (real HTTP over sockets), each on its own journal:
failover on a refused connection and on a node that never answers, the one-line errors, and
lookups that find the job's node or say that it is down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import decimal
import http.server
import json
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import hybridq
import pytest
from hybridq.client.ids import node_of
from hybridq.client.job import RemoteJob, _result
from hybridq.client.nodes import Nodes
from hybridq.client.queue import Remote
from hybridq.envelope.model import Envelope
from hybridq.envelope.tagged import encode
from hybridq.errors import (
    ConfigError,
    EnvelopeError,
    JobWaitTimeout,
    MissingExtra,
    NodeUnavailable,
    OutcomeUnknown,
    QueueFull,
)
from hybridq.http.api import Api
from hybridq.http.app import create_app
from hybridq.http.node import node_name
from hybridq.http.server import Server
from hybridq.journal import JournalReader, RecordType
from starlette.requests import Request
from starlette.responses import Response

from tests.unit.test_http_api import config, job_ids, write_tokens

TOKEN = "remote-token-0123456789abcdef"


class Node:
    """One ingest node: ``hybridq serve`` on its own journal, in a thread; stop and start it."""

    def __init__(self, journal: Path, tokens: Path, **kw: object) -> None:
        self.journal = journal
        self.cfg = config(journal, tokens_file=tokens, **kw)
        self.server: Server | None = None
        self.port = 0
        self.start()

    def start(self) -> None:
        cfg = dataclasses.replace(self.cfg, port=self.port)  # the same port again after a stop
        self.server = Server(create_app(cfg), cfg, access_log=False)
        self.server.start()
        self.port = int(self.server.url.rsplit(":", 1)[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    tokens = write_tokens(tmp_path / "tokens", TOKEN)
    with ExitStack() as stack:
        a = Node(tmp_path / "a", tokens)
        stack.callback(a.stop)
        b = Node(tmp_path / "b", tokens)
        stack.callback(b.stop)
        yield a, b


def urls(*nodes: Node) -> str:
    return ",".join(n.url for n in nodes)


def test_jobs_go_to_both_nodes_and_any_process_finds_each(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    queue = hybridq.Queue("emails", url=urls(a, b), token=TOKEN)
    jobs = [queue.enqueue("tests.tasks.add", i, 1) for i in range(6)]
    names = {node_name(str(a.journal)): a, node_name(str(b.journal)): b}
    assert {node_of(j.id) for j in jobs} == set(names)  # round robin over both
    for job in jobs:
        assert job.id in job_ids(names[node_of(job.id) or ""].journal)  # durable where it says
    # Another client, which never enqueued: any node first, it finds each job's node.
    for job in jobs:
        found = hybridq.fetch_job(job.id, url=urls(b, a), token=TOKEN)
        assert found is not None
        assert (found.id, found.queue, found.envelope.func, found.status) == (
            job.id,
            "emails",
            "tests.tasks.add",
            "queued",
        )
    missing = f"http-{node_name(str(a.journal))}-{'0' * 32}"
    assert hybridq.fetch_job(missing, url=urls(b, a), token=TOKEN) is None
    assert queue.fetch_job("nosuchjob") is None


def test_a_node_down_is_skipped_and_a_lookup_of_its_job_says_it_is_down(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    queue = hybridq.Queue("default", url=urls(a, b), token=TOKEN)
    on_a = next(
        j
        for j in (queue.enqueue("tests.tasks.add", 1, 2) for _ in range(4))
        if node_of(j.id) == node_name(str(a.journal))
    )
    a.stop()
    ids = [queue.enqueue("tests.tasks.add", i, 2).id for i in range(5)]  # refused by a: all on b
    assert set(ids) <= set(job_ids(b.journal))
    with pytest.raises(
        NodeUnavailable, match=f"job {on_a.id} is held by node {node_of(on_a.id)}, which did not answer"
    ):
        hybridq.fetch_job(on_a.id, url=urls(a, b), token=TOKEN)
    with pytest.raises(NodeUnavailable):
        on_a.cancel()
    b.stop()
    with pytest.raises(NodeUnavailable, match="no ingest node took the call") as err:
        queue.enqueue("tests.tasks.add", 1, 2)
    assert {url for url, _ in err.value.tried} == {a.url, b.url}
    assert "cannot connect" in str(err.value)
    a.start()
    assert hybridq.fetch_job(on_a.id, url=urls(b, a), token=TOKEN) is not None  # back: found


def test_a_node_that_never_answers_is_left_for_the_next_with_the_same_key(nodes: tuple[Node, Node]) -> None:
    a, _ = nodes
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts connections (the backlog), never answers
    try:
        port = silent.getsockname()[1]
        queue = hybridq.Queue("default", url=urls(a), token=TOKEN)
        queue.remote = Remote(Nodes([f"http://127.0.0.1:{port}", a.url], TOKEN, read_timeout=0.3))
        jobs = [queue.enqueue("tests.tasks.add", i, 1, idempotency_key=f"k{i}") for i in range(3)]
        again = [queue.enqueue("tests.tasks.add", i, 1, idempotency_key=f"k{i}") for i in range(3)]
    finally:
        silent.close()
    assert [j.id for j in jobs] == [j.id for j in again]  # the same key: the same job
    assert sorted(job_ids(a.journal)) == sorted(j.id for j in jobs)  # one record each
    assert jobs[0].idempotency_key == "k0"


def test_refusals_are_one_line_errors_and_write_nothing(tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens", TOKEN)
    node = Node(tmp_path / "full", tokens, capacity=2)
    try:
        queue = hybridq.Queue("default", url=node.url, token=TOKEN)
        delayed = queue.enqueue("tests.tasks.add", 1, 2, delay=3600)
        with pytest.raises(QueueFull, match="2 pending jobs, capacity 2") as full:
            queue.enqueue_many(  # one POST per job: the ones before the refused one stay acknowledged
                [queue.prepare("tests.tasks.add", (1, 2)), queue.prepare("tests.tasks.add", (3, 4))]
            )
        # The node wrote the delayed job to its delayed chain (docs/journal.md): no set order.
        written = job_ids(node.journal)
        assert full.value.acknowledged == [i for i in written if i != delayed.id]  # type: ignore[attr-defined]
        assert delayed.id in written
        with pytest.raises(EnvelopeError, match=r"refused the job \(400\).*not registered"):
            queue.enqueue("os.system", "true")
        with pytest.raises(EnvelopeError, match="cannot send job_timeout, description"):
            queue.enqueue("tests.tasks.add", 1, 2, job_timeout=5, description="x")
        with pytest.raises(EnvelopeError, match="cannot take job_id="):
            queue.enqueue("tests.tasks.add", 1, 2, job_id="mine")
        with pytest.raises(ConfigError, match="capacity= is the nodes' own"):
            hybridq.Queue("default", url=node.url, token=TOKEN, capacity=5)
        with pytest.raises(ConfigError, match=r"refused the token \(401\)"):
            hybridq.Queue("default", url=node.url, token="wrong-token-0123456789").enqueue(
                "tests.tasks.add", 1, 2
            )
        assert len(job_ids(node.journal)) == 2
    finally:
        node.stop()
    with pytest.raises(ConfigError, match="not an ingest node URL"):
        hybridq.Queue("default", url="ftp://x")
    with pytest.raises(ConfigError, match="give the token with token=") as err:
        hybridq.Queue("default", url="http://user:s3cret@127.0.0.1:1")
    assert "s3cret" not in str(err.value)
    with pytest.raises(ConfigError, match="journal= or url=, not both"):
        hybridq.Queue("default", tmp_path / "j", url="http://127.0.0.1:1")


def test_without_urllib3_a_remote_queue_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "urllib3", None)
    with pytest.raises(MissingExtra, match=r"needs the client extra \(urllib3 is not installed\)"):
        hybridq.Queue("default", url="http://127.0.0.1:9/", token=TOKEN)


def test_env_settings_the_decorator_async_cancel_and_wait(
    nodes: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = nodes
    monkeypatch.delenv("HYBRIDQ_JOURNAL", raising=False)
    monkeypatch.setenv("HYBRIDQ_URL", urls(a, b))
    monkeypatch.setenv("HYBRIDQ_TOKEN", TOKEN)
    job = later.delay(5)
    assert node_of(job.id) is not None
    assert hybridq.fetch_job(job.id).status == "queued"  # type: ignore[union-attr] # no forwarder
    with pytest.raises(JobWaitTimeout):
        job.wait(timeout=0.05)
    assert job.cancel() == "requested"
    queued = asyncio.run(hybridq.Queue("q").enqueue_async("tests.tasks.add", 2, 3))
    assert queued.status == "queued"
    # Many threads share the pool (keep-alive, at most pool_size connections per node).
    out: list[str] = []
    threads = [
        threading.Thread(target=lambda: out.append(hybridq.Queue("q").enqueue("tests.tasks.add", 1, 1).id))
        for _ in range(16)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(out)) == 16
    assert set(out) <= set(job_ids(a.journal)) | set(job_ids(b.journal))


@hybridq.task("later", delay=3600)
def later(x: int) -> int:
    """A task enqueued by its decorator (``HYBRIDQ_URL``: through the nodes)."""
    return x


class _Hostile(http.server.BaseHTTPRequestHandler):
    """A node that answers every request with what ``server.answer`` says."""

    def do_POST(self) -> None:
        status, headers, body = self.server.answer  # type: ignore[attr-defined]
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.do_POST()

    def log_message(self, *args: object) -> None:
        pass


def test_a_hostile_node_cannot_exhaust_memory_nor_redirect_the_token(
    nodes: tuple[Node, Node], caplog: pytest.LogCaptureFixture
) -> None:
    a, _ = nodes
    hostile = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    thread = threading.Thread(target=hostile.serve_forever, daemon=True)
    thread.start()
    try:
        evil = f"http://127.0.0.1:{hostile.server_address[1]}"
        hostile.answer = (202, {}, b'{"id": "' + b"x" * (5 << 20) + b'"}')  # type: ignore[attr-defined]
        remote = Remote(Nodes([evil, a.url], TOKEN))
        queue = hybridq.Queue("default", url=a.url, token=TOKEN)
        queue.remote = remote
        job = queue.enqueue("tests.tasks.add", 1, 2)  # the oversized answer is no answer: a took it
        assert job.id in job_ids(a.journal)
        hostile.answer = (503, {"Retry-After": "1"}, b'{"error": "journal_unavailable"}')  # type: ignore[attr-defined]
        assert queue.enqueue("tests.tasks.add", 1, 3).id in job_ids(a.journal)  # a 503: the next node
        hostile.answer = (307, {"Location": f"{a.url}/v1/jobs"}, b"")  # type: ignore[attr-defined]
        queue.remote = Remote(Nodes([evil], TOKEN))
        before = len(job_ids(a.journal))
        with pytest.raises(hybridq.HybridqError, match="answered 307"):
            queue.enqueue("tests.tasks.add", 1, 2)
        assert len(job_ids(a.journal)) == before  # not followed: the token went nowhere else
    finally:
        hostile.shutdown()
        hostile.server_close()
    with caplog.at_level("WARNING", logger="hybridq.client"):
        Nodes(["http://10.0.0.1:8080", "https://10.0.0.2:8080", "http://127.0.0.1:1"], TOKEN)
    assert caplog.messages == [
        "the token is sent in clear text to http://10.0.0.1:8080: use https:// (docs/security.md)"
    ]


def test_calls_reuse_kept_alive_connections(nodes: tuple[Node, Node]) -> None:
    a, _ = nodes
    remote = Remote(Nodes([a.url], TOKEN))
    queue = hybridq.Queue("default", url=a.url, token=TOKEN)
    queue.remote = remote
    for i in range(30):
        queue.enqueue("tests.tasks.add", i, 1)
    pool = remote.client.nodes._pool.connection_from_url(a.url)
    assert pool.num_connections == 1  # one connection opened, kept alive for all 30


def keys_in(*journals: Path) -> list[str]:
    """The idempotency key of every job record in the journals."""
    return [
        Envelope.from_bytes(r.payload).idempotency_key
        for journal in journals
        for r in JournalReader(journal).records()
        if r.rtype == RecordType.DATA
    ]


def test_a_timeout_then_a_refusal_is_outcome_unknown_and_a_retry_keeps_one_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node a writes the job but answers too late; b answers 429: that is no "nothing written".

    Fails before: the client raised QueueFull (b's answer), and each post made a new random key,
    so enqueue_many of the same envelopes again wrote a second job.
    """
    tokens = write_tokens(tmp_path / "tokens", TOKEN)
    a, b = Node(tmp_path / "a", tokens), Node(tmp_path / "b", tokens, capacity=1)
    original = Api._post

    async def late(self: Api, request: Request) -> Response:  # a takes the job, answers in 1 s
        response = await original(self, request)
        if response.status_code == 202:
            await asyncio.sleep(1.0)
        return response

    try:
        hybridq.Queue("default", url=b.url, token=TOKEN).enqueue("tests.tasks.add", 0, 0)  # b is full
        monkeypatch.setattr(Api, "_post", late)
        queue = hybridq.Queue("default", url=a.url, token=TOKEN)
        queue.remote = Remote(Nodes([a.url, b.url], TOKEN, read_timeout=0.3, rounds=1))
        envs = [queue.prepare("tests.tasks.add", (1, 2))]
        with pytest.raises(OutcomeUnknown, match=rf"idempotency_key='hq-{envs[0].id}'") as err:
            queue.enqueue_many(envs)
        assert err.value.key == f"hq-{envs[0].id}"
        assert "\n" not in str(err.value)
        monkeypatch.undo()
        time.sleep(1.0)  # a's late answer is gone
        queue.remote = Remote(Nodes([a.url], TOKEN))
        (job,) = queue.enqueue_many(envs)  # the same envelopes again: the same key, the same job
        assert job.id in job_ids(a.journal)
        written = keys_in(a.journal, b.journal)
        assert len([k for k in written if k.endswith(f":hq-{envs[0].id}")]) == 1
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize(
    ("state", "read"),
    [
        ({"status": "queued"}, "found"),  # no id: KeyError before
        ({"id": "job1", "status": "queued", "enqueued_at": 10**400}, "found"),  # OverflowError before
        ({"id": "job1", "status": "queued", "attempt": "x"}, "attempt"),  # ValueError before
        ({"id": "job1", "status": "queued", "started_at": 10**400}, "started_at"),  # OverflowError before
    ],
)
def test_a_forged_job_state_is_a_one_line_hybridq_error(state: dict[str, object], read: str) -> None:
    hostile = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    threading.Thread(target=hostile.serve_forever, daemon=True).start()
    try:
        hostile.answer = (200, {}, json.dumps(state).encode())  # type: ignore[attr-defined]
        evil = f"http://127.0.0.1:{hostile.server_address[1]}"
        look = (lambda: hybridq.fetch_job("job1", url=evil, token=TOKEN)) if read == "found" else None
        if look is None:
            queue = hybridq.Queue("default", url=evil, token=TOKEN)
            job = RemoteJob(queue.prepare("tests.tasks.add", (1, 2)), queue.remote.client)  # type: ignore[union-attr]
            look = lambda: getattr(job, read)  # noqa: E731
        with pytest.raises(hybridq.HybridqError, match="not a job's state") as err:
            look()
        assert type(err.value) is hybridq.HybridqError
        assert "\n" not in str(err.value)
    finally:
        hostile.shutdown()
        hostile.server_close()


def test_two_nodes_of_one_name_are_reported_and_their_jobs_still_found(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A journal copied to make a second node keeps the first one's name (a cloned volume).

    Fails before: a lookup went to whichever node last answered with the name, and the other
    node's acknowledged jobs read as missing (``None``).
    """
    tokens = write_tokens(tmp_path / "tokens", TOKEN)
    (tmp_path / "a").mkdir()
    node_name(str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    a, b = Node(tmp_path / "a", tokens), Node(tmp_path / "b", tokens)
    try:
        queue = hybridq.Queue("default", url=urls(a, b), token=TOKEN)
        with caplog.at_level("ERROR", logger="hybridq.client"):
            jobs = [queue.enqueue("tests.tasks.add", i, i) for i in range(6)]
        assert all(queue.fetch_job(j.id) is not None for j in jobs)
    finally:
        a.stop()
        b.stop()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "hybridq.client"]  # once
    assert f"{a.url} and {b.url} both say they are node {node_name(str(a.journal))}" in line


def test_a_cancelled_async_enqueue_goes_on_and_its_envelopes_retry_as_one_job(
    nodes: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remote enqueue_async cancelled by its caller goes on (docs/api.md); its envelopes retry as one.

    The same envelopes again are the same key (``hq-<envelope id>``), so one job. About 2 s.
    Fails before the key was derived from the envelope (a random key per post: two jobs).
    """
    a, _ = nodes
    original = Api._post

    async def late(self: Api, request: Request) -> Response:
        response = await original(self, request)
        await asyncio.sleep(0.5)
        return response

    monkeypatch.setattr(Api, "_post", late)
    queue = hybridq.Queue("default", url=a.url, token=TOKEN)
    envs = [queue.prepare("tests.tasks.add", (4, 4))]

    async def cancelled_then_again() -> str:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(queue.enqueue_many_async(envs), 0.1)
        await asyncio.sleep(0.8)  # its POST went on
        assert len(job_ids(a.journal)) == 1  # not withdrawn
        (job,) = await queue.enqueue_many_async(envs)
        return job.id

    job = asyncio.run(cancelled_then_again())
    assert job_ids(a.journal) == [job]  # one job
    (key,) = keys_in(a.journal)
    assert key.endswith(f":hq-{envs[0].id}")


def test_every_node_silent_is_outcome_unknown_with_the_key() -> None:
    """A node that took the request and never answered may hold the job: not NodeUnavailable (0.3 s)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts connections (the backlog), never answers
    try:
        queue = hybridq.Queue("default", url=f"http://127.0.0.1:{silent.getsockname()[1]}", token=TOKEN)
        queue.remote = Remote(Nodes(queue.remote.urls, TOKEN, read_timeout=0.2, rounds=1))  # type: ignore[union-attr]
        with pytest.raises(OutcomeUnknown, match="no answer in time") as err:
            queue.enqueue("tests.tasks.add", 1, 2, idempotency_key="mine")
        assert err.value.key == "mine"
    finally:
        silent.close()


def test_tagged_arguments_and_results_cross_the_remote_queue(nodes: tuple[Node, Node]) -> None:
    """Dates, decimals, UUIDs, bytes, sets and tuples go through a node as through a journal."""
    a, _ = nodes
    values = (
        dt.datetime(2026, 12, 5, 20, 0, tzinfo=dt.UTC),
        decimal.Decimal("1.10"),
        uuid.UUID(int=7),
        b"\x00\xff",
        {3, 1},
        (1, "x"),
    )
    queue = hybridq.Queue("emails", url=a.url, token=TOKEN)
    job = queue.enqueue("tests.tasks.add", *values, when=dt.date(2026, 12, 5))
    (stored,) = [
        Envelope.from_bytes(r.payload)
        for r in JournalReader(a.journal).records()
        if r.rtype == RecordType.DATA
    ]
    assert stored.id == job.id
    assert stored.call_args() == (values, {"when": dt.date(2026, 12, 5)})
    # A finished job's result, as a node answers it (tagged again: docs/http.md).
    state = {"id": job.id, "status": "finished", "result": encode({"total": decimal.Decimal("2.5")})[0]}
    assert _result(job.id, state) == {"total": decimal.Decimal("2.5")}
