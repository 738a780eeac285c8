"""Data: sources (download, verify, decode, cache), the on-device loader and batch augmentations."""

from speedrun.data.dataset import Dataset
from speedrun.data.sources import load_dataset

__all__ = ["Dataset", "load_dataset"]
