"""BatchNorm's running statistics made to follow the last few steps: momentum 0.4 in PyTorch's convention (the
weight of each new batch; airbench's 0.6 in the other convention), where PyTorch's default is 0.1.

Why: a record-class run is a few hundred steps at a large learning rate, and the network changes a lot from one
step to the next; evaluation uses the running statistics, which at momentum 0.1 average about the last ten steps
and so describe a network that no longer exists. Measured here on the example network (examples/mobile_net.py, a
MobileNet-style net with PyTorch's default BatchNorm) trained by cifar10-94 on 4,096 cifar10-jpeg images for 16
steps, Lookahead off: test accuracy 9.5% in eval mode (chance) against 38.4% with the batch's own statistics; at
momentum 0.4, 38.4% in both. The recipe's own network sets it in its constructor (models/cifar_net.py); this sets it
on any other network's BatchNorm layers.
"""

from __future__ import annotations

from torch import nn


def set_bn_momentum_(model: nn.Module, momentum: float) -> int:
    """Set the momentum of every BatchNorm layer of `model` (1d, 2d, 3d, SyncBatchNorm); how many were set."""
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in layers:
        m.momentum = momentum
    return len(layers)
