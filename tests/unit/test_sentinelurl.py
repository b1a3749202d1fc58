"""``redis+sentinel://`` URLs: parsing, checking, redaction and the client factory (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from hybridq.errors import InvalidRedisURL
from hybridq.transport import redisurl
from hybridq.transport.sentinel import SENTINEL_PORT, SENTINEL_TIMEOUT_S, parse_sentinel
from redis.sentinel import SentinelConnectionPool

from tests.unit.test_cli import assert_one_line_error, run_cli


def test_the_contract_form_parses() -> None:
    parsed = parse_sentinel("redis+sentinel://10.0.0.1:26379,10.0.0.2:26380/mymaster/0")
    assert parsed.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26380))
    assert (parsed.service, parsed.db) == ("mymaster", 0)
    kwargs = parsed.sentinel_kwargs()
    assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == SENTINEL_TIMEOUT_S
    assert kwargs["retry"].get_retries() == 0  # a dead Sentinel: the next one is asked at once


def test_defaults_ipv6_credentials_and_options() -> None:
    parsed = parse_sentinel(
        "redis+sentinel://hq:p%40ss@s1,[::1]:26390/cache/3"
        "?sentinel_password=sp&sentinel_username=su&sentinel_timeout=0.25&socket_timeout=7&client_name=hq"
    )
    assert parsed.sentinels == (("s1", SENTINEL_PORT), ("::1", 26390))
    assert (parsed.service, parsed.db) == ("cache", 3)
    master = parsed.master_kwargs()
    assert master["username"] == "hq"
    assert master["password"] == "p@ss"
    assert master["db"] == 3
    assert master["socket_timeout"] == 7.0
    assert master["client_name"] == "hq"
    assert "sentinel_password" not in master
    kwargs = parsed.sentinel_kwargs()
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (0.25, 0.25)
    assert (kwargs["username"], kwargs["password"]) == ("su", "sp")


def test_the_factory_builds_a_sentinel_master_client_and_the_url_options_win() -> None:
    url = "redis+sentinel://hq:pw@127.0.0.1:1,127.0.0.1:2/mymaster/2?socket_timeout=7"
    client = redisurl.client(url, socket_timeout=1.0, socket_connect_timeout=3.0)
    try:
        pool = client.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        assert pool.service_name == "mymaster"
        assert pool.is_master
        assert [s.connection_pool.connection_kwargs["port"] for s in pool.sentinel_manager.sentinels] == [
            1,
            2,
        ]
        kwargs = pool.connection_kwargs
        assert (kwargs["db"], kwargs["password"], kwargs["username"]) == (2, "pw", "hq")
        assert kwargs["socket_timeout"] == 7.0  # the URL's, as with redis.Redis.from_url
        assert kwargs["socket_connect_timeout"] == 3.0  # the caller's
        # The worker's short-timeout client of the same service (hybridq.worker.scripts.client).
        sibling = redisurl.sibling(client, socket_timeout=0.5)
        assert isinstance(sibling.connection_pool, SentinelConnectionPool)
        assert sibling.connection_pool.sentinel_manager is pool.sentinel_manager
        assert sibling.connection_pool.connection_kwargs["socket_timeout"] == 0.5
        assert sibling.connection_pool.connection_kwargs["connection_pool"] is not kwargs["connection_pool"]
    finally:
        client.close()


def test_a_plain_url_still_makes_a_plain_client() -> None:
    client = redisurl.client("redis://127.0.0.1:1/4", socket_timeout=2.0)
    try:
        assert type(client.connection_pool) is redis.ConnectionPool
        assert client.connection_pool.connection_kwargs["db"] == 4
        assert type(redisurl.sibling(client).connection_pool) is redis.ConnectionPool
    finally:
        client.close()


BAD_SENTINEL_URLS = {
    "redis+sentinel://127.0.0.1:26379": "name the master's service",
    "redis+sentinel://127.0.0.1:26379/": "name the master's service",
    "redis+sentinel://127.0.0.1:26379/mymaster/zero": "the database must be a number",
    "redis+sentinel://127.0.0.1:26379/mymaster/0/1": "the path must be /SERVICE or /SERVICE/DB",
    "redis+sentinel://127.0.0.1:notaport/mymaster": "bad Sentinel port",
    "redis+sentinel://127.0.0.1:99999/mymaster": "bad Sentinel port",
    "redis+sentinel://h1:26379,,h2/mymaster": "bad Sentinel address",
    "redis+sentinel://[::1/mymaster": "bad Sentinel address",
    "redis+sentinel://h1/mymaster?sentinel_timeout=soon": "sentinel_timeout must be",
    "redis+sentinel://h1/mymaster?sentinel_timeout=0": "sentinel_timeout must be",
    "redis+sentinel://h1/mymaster?socket_timeout=soon": "socket_timeout",
    "redis+sentinel://:s3cret@h1/mymaster?no_such_option=1": "no_such_option",
    "rediss+sentinel://h1/mymaster": "TLS to Sentinels is not supported",
}


@pytest.mark.parametrize("url", BAD_SENTINEL_URLS)
def test_a_malformed_sentinel_url_is_one_line_without_secrets(url: str) -> None:
    with pytest.raises(InvalidRedisURL) as caught:
        redisurl.check_url(url + ("&" if "?" in url else "?") + "sentinel_password=s3cret")
    message = str(caught.value)
    assert message.startswith("invalid Redis URL redis")
    assert BAD_SENTINEL_URLS[url] in message
    assert "\n" not in message
    assert "s3cret" not in message


def test_a_good_sentinel_url_passes_the_check() -> None:
    url = "redis+sentinel://u:pw@h1:26379,h2:26379/mymaster/0?sentinel_password=x&socket_timeout=5"
    assert redisurl.check_url(url) == url


def test_every_secret_of_a_sentinel_url_is_redacted() -> None:
    url = "redis+sentinel://hq:s3cret@h1:26379,h2:26379/mymaster/0?sentinel_password=t0p&socket_timeout=5"
    assert redisurl.redact_url(url) == (
        "redis+sentinel://hq:***@h1:26379,h2:26379/mymaster/0?sentinel_password=***&socket_timeout=5"
    )


@pytest.mark.parametrize(
    ("command", "url"),
    [
        ("status", "redis+sentinel://127.0.0.1:26379/mymaster/zero"),
        ("doctor", "redis+sentinel://:s3cret@127.0.0.1:26379"),
        ("worker", "redis+sentinel://127.0.0.1:notaport/mymaster"),
        ("forward", "redis+sentinel://127.0.0.1/mymaster?sentinel_timeout=soon&sentinel_password=s3cret"),
    ],
)
def test_the_commands_refuse_a_malformed_sentinel_url_in_one_line(
    command: str, url: str, journal_dir: Path, subprocess_env: dict[str, str]
) -> None:
    from hybridq import Queue

    Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 1)
    args = {
        "status": ["status", "--journal", str(journal_dir)],
        "doctor": ["doctor", "--journal", str(journal_dir)],
        "worker": ["worker", "--burst"],
        "forward": ["forward", "--journal", str(journal_dir)],
    }[command]
    assert_one_line_error(run_cli({**subprocess_env, "HYBRIDQ_REDIS_URL": url}, *args), "invalid Redis URL")


def test_a_password_file_fills_in_the_redis_servers_password() -> None:
    from hybridq.transport.redisurl import with_password

    url = with_password("redis+sentinel://hq@h1:26379,h2:26379/mymaster/0?sentinel_password=sp", "p@ss/w")
    parsed = parse_sentinel(redisurl.check_url(url))
    assert parsed.sentinels == (("h1", 26379), ("h2", 26379))
    assert (parsed.master_kwargs()["username"], parsed.master_kwargs()["password"]) == ("hq", "p@ss/w")
    assert parsed.sentinel_password == "sp"
    assert "p@ss" not in redisurl.redact_url(url)
    assert "sp" not in redisurl.redact_url(url).split("?")[1]


def test_no_sentinel_answering_is_one_short_line_naming_each() -> None:
    from redis.sentinel import MasterNotFoundError

    ports = [_closed_port(), _closed_port()]
    url = f"redis+sentinel://:s3cret@127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/mymaster/0?sentinel_password=s3cret"
    client = redisurl.client(url)
    try:
        with pytest.raises(MasterNotFoundError) as caught:
            client.ping()
    finally:
        client.close()
    message = str(caught.value)
    assert message.startswith("no Sentinel names a healthy master for 'mymaster' (127.0.0.1:")
    assert all(f"127.0.0.1:{port}: " in message for port in ports)
    assert "\n" not in message
    assert "s3cret" not in message
    assert len(message) < 400  # redis-py's own message: the repr of every Sentinel client (kB)


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class _FakeSentinel:
    def __init__(self, host: str, result: object) -> None:
        from types import SimpleNamespace

        self.connection_pool = SimpleNamespace(connection_kwargs={"host": host, "port": 26379})
        self.result = result

    def sentinel_masters(self) -> object:
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.mark.parametrize("others", ["master_down", "unreachable"])
def test_one_sentinel_refusing_the_login_is_an_outage_not_a_refusal(others: str) -> None:
    """A password rotation half done during a failover must not make every process exit."""
    from hybridq.transport import redisurl
    from hybridq.transport.sentinel import _sentinel_class
    from redis.exceptions import AuthenticationError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.sentinel import MasterNotFoundError

    down = {"mymaster": {"ip": "10.0.0.1", "port": 6379, "is_master": True, "is_sdown": True,
                         "is_odown": True, "num-other-sentinels": 2}}  # fmt: skip
    other: object = down if others == "master_down" else RedisConnectionError("refused")
    sentinels = _sentinel_class()([("x", 1)])
    sentinels.sentinels = [
        _FakeSentinel("s1", other),
        _FakeSentinel("s2", other),
        _FakeSentinel("s3", AuthenticationError("WRONGPASS invalid username-password pair")),
    ]
    with pytest.raises(MasterNotFoundError) as caught:
        sentinels.discover_master("mymaster")
    assert redisurl.refusal(caught.value) is None  # retried as an outage
    sentinels.sentinels = [_FakeSentinel(f"s{i}", AuthenticationError("WRONGPASS")) for i in range(3)]
    with pytest.raises(AuthenticationError):  # every one refuses: a configuration to fix
        sentinels.discover_master("mymaster")
