"""Everything torchrun and DDP: the world a process runs in, wrapping, reductions, barriers.

Recipes ask this module for the rank and world size, a wrapped model, and sums across processes; no other module
imports torch.distributed. One process (no torchrun) is a World of size 1, and every function here is then a no-op
that costs nothing.

The contract with the loops: the global batch is defined in examples and fixed; each of K processes
takes an equal 1/K share of every batch; the loss each process differentiates is the sum over its share, and the
gradients are *summed* across processes (sum_hook), so the step is exactly the single-process step on the global
batch (up to float summation order and BatchNorm's per-process statistics), and the lr schedule and step count do
not depend on K.
"""

from __future__ import annotations

import datetime
import os
import shlex
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# torchrun's environment (torch.distributed.run): which process this is, of how many, on how many machines.
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_joined = [False]  # this process joined a process group (init); exit_process ends it without teardown


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    backend: str | None = None  # "nccl" on GPUs, "gloo" on CPUs; None for one process
    restarts: int = 0  # torchrun's restart count of this worker group (--max-restarts)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints and writes results, checkpoints and saved models."""
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return max(1, self.size // self.local_size)

    def to_dict(self) -> dict:
        return {"processes": self.size, "nodes": self.nodes, "backend": self.backend, "restarts": self.restarts}


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} is not an integer; it is set by torchrun, "
                         "unset it to run one process") from None


def from_env() -> World:
    """The world torchrun describes in the environment; one process when WORLD_SIZE is absent or 1."""
    size = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    local_size = _env_int("LOCAL_WORLD_SIZE", size)
    if not (size >= 1 and 0 <= rank < size and 0 <= local_rank < local_size <= size):
        raise ValueError(f"inconsistent torchrun environment ({', '.join(f'{k}={os.environ.get(k)}' for k in _ENV)});"
                         " start the job with torchrun, or unset these variables to run one process")
    return World(rank, size, local_rank, local_size, None, _env_int("TORCHELASTIC_RESTART_COUNT", 0))


def command_line(argv: list[str]) -> str:
    """The command line a result records. A torchrun worker sees only its own arguments: the launcher is
    reconstructed from torchrun's environment (its rendezvous flags are not visible, and are elided for several
    machines)."""
    own = shlex.join(["speedrun", *argv])
    size, local = os.environ.get("WORLD_SIZE", "1"), os.environ.get("LOCAL_WORLD_SIZE", "1")
    if size == "1" or not size.isdigit() or not local.isdigit() or int(local) < 1:
        return own
    nodes = int(size) // int(local)
    launcher = (f"torchrun --standalone --nproc_per_node={local}" if nodes == 1 else
                f"torchrun --nnodes={nodes} --nproc_per_node={local} --rdzv_endpoint=...")
    return f"{launcher} -m {own}"


def device_for(world: World, device: torch.device) -> torch.device:
    """Under torchrun, process r on a machine takes GPU LOCAL_RANK (one GPU per process)."""
    if world.size > 1 and device.type == "cuda" and device.index is None:
        if world.local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {world.local_rank} has no GPU: this machine has {torch.cuda.device_count()}"
                             "; start at most that many processes per node (--nproc_per_node)")
        return torch.device("cuda", world.local_rank)
    return device


def init(world: World, device: torch.device) -> World:
    """Join the process group (NCCL for CUDA devices, gloo otherwise); returns the world with its backend."""
    if world.size == 1:
        return world
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # A peer that dies is noticed by torchrun, which stops the group; the timeout only bounds a hang.
        timeout = datetime.timedelta(minutes=10)
        kwargs = {"device_id": device if device.type == "cuda" else None, "timeout": timeout}
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps one key-value store across restarts of the worker group; a restarted group
            # reading the addresses its dead predecessors published there fails to connect ("connectFullMesh ...
            # Connection refused", measured with torch 2.13 and --max-restarts). One key prefix per attempt.
            store = dist.PrefixStore(f"speedrun/attempt-{world.restarts}", dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world.size, is_master=False,
                timeout=timeout))
            kwargs.update(store=store, rank=world.rank, world_size=world.size)
        dist.init_process_group(backend, **kwargs)
        _joined[0] = True
    return World(world.rank, world.size, world.local_rank, world.local_size, backend, world.restarts)


def shutdown(world: World, in_step: bool) -> None:
    """Leave the process group. in_step: every process got here the same way (the command succeeded, or a signal
    stopped all of them at the same step), so they wait for each other first: a process that tears its group down
    while a peer still talks to it can abort ("terminate called without an active exception"). After a failure
    no one waits: the peers may be gone, and torchrun stops the rest. A program that wrapped a model in DDP ends
    with exit_process after this (cli/program.py's entry does)."""
    if world.size > 1:
        if dist.is_initialized():
            if in_step:
                dist.barrier()
            dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End a process that joined a process group with `code`, skipping the interpreter's and the C++ runtime's
    teardown; returns (does nothing) in a process that never joined one. Call it last, once every file is closed.

    Why: DistributedDataParallel keeps its process group alive past destroy_process_group. Measured with torch
    2.13 and gloo: after a DDP wrapper is deleted, the group destroyed and gc run, the group's three threads
    (pt_gloo_runloop x2, gloo_tcp_loop) are still running, while without DDP they are joined. They then run
    through the interpreter's finalization and the destruction of C++ statics, and now and then one of them aborts
    the process ("terminate called without an active exception", SIGABRT, after the command had succeeded):
    18 of 40 two-process runs of a 15-line DDP script under CPU load, 0 of 40 ending with os._exit. The same abort
    failed 1 in about 30 of the torchrun tests."""
    if _joined[0]:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more can reach it anyway
                pass
        os._exit(code)


def _sum_hook(group, bucket):
    """DDP communication hook: gradients summed across processes (DDP's default averages them). Each process's
    loss is the sum over its share of the batch, so the sum is the gradient of the loss summed over the global
    batch, the quantity one process computes (the CIFAR recipes' lr is per summed loss, as airbench's)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap(model: nn.Module, world: World, device: torch.device, sync_bn: bool = False) -> nn.Module:
    """The model to train: itself for one process, else DistributedDataParallel with summed gradients.

    sync_bn converts BatchNorm to SyncBatchNorm first (in place: the parameters stay the model's own).
    """
    if world.size == 1:
        return model
    if sync_bn:
        if device.type != "cuda":
            raise ValueError("sync_bn needs CUDA devices (PyTorch's SyncBatchNorm does not run on CPUs); "
                             "leave it off (--set sync_bn=false)")
        _convert_sync_bn(model)
    # Buffers (BatchNorm's running statistics) are rank 0's at every forward: DDP's default.
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    ddp.register_comm_hook(None, _sum_hook)
    return ddp


def _convert_sync_bn(model: nn.Module) -> None:
    # convert_sync_batchnorm returns new modules; swap them in place so `model` keeps its identity (optimizers and
    # Lookahead hold its tensors, and they are moved over as the same Parameter objects).
    for name, child in list(model.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            setattr(model, name, nn.SyncBatchNorm.convert_sync_batchnorm(child))
        else:
            _convert_sync_bn(child)


def rewrap(wrapped: nn.Module, world: World, device: torch.device) -> nn.Module:
    """After parameters stopped (or started) requiring gradients: a new DDP wrapper, whose reducer expects exactly
    the trainable parameters (DDP fixes that set when it is built, and would wait forever for a frozen one's
    gradient). The old wrapper's reducer is released with it."""
    if world.size == 1:
        return wrapped
    inner = wrapped.module  # the model DDP wrapped (compiled or not), BatchNorm already converted if asked
    del wrapped
    return wrap(inner, world, device)


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model inside DDP and torch.compile wrappers (what is saved and checkpointed)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def sum_(tensor: torch.Tensor, world: World, async_op: bool = False):
    """In-place sum across processes (a no-op for one); returns the work handle when async_op."""
    if world.size == 1:
        return None
    return dist.all_reduce(tensor, async_op=async_op)


def broadcast_model(model: nn.Module, world: World) -> None:
    """Every process takes rank 0's parameters and buffers (before evaluating and saving: BatchNorm running
    statistics, and the averages Lookahead keeps of them, are per process)."""
    if world.size == 1:
        return
    with torch.no_grad():
        for t in unwrap(model).state_dict().values():
            dist.broadcast(t, src=0)


def broadcast_object(obj, world: World):
    """Rank 0's picklable `obj` on every process (small control data only: which checkpoint to resume)."""
    if world.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class PeerFailed(Exception):
    """Rank 0 failed at a step the other processes wait on (main_first), and printed why: the others end too, at
    once and quietly, instead of waiting in a collective until torchrun kills them (30 s later, SIGKILL)."""


def main_first(world: World, fn, *, everyone: bool = True):
    """fn() on rank 0 first, then (everyone) on the other processes, which wait for rank 0's outcome.

    For what rank 0 does once before the others may go on: writing a data cache the others then read (everyone),
    or opening the results database and claiming the result file (rank 0 alone: everyone=False, the others get
    None). A failure on rank 0 (an error, an interrupt) is sent to the others, which raise PeerFailed."""
    if world.size == 1:
        return fn()
    if world.is_main:
        try:
            out = fn()
        except BaseException as e:
            try:
                broadcast_object(type(e).__name__, world)
            except Exception:  # noqa: BLE001 -- the peers are gone already (torchrun stopped them): e is the news
                pass
            raise
        broadcast_object(None, world)
        return out
    failed = broadcast_object(None, world)
    if failed is not None:
        raise PeerFailed(f"rank 0 stopped ({failed})")
    return fn() if everyone else None


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()


def check(batch: int, world: World, device: torch.device, sync_bn: bool) -> None:
    """What the batch and running under torchrun ask of any family's config, before any data is read or step
    taken: the global batch splits evenly over the processes, each process's share can be batch-normalized, and
    SyncBatchNorm has CUDA devices (ValueError with the fix)."""
    if world.size > 1:
        share(batch, world)
    per_process = batch // world.size
    if batch < 2 or (per_process < 2 and not sync_bn):  # SyncBatchNorm normalizes over the global batch
        # BatchNorm in training normalizes each channel over the batch; where a net's map is 1x1 (a ResNet's last
        # stage, a CIFAR net on small images) one image gives one value, and torch refuses it mid-run
        each = f"{per_process} image" + ("" if per_process == 1 else "s")  # errors.counted is not ours to import
        who = "its one process" if world.size == 1 else f"each of {world.size} processes"
        raise ValueError(f"batch_size {batch} gives {who} {each} per "
                         f"step, and BatchNorm needs at least 2; use batch_size >= {2 * world.size} "
                         "(--set batch_size=...)")
    if sync_bn and device.type != "cuda":
        raise ValueError("sync_bn needs CUDA devices (PyTorch's SyncBatchNorm does not run on CPUs); leave it off "
                         "(--set sync_bn=false)")


def part(n: int, world: World) -> slice:
    """This process's contiguous part of n items that every process scores apart (the test set): rank r of K takes
    [n*r//K, n*(r+1)//K), so the parts cover all n and differ by at most one item (one may be empty)."""
    return slice(n * world.rank // world.size, n * (world.rank + 1) // world.size)


def share(batch: int, world: World) -> slice:
    """This process's part of a global batch of `batch` examples (an equal 1/K share)."""
    if batch % world.size:
        raise ValueError(f"batch_size {batch} does not split evenly over {world.size} processes; use a multiple of "
                         f"{world.size} (--set batch_size=...)")
    part = batch // world.size
    return slice(world.rank * part, (world.rank + 1) * part)
