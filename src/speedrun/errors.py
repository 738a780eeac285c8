"""Warnings the user should see even with --quiet (a rebuilt cache, a batch larger than the data, ...).

Library code calls `warn(message)`: Python API users get a standard `SpeedrunWarning` they can filter; the CLI
shows each as one line, `speedrun: warning: ...`, on stderr.
"""

from __future__ import annotations

import warnings


class SpeedrunWarning(UserWarning):
    """Something worth knowing that does not stop the run."""


def warn(message: str) -> None:
    warnings.warn(message, SpeedrunWarning, stacklevel=3)


class Terminated(KeyboardInterrupt):
    """SIGTERM (sent by `timeout`, schedulers and container runtimes) as an interrupt: the finished runs are kept,
    as for Ctrl-C, and the CLI exits 143 (128 + 15)."""
