"""The `speedrun` command, the only part of the package that sees argparse: parser.py is the grammar, program.py
runs a command and turns failures into one line, commands.py turns parsed arguments into library calls."""

from speedrun.cli.program import entry, main

__all__ = ["entry", "main"]
