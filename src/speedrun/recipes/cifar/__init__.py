"""The cifar family: airbench-class networks trained from an in-memory dataset on the device (recipes cifar10-94,
-94-muon, -95, -96). This module is the family as the registry and the runner see it (recipes/family.py's
Family): config.py holds the settings and variants, data.py loads and checks the data, loop.py trains one run."""

from speedrun.recipes.cifar.config import (MAY_DIFFER_ON_RESUME, CifarConfig, cifar10_94, cifar10_94_muon,
                                          cifar10_95, cifar10_96, final_evaluation, timed_region)
from speedrun.recipes.cifar.data import (TRICKS, check, check_data, data_signature, describe, load_data, model_card,
                                        notes, smoke, with_epochs)
from speedrun.recipes.cifar.loop import TrainState, build_model, build_optimizers, train_run, train_step, warmup

__all__ = ["MAY_DIFFER_ON_RESUME", "CifarConfig", "cifar10_94", "cifar10_94_muon", "cifar10_95", "cifar10_96",
           "final_evaluation", "timed_region", "TRICKS", "check", "check_data", "data_signature", "describe", "load_data", "model_card",
           "notes", "smoke", "with_epochs", "TrainState", "build_model", "build_optimizers", "train_run",
           "train_step", "warmup"]
