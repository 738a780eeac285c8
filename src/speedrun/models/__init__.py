"""Network definitions only: no training logic, no torch.distributed."""

from speedrun.models.cifar_net import CifarNet

__all__ = ["CifarNet"]
