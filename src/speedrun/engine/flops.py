"""FLOPs of a run, counted by torch.utils.flop_counter on the recipe's real shapes.

What is counted is what FlopCounterMode counts: matrix multiplies and convolutions (forward and backward) and
attention; the elementwise work (BatchNorm, activations, the optimizer's updates) is not, as in the MFU of the
PaLM paper (Chowdhery et al. 2022, appendix B), which counts the model's matmul FLOPs only. A multiply-add is 2 FLOPs.

The model is built on the meta device, so counting allocates nothing, draws no random numbers and takes
milliseconds: the counter needs shapes, not values. A convolution's or matmul's FLOPs are linear in the batch,
so a probe batch is counted and scaled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from speedrun.tricks.tta import tta_logits

PROBE_BATCH = 2


def count(fn: Callable[[], object]) -> int:
    """The FLOPs of what `fn` runs."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """build() with every tensor on the meta device (shapes only; no memory, no random draws)."""
    with torch.device("meta"):
        return build()


def train_step(model: nn.Module, image_shape: tuple[int, ...], batch_size: int) -> int:
    """Forward and backward of one batch of `batch_size` images (C, H, W) through `model` (on meta), with a
    cross-entropy loss against its logits."""
    def step():  # two examples: BatchNorm in training refuses one example per channel
        x = torch.zeros((PROBE_BATCH, *image_shape), device="meta")
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long, device="meta"))
        loss.backward()

    was = model.training
    model.train()
    try:
        return count(step) // PROBE_BATCH * batch_size
    finally:
        model.train(was)
        model.zero_grad(set_to_none=True)


def evaluation(model: nn.Module, image_shape: tuple[int, ...], images: int, tta_level: int) -> int:
    """Forward passes over `images` test images (C, H, W) with test-time augmentation at `tta_level`."""
    def forward():
        with torch.no_grad():
            tta_logits(model, torch.zeros((1, *image_shape), device="meta"), tta_level)

    was = model.training
    model.eval()
    try:
        return count(forward) * images
    finally:
        model.train(was)


@dataclass(frozen=True)
class RunFlops:
    """FLOPs of one run (every process together): its training steps, the final evaluation, the timed region."""

    train: int  # every training step (each a global batch)
    steps: int
    evaluation: int  # the final evaluation (inside the timed region)
    counted: str  # what was counted, in words

    @property
    def train_step(self) -> int:
        """A training step's FLOPs (the mean step's, where the resolution changes during the run)."""
        return self.train // max(1, self.steps)

    @property
    def run(self) -> int:
        return self.train + self.evaluation

    def to_dict(self) -> dict:
        return {"train_step": self.train_step, "steps": self.steps, "train": self.train,
                "evaluation": self.evaluation, "run": self.run, "counted": self.counted}


def in_memory_run(model: nn.Module, image_shape: tuple[int, ...], batch_size: int, steps: int, test_images: int,
                  tta_level: int) -> RunFlops:
    """An in-memory family's run (every step one batch of the same shape; the final evaluation with TTA)."""
    return RunFlops(train=train_step(model, image_shape, batch_size) * steps, steps=steps,
                    evaluation=evaluation(model, image_shape, test_images, tta_level),
                    counted=f"{steps} steps of {batch_size} images {'x'.join(map(str, image_shape))} (forward and "
                            f"backward), {test_images} test images at TTA level {tta_level}; convolutions and "
                            "matmuls only (torch.utils.flop_counter)")
