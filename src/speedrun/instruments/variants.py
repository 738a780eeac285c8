"""What ablate and to_target share: the variants of a recipe that switch one registered trick off (a family's
TRICKS: its config switch, its "off" value, what it is), and which of them are already off on the device that runs.

"Already off" is judged on that device: `precision=auto` is fp32 on a CPU, so switching bf16 off there would train
the baseline again under another name; so is `half_weights=auto`, off wherever the run is not fp16 on CUDA.
"""

from __future__ import annotations

import dataclasses

from speedrun.engine.system import resolve_system

Trick = tuple[str, object, str]  # (config key, its "off" value, what it is): a family's TRICKS entry


def effective(key: str, value, device, base):
    """What a switch's value means on `device` in `base`'s family: the shared "auto" settings resolved as the run
    resolves them (engine.resolve_system: precision=auto is bf16 on a CPU with native bf16 for a family that has
    measured it, else fp32 on a CPU; channels_last=auto is off on a CPU for a family that says so)."""
    if key in ("precision", "channels_last", "half_weights"):
        changes = {key: value}
        if key == "precision" and value == "fp32" and base.half_weights == "on":  # fp32 has no half weights
            changes["half_weights"] = "auto"
        system = resolve_system(dataclasses.replace(base, **changes), device)
        return {"precision": system.dtype, "channels_last": system.channels_last,
                "half_weights": system.half_weights}[key]
    return value


def set_text(value) -> str:
    """A config value (a TRICKS "off" value, a setting tune recommends) as --set, --vary and a settings file take
    it (False -> "false")."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def split_tricks(tricks: list[Trick], base, dev, idle: list[str] | tuple = ()) -> tuple[list[Trick], list[Trick]]:
    """`tricks` as (on in `base`, already off in `base`), judged by what each value means on `dev`. `idle`: keys
    that do nothing for base's network (a family's idle_tricks: the user's network, --model), counted as off,
    their text saying why."""
    def is_off(key: str, off) -> bool:
        return key in idle or effective(key, getattr(base, key), dev, base) == effective(key, off, dev, base)

    def said(t: Trick) -> Trick:
        return (t[0], t[1], f"{t[2]}; does nothing for the network {base.model}") if t[0] in idle else t

    return [t for t in tricks if not is_off(t[0], t[1])], [said(t) for t in tricks if is_off(t[0], t[1])]
