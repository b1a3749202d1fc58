"""Stateless app hosts over two ingest nodes, one SIGKILLed and restarted (issue 32, docs/http.md).

Real processes: a private redis-server, two ``hybridq forward --serve`` nodes with tokens (each its
own journal), one ``hybridq worker``, two application processes with no journal that enqueue
through both nodes (``$HYBRIDQ_URL``), and a third process that looks every job up and waits for
it. Node A is SIGKILLed while the applications enqueue, and restarted on the same port.

Checked from the tasks' own effects file (``tests.tasks.record`` appends its token, fsync'd):
every acknowledged job ran exactly once, no job ran twice although some were written by the
killed node and then again by the other (a retry with the same key after a broken connection);
every enqueue was acknowledged (one node was always up); ``fetch_job``/``wait`` from the third
process gives each job's result.

The default run enqueues 600 jobs (about 15 s here); ``-m slow`` runs the issue's 10,000.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from hybridq import fetch_job
from hybridq.client.ids import node_of
from hybridq.envelope.model import Envelope
from hybridq.errors import NodeUnavailable
from hybridq.http.app import create_app
from hybridq.http.config import ServeConfig
from hybridq.http.node import NodeDown, node_name
from hybridq.http.peers import ASK_TIMEOUT_S, Peers
from hybridq.http.server import Server
from hybridq.journal import JournalReader, RecordType
from hybridq.journal.paths import ensure_journal_dir
from hybridq.protocol import keys

from tests.support.http import request
from tests.support.processes import WorkerProcess, wait_until
from tests.support.redis import RedisServer
from tests.support.tiers import skip_unless_asked

TOKEN = "fleet-token-0123456789abcdef"


class IngestNode:
    """``hybridq forward --serve 127.0.0.1:PORT --tokens-file T``: a forwarder with the HTTP API."""

    def __init__(self, journal: Path, redis_url: str, tokens: Path, env: dict[str, str], log: Path) -> None:
        self.journal, self.redis_url, self.tokens, self.env, self.log = journal, redis_url, tokens, env, log
        ensure_journal_dir(journal)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        args = [sys.executable, "-m", "hybridq", "forward", "--journal", str(self.journal), "--redis",
                self.redis_url, "--serve", f"127.0.0.1:{self.port}", "--tokens-file", str(self.tokens),
                "--serve-allow", "tests"]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                args, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        assert line.startswith("listening on "), self.log.read_text()[-3000:]
        self.port = int(line.split()[-1].rsplit(":", 1)[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None


def fleet(
    tmp_path: Path, redis_server: RedisServer, subprocess_env: dict[str, str], processes: int
) -> tuple[dict[str, str], IngestNode, IngestNode, WorkerProcess]:
    """Two ingest nodes with one token and a worker: (the children's env, node a, node b, the worker)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    tokens.chmod(0o600)
    env = {k: v for k, v in subprocess_env.items() if k != "HYBRIDQ_JOURNAL"}
    a = IngestNode(tmp_path / "a", redis_server.url, tokens, env, tmp_path / "a.log")
    b = IngestNode(tmp_path / "b", redis_server.url, tokens, env, tmp_path / "b.log")
    worker = WorkerProcess(
        [sys.executable, "-m", "hybridq", "worker", "--redis", redis_server.url, "--processes", str(processes),
         "default"],
        env=env,
        log_path=tmp_path / "worker.log",
        cwd=tmp_path,
    )  # fmt: skip
    return env, a, b, worker


@pytest.fixture(autouse=True)
def _slow_tier_only(request: pytest.FixtureRequest) -> None:
    """The 10,000-job run is skipped unless the run asks for the tier (``-m slow``)."""
    skip_unless_asked(request, "pytest -m slow tests/integration/test_remote_fleet.py")


def records(journal: Path) -> list[Envelope]:
    return [
        Envelope.from_bytes(r.payload) for r in JournalReader(journal).records() if r.rtype == RecordType.DATA
    ]


def lines(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split(" ", 1) for line in path.read_text().splitlines() if line]


@pytest.mark.parametrize(
    "jobs",
    [pytest.param(600, id="600"), pytest.param(10_000, id="10000", marks=pytest.mark.slow)],
)
def test_app_hosts_without_a_journal_enqueue_through_two_nodes_one_killed(
    tmp_path: Path,
    redis_server: RedisServer,
    subprocess_env: dict[str, str],
    figures: object,
    jobs: int,
) -> None:
    env, a, b, worker = fleet(tmp_path, redis_server, subprocess_env, 2)
    app_env = {**env, "HYBRIDQ_URL": f"{a.url},{b.url}", "HYBRIDQ_TOKEN": TOKEN}
    effects, acks = tmp_path / "effects", [tmp_path / "acks-0", tmp_path / "acks-1"]
    apps: list[subprocess.Popen[bytes]] = []
    try:
        start = time.monotonic()
        for n, out in enumerate(acks):
            apps.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "tests.support.remote_app",
                        "enqueue",
                        f"app{n}",
                        str(jobs // 2),
                        "4",
                        str(effects),
                        str(out),
                    ],
                    env=app_env,
                    stdin=subprocess.DEVNULL,
                )
            )
        wait_until(
            lambda: sum(len(lines(p)) for p in acks) >= jobs // 4, timeout=300, what="a quarter acknowledged"
        )
        a.kill()  # SIGKILL mid-load: requests in flight on it break
        killed_at = sum(len(lines(p)) for p in acks)
        time.sleep(1.0)
        a.start()  # the same port, the same journal
        for app in apps:
            assert app.wait(600) == 0
        enqueue_s = time.monotonic() - start
        acked = dict(line for p in acks for line in lines(p))
        errors = {token: got for token, got in acked.items() if got.startswith("ERROR")}
        assert not errors, list(errors.items())[:5]  # one node was always up: every enqueue acknowledged
        assert len(acked) == jobs

        def all_ran() -> bool:
            return set(effects.read_text().split()) >= set(acked) if effects.exists() else False

        wait_until(all_ran, timeout=600, interval=0.5, what="every acknowledged job ran")
        # The third process: no journal, looks each job up through the nodes and waits for it.
        ids_file = tmp_path / "ids"
        ids_file.write_text("\n".join(acked.values()))
        results = tmp_path / "results"
        subprocess.run(
            [sys.executable, "-m", "tests.support.remote_app", "wait", str(ids_file), str(results), "60"],
            env=app_env,
            check=True,
            timeout=600,
        )

        def settled() -> list[dict[str, Any]] | None:  # every record of both journals ended: the copies too
            auth = {"Authorization": f"Bearer {TOKEN}"}
            got = [request(n.url, "GET", "/v1/stats", None, auth).json for n in (a, b)]
            return got if all(x["pending"] == 0 for x in got) else None

        node_stats = wait_until(settled, timeout=120, interval=0.2, what="both journals without pending jobs")
        ran = Counter(effects.read_text().split())
    finally:
        for app in apps:
            if app.poll() is None:
                app.kill()
                app.wait()
        worker.kill()
        a.kill()
        b.kill()
    got = dict(lines(results))
    assert {job_id: got[job_id] for job_id in acked.values()} == {j: t for t, j in acked.items()}
    assert set(ran) == set(acked)  # nothing ran that no app asked for
    twice = {t: n for t, n in ran.items() if n != 1}
    assert not twice, twice  # every acknowledged job ran once
    # Copies: a retry after a broken connection made the key's job on the other node too. Counted
    # in the segments still on disk (the forwarders compact those whose every job ended).
    written = [*records(a.journal), *records(b.journal)]
    per_token = Counter(env.args[1] for env in written)
    copies = sum(n - 1 for n in per_token.values())
    assert set(per_token) <= set(acked)
    assert max(per_token.values(), default=1) <= 2  # at most one record per node and key
    names = {node_name(str(a.journal)), node_name(str(b.journal))}
    assert {node_of(j) for j in acked.values()} == names
    figures(
        f"remote fleet jobs={jobs} acked={len(acked)} killed_after={killed_at} enqueue_s={enqueue_s:.1f} "
        f"ran_once={sum(1 for n in ran.values() if n == 1)} ran_twice={len(twice)} "
        f"copies_on_both_nodes>={copies} suppressed={sum(x['duplicates_suppressed'] for x in node_stats)} "
        f"results_ok={len(acked)}"
    )


def test_one_key_written_by_both_nodes_runs_once_and_both_report_its_result(
    tmp_path: Path, redis_server: RedisServer, subprocess_env: dict[str, str]
) -> None:
    """The cross-node retry, made on purpose: A wrote the key's job (its 202 lost), then B did.

    Two journals, two ids (each names its node), one idempotency key (scoped to the token, the
    same on both nodes): the workers' claim of the key in the shared Redis runs it once; the other
    delivery finds the stored outcome and reports it, so both ids read ``finished`` with the result.
    """
    _env, a, b, worker = fleet(tmp_path, redis_server, subprocess_env, 1)
    effects = tmp_path / "effects"
    auth = {"Authorization": f"Bearer {TOKEN}", "Idempotency-Key": "order-42"}
    body = {"task": "tests.tasks.record", "args": [str(effects), "order-42"]}
    try:
        ids = [request(n.url, "POST", "/v1/jobs", body, auth).json["id"] for n in (a, b)]
        assert ids[0] != ids[1]
        assert [node_of(i) for i in ids] == [node_name(str(a.journal)), node_name(str(b.journal))]

        def states() -> list[dict[str, object]] | None:
            got = [
                request(n.url, "GET", f"/v1/jobs/{i}", None, auth).json
                for n, i in zip((a, b), ids, strict=True)
            ]
            return got if all(s["status"] == "finished" for s in got) else None

        done = wait_until(states, timeout=60, what="both copies finished")
        # Any node answers for any node's job: b asks a through Redis.
        via_b = [request(b.url, "GET", f"/v1/jobs/{i}", None, auth) for i in ids]
        assert [(r.status, r.json["result"], r.headers["hybridq-node"]) for r in via_b] == [
            (200, "order-42", node_of(ids[1])),
            (200, "order-42", node_of(ids[1])),
        ]
        missing = f"http-{node_of(ids[0])}-{'0' * 32}"
        assert request(b.url, "GET", f"/v1/jobs/{missing}", None, auth).json["node"] == node_of(ids[0])
        assert fetch_job(missing, url=b.url, token=TOKEN) is None  # a asked through b: no such job
        assert fetch_job(ids[0], url=b.url, token=TOKEN).result == "order-42"  # type: ignore[union-attr]
        a.kill()
        down = request(b.url, "GET", f"/v1/jobs/{ids[0]}", None, auth)
        assert (down.status, down.json["error"], down.json["node"]) == (
            503,
            "node_unavailable",
            node_of(ids[0]),
        )
        with pytest.raises(NodeUnavailable, match=f"held by node {node_of(ids[0])}, which did not answer"):
            fetch_job(ids[0], url=[b.url, a.url], token=TOKEN)
    finally:
        worker.kill()
        a.kill()
        b.kill()
    assert [s["result"] for s in done] == ["order-42", "order-42"]
    assert effects.read_text().split() == ["order-42"]  # ran once


def test_a_lookup_through_redis_writes_only_a_reply_key(redis_server: RedisServer) -> None:
    """A Redis writer's hostile lookups: a reply key that is not one, garbage, a huge request."""
    client = redis.Redis.from_url(redis_server.url)
    peers = Peers(redis_server.url, "0a0a0a0a", lambda job_id: {"id": job_id, "status": "finished"})
    peers.start()
    try:
        asker = Peers(redis_server.url, "0b0b0b0b", lambda _: None)
        got = asker.ask("0a0a0a0a", "http-0a0a0a0a-" + "1" * 32)
        assert got == {"id": "http-0a0a0a0a-" + "1" * 32, "status": "finished"}
        with pytest.raises(NodeDown, match="node 0c0c0c0c is down"):
            asker.ask("0c0c0c0c", "http-0c0c0c0c-" + "1" * 32)
        asks = keys.node_asks("0a0a0a0a")
        client.rpush(
            asks, json.dumps({"id": "x", "reply": keys.rq_queue("default")}), b"{not json", b"x" * 5000
        )
        client.rpush(asks, json.dumps({"id": "../etc", "reply": keys.node_reply("2" * 32)}))
        wait_until(lambda: client.llen(asks) == 0, timeout=10, what="the hostile asks read")
        assert asker.ask("0a0a0a0a", "http-0a0a0a0a-" + "3" * 32) is not None  # still answering
        assert client.exists(keys.rq_queue("default"), keys.node_reply("2" * 32)) == 0
        asker.client.close()
    finally:
        peers.stop()
        client.close()


def _forge_answers(client: redis.Redis, node: str, reply: bytes) -> threading.Thread:
    """A Redis writer answering node ``node``'s next lookup with ``reply``."""

    def forge() -> None:
        got = client.blpop([keys.node_asks(node)], timeout=10)
        if got is not None:
            client.lpush(json.loads(got[1])["reply"], reply)

    thread = threading.Thread(target=forge, daemon=True)
    thread.start()
    return thread


def test_a_forged_answer_over_64_kib_or_of_another_shape_is_refused(redis_server: RedisServer) -> None:
    """Fails before: a 150 MB forged answer was read whole (47 -> 797 MB) and served."""
    client = redis.Redis.from_url(redis_server.url)
    asker = Peers(redis_server.url, "0b0b0b0b", lambda _: None)
    job = "http-0d0d0d0d-" + "1" * 32
    try:
        client.set(keys.node_seen("0d0d0d0d"), "x", ex=60)  # forged: no such node runs
        huge = json.dumps({"state": {"id": job, "status": "finished", "result": "A" * (70 << 10)}})
        thread = _forge_answers(client, "0d0d0d0d", huge.encode())
        with pytest.raises(NodeDown, match="over 65536 bytes"):
            asker.ask("0d0d0d0d", job)
        thread.join()
        thread = _forge_answers(client, "0d0d0d0d", json.dumps({"state": {"id": "other"}}).encode())
        with pytest.raises(NodeDown, match="answered garbage"):
            asker.ask("0d0d0d0d", job)
        thread.join()
    finally:
        asker.client.close()
        client.close()


def test_lookups_of_a_forged_alive_node_do_not_hold_up_posts(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Lookups of another node run on their own few threads; the rest answer 503 at once (about 3 s).

    Fails before: 12 clients looking up ids of a forged "alive" node held the default thread
    pool (2 s each) and a keyed POST waited for it (0.016 s -> 11-12 s, past a client's timeout).
    """
    client = redis.Redis.from_url(redis_server.url)
    client.set(keys.node_seen("0e0e0e0e"), "x", ex=60)
    journal = tmp_path / "j"
    ensure_journal_dir(journal)
    cfg = ServeConfig(journal=journal, port=0, allow=("tests",), redis_url=redis_server.url, peers=True)
    server = Server(create_app(cfg), cfg, access_log=False)
    server.start()
    stop = threading.Event()
    answers: Counter[int] = Counter()

    def look_up() -> None:
        while not stop.is_set():
            answers[request(server.url, "GET", "/v1/jobs/http-0e0e0e0e-" + "0" * 32).status] += 1

    threads = [threading.Thread(target=look_up, daemon=True) for _ in range(12)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        took = []
        for i in range(3):
            start = time.monotonic()
            got = request(
                server.url,
                "POST",
                "/v1/jobs",
                {"task": "tests.tasks.add", "args": [i, 1]},
                {"Idempotency-Key": f"k{i}"},
            )
            took.append(time.monotonic() - start)
            assert got.status == 202
        assert max(took) < ASK_TIMEOUT_S, took  # never behind a lookup's wait (generous: 2 s)
    finally:
        stop.set()
        for t in threads:
            t.join()
        server.stop()
        client.close()
    assert answers[503] > 0  # the lookups past the few threads: "busy", at once


def test_two_running_nodes_of_one_name_are_reported(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A journal copied to make a second node (a cloned volume) keeps the first one's name (about 3 s).

    Fails before: nothing said so, and each node's jobs read as missing through the other.
    """
    first = Peers(redis_server.url, "0f0f0f0f", lambda _: None)
    copy = Peers(redis_server.url, "0f0f0f0f", lambda _: None)
    with caplog.at_level("ERROR", logger="hybridq.http"):
        first.start()
        copy.start()
        try:
            wait_until(
                lambda: any("another running node" in m for m in caplog.messages),
                timeout=10,
                what="the clone reported",
            )
        finally:
            first.stop()
            copy.stop()
    lines = [m for m in caplog.messages if "another running node" in m]  # each sees the other
    assert 1 <= len(lines) <= 2
    assert all("node name 0f0f0f0f" in m and "node.state" in m for m in lines)


def test_a_node_restarted_after_a_kill_is_not_taken_for_a_copy(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The name's key outlives a killed node by up to 5 s: its successor must not warn (about 3 s)."""
    client = redis.Redis.from_url(redis_server.url)
    client.set(keys.node_seen("0f1f0f1f"), json.dumps({"seen": time.time(), "instance": "dead"}), ex=5)
    node = Peers(redis_server.url, "0f1f0f1f", lambda _: None)
    with caplog.at_level("ERROR", logger="hybridq.http"):
        node.start()
        time.sleep(2.5)
        node.stop()
    client.close()
    assert not [m for m in caplog.messages if "another running node" in m]
