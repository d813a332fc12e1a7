"""`lr --help` and every subcommand's `--help`, as a new user reads them: each command says what it
does and each option what it means."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from airflow_provider_lr import cli


def _commands(parser: argparse.ArgumentParser, path: str = "lr") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield f"{path} {name}", child
                yield from _commands(child, f"{path} {name}")


def test_every_command_says_what_it_does_and_every_option_what_it_means(capsys):
    """`lr sync --help`, `lr init --help` ... printed only their usage and options (the one line of
    what the command does was in `lr --help` alone), and `--count`, `--region`, `--reason`,
    `--sinks`, `--federated` ... had no help at all."""
    commands = dict(_commands(cli.build_parser()))
    assert {"lr sync", "lr sites up", "lr tables open", "lr roles grant"} <= set(commands)
    missing = []
    for path, parser in commands.items():
        if not parser.description:
            missing.append(f"{path}: no description")
        for action in parser._actions:
            if action.option_strings and action.help is None and "-h" not in action.option_strings:
                missing.append(f"{path} {action.option_strings[0]}: no help")
            elif not action.option_strings and action.help is None and action.dest != "command":
                if not isinstance(action, argparse._SubParsersAction):
                    missing.append(f"{path} {action.dest}: no help")
    assert not missing, "\n".join(missing)
    parser = commands["lr sync"]
    assert "streaming until stopped" in parser.format_help()
