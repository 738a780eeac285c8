"""The two files of a saved model (export.py): their paths, the card's checks, and reading and writing them.

PATH.safetensors holds the network's state_dict. PATH.json, the card, holds what makes it a classifier: the recipe
and its whole config (which build the network), the class names, the input shape, the normalization and the TTA
level it was scored with; its origin (dataset, accuracy, seed, speedrun version); the weights file's SHA-256.

Both files come from disk, so a reader trusts neither (as checkpoint.py): the card is size-bounded and every field
checked; the weights are held against memory, hashed, then parsed by safetensors (raw tensor bytes: no pickle, no
code), and must hold exactly the tensors, shapes and dtypes of the network the card builds, which is first built
and run on PyTorch's `meta` device (shapes only, no memory), so a hostile card allocates nothing. A writer never
replaces a file: each is written under a temporary name, fsynced, and hard-linked into place, which fails if the
name exists.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import reprlib
import shutil
import stat
import tempfile
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Callable

import safetensors
import safetensors.torch
import torch
from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, TypeAdapter, ValidationInfo, field_validator

from speedrun._version import __version__
from speedrun.config import apply_overrides
from speedrun.data import limits
from speedrun.errors import clip
from speedrun.paths import make_dirs
from speedrun.recipes import RECIPES
from speedrun.records.typed_files import STRICT, Fraction, Number, Refusal, Typed, checked, refusal
from speedrun.tricks.tta import tta_logits

MODEL_FORMAT = "speedrun-model"
MODEL_VERSION = 1
# A card is ~2 kB plus its class names: ImageNet-21k's 21,841 WordNet ids take 280 kB. 16 MiB holds any class list
# within limits.MAX_CLASSES of names up to a few dozen characters, and bounds what a hostile card makes us parse.
MAX_CARD_BYTES = 16 * 2**20
MAX_CLASS_NAME_CHARS = 1024  # a folder name (255 bytes) after errors.printable's escapes
# A card's normalization is of pixel values in [0, 1] (uint8 / 255, as loader.normalize): a channel's mean lies in
# [0, 1] and its std at most ~0.71 (the unbiased std of two pixels, 0 and 1). The smallest std a card is written with
# is loader.channel_stats' floor for a constant channel, sqrt(1e-12) = 1e-6 (9.99999997e-7 in float32); from 1e-7 up
# (x - mean) / std stays within 1e7, finite in float32. A float32 subnormal (1e-45) turns it into inf and NaN.
MEAN_RANGE = (0.0, 1.0)
STD_RANGE = (1e-7, 1.0)
MAX_SEED = 2**63  # a seed torch.manual_seed takes: [0, 2**63)
# The safetensors header of a state_dict (an 8-byte length, then JSON): per tensor its quoted name, dtype, shape
# and two offsets (each number at most 20 digits), plus the format's metadata and padding to 8 bytes. The weights
# file must be the tensors' bytes plus at most this, so a file of another size is refused before it is read.
HEADER_BYTES_BASE = 8 + 4096
HEADER_BYTES_PER_TENSOR = 128  # "name":{"dtype":"F32","shape":[...],"data_offsets":[A,B]}, besides name and shape


class Unusable(Exception):
    """Why a file cannot be used; the caller names the file and the fix."""


@dataclass
class CardSpec:
    """A card's fields, checked."""
    family: ModuleType
    cfg: Any
    classes: list[str]
    shape: tuple[int, int, int]
    tta_level: int
    sha256: str


# A card's value as a message shows it: a few items and characters of it, each level of a nested list cut alike
# (a hostile card's list may hold a million names, or lists 900 deep).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 3, 6, 40, 40, 40


def _shown(v: Any) -> str:
    """The value `v` from a card, short: [3, 0, 32] as it is, a long list as its first items and its length."""
    text = _SHOWN.repr(v)
    return f"{text} ({len(v):,} items)" if isinstance(v, list) and len(v) > _SHOWN.maxlist else text


def _printable(name: str) -> str:
    if not name.isprintable():
        raise ValueError("not printable")
    return name


def _counted(classes: Any) -> Any:
    if isinstance(classes, list) and not 2 <= len(classes) <= limits.MAX_CLASSES:
        raise ValueError("too few or too many")
    return classes


def _channels(shape: list[int]) -> list[int]:
    if not 1 <= shape[0] <= 4:
        raise ValueError("channels not in 1..4")
    return shape


Side = Annotated[int, Field(ge=1, le=limits.MAX_IMAGE_SIDE_PX)]
ClassName = Annotated[str, Field(min_length=1, max_length=MAX_CLASS_NAME_CHARS), AfterValidator(_printable)]


class Card(BaseModel):
    """A saved model's card, each field checked as the module's docstring says, in the order a refusal names the
    first one wrong. `config` is given as a JSON object and read as the recipe's config with those values."""
    model_config = STRICT
    format: str
    version: Annotated[int, Field(ge=MODEL_VERSION, le=MODEL_VERSION)]
    recipe: str
    family: str
    config: Any
    # counted before any name is read, and read up to the first bad one: 100,000 bad names are not 100,000 errors
    classes: Annotated[list[ClassName], Field(fail_fast=True), BeforeValidator(_counted)]
    image_shape: Annotated[list[Side], Field(min_length=3, max_length=3), AfterValidator(_channels)]
    mean: Annotated[list[Annotated[Number, Field(ge=MEAN_RANGE[0], le=MEAN_RANGE[1], allow_inf_nan=False)]],
                    Field(max_length=4)]
    std: Annotated[list[Annotated[Number, Field(ge=STD_RANGE[0], le=STD_RANGE[1], allow_inf_nan=False)]],
                   Field(max_length=4)]
    tta_level: Annotated[int, Field(ge=0, le=2)]
    dataset: str
    accuracy: Fraction | None = None
    seed: Annotated[int, Field(ge=0, lt=MAX_SEED)] | None = None
    smoke_test: bool | None = None
    weights_sha256: Annotated[str, Field(pattern="^[0-9a-f]{64}$")]

    @field_validator("format")
    @classmethod
    def _ours(cls, value: str) -> str:
        if value != MODEL_FORMAT:
            raise ValueError("another format")
        return value

    @field_validator("recipe")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in RECIPES:
            raise ValueError("unknown recipe")
        return name

    @field_validator("family")
    @classmethod
    def _the_recipes(cls, family: str, info: ValidationInfo) -> str:
        if "recipe" in info.data and family != RECIPES[info.data["recipe"]].family:
            raise ValueError("another family")
        return family

    @field_validator("config")
    @classmethod
    def _build(cls, config: Any, info: ValidationInfo) -> Any:
        """The recipe's config with the card's values applied, checked as --set checks them."""
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
        if "recipe" not in info.data:
            return config  # no recipe to build: the card is refused for it
        try:
            cfg = apply_overrides(RECIPES[info.data["recipe"]].make_config(), config)
            cfg.validate()
        except ValueError as e:
            raise refusal(f"config: {e}") from None
        return cfg

    @field_validator("classes")
    @classmethod
    def _distinct(cls, classes: list[str]) -> list[str]:
        seen: dict[str, int] = {}
        for i, c in enumerate(classes):
            # NFC: "é" as one code point or as e + a combining accent is one name on screen
            first = seen.setdefault(unicodedata.normalize("NFC", c), i)
            if first != i:
                raise refusal(f"class {i} {_shown(c)} is class {first}'s name again (after Unicode NFC "
                              "normalization): its predictions could not be told apart; names must be distinct")
        return classes

    @field_validator("mean", "std")
    @classmethod
    def _per_channel(cls, values: list[float], info: ValidationInfo) -> list[float]:
        low, high = MEAN_RANGE if info.field_name == "mean" else STD_RANGE
        if "image_shape" in info.data and len(values) != info.data["image_shape"][0]:
            raise ValueError("not one per channel")
        # checked as float32 too, the dtype the model holds them in: its rounding must stay in the range
        if not all(low <= x <= high for x in torch.tensor(values, dtype=torch.float32).tolist()):
            raise ValueError("out of range in float32")
        return values


def _per_channel_reason(key: str) -> Callable[[Refusal], str]:
    low, high = MEAN_RANGE if key == "mean" else STD_RANGE
    return lambda r: (f"{key} must be {r.data['image_shape'][0]} finite numbers (one per channel"
                      f"{', > 0' * (key == 'std')}), each in [{low:g}, {high:g}] as for pixel values in [0, 1]; got "
                      f"{repr(r.value)[:80]}")


CARD: Typed[Card] = Typed(TypeAdapter(Card), {
    "": lambda r: "it is not a JSON object",
    "format": lambda r: f'not a speedrun model card (no "format": "{MODEL_FORMAT}")',
    "version": lambda r: f"card version {_shown(r.value)}; speedrun {__version__} reads version {MODEL_VERSION}",
    "recipe": lambda r: f"unknown recipe {_shown(r.value)}; known: {', '.join(RECIPES)}",
    "family": lambda r: (f"recipe {r.data['recipe']} is of the {RECIPES[r.data['recipe']].family} family, not "
                         f"{_shown(r.value)}"),
    "config": lambda r: "its config is not a JSON object",
    "classes": lambda r: f"classes must be a list of 2 to {limits.MAX_CLASSES:,} names, got {_shown(r.value)}",
    "classes.*": lambda r: (f"class {r.at[0]} is {_shown(r.value)}: names are printable strings of 1 to "
                            f"{MAX_CLASS_NAME_CHARS} characters"),
    "image_shape": lambda r: (f"image_shape must be [C, H, W], C in 1..4, sides 1 to {limits.MAX_IMAGE_SIDE_PX} px; "
                              f"got {_shown(r.value)}"),
    "mean": _per_channel_reason("mean"), "std": _per_channel_reason("std"),
    "tta_level": lambda r: f"tta_level must be 0, 1 or 2, got {_shown(r.value)}",
    "dataset": lambda r: f"dataset must be a string, got {_shown(r.value)}",
    "accuracy": lambda r: f"accuracy must be a fraction in [0, 1] or null, got {_shown(r.value)}",
    "seed": lambda r: f"seed must be an integer in [0, 2**63) or null, got {_shown(r.value)}",
    "smoke_test": lambda r: f"smoke_test must be true, false or absent, got {_shown(r.value)}",
    "weights_sha256": lambda r: "weights_sha256 is not 64 hexadecimal digits",
})


def parse_card(card: Any) -> CardSpec:
    """The card's fields, checked (CARD); else Unusable saying which is wrong."""
    c = checked(CARD, card, Unusable)
    channels, height, width = c.image_shape
    return CardSpec(RECIPES[c.recipe].module(), c.config, c.classes, (channels, height, width), c.tta_level,
                    c.weights_sha256)


def expected_state(spec: CardSpec) -> dict[str, torch.Tensor]:
    """The state_dict of the network the card builds, on the meta device: names, shapes, dtypes, and no memory.
    Running it there checks that the card's images fit the network (three 2x2 pools need 10 px) and give K logits."""
    c, h, w = spec.shape
    try:
        with torch.device("meta"):
            net = spec.family.build_model(spec.cfg, c, len(spec.classes), spec.shape[1]).eval()
            out = tta_logits(net, torch.empty(1, c, h, w), spec.tta_level)
    except Exception as e:  # noqa: BLE001 -- whatever the network raises, the card's shape and config do not fit
        raise Unusable(f"its network cannot take {c}x{h}x{w} images ({type(e).__name__}: {clip(str(e), 160)})")
    if tuple(out.shape) != (1, len(spec.classes)):
        raise Unusable(f"its network gives {tuple(out.shape)} logits per image, not (1, {len(spec.classes)})")
    return net.state_dict()


def weights_size_range(expected: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(fewest, most) bytes a safetensors file of the `expected` state_dict may take: its tensors' bytes plus the
    header (HEADER_BYTES_*). The tensors are on the meta device: their sizes cost nothing."""
    data = sum(t.numel() * t.element_size() for t in expected.values())
    header = HEADER_BYTES_BASE + sum(HEADER_BYTES_PER_TENSOR + len(k.encode()) + 21 * t.dim()
                                     for k, t in expected.items())
    return data + 8, data + header


def match_state(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    for key, want in expected.items():
        have = got.get(key)
        if have is None:
            raise Unusable(f"it lacks the tensor {key!r} of the card's network")
        if have.shape != want.shape or have.dtype != want.dtype:
            raise Unusable(f"tensor {key!r} is {have.dtype} {list(have.shape)}; the card's network has "
                           f"{want.dtype} {list(want.shape)}")
    extra = sorted(set(got) - set(expected))
    if extra:
        raise Unusable(f"it holds a tensor {extra[0][:80]!r} that the card's network does not have")


def read_bytes(path: Path, limit: int | None, size_range: tuple[int, int] | None = None) -> bytes:
    """The whole file, at most `limit` bytes (else as much as memory holds three times: bytes, tensors, network);
    with `size_range` (weights_size_range), a file of another size is refused before a byte is read."""
    shown = str(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{shown} does not exist; give the PATH of a model saved with --save PATH (PATH, "
                                "PATH.safetensors and PATH.json name the same model)") from None
    except OSError as e:
        raise Unusable(f"cannot read it ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block forever, /dev/zero never end
        raise Unusable("not a regular file")
    if limit is not None and st.st_size > limit:
        raise Unusable(f"{st.st_size:,} bytes, over the {limit:,} a model card may take")
    if size_range is not None and not size_range[0] <= st.st_size <= size_range[1]:
        raise Unusable(f"not a valid safetensors file of the card's network: {st.st_size:,} bytes, where its tensors "
                       f"and header take {size_range[0]:,} to {size_range[1]:,}")
    if limit is None:
        limits.check_memory(3 * st.st_size, f"loading {shown}", "load it on a machine with more memory")
    try:
        with open(path, "rb") as f:
            data = f.read(st.st_size + 1)
    except OSError as e:
        raise Unusable(f"cannot read it ({e.strerror})") from None
    if len(data) != st.st_size:
        raise Unusable("it changed while being read")
    return data


def write_files(weights: Path, card_path: Path, tensors: dict[str, torch.Tensor], card: dict) -> None:
    """The tensors at `weights` and the card, with the weights' SHA-256 added, at `card_path`. Neither replaces a
    file, and a failure leaves neither behind."""
    shown = str(weights)
    temps: list[str] = []
    made: list[Path] = []
    try:
        make_dirs(weights.parent)
        temps += [tempfile.mkstemp(prefix=".tmp-model-", dir=weights.parent)[1] for _ in range(2)]
        meta = {"format": MODEL_FORMAT, "version": str(MODEL_VERSION)}
        safetensors.torch.save_file(tensors, temps[0], metadata=meta)
        card = {**card, "weights_sha256": _sync(temps[0])}
        with open(temps[1], "w", encoding="utf-8") as f:
            f.write(json.dumps(card, indent=2, allow_nan=False) + "\n")
        _sync(temps[1])
        for tmp, final in ((temps[0], weights), (temps[1], card_path)):
            _publish(tmp, final)
            made.append(final)
        _fsync_dir(weights.parent)
        made = []  # both in place: nothing to undo
    except _Taken:
        raise
    except (OSError, safetensors.SafetensorError, TypeError, ValueError) as e:  # ValueError: a NaN in the card
        reason = getattr(e, "strerror", None) or clip(str(e), 200)
        raise ValueError(f"could not write the model {shown} ({reason}); {write_fix(e)}") from None
    finally:
        left: list[str | Path] = [*temps, *made]  # the temp files, and a weights file whose card could not follow it
        for p in left:
            unlink(p)


def write_fix(error: BaseException) -> str:
    """What to do about a failure to write a model: free disk space only where the disk (or quota) is full."""
    number = getattr(error, "errno", None)
    if number in (errno.ENOSPC, errno.EDQUOT):
        return "free disk space or choose another --save path"
    if number in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "choose a writable --save path"
    return "choose another --save path"


def unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _sync(path: str) -> str:
    """fsync the file at `path`, make it readable like any result (mkstemp makes it private); its SHA-256."""
    h = hashlib.sha256()
    with open(path, "rb+") as f:
        os.fchmod(f.fileno(), 0o644)
        while chunk := f.read(1 << 20):
            h.update(chunk)
        os.fsync(f.fileno())
    return h.hexdigest()


class _Taken(ValueError):
    def __init__(self, final: Path):
        super().__init__(f"{final} appeared while the model was being saved and is never replaced; "
                         "choose a new --save path")


def _publish(tmp: str, final: Path) -> None:
    """`tmp`'s bytes at `final`, which must not exist: link(2) is atomic and fails if the name is taken."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise _Taken(final) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS):
            raise
        # A file system without hard links (FAT, some network shares): create exclusively, then copy. Not atomic
        # against a crash, but it still never replaces a file.
        with open(tmp, "rb") as src:
            try:
                dst = open(final, "xb")
            except FileExistsError:
                raise _Taken(final) from None
            try:
                with dst:
                    shutil.copyfileobj(src, dst)
                    dst.flush()
                    os.fsync(dst.fileno())
            except BaseException:
                unlink(final)  # ours, partly written
                raise


def _fsync_dir(directory: Path) -> None:
    try:  # the new names are durable only once the folder's entries are
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
