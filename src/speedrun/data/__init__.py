"""Data: sources (download, verify, decode, cache), the on-device loader and batch augmentations."""

from speedrun.data.dataset import Dataset

__all__ = ["Dataset"]
