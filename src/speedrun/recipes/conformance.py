"""Each family module checked by mypy against the Family protocol (family.py): a family whose answer has another
type than the contract's (run_steps returning a str, a train_run without one of its keyword arguments) fails the
type check, `mypy` in CI, with the family and the member named.

mypy takes a module as an implementation of a protocol: its functions stand for the methods, its globals for the
attributes. Everything here is under TYPE_CHECKING: nothing imports this module to run, and importing it imports
no family (tests/test_architecture.py checks the names and parameters at run time: family.mismatches).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from speedrun.data.dataset import Dataset
    from speedrun.recipes import cifar, cifar_resnet, imagenet
    from speedrun.recipes.cifar.config import CifarConfig
    from speedrun.recipes.cifar_resnet.config import ResnetConfig
    from speedrun.recipes.family import Family
    from speedrun.recipes.imagenet.config import ImagenetConfig
    from speedrun.recipes.imagenet.data import ShardData

    # One line per family of recipes/__init__.py's FAMILIES: the family, typed by its config and its data.
    _cifar: Family[CifarConfig, Dataset] = cifar
    _cifar_resnet: Family[ResnetConfig, Dataset] = cifar_resnet
    _imagenet: Family[ImagenetConfig, ShardData] = imagenet
