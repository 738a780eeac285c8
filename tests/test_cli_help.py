"""Every flag and argument of every command has a help text (`speedrun COMMAND --help` explains each)."""

from __future__ import annotations

import argparse

from speedrun.cli.parser import build_parser


def _commands(parser: argparse.ArgumentParser, name: str = "speedrun"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _commands(sub, f"{name} {sub_name}")


def test_every_argument_of_every_command_has_help():
    missing = [f"{name}: {'/'.join(a.option_strings) or a.dest}" for name, parser in _commands(build_parser())
               for a in parser._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
    assert missing == []

