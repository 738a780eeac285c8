"""The cifar_resnet family: a standard ResNet-18 (He et al. 2016; the CIFAR form of kuangliu/pytorch-cifar) trained
from an in-memory dataset on the device with airbench's tricks, each a switch (recipe cifar10-resnet18; its target
and reference are in config.py's header). This module is the family as the registry and the runner see it
(recipes/family.py's Family): config.py holds the settings and the variant, data.py loads and checks the data,
model.py the network, loop.py trains one run."""

from speedrun.recipes.cifar_resnet.config import (MAY_DIFFER_ON_RESUME, ResnetConfig, cifar10_resnet18,
                                                  final_evaluation, timed_region)
from speedrun.recipes.cifar_resnet.data import (TRICKS, check, check_data, data_signature, describe, epochs_for_steps,
                                                idle_tricks, load_data, model_card, notes, run_steps, smoke,
                                                with_epochs)
from speedrun.recipes.cifar_resnet.loop import (TrainState, build_model, build_optimizers, flops, train_run, train_step,
                                                warmup)
from speedrun.recipes.cifar_resnet.model import CifarResNet, parameter_count, whiten_stem_

__all__ = ["MAY_DIFFER_ON_RESUME", "ResnetConfig", "cifar10_resnet18", "final_evaluation", "timed_region", "TRICKS",
           "idle_tricks", "check", "check_data", "data_signature", "describe", "load_data", "model_card", "notes",
           "smoke", "with_epochs", "run_steps", "epochs_for_steps", "TrainState", "build_model", "build_optimizers",
           "flops", "train_run", "train_step", "warmup", "CifarResNet", "parameter_count", "whiten_stem_"]
