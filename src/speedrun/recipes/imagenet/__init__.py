"""The imagenet family: ResNet-18/50 from prepared shards on FFCV's schedule (recipes imagenet-resnet18[-E],
imagenet-resnet50[-E], imagenet-debug). This module is the family as the registry and the runner see it
(recipes/family.py's Family): config.py holds the settings and variants, data.py opens and checks the shards,
loop.py trains one run."""

from speedrun.recipes.imagenet.config import (FFCV_HARDWARE, FFCV_REFERENCE, MAY_DIFFER_ON_RESUME, ImagenetConfig,
                                             debug, resnet18, resnet18_16, resnet18_24, resnet18_32, resnet18_40,
                                             resnet18_88, resnet50, resnet50_16, resnet50_24, resnet50_32,
                                             resnet50_40, resnet50_88, final_evaluation, timed_region)
from speedrun.recipes.imagenet.data import (TRICKS, ShardData, check, data_signature, describe, load_data,
                                           model_card, notes, smoke, warmup, with_epochs, write_synthetic_shards)
from speedrun.recipes.imagenet.loop import (TrainState, build_model, build_optimizer, eval_decode_px, evaluate_top1,
                                           res_at, train_run)

__all__ = ["FFCV_HARDWARE", "FFCV_REFERENCE", "MAY_DIFFER_ON_RESUME", "ImagenetConfig", "debug", "resnet18",
           "resnet18_16", "resnet18_24", "resnet18_32", "resnet18_40", "resnet18_88", "resnet50", "resnet50_16",
           "resnet50_24", "resnet50_32", "resnet50_40", "resnet50_88", "final_evaluation", "timed_region", "TRICKS", "ShardData",
           "check", "data_signature", "describe", "load_data", "model_card", "notes", "smoke", "warmup",
           "with_epochs", "write_synthetic_shards", "TrainState", "build_model", "build_optimizer",
           "eval_decode_px", "evaluate_top1", "res_at", "train_run"]
