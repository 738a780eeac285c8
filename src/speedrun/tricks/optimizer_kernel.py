"""Which implementation of a torch.optim optimizer's update runs (PyTorch performance tuning guide: "use fused
optimizers"; torch.optim's docs, "Algorithms", on foreach and fused).

What: "foreach" updates every parameter of a group in a few multi-tensor kernels; "fused" in one kernel per
  group (CUDA, and the CPU for SGD/Adam/AdamW since PyTorch 2.4); "for-loop" one parameter at a time (the
  kernel launches per step grow with the parameter count). "auto" passes nothing: PyTorch's own default
  (foreach on CUDA, the for-loop on the CPU).
Why: an optimizer step of a small network is launch-bound on a GPU; on a CPU the three run the same arithmetic
  and differ in memory passes. The numbers are the same up to floating-point order; `speedrun tune` measures it.
"""

from __future__ import annotations

KERNELS = ("auto", "foreach", "fused", "for-loop")


def optimizer_kernel_kwargs(kernel: str) -> dict:
    """Keyword arguments for a torch.optim optimizer's constructor; {} for "auto" (exactly PyTorch's default)."""
    if kernel not in KERNELS:
        raise ValueError(f"optimizer_kernel must be one of {KERNELS}, got {kernel!r}")
    return {"auto": {}, "foreach": {"foreach": True}, "fused": {"fused": True},
            "for-loop": {"foreach": False}}[kernel]
