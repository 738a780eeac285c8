"""`python -m speedrun ...`: the same program as the `speedrun` console script."""

import sys

from speedrun.cli.program import entry

sys.exit(entry())
