"""What a training loop asks of its device, counted without one: kernels launched, copies from the host, reads
back to the host and data-dependent synchronizations, step by step.

A GPU wastes time in ways a CPU cannot time: a blocking copy from pageable memory, an `.item()` that drains the
queue, a boolean mask whose output size the host must wait for, an extra elementwise kernel. They can be counted
anywhere, though: the loop runs on PyTorch's meta device (shapes only, no data, no arithmetic) under a
TorchDispatchMode that sees every operator below autograd, as the device would receive it. The host stays the
CPU, so a tensor crossing between CPU and meta is a transfer, and everything the loop does on meta tensors is
work a GPU would be given. Counts do not depend on batch size or width, so tiny shapes give a real recipe's counts.

What is counted, per stretch of the loop (Counter.mark() ends one; a loop marks once per optimizer step):
- kernels: every operator on a meta tensor that computes (views and allocations excluded: they launch nothing),
  by name; a multi-tensor (_foreach_) operator counts once, as one launch sequence from the host;
- host_to_device: copies of non-scalar CPU tensors onto the device (`.to(device)`, `copy_`), with where they
  were made (file:line), since a copy from pageable memory synchronizes the host with the device on CUDA;
- device_to_host: reads of device values on the host (`item`, `tolist`, `bool(t)`, `.cpu()`), with where;
- data_dependent: operators whose output size depends on the values (nonzero, boolean-mask indexing,
  masked_select, unique): the host must wait for the device to learn a shape. On meta they are assumed to select
  everything (torch's meta_nonzero_assume_all_nonzero), so the loop goes on.
A read returns ones (a finite loss, a count that divides), which is what the loops here need to carry on.

Autocast has no meta implementation: on "meta" tricks/precision.py's autocast emulates CUDA's casts
(precision.emulated_autocast), so a counted step holds the casts a CUDA step makes, backward ones included.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter as Tally
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
import torch.optim.optimizer as optimizer_module
from torch.fx.experimental import _config as fx_config
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve()
TORCH_DIR = Path(torch.__file__).resolve().parent
# Operators that allocate or alias without computing: no kernel on a GPU.
_NO_KERNEL = {"empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
              "new_empty_strided.default", "lift_fresh.default", "detach.default", "alias.default",
              "_has_compatible_shallow_copy_type.default", "set_.source_Storage_storage_offset",
              "resize_.default", "record_stream.default"}
_READS = {"_local_scalar_dense.default", "is_nonzero.default", "equal.default"}


@dataclass
class Work:
    """What one stretch of a loop asked of the device."""

    kernels: Tally = field(default_factory=Tally)  # operator name -> launches
    host_to_device: list[str] = field(default_factory=list)  # where each copy onto the device was made
    device_to_host: list[str] = field(default_factory=list)  # where each read back was made
    data_dependent: list[str] = field(default_factory=list)  # "op at file:line"

    @property
    def launches(self) -> int:
        return sum(self.kernels.values())

    def totals(self) -> dict[str, int]:
        return {"kernels": self.launches, "host_to_device": len(self.host_to_device),
                "device_to_host": len(self.device_to_host), "data_dependent": len(self.data_dependent)}

    def __add__(self, other: Work) -> Work:
        return Work(self.kernels + other.kernels, self.host_to_device + other.host_to_device,
                    self.device_to_host + other.device_to_host, self.data_dependent + other.data_dependent)


def _where() -> str:
    """file:line of the innermost frame outside torch and this module (the loop's own line)."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path == HERE or path.is_relative_to(TORCH_DIR) or frame.filename.startswith("<"):
            continue
        parts = path.parts
        short = "/".join(parts[parts.index("speedrun") + 1:]) if "speedrun" in parts else "/".join(parts[-2:])
        return f"{short}:{frame.lineno}"
    return "?"


def _devices(tree) -> set[str]:
    found = set()

    def visit(x):
        if isinstance(x, torch.Tensor):
            # A 0-d CPU tensor beside device tensors is a wrapped scalar, passed by value, not copied
            if not (x.device.type == "cpu" and x.dim() == 0):
                found.add(x.device.type)
        elif isinstance(x, (list, tuple)):
            for item in x:
                visit(item)
        elif isinstance(x, dict):
            for item in x.values():
                visit(item)

    visit(tree)
    return found


def _data_dependent(short: str, func, args) -> bool:
    """Whether the output's size depends on values: torch tags such operators, and indexing is one only with a
    boolean mask (aten's index and index_put take either kind of index, so both carry the tag)."""
    if short in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else []
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return torch.Tag.dynamic_output_shape in func.tags


class Counter(TorchDispatchMode):
    """Counts, under `with Counter() as c:`, what the code does on meta tensors; c.mark() closes a stretch.

    c.stretches: the Work of each closed stretch, in order; c.current: the open one."""

    def __init__(self) -> None:
        super().__init__()
        self.stretches: list[Work] = []
        self.current = Work()
        self._config = contextlib.ExitStack()

    def __enter__(self):
        if hasattr(fx_config, "meta_nonzero_assume_all_nonzero"):  # torch >= 2.12; before it nonzero on meta raises
            self._config.enter_context(fx_config.patch(meta_nonzero_assume_all_nonzero=True))
        # torch.optim picks its multi-tensor (foreach) kernels by device type; meta stands for CUDA, so it gets
        # what CUDA gets, rather than one kernel per parameter
        cuda_like = torch.utils._foreach_utils._get_foreach_kernels_supported_devices() + ["meta"]
        self._config.enter_context(mock.patch.object(optimizer_module, "_get_foreach_kernels_supported_devices",
                                                     lambda: cuda_like))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._config.close()

    def mark(self) -> None:
        self.stretches.append(self.current)
        self.current = Work()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__  # "add.Tensor"
        short = name.split(".")[0]
        inputs = _devices((args, kwargs))
        if name in _READS and "meta" in inputs:
            self.current.device_to_host.append(f"{short} at {_where()}")
            return 1 if name != "equal.default" else True
        if short in ("_to_copy", "copy_", "to"):
            src = args[1] if short == "copy_" else args[0]
            dst_device = (args[0].device.type if short == "copy_"
                          else str(kwargs.get("device", src.device)).split(":")[0])
            if src.device.type == "cpu" and dst_device == "meta" and src.dim() > 0:
                self.current.host_to_device.append(f"{short} at {_where()}")
                return func(*args, **kwargs)
            if src.device.type == "meta" and dst_device == "cpu":
                self.current.device_to_host.append(f"{short} at {_where()}")
                if short == "copy_":
                    return args[0].fill_(1)
                return torch.ones(src.shape, dtype=kwargs.get("dtype") or src.dtype)
        if "meta" not in inputs and "meta" not in str(kwargs.get("device", "")):
            return func(*args, **kwargs)  # host-side work
        if _data_dependent(short, func, args):
            self.current.data_dependent.append(f"{short} at {_where()}")
        if not (func.is_view or name in _NO_KERNEL):
            self.current.kernels[short] += 1
        return func(*args, **kwargs)
