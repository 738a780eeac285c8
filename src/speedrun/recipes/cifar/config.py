"""The cifar family's settings (CifarConfig), its recipes' variants and the bounds each setting is checked
against."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from speedrun.config import Check, ConfigError, refuse
from speedrun.data.loader import Augmentation
from speedrun.models.custom import check_name
from speedrun.recipes.in_memory.config import MAX_EPOCHS, InMemoryConfig

# Bounds that no sensible run crosses; they keep a typo (widths=...,1000000) from allocating the machine away before
# the first step (in_memory/config.py holds the batch's and the epochs').
MAX_FLOAT_SETTING = 1e4  # the largest default is lr_per_1024 = 11.5, times bias_lr_mult = 64
# The smallest lr setting and multiplier: weight decay is decoupled as wd / lr (tricks/decoupled_sgd.py, and the
# Muon recipe's SGD groups), so a tiny lr makes a weight decay past float32's 3.4e38, which torch refuses mid-step,
# and 1e-320 / scale is 0.0 (a ZeroDivisionError). The smallest default is muon_bias_lr = 0.053.
MIN_LR_SETTING = 1e-6
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: an lr below it is 0 or imprecise there
MAX_GROUPS = 8
MAX_WIDTH = 8192
NONNEG = ("weight_decay_per_1024", "lr_start_mult", "lr_end_mult", "muon_lr", "muon_weight_decay_per_example",
          "whiten_bias_epochs", "translate_px", "cutout_px", "cutmix_px")
# Weight decay is decoupled from the lr as wd / lr (tricks/decoupled_sgd.py), so these lrs cannot be 0, nor so small
# that wd / lr leaves float32 (MIN_LR_SETTING); muon_lr may be 0 (Muon has no weight decay).
POSITIVE = ("lr_per_1024", "bias_lr_mult", "muon_bias_lr", "muon_head_lr")


@dataclass(frozen=True)
class CifarConfig(InMemoryConfig):
    """Settings of the cifar family; those every in-memory family shares (the schedule's shape, augmentation,
    whitening, Lookahead, TTA, evaluation) come from in_memory.config.InMemoryConfig at airbench94's values, the
    device-side ones (precision, channels_last, compile, ...) from config.SystemConfig."""

    # precision=auto is bf16 autocast on a CPU with native bf16 instructions: cifar10-94 at 3 epochs on the JPEG
    # copy of CIFAR-10, side by side at the same steps (n = 2 a side, one invocation): 85.35 ± 0.16% in fp32 and
    # 85.16 ± 0.38% in bf16, a difference of -0.19 points (95% CI -2.31 to +1.93), in 0.40 of the time
    # (BENCHMARKS.md, "bf16 on the CPU").
    BF16_AUTO_ON_CPU: ClassVar[bool] = True
    # On CUDA, fp16 with half weights, as airbench94 trains: fp16 activations get cuDNN's BatchNorm kernels (bf16
    # ones do not), and no autocast casts are launched. fp16 autocast measured on one H100 against airbench94
    # (n = 6 a side): accuracy -0.04 points (95% CI -0.29 to +0.22) of airbench's, 1.23x its time against bf16's
    # 1.33x (BENCHMARKS.md, "the first race against airbench94 on a GPU"). A loss scaler is not needed: the loss is
    # summed over the batch, as airbench's, far from fp16's underflow.
    CUDA_AUTO_PRECISION: ClassVar[str] = "fp16"
    HALF_WEIGHTS_AUTO_ON_CUDA: ClassVar[bool] = True

    # Augmentation (speedrun/data/augment.py) beyond the shared flip and translate
    cutout_px: int = 0  # side of the zeroed square; 0 = off
    cutmix_px: int = 0  # side of the pasted square; 0 = off
    # Network (speedrun/models/cifar_net.py); widths are the shared setting
    convs_per_group: int = 2  # 3 = airbench96's residual groups
    activation: Literal["gelu", "relu", "silu", "celu"] = "gelu"
    logit_scale: float = 1 / 9  # scaled logits: the head's output is multiplied by this
    bn_momentum: float = 0.4  # PyTorch convention (weight of the new batch); airbench writes 0.6
    bn_eps: float = 1e-12
    bn_scale_frozen: bool = True  # BN scales fixed at 1, only biases learn
    dirac_init: bool = True  # identity init of 3x3 convs (tricks/identity_init.py)
    # Patch whitening (tricks/whitening.py): whiten_init off is PyTorch's default init, the weights still frozen
    whiten_kernel_px: int = 2
    whiten_method: Literal["eigh", "svd"] = "eigh"  # how the covariance's basis is found
    whiten_bias_epochs: float = 3.0  # the first conv's bias learns for this many epochs, then freezes
    tta_select: float = 0.0  # fraction in (0, 1]: TTA only for the least confident images; 0 (or None) = all
    # Optimizer: "sgd" = decoupled Nesterov SGD on everything; "muon" = Muon on conv filters + SGD on the rest
    optimizer: Literal["sgd", "muon"] = "sgd"
    lr_per_1024: float = 11.5  # lr per 1024 examples (tricks/decoupled_sgd.py)
    weight_decay_per_1024: float = 0.0153
    bias_lr_mult: float = 64.0  # BN biases learn this much faster (weight decay unchanged)
    muon_lr: float = 0.24
    muon_momentum: float = 0.6
    muon_nesterov: bool = True
    muon_ns_steps: int = 3
    muon_bias_lr: float = 0.053  # PyTorch lr (summed loss) of whitening/BN biases under Muon
    muon_head_lr: float = 0.67
    muon_weight_decay_per_example: float = 2e-6  # times batch_size, per step
    muon_ns_batched: bool = False  # one Newton-Schulz chain over all filter banks, zero-padded (tricks/muon.py)
    muon_renorm_every_steps: int = 1  # filter banks renormalized before every K-th Muon step
    muon_ns_compile: bool = False  # Newton-Schulz compiled by torch.compile (tricks/muon.py)
    # Brightness / contrast jitter of training images (tricks/color_jitter.py); 0 = off
    jitter_brightness: float = 0.0  # largest offset, in [0, 1] pixel units
    jitter_contrast: float = 0.0  # largest relative change of contrast: factor in [1 - c, 1 + c]
    # Evaluation
    index_free_eval_pool: bool = False  # max pooling without argmax indices where no gradient is kept (tricks/)

    def validate(self) -> None:
        """Every setting alone, before any data is read (data-dependent checks: `check_data`)."""
        self.validate_system()
        check_name(self.model)
        # Every float setting multiplies others (lr x bias_lr_mult x schedule ...) into scalars that torch casts
        # to float32: 1e308 is finite here but not there, and fails mid-step. No sensible value is this large.
        self.check_floats(MAX_FLOAT_SETTING)
        for key in POSITIVE + ("muon_lr",):
            value = getattr(self, key)
            if not (MIN_LR_SETTING <= value <= MAX_FLOAT_SETTING or key == "muon_lr" and value == 0):
                zero = " or 0" if key == "muon_lr" else ""
                raise ConfigError(f"bad config: {key}={value:g} must be in [{MIN_LR_SETTING:g}, "
                                  f"{MAX_FLOAT_SETTING:g}]{zero}: the optimizers' lrs (and weight decay over lr) are "
                                  "derived from it in float32", keys=key)
        refuse(self.checks())
        # momentum near 1 scales decoupled_sgd's lrs down by 1 / (1 - momentum): each checked as torch holds it
        for key, value in self.optimizer_values().items():
            if not (math.isfinite(value) and (value == 0 or FLOAT32_TINY <= abs(value) <= FLOAT32_MAX)):
                raise ConfigError(f"bad config: the optimizer's {key} would be {value:g}, which float32 cannot hold; "
                                  f"keep lr_per_1024, bias_lr_mult and the muon_*_lr in [{MIN_LR_SETTING:g}, "
                                  f"{MAX_FLOAT_SETTING:g}] and momentum below 1",
                                  keys=("lr_per_1024", "bias_lr_mult", "muon_lr", "muon_bias_lr", "muon_head_lr",
                                        "momentum"))

    def checks(self) -> list[Check]:
        return super().checks() + [
            (0 < self.epochs <= MAX_EPOCHS, f"epochs must be in (0, {MAX_EPOCHS}]", "epochs"),
            (1 <= len(self.widths) <= MAX_GROUPS and all(1 <= w <= MAX_WIDTH for w in self.widths),
             f"widths must be 1 to {MAX_GROUPS} numbers in [1, {MAX_WIDTH}], e.g. 64,256,256", "widths"),
            (self.convs_per_group in (2, 3), "convs_per_group must be 2 or 3", "convs_per_group"),
            (0 <= self.muon_momentum < 1, "muon_momentum must be in [0, 1)", "muon_momentum"),
            (0 < self.bn_momentum <= 1, "bn_momentum must be in (0, 1]", "bn_momentum"),
            (self.bn_eps > 0, "bn_eps must be > 0", "bn_eps"),
            (self.whiten_eps > 0, "whiten_eps must be > 0", "whiten_eps"),
            (self.logit_scale > 0, "logit_scale must be > 0", "logit_scale"),
            *[(getattr(self, k) >= 0, f"{k} must be >= 0", k) for k in NONNEG],
            *[(getattr(self, k) > 0, f"{k} must be > 0", k) for k in POSITIVE],
            (1 <= self.lookahead_every_steps <= 10**6, "lookahead_every_steps must be in [1, 1000000]",
             "lookahead_every_steps"),
            (0 <= self.lookahead_base <= 1, "lookahead_base must be in [0, 1]", "lookahead_base"),
            (0 <= self.lr_peak_frac <= 1, "lr_peak_frac must be in [0, 1]", "lr_peak_frac"),
            (1 <= self.whiten_kernel_px <= 8, "whiten_kernel_px must be in [1, 8]", "whiten_kernel_px"),
            (1 <= self.whiten_images <= 10**7, "whiten_images must be in [1, 10000000]", "whiten_images"),
            (1 <= self.muon_ns_steps <= 20, "muon_ns_steps must be in [1, 20]", "muon_ns_steps"),
            (type(self.muon_renorm_every_steps) is int and 1 <= self.muon_renorm_every_steps <= 10**6,
             "muon_renorm_every_steps must be an integer in [1, 1000000]; 1 renormalizes every step",
             "muon_renorm_every_steps"),
            (0 <= self.jitter_brightness <= 1, "jitter_brightness must be in [0, 1] (pixel units); 0 is off",
             "jitter_brightness"),
            (0 <= self.jitter_contrast <= 1, "jitter_contrast must be in [0, 1]; 0 is off", "jitter_contrast"),
            (self.tta_select is None or 0 <= self.tta_select <= 1,
             "tta_select must be a fraction in (0, 1], or 0 for TTA on every image", "tta_select"),
            (self.whiten_method in ("eigh", "svd"), "whiten_method must be eigh or svd", "whiten_method"),
        ]

    def optimizer_values(self) -> dict[str, float]:
        """The numbers the optimizers are built with from these settings (recipes/cifar/loop.py's
        build_optimizers: decoupled_sgd's group lrs and weight decays, the Muon recipe's SGD groups), by name."""
        scale = 1024 * (1 + 1 / (1 - self.momentum))  # decoupled_sgd's
        lr, shrink = self.lr_per_1024 / scale, self.weight_decay_per_1024 * self.batch_size / scale
        wd = self.muon_weight_decay_per_example * self.batch_size
        values = {"lr": lr, "bias lr": lr * self.bias_lr_mult, "weight decay over lr": shrink / lr,
                  "bias weight decay over lr": shrink / (lr * self.bias_lr_mult)}
        if self.optimizer == "muon":
            values.update({"Muon lr": self.muon_lr, "bias lr": self.muon_bias_lr, "head lr": self.muon_head_lr,
                           "bias weight decay over lr": wd / self.muon_bias_lr,
                           "head weight decay over lr": wd / self.muon_head_lr})
        return values

    def augmentation(self) -> Augmentation:
        return Augmentation(self.flip, self.translate_px, self.cutout_px, self.cutmix_px)

    def user_bn_momentum(self) -> float | None:
        """bn_momentum: the recipe's short runs need statistics of the last steps (tricks/bn_momentum.py)."""
        return self.bn_momentum

    def tta_fraction(self) -> float | None:
        return self.tta_select

    def with_epochs(self, epochs: float) -> CifarConfig:
        """This config with `epochs`, the whitening bias's window scaled by the same factor (the lr schedule and
        Lookahead are defined in fractions of the run already)."""
        scale = epochs / self.epochs
        return dataclasses.replace(self, epochs=epochs, whiten_bias_epochs=self.whiten_bias_epochs * scale)


def cifar10_94() -> CifarConfig:
    return CifarConfig()


def cifar10_94_muon() -> CifarConfig:
    # airbench94_muon (KellerJordan/cifar10-airbench): batch 2000, 8 epochs, lrs decay linearly to 0, no Lookahead,
    # head output divided by its width.
    return dataclasses.replace(CifarConfig(), optimizer="muon", batch_size=2000, epochs=8.0, lookahead=False,
                               lr_start_mult=1.0, lr_peak_frac=0.0, lr_end_mult=0.0, logit_scale=1 / 256)


def cifar10_94_hiverge() -> CifarConfig:
    """Hiverge's 2025 record (hiverge/cifar10-speedrun, its README: 94.008% mean over 2,000 runs in 2.015 s on an
    A100, from airbench94_muon) as switches on cifar10-94-muon: Newton-Schulz batched over all filter banks,
    renormalization at an interval, brightness/contrast jitter, SiLU, whitening by SVD, selective TTA, and the
    README's retuned values: batch 1536, 7.59 epochs, label smoothing 0.09, Muon lr 0.205 and momentum 0.655.
    The README gives no renormalization interval (its own adapts), jitter strengths or TTA share: 2, 0.05 / 0.05
    and 0.25 are ours. Hiverge's loop-free crops are the loader's translate already (data/augment.py: one gather).
    """
    return dataclasses.replace(cifar10_94_muon(), batch_size=1536, epochs=7.59, label_smoothing=0.09,
                               muon_lr=0.205, muon_momentum=0.655, activation="silu", whiten_method="svd",
                               muon_ns_batched=True, muon_renorm_every_steps=2, jitter_brightness=0.05,
                               jitter_contrast=0.05, tta_select=0.25)


def cifar10_95() -> CifarConfig:
    return dataclasses.replace(CifarConfig(), target_accuracy=0.95, widths=(128, 384, 384), epochs=15.0,
                               lr_per_1024=10.0)


def cifar10_96() -> CifarConfig:
    return dataclasses.replace(CifarConfig(), target_accuracy=0.96, widths=(128, 384, 512), convs_per_group=3,
                               epochs=37.0, lr_per_1024=9.0, weight_decay_per_1024=0.012, translate_px=4,
                               cutout_px=12)
