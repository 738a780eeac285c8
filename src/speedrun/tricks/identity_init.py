"""Identity (dirac) initialization of 3x3 convolutions.

What: the first min(c_out, c_in) filters of a conv are set to pass their input channel through unchanged
(a 1 at the kernel centre); the other filters keep PyTorch's default init.
Why: the network starts close to a shallow one, so signal and gradients flow through all layers from step 0;
airbench94 uses it on every 3x3 conv (arXiv 2404.00498, sec. 3.3).
Suggested: on for the airbench-class nets. Interactions: none with the optimizers here.
Source: airbench; Goyal et al.'s zero-init of residual BN scales is the same idea for ResNets.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def dirac_init_(conv: nn.Conv2d) -> nn.Conv2d:
    """In place: filters [0, min(c_out, c_in)) become identity maps of their own input channel."""
    k = min(conv.out_channels, conv.in_channels)
    nn.init.dirac_(conv.weight[:k])
    return conv
