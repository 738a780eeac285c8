"""The `speedrun` command, the only part of the package that sees argparse: parser.py is the grammar, program.py
runs a command and turns failures into one line, file_commands.py and train_commands.py turn parsed arguments into
library calls and print what they return."""

from speedrun.cli.program import entry, main

__all__ = ["entry", "main"]
