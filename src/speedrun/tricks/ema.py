"""Exponential moving average of the weights, used for evaluation only (Polyak averaging: Polyak & Juditsky 1992,
"Acceleration of Stochastic Approximation by Averaging", SIAM J. Control Optim. 30(4), in exponential form; timm's
model_ema.py notes that Google's RMSprop recipes for MnasNet/MobileNet-V3/EfficientNet need it to match results).

What: every `every_steps` optimizer steps, avg <- d*avg + (1-d)*w with d = decay_per_step**every_steps, for every
parameter and floating-point buffer (BatchNorm running statistics included), kept in float32 whatever the model's
dtype; integer buffers (num_batches_tracked) are copied. `swapped(model)` puts the averages into the model for an
evaluation and restores the live weights afterwards, bit for bit, so training never sees the average. Unlike
Lookahead (tricks/lookahead.py), which copies its average back into the live network, this one never does.
Why: the last iterate of SGD rattles around the bottom of the valley; an average of the last stretch sits nearer
its middle, worth most when the run ends at a non-zero lr or with noisy small-batch steps.
Suggested: a half-life of a few hundred to a few thousand steps (decay_for_half_life), updated every 10-32 steps
to save launches. torchvision's classification reference updates every 32 steps (--model-ema-steps) and rescales
its --model-ema-decay 0.99998 by world size * batch * 32 / epochs (references/classification/train.py); MosaicML
Composer's ResNet ImageNet configs: half-life 100 batches, updated every 20.
FFCV's ImageNet recipe (libffcv/ffcv-imagenet: train_imagenet.py, rn*_configs) has no weight EMA at all: SGD, a
linear-ramp lr ending at 0, label smoothing, BlurPool, progressive resizing and flip TTA. Whether an EMA still
gains when the lr already anneals to 0 is for an ablation to say.
Interactions: off when the recipe's `ema_decay` is 0 (make_ema returns None; the loop then skips update and
evaluates the live model). BatchNorm statistics are averaged with the weights, not recomputed for them.
Common implementation to compare with: timm's ModelEmaV2 keeps a deep copy of the whole module in the model's own
dtype and evaluates that copy; here the averages are plain fp32 tensors swapped into the one model, which saves
the second module and keeps low-precision models' averages from rounding away small updates.
Create it after the model is on its device (the averages live there).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def decay_for_half_life(half_life_steps: float) -> float:
    """The per-step decay d with d**half_life_steps == 1/2: a weight's influence halves every half_life_steps."""
    if not half_life_steps > 0:
        raise ValueError(f"half_life_steps must be > 0, got {half_life_steps}")
    return 0.5 ** (1.0 / half_life_steps)


class WeightEma:
    """fp32 averages of every state_dict entry of `model` (floating ones averaged, integer ones copied)."""

    def __init__(self, model: nn.Module, decay_per_step: float, every_steps: int = 1):
        if not 0 < decay_per_step < 1:
            raise ValueError(f"decay_per_step must be in (0, 1) (use make_ema for 0 = off), got {decay_per_step}")
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"every_steps must be an int >= 1, got {every_steps!r}")
        self.decay_per_step, self.every_steps = decay_per_step, every_steps
        self.model = model  # read (never written) by update(); copy_to/swapped take the model explicitly
        self.averages = {k: v.detach().to(torch.float32, copy=True) if v.is_floating_point() else v.detach().clone()
                         for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, step: int) -> bool:
        """Call after optimizer step number `step` (1 after the first). Averages when step % every_steps == 0.

        Returns whether it averaged. Reads the model, never writes it.
        """
        if step % self.every_steps != 0:
            return False
        live = self.model.state_dict()
        names = [k for k, v in self.averages.items() if v.is_floating_point()]
        # d**every: one update stands in for `every_steps` of them, so the half-life in steps is unchanged.
        weight = 1 - self.decay_per_step**self.every_steps
        torch._foreach_lerp_([self.averages[k] for k in names], [live[k].float() for k in names], weight)
        for k, v in self.averages.items():
            if not v.is_floating_point():
                v.copy_(live[k])
        return True

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Overwrite the model's parameters and buffers with the averages (cast to each tensor's dtype)."""
        live = model.state_dict()
        for k, v in self.averages.items():
            live[k].copy_(v)

    @contextlib.contextmanager
    def swapped(self, model: nn.Module):
        """`with ema.swapped(model): evaluate(model)` runs on the averages; the live weights come back exactly."""
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    v.copy_(saved[k])

    def state_dict(self) -> dict:
        return {"averages": {k: v.clone() for k, v in self.averages.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Load averages saved by state_dict(); keys and shapes must match this model's, else ValueError."""
        averages = state.get("averages") if isinstance(state, dict) else None
        if not isinstance(averages, dict):
            raise ValueError("EMA state must be a dict with an 'averages' dict, as WeightEma.state_dict() returns")
        missing, unexpected = sorted(set(self.averages) - set(averages)), sorted(set(averages) - set(self.averages))
        if missing or unexpected:
            raise ValueError(f"EMA state does not fit this model: missing keys {missing}, unexpected keys {unexpected}")
        for k, v in averages.items():
            if tuple(v.shape) != tuple(self.averages[k].shape):
                raise ValueError(f"EMA state key {k!r} has shape {tuple(v.shape)}, the model's is "
                                 f"{tuple(self.averages[k].shape)}")
        with torch.no_grad():
            for k, v in averages.items():
                self.averages[k].copy_(v)


def make_ema(model: nn.Module, decay: float, every_steps: int = 1) -> WeightEma | None:
    """The recipe switch: None when decay == 0 (the trick is off), else a WeightEma of `model`."""
    if decay == 0:
        return None
    return WeightEma(model, decay, every_steps)
