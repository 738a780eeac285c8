"""CIFAR speedrun recipes: airbench-class networks trained to 94%, 95% and 96% on CIFAR-10 in seconds.

Target and claim, each a published result (theirs, on an A100):
  cifar10-94       94% mean test accuracy (with TTA). Descends from airbench94 (Jordan, arXiv 2404.00498:
                   94.01%, n=1000, 3.83 s on an A100), itself from hlb-CIFAR10 and Page's ResNet-9 posts
                   ("How to train your ResNet", Myrtle.ai 2018).
  cifar10-94-muon  the same target with Muon on the conv filters (airbench94_muon: 2.59 s, A100).
  cifar10-94-hiverge  cifar10-94-muon with the changes of Hiverge's record (hiverge/cifar10-speedrun README:
                   94.008%, n=2000, 2.015 s, A100) as switches, and its retuned values (config.cifar10_94_hiverge).
  cifar10-95       airbench95's widths and schedule (95.01%, n=200, 10.4 s, A100).
  cifar10-96       airbench96 (improved): three convs per group with a residual, translate 4 + cutout 12
                   (96.03%, 34.7 s, A100).
  What speedrun has measured of them, and on what, is in BENCHMARKS.md.

Everything is written from the published descriptions; each trick is a named function in speedrun/tricks/ and
a field of CifarConfig, so every trick is an ablation axis (`--set lookahead=false`). Hiverge's changes, each off
by default: tta_select (fraction of test images, the least confident, that get TTA; 0 = all), activation=silu,
whiten_method=svd, jitter_brightness / jitter_contrast (strengths; 0 = off), muon_ns_batched (one Newton-Schulz
chain for all filter banks) and muon_renorm_every_steps (1 = every step).

Timed region (as airbench): from the patch-whitening initialization to the end of the TTA evaluation, with
device synchronization. Data loading, the upload to the device, per-epoch evaluations for the table and the
compile warm-up run are outside it and reported separately.

The family as the registry and the runner see it (recipes/family.py's Family): config.py holds the settings and
variants, data.py its own checks and tricks, loop.py its network, optimizers and what it adds to the shared
in-memory run; the answers it gives alike with cifar_resnet, and the training loop, are in recipes/in_memory/.
"""

from speedrun.recipes.cifar.config import (CifarConfig, cifar10_94, cifar10_94_hiverge, cifar10_94_muon, cifar10_95,
                                           cifar10_96)
from speedrun.recipes.cifar.data import TRICKS, check, check_data, idle_tricks
from speedrun.recipes.cifar.loop import TrainState, build_model, build_optimizers, flops, train_run, train_step, warmup
from speedrun.recipes.in_memory.config import MAY_DIFFER_ON_RESUME, final_evaluation, timed_region
from speedrun.recipes.in_memory.data import (data_signature, describe, epochs_for_steps, load_data, model_card, notes,
                                             own_data, run_steps, smoke, with_epochs)

__all__ = ["MAY_DIFFER_ON_RESUME", "CifarConfig", "cifar10_94", "cifar10_94_hiverge", "cifar10_94_muon", "cifar10_95",
           "cifar10_96", "final_evaluation", "timed_region", "TRICKS", "idle_tricks", "check", "check_data",
           "data_signature", "own_data",
           "describe", "load_data", "model_card", "notes", "smoke", "with_epochs", "run_steps",
           "epochs_for_steps", "TrainState", "build_model", "build_optimizers", "flops", "train_run", "train_step",
           "warmup"]
