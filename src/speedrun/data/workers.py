"""The processes this package forks to read data (the folder decode's, `data prepare`'s pool, the DataLoader workers
that read shards) and the stop signals: one policy for all of them.

Ctrl-C reaches the whole foreground process group; `kill -TERM -PGID` (Slurm, a shell) and a cgroup's stop
(systemd, a container runtime) reach every process. A worker acting on such a signal itself would print its own
traceback, or die by it, and the parent would then fail on a dead worker in the middle of stopping: torch's SIGCHLD
handler raises "DataLoader worker ... is killed by signal" wherever the parent is, a checkpoint's write included.
So the parent alone decides: it turns the signal into KeyboardInterrupt (the CLI's SIGTERM handler raises
errors.Terminated), finishes or abandons its work, and ends its workers.

- The signals are blocked in the forking thread across the fork (`stop_signals_blocked`), so none reaches a worker
  before `leave_stop_signals_to_the_parent` has set its handling and unblocked them.
- A worker ignores SIGINT. SIGTERM ends a worker that holds nothing its parent waits for (the decode's, prepare's).
  A DataLoader worker, whose batches the parent may need to finish its current step, ignores a SIGTERM from anyone
  but its parent, and ends quietly on its parent's (torch's shutdown and multiprocessing's exit end workers with
  terminate(): ignoring those hung the parent's exit).
- A worker dies with its parent, so a SIGKILLed command leaves none behind: ours by Linux's PR_SET_PDEATHSIG
  (`forked_worker`), a DataLoader's by torch's own watchdog (its parent may be a forkserver, Python 3.14's default).
- The parent waits on its workers in slices of WAIT_SLICE_S (`wait_for`). The kernel may deliver a process-wide
  signal to any thread that does not block it (torch's, a pool's; any, while the waiting thread blocks the signals
  to fork): that interrupts no blocking call in the main thread, and CPython runs the handler only when the main
  thread next runs Python. One wait without a timeout saw a Ctrl-C at the end of the decode.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import functools
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})
WAIT_SLICE_S = 0.1  # how late the parent may see a stop signal that another of its threads received

_T = TypeVar("_T")


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """SIGINT and SIGTERM held back in this thread (a fork inherits the mask); delivered when the block ends."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def forked_worker(parent_pid: int) -> None:
    """First thing in a worker this package forks itself (the decode's, prepare's): SIGINT ignored, SIGTERM ending
    it at once, and it dies with `parent_pid`."""
    leave_stop_signals_to_the_parent(parent_pid, sigterm_ends_worker=True)
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the parent ends its workers itself
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def leave_stop_signals_to_the_parent(parent_pid: int, *, sigterm_ends_worker: bool) -> None:
    """In a worker: SIGINT ignored; SIGTERM ending it at once, or only when `parent_pid` sent it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sigterm_ends_worker or not hasattr(signal, "sigwaitinfo"):  # macOS has none: SIGTERM ends the worker
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    else:
        _end_on_the_parents_sigterm(parent_pid)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _end_on_the_parents_sigterm(parent_pid: int) -> None:
    """SIGTERM stays blocked in every thread of this worker (threads made later inherit the mask), and one thread
    takes each with its sender, which a Python handler cannot see: the parent's ends the worker as torch's own
    handler does (exit 0, which torch's SIGCHLD check in the parent accepts), anyone else's is dropped."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def take() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent_pid:
                os._exit(0)

    threading.Thread(target=take, name="speedrun-sigterm", daemon=True).start()


def _dataloader_worker(parent_pid: int, worker_id: int) -> None:
    leave_stop_signals_to_the_parent(parent_pid, sigterm_ends_worker=False)


def dataloader_worker_init() -> Callable[[int], None]:
    """A DataLoader's worker_init_fn: the policy above, run after torch's own handlers are set (it replaces the
    SIGTERM one, which ends the worker by the signal unless the parent sent it). Picklable, for a spawn context."""
    return functools.partial(_dataloader_worker, os.getpid())


def started(loader: Iterable[_T]) -> Iterator[_T]:
    """iter(loader) with the stop signals blocked while it forks its workers (a DataLoader starts them here)."""
    with stop_signals_blocked():
        return iter(loader)


def wait_for(future: cf.Future[_T]) -> _T:
    """future.result(), waited for in slices (see the module)."""
    while not future.done():
        cf.wait([future], timeout=WAIT_SLICE_S)
    return future.result()


def kill_pool(pool: cf.ProcessPoolExecutor) -> None:
    """End a pool's workers now, whatever they are doing: for an abandoned pool, whose shutdown would otherwise wait
    for every task a worker holds (minutes, for large photos)."""
    kill = getattr(pool, "kill_workers", None)  # Python 3.14
    if kill is not None:
        kill()
        return
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        with contextlib.suppress(OSError, ValueError):  # already ended, or closed
            proc.kill()
