"""The recipe registry: every recipe by name, and the family module that trains it, imported only when chosen.

A recipe is a named variant of a family's config ("cifar10-94" is the cifar family's `cifar10_94()`). The table
below is all the runner and the CLI know before a recipe is chosen, so `speedrun train --help` lists the recipes
without importing torch or any family (timm's registry by name; torchtitan's --module/--config).

A family is one module under speedrun/recipes/ that owns its config, data, model and loop. It provides (the runner
in runs.py calls nothing else):

    Config                      frozen dataclass of the family's settings; inherits config.SystemConfig (device-side
                                settings every family shares); `validate()` checks each setting alone
    timed_region(cfg) -> str    what the timed seconds cover, for the result file and the summary
    with_epochs(cfg, epochs)    cfg trained for `epochs`, with every epoch-denominated setting scaled alike
    load_data(dataset, *, data_dir, image_size, log) -> data   (data.num_train: its training examples)
    describe(data) -> str       one line: name, sizes, shape
    smoke(cfg, data) -> (cfg, data)           a few steps on a little data: does the pipeline run?
    check(cfg, data, device, world) -> [str]  refuse (ValueError) what cannot train; warnings for the odd
    notes(cfg, data, smoke) -> [str]          lines shown before training: what a smoke test is, advice
    data_signature(data) -> dict              what a checkpoint must agree on with the data it resumes on
    warmup(cfg, data, device, world) -> float seconds of an untimed run (compile, autotune); 0.0 when skipped
    train_run(cfg, data, device, seed, *, world, on_step, on_epoch, checkpoints, resume) -> engine.RunResult
    model_card(cfg, data) -> dict             what a saved model needs besides its weights (saved.py)
    build_model(cfg, in_channels, num_classes) -> nn.Module
    MAY_DIFFER_ON_RESUME        config fields a resumed run may change (they do not change what is trained)
    TRICKS                      [(config key, its "off" value, description)]: every trick, for `speedrun ablate`
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

FAMILIES = {"cifar": "speedrun.recipes.cifar", "imagenet": "speedrun.recipes.imagenet",
            "cifar_resnet": "speedrun.recipes.cifar_resnet"}


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
    return [f"{r.name:18s} {r.description}" for r in RECIPES.values()]
