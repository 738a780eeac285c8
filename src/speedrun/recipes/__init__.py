"""The recipe registry: every recipe by name, and the family module that trains it, imported only when chosen.

A recipe is a named variant of a family's config ("cifar10-94" is the cifar family's `cifar10_94()`). The table
below is all the runner and the CLI know before a recipe is chosen, so `speedrun train --help` lists the recipes
without importing torch or any family (timm's registry by name; torchtitan's --module/--config).

A family is a package under speedrun/recipes/ that owns its config, data, model and loop; what it provides, and
all that the runner, the instruments, checkpoints and saved models use of it, is the Family protocol in family.py.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

FAMILIES = {"cifar": "speedrun.recipes.cifar", "imagenet": "speedrun.recipes.imagenet",
            "cifar_resnet": "speedrun.recipes.cifar_resnet"}
# Families whose test split streams from shards and is never held in memory: `speedrun eval` cannot score their
# saved models (their training run's final evaluation does), and says so before it loads any data.
STREAMED_TEST_SPLIT = frozenset({"imagenet"})


@dataclass(frozen=True)
class Recipe:
    name: str
    family: str  # a key of FAMILIES
    variant: str  # the family module's function returning this recipe's config
    default_dataset: str
    description: str

    def module(self) -> ModuleType:
        return importlib.import_module(FAMILIES[self.family])

    def make_config(self):
        return getattr(self.module(), self.variant)()


RECIPES = {r.name: r for r in [
    Recipe("cifar10-94", "cifar", "cifar10_94", "cifar10", "airbench94-class net, SGD + Lookahead, 9.9 epochs: 94%"),
    Recipe("cifar10-94-muon", "cifar", "cifar10_94_muon", "cifar10",
           "the same net with Muon on the conv filters, batch 2000, 8 epochs: 94%"),
    Recipe("cifar10-94-hiverge", "cifar", "cifar10_94_hiverge", "cifar10",
           "cifar10-94-muon with Hiverge's 2025 changes as switches, batch 1536, 7.59 epochs: 94%"),
    Recipe("cifar10-95", "cifar", "cifar10_95", "cifar10", "widths 128/384/384, 15 epochs: 95%"),
    Recipe("cifar10-96", "cifar", "cifar10_96", "cifar10",
           "residual groups 128/384/512, translate 4 + cutout 12, 37 epochs: 96%"),
    Recipe("cifar10-resnet18", "cifar_resnet", "cifar10_resnet18", "cifar10",
           "ResNet-18 with airbench's tricks, 15 epochs (kuangliu/pytorch-cifar's 93.02% in 350: theirs)"),
    *[Recipe(f"imagenet-resnet{depth}" + ("" if epochs == 16 else f"-{epochs}"), "imagenet",
             f"resnet{depth}_{epochs}", "", f"ResNet-{depth}, {epochs} epochs, 160->192 px (FFCV's config: "
             f"{top1}% top-1, theirs)")
      for depth, budgets in ((18, ((16, 66.9), (24, 68.8), (32, 70.0), (40, 70.6), (88, 72.4))),
                             (50, ((16, 73.8), (24, 75.6), (32, 76.6), (40, 77.2), (88, 78.4))))
      for epochs, top1 in budgets],
    Recipe("imagenet-debug", "imagenet", "debug", "synthetic",
           "ResNet-18 at width 8 on 32-px synthetic shards: the ImageNet path in seconds on a CPU"),
]}


def get_recipe(name: str) -> Recipe:
    if not isinstance(name, str) or name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of: {', '.join(RECIPES)}")
    return RECIPES[name]


def recipe_lines() -> list[str]:
    """One line per recipe, its description in a column past the longest name."""
    width = max((len(name) for name in RECIPES), default=0)
    return [f"{r.name:{width}s}  {r.description}" for r in RECIPES.values()]
