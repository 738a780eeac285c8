"""Random uint8 images and labels: `synthetic` or `synthetic:train=N,test=N,shape=CxHxW,classes=K,seed=S`.

Used to measure speed without a download and in tests. Nothing is learnable and nothing is cached:
generating is faster than reading a cache file would be.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from speedrun.data import limits
from speedrun.data.dataset import Dataset

DEFAULTS: dict[str, object] = {"train": 50000, "test": 10000, "shape": (3, 32, 32), "classes": 10, "seed": 0}
# Smallest values: an empty split is no data set, one class no classification task.
_MINIMUM = {"train": 1, "test": 1, "classes": 2, "seed": 0}
# Channels: grey, RGB or RGBA. Sides: those of in-memory image data (limits.MAX_IMAGE_SIDE_PX).
_MAX_CHANNELS = 4
# Largest values: ImageNet-21k has 21,841 classes (the class names are a list of that many strings); numpy
# seeds are unbounded, but a seed beyond 64 bits is a typo.
_MAXIMUM = {"classes": limits.MAX_CLASSES, "seed": 2**64 - 1}


def _int(key: str, text: str, minimum: int, maximum: int | None = None) -> int:
    try:
        # Plain ASCII digits only: int() also takes "64_0" and other scripts' digits, which no one means here.
        if not re.fullmatch(r"[+-]?[0-9]+", text.strip()):
            raise ValueError(text)
        value = int(text)
    except ValueError:
        # Python refuses to parse integers of more than 4,300 digits: too large, not "not an integer".
        kind = "is far too large" if re.fullmatch(r"[+-]?[0-9]+", text.strip()) else "must be an integer"
        shown = text if len(text) <= 20 else text[:20] + "..."
        raise ValueError(f"synthetic: {key} {kind}, got {shown!r}") from None
    if value < minimum:
        raise ValueError(f"synthetic: {key} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"synthetic: {key} must be <= {maximum}, got {value}")
    return value


def parse_spec(spec: str) -> dict[str, object]:
    """`synthetic[:key=val,...]` -> the full option dict (defaults filled in), validated."""
    head, _, rest = spec.strip().partition(":")
    if head.strip().lower() != "synthetic":
        raise ValueError(f"not a synthetic spec: {spec!r}; write synthetic or synthetic:key=val,...")
    options = dict(DEFAULTS)
    seen: set[str] = set()
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if key not in DEFAULTS:
            raise ValueError(f"synthetic: unknown key {key!r}; valid keys are {', '.join(DEFAULTS)}")
        if not eq or not value:
            raise ValueError(f"synthetic: {key!r} needs a value, as in {key}=...")
        if key in seen:
            raise ValueError(f"synthetic: {key!r} is given twice")
        seen.add(key)
        if key == "shape":
            parts = value.lower().split("x")
            if len(parts) != 3:
                raise ValueError(f"synthetic: shape must look like 3x32x32 (CxHxW), got {value!r}")
            sides = (_MAX_CHANNELS, limits.MAX_IMAGE_SIDE_PX, limits.MAX_IMAGE_SIDE_PX)
            options[key] = tuple(_int(f"shape {axis}", p, 1, top) for axis, p, top in zip("CHW", parts, sides))
        else:
            options[key] = _int(key, value, _MINIMUM[key], _MAXIMUM.get(key))
    c, h, w = options["shape"]  # type: ignore[misc]
    # Refused here, before make() allocates: both splits are held in memory at once.
    total = (int(options["train"]) + int(options["test"])) * c * h * w  # type: ignore[call-overload]
    limits.check_dataset_bytes(total, f"synthetic data ({options['train']} + {options['test']} images of {c}x{h}x{w})")
    return options


def make(spec: str) -> Dataset:
    """A deterministic random Dataset: the same spec gives the same tensors on every machine."""
    o = parse_spec(spec)
    c, h, w = o["shape"]  # type: ignore[misc]
    splits = {}
    for index, split in enumerate(("train", "test")):
        n = int(o[split])  # type: ignore[arg-type]
        # One stream per split (seed, split index): changing `train=` leaves the test set unchanged.
        rng = np.random.default_rng([int(o["seed"]), index])  # type: ignore[arg-type]
        # rng.bytes is several times faster than integers(0, 256) for 150 MB of uint8.
        x = np.frombuffer(bytearray(rng.bytes(n * c * h * w)), dtype=np.uint8).reshape(n, c, h, w)
        y = rng.integers(0, int(o["classes"]), size=n, dtype=np.int64)  # type: ignore[arg-type]
        splits[split] = (torch.from_numpy(x), torch.from_numpy(y))
    return Dataset(
        name="synthetic",
        train_images=splits["train"][0],
        train_labels=splits["train"][1],
        test_images=splits["test"][0],
        test_labels=splits["test"][1],
        classes=[str(i) for i in range(int(o["classes"]))],  # type: ignore[arg-type]
    )
