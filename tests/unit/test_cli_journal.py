"""No ``--journal`` and no ``HYBRIDQ_JOURNAL``: every command refuses in one line (issue 27).

As the Python API does (``Queue().enqueue`` raises ``ConfigError``), the command line never
assumes ``./hybridq-journal``: a forwarder started in the wrong directory used to forward an
empty journal without a word.
"""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from hybridq.cli import EXIT_USAGE, cli

#: Every command that takes --journal, with the other arguments it needs to get that far.
COMMANDS = {
    ("journal", "verify"): [],
    ("journal", "dump"): [],
    ("journal", "repair"): [],
    ("forward",): [],
    ("status",): [],
    ("doctor",): [],
    ("enqueue",): ["tasks.send", "1"],
    ("failed", "list"): [],
    ("failed", "show"): ["0190c3"],
    ("failed", "requeue"): ["0190c3"],
    ("cancel",): ["0190c3"],
    ("relay",): ["--outbox", "sqlite:///app.db"],
    ("serve",): [],
}


def _commands_with_journal(group: click.Group, ctx: click.Context, prefix: tuple[str, ...] = ()):
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None
        if isinstance(command, click.Group):
            yield from _commands_with_journal(command, ctx, (*prefix, name))
        elif any("--journal" in p.opts for p in command.params):
            yield (*prefix, name)


def test_the_list_holds_every_command_that_takes_a_journal() -> None:
    found = set(_commands_with_journal(cli, click.Context(cli)))
    assert found == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=" ".join)
def test_no_journal_given_is_one_line_exit_2_and_nothing_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: tuple[str, ...]
) -> None:
    monkeypatch.chdir(tmp_path)
    for env in ({"HYBRIDQ_JOURNAL": None}, {"HYBRIDQ_JOURNAL": ""}):
        result = CliRunner().invoke(cli, [*command, *COMMANDS[command]], env=env)
        assert result.exit_code == EXIT_USAGE, result.output
        assert result.stderr == (
            "hybridq: error: no journal given: pass --journal PATH or set HYBRIDQ_JOURNAL (docs/cli.md)\n"
        )
        assert list(tmp_path.iterdir()) == []  # no ./hybridq-journal, no app.db


def test_help_says_it_is_required_and_needs_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDQ_JOURNAL", raising=False)
    result = CliRunner().invoke(cli, ["forward", "--help"])
    assert result.exit_code == 0
    assert "hybridq-journal" not in result.output
    assert "required" in result.output


def test_hybridq_journal_is_used_when_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["status", "--json"], env={"HYBRIDQ_JOURNAL": str(tmp_path / "j")})
    assert result.exit_code == 1  # it does not exist: the path it was given, not a guess
    assert str(tmp_path / "j") in result.stderr
