"""CIFAR speedrun recipes: airbench-class networks trained to 94%, 95% and 96% on CIFAR-10 in seconds.

Target and claim (STYLE.md habit 1):
  cifar10-94       94% mean test accuracy (with TTA). Descends from airbench94 (Jordan, arXiv 2404.00498:
                   94.01%, n=1000, 3.83 s on an A100), itself from hlb-CIFAR10 and Page's ResNet-9 posts.
  cifar10-94-muon  the same target with Muon on the conv filters (airbench94_muon: 2.59 s, A100).
  cifar10-95       airbench95's widths and schedule (95.01%, n=200, 10.4 s, A100).
  cifar10-96       airbench96 (improved): three convs per group with a residual, translate 4 + cutout 12
                   (96.03%, 34.7 s, A100).
  Measured here (BENCHMARKS.md; data: the lossy JPEG copy of CIFAR-10, torch 2.13 CPU, fp32, 2 cores):
                   cifar10-94 90.65% (n=1) in 54 min; with --epochs 1, 66.75 +- 0.62% (n=3).
                   Not yet on a GPU: the side-by-side run against airbench94 (benchmarks/vs_airbench.py) is
                   pending, so no speed or 94% claim is made yet.

Everything is written from the published descriptions; each trick is a named function in speedrun/tricks/ and
a field of CifarConfig, so every trick is an ablation axis (`--set lookahead=false`).

Timed region (as airbench): from the patch-whitening initialization to the end of the TTA evaluation, with
device synchronization. Data loading, the upload to the device, per-epoch evaluations for the table and the
compile warm-up run are outside it and reported separately.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from speedrun.data import limits
from speedrun.data.dataset import Dataset
from speedrun.data.loader import DeviceLoader, channel_stats, normalize
from speedrun.engine import FiniteLossGuard, Timer, evaluate, seed_everything, synchronize
from speedrun.models import CifarNet
from speedrun.models.cifar_net import memory_lower_bound, output_side
from speedrun.tricks.decoupled_sgd import decoupled_sgd
from speedrun.tricks.label_smoothing import cross_entropy
from speedrun.tricks.lookahead import Lookahead, lookahead_decay
from speedrun.tricks.muon import Muon
from speedrun.tricks.precision import (DTYPES, autocast, maybe_compile, resolve_channels_last, resolve_precision,
                                      set_cudnn_benchmark, to_channels_last)
from speedrun.tricks.schedule import triangle
from speedrun.tricks.whitening import patch_whitening_init_


@dataclass(frozen=True)
class CifarConfig:
    target_accuracy: float = 0.94  # fraction; the share of runs reaching it is reported
    # Schedule
    batch_size: int = 1024
    epochs: float = 9.9  # fractional epochs count steps exactly: ceil(epochs * N / batch_size)
    # Augmentation (speedrun/data/augment.py)
    flip: Literal["none", "random", "alternating"] = "alternating"
    translate_px: int = 2  # random shift with reflect padding, in pixels
    cutout_px: int = 0  # side of the zeroed square; 0 = off
    cutmix_px: int = 0  # side of the pasted square; 0 = off
    # Network (speedrun/models/cifar_net.py)
    widths: tuple[int, ...] = (64, 256, 256)
    convs_per_group: int = 2  # 3 = airbench96's residual groups
    activation: Literal["gelu", "relu", "silu", "celu"] = "gelu"
    logit_scale: float = 1 / 9  # scaled logits: the head's output is multiplied by this
    bn_momentum: float = 0.4  # PyTorch convention (weight of the new batch); airbench writes 0.6
    bn_eps: float = 1e-12
    bn_scale_frozen: bool = True  # BN scales fixed at 1, only biases learn
    dirac_init: bool = True  # identity init of 3x3 convs (tricks/identity_init.py)
    # Patch whitening (tricks/whitening.py)
    whiten_init: bool = True  # off: PyTorch's default init, weights still frozen
    whiten_kernel_px: int = 2
    whiten_eps: float = 5e-4
    whiten_images: int = 5000  # training images (a random sample) whose patches set the covariance
    whiten_bias_epochs: float = 3.0  # the first conv's bias learns for this many epochs, then freezes
    # Loss and averaging
    label_smoothing: float = 0.2
    lookahead: bool = True
    lookahead_every_steps: int = 5
    lookahead_base: float = 0.95
    tta_level: int = 2  # 0 none, 1 mirror, 2 mirror + 1-px translate (tricks/tta.py)
    # Optimizer: "sgd" = decoupled Nesterov SGD on everything; "muon" = Muon on conv filters + SGD on the rest
    optimizer: Literal["sgd", "muon"] = "sgd"
    lr_per_1024: float = 11.5  # lr per 1024 examples (tricks/decoupled_sgd.py)
    weight_decay_per_1024: float = 0.0153
    momentum: float = 0.85
    bias_lr_mult: float = 64.0  # BN biases learn this much faster (weight decay unchanged)
    lr_start_mult: float = 0.2  # triangular schedule (tricks/schedule.py)
    lr_peak_frac: float = 0.23
    lr_end_mult: float = 0.07
    muon_lr: float = 0.24
    muon_momentum: float = 0.6
    muon_nesterov: bool = True
    muon_ns_steps: int = 3
    muon_bias_lr: float = 0.053  # PyTorch lr (summed loss) of whitening/BN biases under Muon
    muon_head_lr: float = 0.67
    muon_weight_decay_per_example: float = 2e-6  # times batch_size, per step
    # System (tricks/precision.py)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 autocast on CUDA, else fp32
    channels_last: Literal["auto", "on", "off"] = "auto"  # auto: on for CUDA and CPU, off for MPS
    compile: bool = False
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = \
        "max-autotune-no-cudagraphs"  # torch.compile's modes
    cudnn_benchmark: bool = True  # let cuDNN time its convolution algorithms (CUDA only; in the warm-up run)
    eval_each_epoch: bool = True  # untimed per-epoch test accuracy (no TTA) for the table
    eval_batch_size: int = 2000
    check_finite_loss: bool = True  # stop a run within one step of its loss turning NaN/inf (engine.FiniteLossGuard)

    def validate(self) -> None:
        """Every setting alone, before any data is read (data-dependent checks: `check_data`)."""
        for f in dataclasses.fields(self):  # config.py already refuses NaN/inf from strings; this covers the API
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"bad config: {f.name}={value} must be a finite number")
            # Every float setting multiplies others (lr x bias_lr_mult x schedule ...) into scalars that torch casts
            # to float32: 1e308 is finite here but not there, and fails mid-step. No sensible value is this large.
            if isinstance(value, float) and abs(value) > MAX_FLOAT_SETTING:
                raise ValueError(f"bad config: {f.name}={value:g} is outside [-{MAX_FLOAT_SETTING:g}, "
                                 f"{MAX_FLOAT_SETTING:g}]")
        nonneg = ("weight_decay_per_1024", "lr_start_mult", "lr_end_mult", "muon_lr",
                  "muon_weight_decay_per_example", "whiten_bias_epochs", "translate_px", "cutout_px", "cutmix_px")
        # Weight decay is decoupled from the lr as wd / lr (tricks/decoupled_sgd.py), so these lrs cannot be 0.
        positive = ("lr_per_1024", "bias_lr_mult", "muon_bias_lr", "muon_head_lr")
        checks = [
            (1 <= self.batch_size <= MAX_BATCH, f"batch_size must be in [1, {MAX_BATCH}]"),
            (0 < self.epochs <= MAX_EPOCHS, f"epochs must be in (0, {MAX_EPOCHS}]"),
            (1 <= len(self.widths) <= MAX_GROUPS and all(1 <= w <= MAX_WIDTH for w in self.widths),
             f"widths must be 1 to {MAX_GROUPS} numbers in [1, {MAX_WIDTH}], e.g. 64,256,256"),
            (self.convs_per_group in (2, 3), "convs_per_group must be 2 or 3"),
            (self.tta_level in (0, 1, 2), "tta_level must be 0, 1 or 2"),
            (0 <= self.label_smoothing < 1, "label_smoothing must be in [0, 1)"),
            (0 <= self.momentum < 1 and 0 <= self.muon_momentum < 1, "momentum must be in [0, 1)"),
            (0 < self.bn_momentum <= 1, "bn_momentum must be in (0, 1]"),
            (self.bn_eps > 0 and self.whiten_eps > 0, "bn_eps and whiten_eps must be > 0"),
            (self.logit_scale > 0, "logit_scale must be > 0"),
            (0 <= self.target_accuracy <= 1, "target_accuracy is a fraction in [0, 1], e.g. 0.94"),
            (all(getattr(self, k) >= 0 for k in nonneg), f"{', '.join(nonneg)} must be >= 0"),
            (all(getattr(self, k) > 0 for k in positive), f"{', '.join(positive)} must be > 0"),
            (1 <= self.lookahead_every_steps <= 10**6 and 0 <= self.lookahead_base <= 1,
             "lookahead_every_steps must be in [1, 1000000] and lookahead_base in [0, 1]"),
            (0 <= self.lr_peak_frac <= 1, "lr_peak_frac must be in [0, 1]"),
            (1 <= self.whiten_kernel_px <= 8 and 1 <= self.whiten_images <= 10**7,
             "whiten_kernel_px must be in [1, 8] and whiten_images in [1, 10000000]"),
            (1 <= self.muon_ns_steps <= 20, "muon_ns_steps must be in [1, 20]"),
            (1 <= self.eval_batch_size <= MAX_BATCH, f"eval_batch_size must be in [1, {MAX_BATCH}]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"bad config: {message}")


# Bounds that no sensible run crosses; they keep a typo (batch_size=10000000, widths=...,1000000) from allocating
# the machine away before the first step.
MAX_BATCH = 1 << 16
MAX_FLOAT_SETTING = 1e4  # the largest default is lr_per_1024 = 11.5, times bias_lr_mult = 64
MAX_EPOCHS = 10_000.0
MAX_GROUPS = 8
MAX_WIDTH = 8192


def check_data(cfg: CifarConfig, image_shape: tuple[int, int, int], num_train: int, num_test: int,
               num_classes: int, device: torch.device | None = None) -> list[str]:
    """Refuse (ValueError) a config that cannot train on data of this shape; return warnings for odd but valid ones.

    Called before any step, so that no run starts that would fail or mean nothing later.
    """
    c, h, w = image_shape
    side = min(h, w)
    if output_side(side, cfg.widths, cfg.whiten_kernel_px) < 1:
        fits = [n for n in range(1, len(cfg.widths) + 1)
                if output_side(side, cfg.widths[:n], cfg.whiten_kernel_px) >= 1]
        need = 2 ** len(cfg.widths) + cfg.whiten_kernel_px - 1  # the smallest side these groups leave 1 px of
        fix = (f"use at most {max(fits)} widths (--set widths=...) or images of at least {need} px" if fits else
               f"use images of at least {need} px")
        raise ValueError(
            f"{h}x{w} images are too small for {len(cfg.widths)} groups: the whitening conv ({cfg.whiten_kernel_px} "
            f"px) and {len(cfg.widths)} 2x2 pools leave nothing; {fix} (image_size / --image-size for image "
            "folders)")
    for name, px, limit in (("translate_px", cfg.translate_px, side - 1), ("cutout_px", cfg.cutout_px, side),
                            ("cutmix_px", cfg.cutmix_px, side)):
        if px > limit:
            raise ValueError(f"{name}={px} does not fit {h}x{w} images; use at most {limit}")
    param_bytes, train_bytes, eval_bytes = memory_lower_bound(image_shape, num_classes, cfg.widths,
                                                              cfg.convs_per_group, cfg.whiten_kernel_px,
                                                              cfg.batch_size, min(cfg.eval_batch_size, num_test))
    fix = "lower batch_size, eval_batch_size or widths (--set batch_size=... / eval_batch_size=... / widths=...)"
    # The net is built on the host first; on an accelerator the activations live there, and its allocator reports
    # running out with an error of its own (a one-line message from the CLI), unlike the host's OOM killer.
    on_host = device is None or device.type == "cpu"
    limits.check_memory(param_bytes + (max(train_bytes, eval_bytes) if on_host else 0),
                        f"this net ({cfg.widths}, batch {cfg.batch_size}, eval batch {cfg.eval_batch_size}, {h}x{w} "
                        "images)", fix)
    notes = []
    if cfg.batch_size > num_train:
        notes.append(f"batch_size {cfg.batch_size} is larger than the {num_train} training images: every step "
                     f"repeats images, and {math.ceil(cfg.epochs * num_train / cfg.batch_size)} step(s) will not "
                     f"train a network; lower batch_size (--set batch_size=...)")
    return notes


def cifar10_94() -> CifarConfig:
    return CifarConfig()


def cifar10_94_muon() -> CifarConfig:
    # airbench94_muon (REFERENCES.md): batch 2000, 8 epochs, lrs decay linearly to 0, no Lookahead,
    # head output divided by its width.
    return dataclasses.replace(CifarConfig(), optimizer="muon", batch_size=2000, epochs=8.0, lookahead=False,
                               lr_start_mult=1.0, lr_peak_frac=0.0, lr_end_mult=0.0, logit_scale=1 / 256)


def cifar10_95() -> CifarConfig:
    return dataclasses.replace(CifarConfig(), target_accuracy=0.95, widths=(128, 384, 384), epochs=15.0,
                               lr_per_1024=10.0)


def cifar10_96() -> CifarConfig:
    return dataclasses.replace(CifarConfig(), target_accuracy=0.96, widths=(128, 384, 512), convs_per_group=3,
                               epochs=37.0, lr_per_1024=9.0, weight_decay_per_1024=0.012, translate_px=4,
                               cutout_px=12)


@dataclass
class RunResult:
    seed: int
    accuracy: float | None  # final test accuracy after TTA, fraction; None for a diverged run
    train_seconds: float | None  # the timed region; None for a diverged run
    epochs: float
    steps: int  # steps taken (for a diverged run: up to the step whose loss was not finite)
    history: list[dict] = field(default_factory=list)  # one row per epoch
    model: torch.nn.Module | None = None
    diverged: dict | None = None  # engine.Diverged.to_dict() when the loss became NaN/inf

    def to_dict(self) -> dict:
        """JSON-ready fields (the model is not serialized)."""
        return {"seed": self.seed, "accuracy": self.accuracy, "train_seconds": self.train_seconds,
                "epochs": self.epochs, "steps": self.steps, "diverged": self.diverged, "history": self.history}


def build_model(cfg: CifarConfig, in_channels: int, num_classes: int) -> CifarNet:
    return CifarNet(in_channels, num_classes, cfg.widths, cfg.convs_per_group, cfg.whiten_kernel_px, cfg.bn_momentum,
                    cfg.bn_eps, cfg.bn_scale_frozen, cfg.dirac_init, cfg.logit_scale, cfg.activation)


def build_optimizers(cfg: CifarConfig, model: CifarNet) -> list[torch.optim.Optimizer]:
    """Parameter groups as airbench. SGD (airbench94): BN parameters get the bias lr multiplier; the whitening
    bias, conv filters and head the base lr. Muon (airbench94_muon): Muon on the conv filters; SGD with one lr
    for the whitening and BN biases and another for the head."""
    norms = [p for n, p in model.named_parameters() if "norms" in n and p.requires_grad]
    filters = [p for n, p in model.named_parameters() if "convs" in n]
    head = [model.head.weight]
    if cfg.optimizer == "sgd":
        return [decoupled_sgd([{"params": norms, "lr_mult": cfg.bias_lr_mult},
                               {"params": [model.whiten.bias] + filters + head, "lr_mult": 1.0}],
                              lr_per_1024=cfg.lr_per_1024, weight_decay_per_1024=cfg.weight_decay_per_1024,
                              momentum=cfg.momentum, batch_size=cfg.batch_size)]
    wd = cfg.muon_weight_decay_per_example * cfg.batch_size
    biases = [model.whiten.bias] + norms
    sgd = torch.optim.SGD([{"params": biases, "lr": cfg.muon_bias_lr, "weight_decay": wd / cfg.muon_bias_lr},
                           {"params": head, "lr": cfg.muon_head_lr, "weight_decay": wd / cfg.muon_head_lr}],
                          momentum=cfg.momentum, nesterov=True)
    muon = Muon(filters, lr=cfg.muon_lr, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                ns_steps=cfg.muon_ns_steps)
    for opt in (sgd, muon):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return [sgd, muon]


def train_step(forward: Callable[[torch.Tensor], torch.Tensor], optimizers: list[torch.optim.Optimizer],
               inputs: torch.Tensor, targets: torch.Tensor, label_smoothing: float,
               amp: Callable[[], contextlib.AbstractContextManager]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step on a batch: forward under amp(), label-smoothed summed loss, backward, every optimizer's step.

    Returns (logits, loss) for the per-epoch table. benchmarks/step_time.py times exactly this.
    """
    with amp():
        logits = forward(inputs)
    loss = cross_entropy(logits, targets, label_smoothing)
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    loss.backward()
    for opt in optimizers:
        opt.step()
    return logits, loss


def _epoch_row(epoch: float, step: int, loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
               seconds: float) -> dict:
    """One row of the per-epoch table; train loss/accuracy are those of the last batch (as airbench)."""
    labels = targets if targets.ndim == 1 else targets.argmax(1)
    return {"epoch": round(epoch, 4), "step": step, "train_loss": loss.item() / len(labels),
            "train_acc": (logits.argmax(1) == labels).float().mean().item(), "val_acc": None,
            "train_seconds": seconds}


def train_run(cfg: CifarConfig, data: Dataset, device: torch.device, seed: int, *, shuffle_labels: bool = False,
              on_step: Callable[[int, int], None] | None = None,
              on_epoch: Callable[[dict], None] | None = None) -> RunResult:
    """One training run of `cfg` on `data`; returns the final TTA accuracy and the timed seconds.

    shuffle_labels: train on permuted labels (the untimed compile/autotune warm-up run, as airbench does).
    """
    cfg.validate()
    seed_everything(seed)
    precision = resolve_precision(cfg.precision, device)
    channels_last = resolve_channels_last(cfg.channels_last, device)
    dtype = DTYPES[precision]
    in_channels, _, _ = data.image_shape

    # Untimed: statistics, upload, model construction.
    mean, std = channel_stats(data.train_images)
    train_labels = data.train_labels
    if shuffle_labels:
        train_labels = train_labels[torch.randperm(len(train_labels), generator=torch.Generator().manual_seed(seed))]
    loader = DeviceLoader(data.train_images, train_labels, batch_size=cfg.batch_size, epochs=cfg.epochs,
                          num_classes=data.num_classes, device=device, mean=mean, std=std, dtype=dtype,
                          channels_last=channels_last, flip=cfg.flip, translate_px=cfg.translate_px,
                          cutout_px=cfg.cutout_px, cutmix_px=cfg.cutmix_px, seed=seed)
    test_images, test_labels = data.test_images.to(device), data.test_labels.to(device)
    model = to_channels_last(build_model(cfg, in_channels, data.num_classes).to(device), channels_last)
    set_cudnn_benchmark(device, cfg.cudnn_benchmark)
    forward = maybe_compile(model, cfg.compile, cfg.compile_mode)
    optimizers = build_optimizers(cfg, model)
    total_steps = loader.steps
    # The lr the divergence message names: the setting a user would lower.
    lr_name, base_lr = ("lr_per_1024", cfg.lr_per_1024) if cfg.optimizer == "sgd" else ("muon_lr", cfg.muon_lr)
    guard = FiniteLossGuard(device, total_steps, lr_name, enabled=cfg.check_finite_loss)

    def amp():
        return autocast(device, precision)

    timer = Timer(device)
    timer.start()  # ---- timed region: whitening init ... TTA evaluation ----
    if cfg.whiten_init:
        # A random sample, not the first images: image folders list their files class by class.
        pick = torch.randperm(loader.num_examples, generator=torch.Generator().manual_seed(seed))
        sample = loader.images[pick[:cfg.whiten_images].to(device)]
        patch_whitening_init_(model.whiten, normalize(sample, mean, std, torch.float32), cfg.whiten_eps)
    lookahead = Lookahead(model) if cfg.lookahead else None  # slow weights start from the initialized net

    history: list[dict] = []
    step = 0
    epoch_done = 0  # whole epochs completed, for the per-epoch table
    model.train()
    for inputs, targets in loader:
        if model.whiten.bias.requires_grad and loader.epoch_at(step) >= cfg.whiten_bias_epochs:
            model.whiten.bias.requires_grad_(False)
        mult = triangle(step, total_steps, cfg.lr_start_mult, cfg.lr_peak_frac, cfg.lr_end_mult)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * mult
        logits, loss = train_step(forward, optimizers, inputs, targets, cfg.label_smoothing, amp)
        step += 1
        guard.check(step, loss, base_lr * mult)
        if lookahead is not None and step % cfg.lookahead_every_steps == 0:
            lookahead.update(lookahead_decay(step, total_steps, cfg.lookahead_base, cfg.lookahead_every_steps))
        if on_step is not None:
            on_step(step, total_steps)
        if int(loader.epoch_at(step)) > epoch_done and step < total_steps:
            epoch_done = int(loader.epoch_at(step))
            timer.stop()  # the table's evaluation is not part of the timed region
            row = _epoch_row(loader.epoch_at(step), step, loss, logits, targets, timer.seconds)
            if cfg.eval_each_epoch:
                row["val_acc"] = evaluate(forward, test_images, test_labels, mean=mean, std=std, dtype=dtype,
                                          channels_last=channels_last, tta_level=0,
                                          batch_size=cfg.eval_batch_size, autocast=amp)
            history.append(row)
            if on_epoch is not None:
                on_epoch(row)
            timer.start()
    guard.finish()
    if lookahead is not None:
        lookahead.update(1.0)  # final sync: the live net takes the averaged weights
    accuracy = evaluate(forward, test_images, test_labels, mean=mean, std=std, dtype=dtype,
                        channels_last=channels_last, tta_level=cfg.tta_level, batch_size=cfg.eval_batch_size,
                        autocast=amp)
    train_seconds = timer.stop()  # ---- end of timed region ----
    row = _epoch_row(loader.epoch_at(step), step, loss, logits, targets, train_seconds)
    row["val_acc"] = accuracy  # the last row reports the final accuracy, with TTA
    history.append(row)
    if on_epoch is not None:
        on_epoch(row)
    return RunResult(seed=seed, accuracy=accuracy, train_seconds=train_seconds, epochs=cfg.epochs,
                     steps=total_steps, history=history, model=model)


def warmup(cfg: CifarConfig, data: Dataset, device: torch.device) -> float:
    """An untimed run on shuffled labels, so torch.compile and cuDNN autotuning happen before the timed runs.

    Returns its wall-clock seconds (reported as warm-up time). Skipped (0.0) on CPU without compile.
    """
    if device.type == "cpu" and not cfg.compile:
        return 0.0
    start = time.perf_counter()
    train_run(cfg, data, device, seed=0, shuffle_labels=True)
    synchronize(device)
    return time.perf_counter() - start
