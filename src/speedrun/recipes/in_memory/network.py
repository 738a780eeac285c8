"""The user's network (`--model MODULE:FUNCTION`, models/custom.py) in an in-memory family, written once for every
family: built for the data's images, with the family's BatchNorm momentum where it sets one; checked on two images
before any work, with the note that names the tricks doing nothing for it; those tricks, for ablate.

Each family keeps what is its own: which of its tricks act inside its own network alone, and what its whitening
does with the user's first conv where that conv has the whitening's shape (tricks/whitening.py's
whitenable_first_conv): cifar freezes it and lets its bias learn for a while, cifar_resnet trains it as its stem.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from speedrun.data.dataset import Dataset
from speedrun.errors import counted
from speedrun.models import custom
from speedrun.recipes.in_memory.config import InMemoryConfig
from speedrun.tricks.bn_momentum import set_bn_momentum_
from speedrun.tricks.whitening import whitenable_first_conv


def user_network(cfg: InMemoryConfig, in_channels: int, num_classes: int, image_px: int | None) -> nn.Module:
    """The user's network (cfg.model) for (N, in_channels, image_px, image_px) images, untrained; its BatchNorm layers
    at cfg.user_bn_momentum() where the family sets one."""
    if image_px is None:
        raise ValueError(f"--model {cfg.model}: the network's builder needs the images' size")
    net = custom.build(cfg.model, in_channels, num_classes, image_px)
    momentum = cfg.user_bn_momentum()
    if momentum is not None:
        set_bn_momentum_(net, momentum)
    return net


def idle_tricks(cfg: InMemoryConfig, inside: tuple[str, ...], whitening: tuple[str, ...], net: nn.Module | None,
                in_channels: int) -> list[str]:
    """The TRICKS keys that do nothing for cfg's network: none for the family's own; for the user's (cfg.model),
    `inside` (those acting inside the family's own network), and, given the network built for the data (`net`),
    `whitening` (the whitening's keys) where its first conv cannot be whitened. ablate asks before any data is read,
    so without the network: the whitening is then measured, and the note of check says where it does nothing."""
    if not cfg.model:
        return []
    idle = list(inside)
    if net is not None and whitenable_first_conv(net, in_channels) is None:
        idle += whitening
    return idle


def notes(cfg: InMemoryConfig, data: Dataset, idle: Callable[[nn.Module], list[str]]) -> list[str]:
    """For the user's network (cfg.model; none for the family's own): built on the CPU and run on two images
    (custom.check_network refuses in one line), then the note before a run: its size, the momentum its BatchNorm
    layers take, and the tricks that do nothing for it (`idle`, given the network)."""
    if not cfg.model:
        return []
    net = custom.check_network(cfg.model, data.image_shape, data.num_classes)
    parts = [f"{sum(p.numel() for p in net.parameters()):,} parameters"]
    norms, momentum = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules()), cfg.user_bn_momentum()
    if norms and momentum is not None:
        parts.append(f"its {counted(norms, 'BatchNorm layer')} take{'s' if norms == 1 else ''} bn_momentum="
                     f"{momentum:g}")
    off = idle(net)
    parts.append(f"off for this network (they act inside the recipe's own): {', '.join(off)}" if off else
                 "every trick of the recipe acts on it")
    return [f"--model {cfg.model}: {'; '.join(parts)}"]
