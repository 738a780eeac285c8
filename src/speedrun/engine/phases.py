"""Named phases of a training step (data, forward, backward, optimizer, evaluation), for `speedrun profile`.

Each family's loop marks where each phase begins and ends; torch.profiler records a mark as a range, and the
profile splits a step's time by them. With no profiler running a mark is a null context: the flag check costs
about a tenth of a microsecond, where a record_function range would cost a dispatcher call per mark.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch

from speedrun.records.debug_apis import profiler_on

PREFIX = "speedrun/"
PHASES = ("data", "forward", "backward", "optimizer", "evaluation")

_T = TypeVar("_T")


def phase(name: str) -> contextlib.AbstractContextManager:
    """A profiler range named speedrun/<name> while a profiler records; otherwise nothing."""
    if not profiler_on():
        return contextlib.nullcontext()
    return torch.profiler.record_function(PREFIX + name)


def phased(items: Iterable[_T], name: str = "data") -> Iterator[_T]:
    """`items` with each next() marked as the phase `name`: the loader's work of making a batch."""
    iterator = iter(items)
    while True:
        with phase(name):
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item
