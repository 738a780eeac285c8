"""The imagenet family's settings (ImagenetConfig), its recipes' variants (FFCV's budgets) and their published
references."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from speedrun.config import SYSTEM_MAY_DIFFER, ConfigError, SystemConfig, refuse

MAY_DIFFER_ON_RESUME = SYSTEM_MAY_DIFFER | {"eval_each_epoch", "eval_batch_size", "target_accuracy", "workers"}
MAX_BATCH = 1 << 17


def final_evaluation(cfg: ImagenetConfig) -> str:
    # the image and its mirror are TTA level 1 in the cifar family's words, which the progress table has always used
    return "final evaluation with TTA level 1" if cfg.tta_flip else "final evaluation without TTA"


def timed_region(cfg: ImagenetConfig) -> str:
    tta = " with flip averaging" if cfg.tta_flip else ""
    return (f"training (loader workers included) + final evaluation at {cfg.eval_res_px} px{tta}, "
            "device-synchronized; excludes model construction, per-epoch evaluations and checkpoint writes")


@dataclass(frozen=True)
class ImagenetConfig(SystemConfig):
    # On a CPU this family is for debugging and tests, where a crash costs more than speed: torch 2.13's CPU
    # kernels kill the process (SIGSEGV / "double free") in the backward pass of this ResNet at width 8 and
    # 224 px in channels_last (width 16, 192 px or contiguous: fine; measured, no single op reproduces it).
    CHANNELS_LAST_AUTO_ON_CPU: ClassVar[bool] = False
    target_accuracy: float = 0.669  # top-1 fraction; FFCV's ResNet-18 at 16 epochs
    # Network (models/resnet.py)
    depth: int = 18
    width: int = 64  # stage widths width x (1, 2, 4, 8)
    zero_init_residual: bool = True
    blurpool: bool = True
    # Schedule
    batch_size: int = 1024  # global, over every process (FFCV's configs give it per GPU)
    epochs: float = 16.0
    lr_per_256: float = 0.125  # peak lr per 256 examples: FFCV's 0.5 at 1024 (ResNet-18), 1.7 at 4096 (ResNet-50)
    warmup_epochs: float = 2.0  # linear from 0 to the peak, then linear to 0 at the end
    momentum: float = 0.9
    weight_decay: float = 5e-5  # FFCV: 5e-5 (ResNet-18), 1e-4 (ResNet-50)
    no_decay_norm_bias: bool = True  # BatchNorm scales/shifts and biases take no weight decay
    optimizer: Literal["sgd", "lars", "lamb"] = "sgd"
    lars_trust: float = 0.001  # LARS's trust coefficient (You et al. 2017)
    label_smoothing: float = 0.1
    ema_decay: float = 0.0  # per step; 0 = off
    # Input (data/shard_loader.py)
    decoder: Literal["auto", "pillow", "nvjpeg"] = "auto"  # auto: nvJPEG (TorchCodec) on CUDA when installed
    decode_px: int = 256  # Pillow workers decode each image to this square
    crop_min_scale: float = 0.08  # random-resized crop's smallest area fraction
    flip: bool = True
    progressive_resizing: bool = True  # off: train at max_res_px throughout
    min_res_px: int = 160
    max_res_px: int = 192
    res_ramp_start_frac: float = 0.7  # fractions of the run between which the resolution ramps
    res_ramp_end_frac: float = 0.85
    res_step_px: int = 32
    workers: int = 8  # DataLoader worker processes per training process (0: decode in the training process)
    # Evaluation
    eval_res_px: int = 256
    eval_crop_ratio: float = 224 / 256
    tta_flip: bool = True
    eval_each_epoch: bool = False  # an untimed evaluation per epoch for the table (a full pass over val each)
    eval_batch_size: int = 256

    def validate(self) -> None:
        self.validate_system()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= 1e4):
                raise ConfigError(f"bad config: {f.name}={value} must be a finite number in [-1e4, 1e4]", keys=f.name)
        refuse([
            (self.depth in (18, 34, 50, 101, 152), "depth must be 18, 34, 50, 101 or 152", "depth"),
            (1 <= self.width <= 1024, "width must be in [1, 1024]", "width"),
            (1 <= self.batch_size <= MAX_BATCH, f"batch_size must be in [1, {MAX_BATCH}]", "batch_size"),
            (0 < self.epochs <= 10_000, "epochs must be in (0, 10000]", "epochs"),
            (self.lr_per_256 > 0, "lr_per_256 must be > 0", "lr_per_256"),
            (self.lars_trust > 0, "lars_trust must be > 0", "lars_trust"),
            (self.weight_decay >= 0, "weight_decay must be >= 0", "weight_decay"),
            (0 <= self.warmup_epochs <= self.epochs, "warmup_epochs must be in [0, epochs]",
             ("warmup_epochs", "epochs")),
            (0 <= self.momentum < 1, "momentum must be in [0, 1)", "momentum"),
            (0 <= self.label_smoothing < 1, "label_smoothing must be in [0, 1)", "label_smoothing"),
            (0 <= self.ema_decay < 1, "ema_decay must be in [0, 1) (0 = off)", "ema_decay"),
            (8 <= self.decode_px <= 1024, "decode_px must be in [8, 1024]", "decode_px"),
            (0 < self.crop_min_scale <= 1, "crop_min_scale must be in (0, 1]", "crop_min_scale"),
            *[(16 <= getattr(self, k) <= 1024, f"{k} must be in [16, 1024]", k)
              for k in ("min_res_px", "max_res_px", "eval_res_px")],
            (self.min_res_px <= self.max_res_px, "min_res_px must be <= max_res_px", ("min_res_px", "max_res_px")),
            (0 <= self.res_ramp_start_frac <= self.res_ramp_end_frac <= 1,
             "res_ramp_start_frac <= res_ramp_end_frac, both in [0, 1]", ("res_ramp_start_frac", "res_ramp_end_frac")),
            (1 <= self.res_step_px <= 256, "res_step_px must be in [1, 256]", "res_step_px"),
            (0 <= self.workers <= 256, "workers must be in [0, 256]", "workers"),
            (0 < self.eval_crop_ratio <= 1, "eval_crop_ratio must be in (0, 1]", "eval_crop_ratio"),
            (1 <= self.eval_batch_size <= MAX_BATCH, f"eval_batch_size must be in [1, {MAX_BATCH}]",
             "eval_batch_size"),
            (0 <= self.target_accuracy <= 1, "target_accuracy is a fraction in [0, 1]", "target_accuracy"),
        ])


# FFCV's published results (libffcv/ffcv-imagenet), theirs, beside each budget: (top-1, minutes, hardware).
FFCV_REFERENCE = {
    18: {16: (0.669, 35.0), 24: (0.688, 51.6), 32: (0.700, 68.9), 40: (0.706, 85.5), 88: (0.724, 187.3)},
    50: {16: (0.738, 14.9), 24: (0.756, 21.7), 32: (0.766, 28.7), 40: (0.772, 35.6), 88: (0.784, 77.2)},
}
FFCV_HARDWARE = {18: "1 x A100", 50: "8 x A100"}


def resnet18(epochs: int = 16) -> ImagenetConfig:
    return ImagenetConfig(epochs=float(epochs), target_accuracy=FFCV_REFERENCE[18][epochs][0])


def resnet50(epochs: int = 16) -> ImagenetConfig:
    return ImagenetConfig(depth=50, batch_size=4096, lr_per_256=1.7 * 256 / 4096, weight_decay=1e-4,
                          epochs=float(epochs), target_accuracy=FFCV_REFERENCE[50][epochs][0])


# The budgets as variants (recipes/__init__.py names them imagenet-resnet18-24 ...; the bare name is 16 epochs).
def resnet18_16() -> ImagenetConfig: return resnet18(16)  # noqa: E704
def resnet18_24() -> ImagenetConfig: return resnet18(24)  # noqa: E704
def resnet18_32() -> ImagenetConfig: return resnet18(32)  # noqa: E704
def resnet18_40() -> ImagenetConfig: return resnet18(40)  # noqa: E704
def resnet18_88() -> ImagenetConfig: return resnet18(88)  # noqa: E704
def resnet50_16() -> ImagenetConfig: return resnet50(16)  # noqa: E704
def resnet50_24() -> ImagenetConfig: return resnet50(24)  # noqa: E704
def resnet50_32() -> ImagenetConfig: return resnet50(32)  # noqa: E704
def resnet50_40() -> ImagenetConfig: return resnet50(40)  # noqa: E704
def resnet50_88() -> ImagenetConfig: return resnet50(88)  # noqa: E704


def debug() -> ImagenetConfig:
    """Seconds on a CPU: ResNet-18 at width 8 on 32-px images (imagenet_checks.load_data's synthetic shards)."""
    return ImagenetConfig(width=8, batch_size=64, epochs=2.0, lr_per_256=0.4, warmup_epochs=0.5, decode_px=32,
                          min_res_px=32, max_res_px=32, eval_res_px=32, eval_crop_ratio=1.0, crop_min_scale=0.35,
                          workers=0, blurpool=False, target_accuracy=0.5, eval_batch_size=256)
