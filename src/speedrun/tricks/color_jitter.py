"""Brightness and contrast jitter of training images (Hiverge's 2025 record, hiverge/cifar10-speedrun README
"Improved data augmentation": better accuracy at the same number of steps).

What: each training image gets its own random brightness offset b ~ U[-brightness, brightness] (in [0, 1] pixel
units, added to every pixel) and contrast factor f ~ U[1 - contrast, 1 + contrast] (each channel's deviations
from that image's channel mean are multiplied by f). It acts on standardized inputs (B, C, H, W), where an offset
of b pixel units is b / std_c in channel c.
Why: the test set's photos vary in exposure and contrast; training on such variations is more data for free.
Suggested: small strengths (0.1 or less); Hiverge's README names the augmentation, not its strengths.
Interactions: applied after the loader's flip, translate and cutout, so a cutout square is shifted too.
Draws: from a CPU generator seeded by (seed, step), so a run is deterministic and a resumed run draws what an
uninterrupted one would; under torchrun every process draws the global batch's values and keeps its share. A run
draws all its steps' values at its start and copies them to the device once (JitterTable): a copy each step would
synchronize a GPU with the host each step.
"""

from __future__ import annotations

import torch

# Keeps the jitter's draws apart from the loader's per-epoch streams (seed * 1_000_003 + epoch).
_STREAM = 1 << 40


def jitter_draws(seed: int, step: int, batch_size: int, brightness: float,
                 contrast: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets, factors), each (batch_size,) float32 on the CPU, for the batch of optimizer step `step`."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + _STREAM + step) % (2**63))
    u = torch.rand(2, batch_size, generator=g) * 2 - 1  # (2, B) in [-1, 1)
    return u[0] * brightness, 1 + u[1] * contrast


def brightness_contrast(x: torch.Tensor, offsets: torch.Tensor, factors: torch.Tensor,
                        std: torch.Tensor) -> torch.Tensor:
    """x (B, C, H, W) standardized; offsets, factors (B,) as jitter_draws gives; std (C,) the channels' std in
    pixel units. Same shape and dtype as x."""
    b, c = x.shape[:2]
    shift = (offsets.view(b, 1) / std.view(1, c)).to(x.device, x.dtype).view(b, c, 1, 1)  # pixel -> standard units
    scale = factors.to(x.device, x.dtype).view(b, 1, 1, 1)
    mean = x.mean((2, 3), keepdim=True)  # (B, C, 1, 1)
    return mean + (x - mean) * scale + shift


def jitter_batch(inputs: torch.Tensor, *, seed: int, step: int, batch_size: int, brightness: float, contrast: float,
                 std: torch.Tensor, share: slice | None = None) -> torch.Tensor:
    """The batch of optimizer step `step` (0-based), standardized (B, C, H, W), jittered; share: this process's
    slice of the global batch of batch_size images under torchrun (None: the whole batch)."""
    offsets, factors = jitter_draws(seed, step, batch_size, brightness, contrast)
    if share is not None:
        offsets, factors = offsets[share], factors[share]
    return brightness_contrast(inputs, offsets, factors, std)


class JitterTable:
    """Every step's jitter of a run, drawn on the host at once and copied to the device in one transfer each:
    table(inputs, step) equals jitter_batch(inputs, step=step, ...) bit for bit, with no copy in the step.

    shift (S, B, C, 1, 1) and scale (S, B, 1, 1, 1) in the inputs' dtype, S the run's steps, B this process's share.
    """

    def __init__(self, *, seed: int, steps: int, batch_size: int, brightness: float, contrast: float,
                 std: torch.Tensor, device: torch.device, dtype: torch.dtype, share: slice | None = None):
        draws = [jitter_draws(seed, step, batch_size, brightness, contrast) for step in range(steps)]
        offsets = torch.stack([d[0] for d in draws])  # (S, B)
        factors = torch.stack([d[1] for d in draws])
        if share is not None:
            offsets, factors = offsets[:, share], factors[:, share]
        b, c = offsets.shape[1], std.numel()
        self.shift = (offsets.view(steps, b, 1) / std.cpu().view(1, 1, c)).to(device, dtype).view(steps, b, c, 1, 1)
        self.scale = factors.to(device, dtype).view(steps, b, 1, 1, 1)

    def __call__(self, inputs: torch.Tensor, step: int) -> torch.Tensor:
        mean = inputs.mean((2, 3), keepdim=True)  # (B, C, 1, 1)
        return mean + (inputs - mean) * self.scale[step] + self.shift[step]
