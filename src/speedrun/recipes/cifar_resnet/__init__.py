"""The cifar_resnet family: a standard ResNet-18 (He et al. 2016; the CIFAR form of kuangliu/pytorch-cifar) trained
from an in-memory dataset on the device with airbench's tricks, each a switch (recipe cifar10-resnet18; its target
and reference are in config.py's header). This module is the family as the registry and the runner see it
(recipes/family.py's Family): config.py holds the settings and the variant, data.py its checks and tricks, model.py
the network, loop.py its optimizer, schedule and what it adds to the shared in-memory run; the answers it gives
alike with the cifar family, the user's network (--model) and the training loop are in recipes/in_memory/."""

from speedrun.recipes.cifar_resnet.config import ResnetConfig, cifar10_resnet18, timed_region
from speedrun.recipes.cifar_resnet.data import TRICKS, check, check_data, idle_tricks
from speedrun.recipes.cifar_resnet.loop import build_model, build_optimizers, flops, train_run, warmup
from speedrun.recipes.cifar_resnet.model import CifarResNet, parameter_count, whiten_stem_
from speedrun.recipes.in_memory.config import MAY_DIFFER_ON_RESUME, final_evaluation
from speedrun.recipes.in_memory.data import (data_signature, describe, epochs_for_steps, load_data, model_card, notes,
                                             own_data, run_steps, smoke, with_epochs)

__all__ = ["MAY_DIFFER_ON_RESUME", "ResnetConfig", "cifar10_resnet18", "final_evaluation", "timed_region", "TRICKS",
           "idle_tricks", "check", "check_data", "data_signature", "own_data",
           "describe", "load_data", "model_card", "notes",
           "smoke", "with_epochs", "run_steps", "epochs_for_steps", "build_model", "build_optimizers", "flops",
           "train_run", "warmup", "CifarResNet", "parameter_count", "whiten_stem_"]
