"""`python -m speedrun.cli`: the same program as the `speedrun` console script."""

import sys

from speedrun.cli.program import entry

if __name__ == "__main__":
    sys.exit(entry())
