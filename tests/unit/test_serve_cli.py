"""``hybridq serve`` and ``forward --serve``: bad command lines are one line and exit 1, nothing served."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from hybridq.cli import cli
from hybridq.cli.serve import parse_bind


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--bind", "0.0.0.0:0"], "not a loopback address: give --tokens-file"),
        (["--bind", "192.0.2.1:8080"], "not a loopback address"),
        (["--bind", "nonsense"], "give HOST:PORT"),
        (["--bind", "127.0.0.1:99999"], "give HOST:PORT"),
        (["--bind", "::1:8080"], "give HOST:PORT"),
        (["--tokens-file", "{tmp}/missing"], "tokens file"),
        (["--bind", "0.0.0.0:0", "--tokens-file", "{tmp}/empty"], "no token in it"),
        (["--tokens-file", "{tmp}/spaced"], "line 1 is not a token"),
        (["--import", "no_such_module_here"], "no_such_module_here"),
        (["--redis", "http://127.0.0.1:6379/0"], "invalid Redis URL"),
        (["--redis", "redis+sentinel://h:26379/"], "invalid Redis URL"),
    ],
)
def test_bad_command_lines_are_one_line_and_exit_1(tmp_path: Path, args: list[str], words: str) -> None:
    (tmp_path / "empty").write_text("# nothing\n\n")
    (tmp_path / "spaced").write_text("two words\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--bind" not in args:
        args += ["--bind", "127.0.0.1:0"]
    result = CliRunner().invoke(cli, ["serve", "--journal", str(tmp_path / "journal"), *args])
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert words in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "journal").exists()  # nothing written


def test_an_unusable_signing_key_is_one_line_and_exit_1(tmp_path: Path) -> None:
    env = {"HYBRIDQ_SIGNING_KEY_FILE": str(tmp_path / "missing-key")}
    result = CliRunner().invoke(
        cli, ["serve", "--journal", str(tmp_path / "journal"), "--bind", "127.0.0.1:0"], env=env
    )
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1
    assert "missing-key" in result.stderr


def test_forward_serve_on_a_public_address_needs_tokens(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["forward", "--journal", str(tmp_path / "journal"), "--serve", "0.0.0.0:8080"]
    )
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1
    assert "give --tokens-file" in result.stderr


def test_parse_bind() -> None:
    assert parse_bind("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_bind("[::1]:8080") == ("::1", 8080)
    assert parse_bind("localhost:80") == ("localhost", 80)
    for bad in ("", ":80", "host", "host:port", "[::1]", "1.2.3.4:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_bind(bad)


def test_allowed_host_and_limit_concurrency_reach_the_server_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridq.cli import serve as serve_module

    seen = []

    class Stub:
        def run(self) -> None:
            pass

    def start(ctx: object, config: object, registry: object = None) -> Stub:
        seen.append(config)
        return Stub()

    monkeypatch.setattr(serve_module, "start_server", start)
    args = ["serve", "--journal", str(tmp_path / "journal"), "--bind", "127.0.0.1:0"]
    extra = ["--allowed-host", "jobs.internal", "--allowed-host", "proxy", "--limit-concurrency", "5"]
    extra += ["--client-connections", "3"]
    result = CliRunner().invoke(cli, [*args, *extra])
    assert result.exit_code == 0, result.output
    (config,) = seen
    assert config.allowed_hosts == ("jobs.internal", "proxy")
    assert config.limit_concurrency == 5
    assert config.client_connections == 3
    assert CliRunner().invoke(cli, [*args, "--limit-concurrency", "0"]).exit_code == 2


def test_forward_serve_takes_allowed_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridq.cli import forward as forward_module

    seen = []

    def config(ctx: object, **kwargs: object) -> None:
        seen.append(kwargs)
        raise SystemExit(0)  # the server's settings are all this test looks at

    monkeypatch.setattr(forward_module, "serve_config", config)
    args = ["forward", "--journal", str(tmp_path / "journal"), "--redis", "redis://127.0.0.1:1/0"]
    result = CliRunner().invoke(cli, [*args, "--serve", "127.0.0.1:0", "--serve-allowed-host", "proxy"])
    assert result.exit_code == 0, result.output
    assert seen[0]["allowed_hosts"] == ("proxy",)
