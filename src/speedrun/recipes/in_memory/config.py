"""The settings every in-memory family shares (InMemoryConfig, which each family's config inherits), the ranges
they are checked against alike, and the texts a run's result shows of them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

from speedrun.config import SYSTEM_MAY_DIFFER, Check, ConfigError, SystemConfig, refuse
from speedrun.data.loader import Augmentation
from speedrun.models.custom import check_name

# Settings a resumed run may change: how fast it runs and what it reports, not what it trains.
MAY_DIFFER_ON_RESUME = SYSTEM_MAY_DIFFER | {"eval_each_epoch", "eval_batch_size", "target_accuracy"}

# Bounds that no sensible run crosses; they keep a typo (batch_size=10000000) from allocating the machine away
# before the first step.
MAX_BATCH = 1 << 16
MAX_EPOCHS = 10_000.0

C = TypeVar("C", bound="InMemoryConfig")


@dataclass(frozen=True)
class InMemoryConfig(SystemConfig):
    """The settings of every in-memory family at airbench94's values (Jordan, arXiv 2404.00498); a family gives
    one another default by declaring it again. The device-side ones (precision, channels_last, compile, ...) come
    from config.SystemConfig, shared by every family."""

    # every epoch's last partial batch was trained on before drop_last_batch existed
    BEFORE_IT_EXISTED: ClassVar[dict[str, Any]] = {**SystemConfig.BEFORE_IT_EXISTED, "drop_last_batch": False}
    # What the family's lr and weight decay are for: the loss summed over the batch (airbench's, whose lrs are per
    # 1024 examples), or its mean over the global batch (PyTorch's convention; in_memory.loop.train_step divides).
    MEAN_LOSS: ClassVar[bool] = False

    target_accuracy: float = 0.94  # fraction; the share of runs reaching it is reported
    # Schedule
    batch_size: int = 1024
    epochs: float = 9.9  # fractional epochs count steps exactly: ceil(epochs * (N // batch_size)) (drop_last_batch)
    drop_last_batch: bool = True  # each epoch's last partial batch dropped, as airbench: 476 steps, not 484
    lr_start_mult: float = 0.2  # triangular schedule (tricks/schedule.py)
    lr_peak_frac: float = 0.23
    lr_end_mult: float = 0.07
    momentum: float = 0.85
    # Augmentation (data/augment.py)
    flip: Literal["none", "random", "alternating"] = "alternating"
    translate_px: int = 2  # random shift with reflect padding, in pixels
    # Network: its stages' widths (channels), as the family's network reads them
    widths: tuple[int, ...] = (64, 256, 256)
    # Patch whitening of the first conv (tricks/whitening.py)
    whiten_init: bool = True
    whiten_eps: float = 5e-4
    whiten_images: int = 5000  # training images (a random sample) whose patches set the covariance
    # Loss and averaging
    label_smoothing: float = 0.2
    lookahead: bool = True
    lookahead_every_steps: int = 5
    lookahead_base: float = 0.95
    tta_level: int = 2  # 0 none, 1 mirror, 2 mirror + 1-px translate (tricks/tta.py)
    # Evaluation
    eval_each_epoch: bool = True  # untimed per-epoch test accuracy (no TTA) for the table
    eval_batch_size: int = 2000
    # The network: "" is the family's own; else the name of the user's builder, set with --model MODULE:FUNCTION
    # (models/custom.py), never with --set. A file written without this field trained the family's own.
    model: str = ""

    def validate(self) -> None:
        """Every setting alone, before any data is read (the data-dependent checks are each family's check_data)."""
        self.validate_system()
        check_name(self.model)
        self.check_floats()
        refuse(self.checks())

    def check_floats(self, bound: float = math.inf) -> None:
        """Every float setting finite (config.py refuses NaN/inf from strings; this covers the API) and, where a
        family bounds them, in [-bound, bound]."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"bad config: {f.name}={value} must be a finite number", keys=f.name)
            if isinstance(value, float) and abs(value) > bound:
                raise ConfigError(f"bad config: {f.name}={value:g} is outside [-{bound:g}, {bound:g}]", keys=f.name)

    def checks(self) -> list[Check]:
        """(holds, what the setting must be, its key) for the shared settings' ranges; a family adds its own."""
        return [
            (1 <= self.batch_size <= MAX_BATCH, f"batch_size must be in [1, {MAX_BATCH}]", "batch_size"),
            (self.tta_level in (0, 1, 2), "tta_level must be 0, 1 or 2", "tta_level"),
            (0 <= self.label_smoothing < 1, "label_smoothing must be in [0, 1)", "label_smoothing"),
            (0 <= self.momentum < 1, "momentum must be in [0, 1)", "momentum"),
            (1 <= self.eval_batch_size <= MAX_BATCH, f"eval_batch_size must be in [1, {MAX_BATCH}]",
             "eval_batch_size"),
            (0 <= self.target_accuracy <= 1,  # the family's default as the example
             f"target_accuracy is a fraction in [0, 1], e.g. {type(self).target_accuracy:g}", "target_accuracy"),
        ]

    def user_bn_momentum(self) -> float | None:
        """The momentum the BatchNorm layers of the user's network take (tricks/bn_momentum.py): the family's own,
        where it sets one; None: the builder's, untouched."""
        return None

    def augmentation(self) -> Augmentation:
        """The training batches' augmentations (data/loader.py), as these settings choose them."""
        return Augmentation(self.flip, self.translate_px)

    def tta_fraction(self) -> float | None:
        """The share of the test images, the least confident, that the final evaluation gives TTA's further views
        (tricks/tta.py's tta_select); 0 or None: every image."""
        return 0.0

    def with_epochs(self: C, epochs: float) -> C:
        """This config trained for `epochs`; the lr schedule and Lookahead's ramp are in fractions of the run."""
        return dataclasses.replace(self, epochs=epochs)


def final_evaluation(cfg: InMemoryConfig) -> str:
    """What the last row of the progress table measures."""
    if not cfg.tta_level:
        return "final evaluation without TTA"
    share = cfg.tta_fraction()
    if share and share < 1:
        return f"final evaluation with TTA level {cfg.tta_level} on the {share:.0%} least confident test images"
    return f"final evaluation with TTA level {cfg.tta_level}"


def timed_region(cfg: InMemoryConfig, start: str = "whitening init + ") -> str:
    """What train_seconds covers, for the result file and the summary (as airbench times); start: what the timed
    region begins with before training."""
    return (f"{start}training + {final_evaluation(cfg)}, device-synchronized; excludes data loading, upload, "
            "per-epoch table evaluations, checkpoint writes and the warm-up run")
