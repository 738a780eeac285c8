"""ImageNet-class recipes: ResNet-18 and ResNet-50 from prepared shards, FFCV's schedule on maintained libraries.

Target and claim, each FFCV's published result (libffcv/ffcv-imagenet's rn18/rn50 configs):
  imagenet-resnet18[-E]   FFCV's ResNet-18 configs (1 x A100, global batch 1024): 16/24/32/40/88 epochs gave
                          66.9/68.8/70.0/70.6/72.4% top-1 in 35.0/51.6/68.9/85.5/187.3 min (theirs).
  imagenet-resnet50[-E]   FFCV's ResNet-50 configs (8 x A100, global batch 4096): 73.8/75.6/76.6/77.2/78.4% in
                          14.9/21.7/28.7/35.6/77.2 min (theirs).
  imagenet-debug          ResNet-18 at width 8 on 32-px synthetic shards: the whole path in seconds on a CPU.
  What speedrun has measured of them, and on what, is in BENCHMARKS.md ("ImageNet-class").

What the recipe does, each a switch in ImagenetConfig (TRICKS lists them for `speedrun ablate`):
  data      shards from `speedrun data prepare` (data/shard_loader.py): random-resized crop (scale 0.08-1) and
            flip on the device; evaluation on a centre crop of ratio 224/256 at eval_res_px (FFCV: 256 px).
  resizing  progressive: min_res_px -> max_res_px linearly between two fractions of the run, in steps of 32 px
            (FFCV: 160 -> 192 px late in training; "ImageNet in 18 minutes": 128 -> 224 -> 288 px).
  network   models/resnet.py: zero-initialized last BN scale per block (Goyal et al. 2017), BlurPool (Zhang 2019).
  optimizer SGD with momentum 0.9 (no Nesterov, as FFCV) and the linear scaling rule (lr_per_256 x batch / 256,
            Goyal et al.), linear warm-up to the peak at warmup_epochs then linear to 0 (FFCV); no weight decay on
            BatchNorm and biases; LARS or LAMB (tricks/lars.py) for global batches past ~8k.
  loss      label smoothing 0.1 (Szegedy et al. 2016), summed over the process's share / global batch: with
            gradients summed across processes (dist.py) the step is the mean over the global batch.
  averaging an EMA of the weights (tricks/ema.py), off by default (FFCV does not use one).
  test      the image and its mirror averaged (tta_flip).

Timed region: model construction excluded; from the first step to the end of the final evaluation, device-
synchronized; checkpoint writes and per-epoch evaluations excluded (reported apart). The loader's worker start-up
is inside it, as a user waits for it.

The family as the registry and the runner see it (recipes/family.py's Family): config.py holds the settings and
variants, data.py opens and checks the shards, loop.py trains one run.
"""

from speedrun.recipes.imagenet.config import (FFCV_HARDWARE, FFCV_REFERENCE, MAY_DIFFER_ON_RESUME, ImagenetConfig,
                                              debug, final_evaluation, resnet18, resnet18_16, resnet18_24, resnet18_32,
                                              resnet18_40, resnet18_88, resnet50, resnet50_16, resnet50_24, resnet50_32,
                                              resnet50_40, resnet50_88, timed_region)
from speedrun.recipes.imagenet.data import (TRICKS, ShardData, check, data_signature, describe, epochs_for_steps,
                                            idle_tricks, load_data, model_card, notes, own_data, run_steps, smoke,
                                            warmup, with_epochs, write_synthetic_shards)
from speedrun.recipes.imagenet.loop import (TrainState, build_model, build_optimizer, eval_decode_px, evaluate_top1,
                                            flops, res_at, train_run)

__all__ = ["own_data", "FFCV_HARDWARE", "FFCV_REFERENCE", "MAY_DIFFER_ON_RESUME", "ImagenetConfig", "debug", "resnet18",
           "resnet18_16", "resnet18_24", "resnet18_32", "resnet18_40", "resnet18_88", "resnet50", "resnet50_16",
           "resnet50_24", "resnet50_32", "resnet50_40", "resnet50_88", "final_evaluation", "timed_region", "TRICKS",
           "idle_tricks", "ShardData", "check", "data_signature", "describe", "load_data", "model_card", "notes",
           "smoke", "warmup", "with_epochs", "run_steps", "epochs_for_steps", "write_synthetic_shards", "TrainState",
           "build_model", "build_optimizer", "eval_decode_px", "evaluate_top1", "flops", "res_at", "train_run"]
