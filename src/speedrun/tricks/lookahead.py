"""Lookahead / EMA of the weights, copied back into the live network (Zhang et al. 2019, "Lookahead";
airbench94's variant: -0.35 s to 94%; hlb-CIFAR10's "EMA copied back").

What: every `every_steps` steps, the slow copy moves toward the live weights, ema <- decay*ema + (1-decay)*w,
and the live weights are replaced by the slow copy. decay rises over the run as base**every * (step/total)**3,
so it does nothing early (decay ~ 0) and averages strongly at the end; a final sync copies the average in.
Why: averaging the last stretch of a high-lr run lands nearer the bottom of the valley than the last iterate.
Suggested: every 5 steps, base 0.95 (airbench94). Interactions: not used with Muon in airbench94_muon.
The final sync is airbench's: the live net takes the slow copy as the last update left it, so the steps after that
update are dropped (1 of airbench94's 476), and a run shorter than one update ends at its initial weights (a smoke
test's 4 steps): the rule is kept as airbench has it, so that ours trains as it does (benchmarks/step_parity.py).
Covers every floating-point tensor of the state dict, BatchNorm running statistics included.
"""

from __future__ import annotations

import torch
from torch import nn


def lookahead_decay(step: int, total_steps: int, base: float = 0.95, every_steps: int = 5) -> float:
    """The slow-weights decay at `step` of `total_steps` (airbench94's cubic ramp)."""
    return base**every_steps * (step / total_steps) ** 3


class Lookahead:
    """Slow copies of `model`'s floating-point state, updated in two fused (foreach) ops.

    Holds the model's own tensors (state_dict views share their storage), so the model must not swap its
    parameters or buffers for new tensors afterwards (a later .to(device) would): create it last.
    """

    def __init__(self, model: nn.Module):
        live = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
        self.names = list(live)
        self.live = list(live.values())
        self.slow = [v.detach().clone() for v in self.live]
        # indices of the tensors of each dtype: CUDA's fused multi-tensor kernels take one dtype a list (half
        # weights keep BatchNorm in fp32), so each dtype gets its own launch
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, v in enumerate(self.live):
            by_dtype.setdefault(v.dtype, []).append(i)
        self._groups = list(by_dtype.values())

    @torch.no_grad()
    def update(self, decay: float) -> None:
        # One multi-tensor launch each per dtype instead of two per tensor (airbench loops over the tensors): ~30
        # tensors, every 5 steps, on a 476-step run where each kernel launch costs microseconds.
        for group in self._groups:
            slow, live = [self.slow[i] for i in group], [self.live[i] for i in group]
            torch._foreach_lerp_(slow, live, 1 - decay)
            torch._foreach_copy_(live, slow)
