"""Typed configs: `--set key=value` parsing and validation.

A recipe's config is a dataclass whose field types are plain: bool, int, float, str, a Literal of strings, or a
tuple of ints. Overrides are parsed against those types; an unknown key or a value of the wrong type raises a
one-line ConfigError (a ValueError) that names the key and the fix, and carries the key.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, ClassVar, Literal, get_args, get_origin


class ConfigError(ValueError):
    """A config setting refused (an unknown key, a value of the wrong type or out of range), carrying `keys`: the
    settings it is about, so that a caller that applied them from elsewhere (records/settings_file.py's file) names
    the values it gave without reading the message; () where the raiser does not know them."""

    def __init__(self, message: str, *, keys: str | tuple[str, ...] = ()):
        super().__init__(message)
        self.keys = (keys,) if isinstance(keys, str) else tuple(keys)


# A range check of a config's settings: (holds, what the settings must be, the keys it is about).
Check = tuple[bool, str, str | tuple[str, ...]]


def refuse(checks: list[Check]) -> None:
    """Raise the first failed check as one line, `bad config: <what the settings must be>`, carrying its keys."""
    for ok, message, keys in checks:
        if not ok:
            raise ConfigError(f"bad config: {message}", keys=keys)


def field_types(cfg_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cfg_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cfg_cls)}


def field_defaults(cfg: Any) -> dict[str, Any]:
    """{field: default} of a config dataclass (instance or class), as dataclasses.asdict writes values (tuples for
    the tuple fields): a setting's behaviour before it existed, for files written before it (checkpoints)."""
    out = {}
    for f in dataclasses.fields(cfg):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    # a setting whose default is not what was done before it existed says what was (SystemConfig.BEFORE_IT_EXISTED)
    return {**out, **getattr(cfg, "BEFORE_IT_EXISTED", {})}


def _describe(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + "|".join(map(str, get_args(tp)))
    if get_origin(tp) is tuple:
        return "comma-separated ints, e.g. 64,256,256"
    return getattr(tp, "__name__", str(tp))


def parse_value(key: str, text: str, tp: Any) -> Any:
    """Parse the string `text` as a value of type `tp` for field `key`."""
    bad = ConfigError(f"{key}={text}: expected {_describe(tp)}", keys=key)
    if tp is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}={text}: expected a boolean (true/false)", keys=key)
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise bad from None
    if tp is float:
        try:
            value = float(text)
        except ValueError:
            raise bad from None
        return _finite(key, value)
    if tp is str:
        return text
    if get_origin(tp) is Literal:
        if text in get_args(tp):
            return text
        raise bad
    if get_origin(tp) is tuple:
        try:
            return tuple(int(v) for v in text.replace("(", "").replace(")", "").split(",") if v.strip())
        except ValueError:
            raise bad from None
    raise AssertionError(f"config field {key} has an unsupported type {tp}")


def _finite(key: str, value: float) -> float:
    # NaN and inf parse as floats but no setting means them: lr_per_1024=nan would train a NaN network.
    if not math.isfinite(value):
        raise ConfigError(f"{key}={value}: expected a finite number", keys=key)
    return value


def check_value(key: str, value: Any, tp: Any) -> Any:
    """Validate a Python value given through the API (not a string): the same rules as the CLI."""
    if isinstance(value, str) and tp is not str and get_origin(tp) is not Literal:
        return parse_value(key, value, tp)
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }
    if tp in ok:
        if not ok[tp](value):
            raise ConfigError(f"{key}={value!r}: expected {_describe(tp)}", keys=key)
        if tp is float:
            try:
                return _finite(key, float(value))
            except OverflowError:  # float(10**400)
                raise ConfigError(f"{key}={value!r}: expected a finite number", keys=key) from None
        return value
    if get_origin(tp) is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{key}={value!r}: expected {_describe(tp)}", keys=key)
        return value
    if get_origin(tp) is tuple:
        if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) for v in value):
            raise ConfigError(f"{key}={value!r}: expected {_describe(tp)}", keys=key)
        return tuple(value)
    raise AssertionError(f"config field {key} has an unsupported type {tp}")


# Settings of a whole invocation, not of a recipe's config: `--set seed=1` means `--seed 1`.
RUN_OPTIONS = {"seed": "--seed", "runs": "--runs", "device": "--device", "dataset": "--dataset",
               "data_dir": "--data-dir", "json": "--json", "json_path": "--json", "image_size": "--image-size",
               "recipe": "the recipe argument"}


def apply_overrides(cfg: Any, overrides: dict[str, Any]) -> Any:
    """A copy of dataclass `cfg` with `overrides` applied; string values are parsed by the field's type."""
    types = field_types(type(cfg))
    changes = {}
    for key, value in overrides.items():
        if key not in types:
            hint = (f"{key} is not a config key: use {RUN_OPTIONS[key]} (the {key} argument in Python)"
                    if key in RUN_OPTIONS else f"unknown config key {key!r}")
            raise ConfigError(f"{hint}; valid keys: {', '.join(sorted(types))}", keys=key)
        changes[key] = check_value(key, value, types[key])
    return dataclasses.replace(cfg, **changes)


def parse_set_args(items: list[str]) -> dict[str, str]:
    """["lr=0.1", "flip=none"] -> {"lr": "0.1", "flip": "none"}; a key given twice takes its last value, as a
    repeated flag does (so a script can append to a base command)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. --set batch_size=512")
        out[key.strip()] = value.strip()
    return out


@dataclasses.dataclass(frozen=True)
class SystemConfig:
    """Device-side settings every recipe family shares (torchtitan's reusable sections): how the work runs, not
    what is trained. A family's Config inherits them, so `--set precision=bf16` means the same in every family.
    engine/system.py's setup_system turns them into what a loop uses (tricks/precision.py holds each trick's card)."""

    # auto: on CUDA the family's CUDA_AUTO_PRECISION (below); bf16 autocast on a CPU with native bf16 instructions
    # where the family says so (below); else fp32
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    # Half weights (tricks/precision.py, as airbench): parameters, gradients and momentum in the 16-bit precision,
    # BatchNorm in fp32, no autocast. auto: on where the run is on CUDA at fp16 and the family says so (below).
    half_weights: Literal["auto", "on", "off"] = "auto"
    channels_last: Literal["auto", "on", "off"] = "auto"  # auto: on for CUDA and CPU (see below), off for MPS
    # What channels_last=auto means on a CPU for this family (a class constant, not a setting): a family whose
    # CPU runs crash in channels_last turns it off here, and everything that resolves "auto" (the run, ablate's
    # "already off") reads it through engine/system.py's setup_system.
    CHANNELS_LAST_AUTO_ON_CPU: ClassVar[bool] = True
    # Whether precision=auto means bf16 autocast on a CPU with native bf16 instructions (AVX-512 BF16 or AMX): a
    # family turns it on once its accuracy is measured to hold at bf16 on such a CPU (BENCHMARKS.md), else fp32.
    BF16_AUTO_ON_CPU: ClassVar[bool] = False
    # What precision=auto means on CUDA for this family, and whether half_weights=auto is on there at fp16: a family
    # changes them once their accuracy is measured to hold (BENCHMARKS.md).
    CUDA_AUTO_PRECISION: ClassVar[str] = "bf16"
    HALF_WEIGHTS_AUTO_ON_CUDA: ClassVar[bool] = False
    # For settings added with a default that changes what runs: the value that means what was done before the
    # setting existed (config.field_defaults), so that a checkpoint made before it resumes as it was made or is
    # refused, never continued under the new default. (half_weights needs none: a checkpoint records whether it ran
    # with half weights, and run/resume.py's check_precision holds a resume to it, a record's absence meaning off.)
    BEFORE_IT_EXISTED: ClassVar[dict[str, Any]] = {}
    compile: bool = False
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = \
        "max-autotune-no-cudagraphs"  # torch.compile's modes
    cudnn_benchmark: bool = True  # let cuDNN time its convolution algorithms (CUDA only; in the warm-up run)
    # CPU intra-op threads (torch.set_num_threads) while a run trains; 0: torch's default (the physical cores,
    # or OMP_NUM_THREADS)
    cpu_threads: int = 0
    # torch.optim's update kernels for the recipe's SGD optimizers (tricks/optimizer_kernel.py); auto: torch's choice
    optimizer_kernel: Literal["auto", "foreach", "fused", "for-loop"] = "auto"
    # stop a run soon after its loss turns NaN/inf (engine/loop.py's FiniteLossGuard), naming the step
    check_finite_loss: bool = True
    # on an accelerator the guard reads the losses back every this many steps, in one copy (a read per step would
    # drain the device's queue each step); on the CPU it reads every step, which costs nothing there
    check_finite_every_steps: int = 8
    # Under torchrun: BatchNorm normalizes each process's share of the batch by that share's statistics unless
    # this is on (SyncBatchNorm: statistics over the global batch, an all-reduce per BN layer; CUDA only).
    sync_bn: bool = False

    def validate_system(self) -> None:
        """The shared settings' ranges (each family's validate calls it; Literal fields are checked on parsing)."""
        if isinstance(self.cpu_threads, bool) or not isinstance(self.cpu_threads, int) or \
                not 0 <= self.cpu_threads <= 1024:
            raise ConfigError(f"bad config: cpu_threads={self.cpu_threads!r} must be an integer in [0, 1024] "
                              "(0: torch's default)", keys="cpu_threads")
        if self.half_weights == "on" and self.precision == "fp32":
            raise ConfigError("bad config: half_weights=on needs a 16-bit precision: add --set precision=fp16 (or "
                              "bf16), or leave half_weights at auto", keys=("half_weights", "precision"))
        every = self.check_finite_every_steps
        if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= 10**6:
            raise ConfigError(f"bad config: check_finite_every_steps={every!r} must be an integer in [1, 1000000]",
                              keys="check_finite_every_steps")


# System settings that change how fast a run goes, never what it computes: a resumed run may change them.
SYSTEM_MAY_DIFFER = frozenset({"compile", "compile_mode", "check_finite_loss", "check_finite_every_steps",
                               "cpu_threads", "optimizer_kernel"})


def check_int(name: str, flag: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} ({flag}) must be an integer in [{low}, {high}], got {value!r}")
    return value
