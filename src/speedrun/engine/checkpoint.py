"""Checkpoints: a training state saved atomically as one safetensors file, and loaded without running any code.

A state nests dicts (str or int keys), lists, tuples, tensors, numbers, bools, None and str. Its tensors go into
the file under the keys "0", "1", ...; the rest goes into the file's metadata as a JSON "skeleton" whose every
object is a one-key tag, so no user dict can pass for one: {"tensor": i}, {"dict": [[key, value], ...]} (keys stay
int for optimizer states), {"tuple": [...]} (random.getstate() is one), {"float": "nan"|"inf"|"-inf"}. Beside it:
the caller's `meta` as plain JSON, the format and version, and a SHA-256 over all of it and every tensor's bytes.

A checkpoint is a file from disk like any other, so loading trusts nothing: no pickle, the size is checked against
memory and the header length against the file before the library parses it, the skeleton's depth is bounded, and
the checksum is verified.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import safetensors
import safetensors.torch
import torch

from speedrun.data import limits
from speedrun.paths import make_dirs

CHECKPOINT_FORMAT = "speedrun-checkpoint"
CHECKPOINT_VERSION = 1

_NAME = re.compile(r"ckpt-([0-9]{5,})-([0-9]{9,})\.safetensors")
_TMP_PREFIX = ".tmp-ckpt-"  # never matches _NAME, so a crash mid-write leaves nothing that looks like a checkpoint
_STALE_TMP_S = 3600  # a temp file this old belongs to a process that died mid-write
# The header holds ~110 bytes per tensor plus the skeleton: a ResNet-50-sized state with SGD momentum (481 tensors)
# takes 54 kB. 64 MiB is far beyond any real state, and below safetensors' own 100 MB cap on headers.
_MAX_HEADER_BYTES = 64 * 2**20
_MAX_DEPTH = 64  # levels of nesting in a state; a model + optimizer + RNG state needs about 5
# Starting afresh needs both: without --resume, and in a folder with no checkpoints (run/resume.py refuses to start
# afresh over a folder's checkpoints). resume.py says it for the flags given; this is the advice for any of them.
AFRESH = "start afresh without --resume (and with a new --checkpoint-dir, if one was given)"
_FIX = f"delete it to resume from the one before, or {AFRESH}"
_MISSING = object()  # a field on one side only


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: the message names it and why, in one line; `reason` is the why alone."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


@contextlib.contextmanager
def restoring():
    """Around a TrainState.load_state_dict: a checkpoint's checksum proves it whole, not well-formed, so anything
    that does not fit this run (a missing key, a wrong shape or type) becomes one CheckpointError line."""
    try:
        yield
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as e:
        raise CheckpointError(f"the checkpoint does not fit this run ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]}); resume with the settings it was made with, "
                              f"or {AFRESH}") from None


def load_optimizer(opt: torch.optim.Optimizer, saved: dict) -> None:
    """opt.load_state_dict(saved), then every buffer of a parameter checked to have its shape (PyTorch checks
    group sizes, not buffer shapes: a momentum of another shape would fail mid-step, or broadcast silently)."""
    opt.load_state_dict(saved)
    for p, buffers in opt.state.items():
        if any(isinstance(b, torch.Tensor) and b.ndim and b.shape != p.shape for b in buffers.values()):
            raise ValueError("an optimizer buffer's shape is not its parameter's")


class _Unusable(Exception):  # why a file cannot be used; load_checkpoint adds the file's name and the fix
    pass


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:160]


def checkpoint_name(run: int, step: int) -> str:
    if type(run) is not int or type(step) is not int or run < 0 or step < 0:
        raise ValueError(f"checkpoint run={run!r} and step={step!r} must be integers >= 0; pass the run index and "
                         "the optimizer step")
    return f"ckpt-{run:05d}-{step:09d}.safetensors"


def list_checkpoints(directory: str | Path) -> list[Path]:
    """The checkpoint files in `directory`, newest first by (run, step); every other file is ignored."""
    found = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                m = _NAME.fullmatch(entry.name)
                # Equal to the name we would write: "ckpt-000001-..." would otherwise parse as a second (1, step).
                if m and entry.name == checkpoint_name(int(m[1]), int(m[2])):
                    found.append(((int(m[1]), int(m[2])), Path(directory) / entry.name))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [path for _, path in sorted(found, reverse=True)]


def _encode(x: Any, tensors: list[torch.Tensor], where: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise ValueError(f"state{where} is nested deeper than {_MAX_DEPTH} levels; flatten the state")
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return int(x)  # an IntEnum comes back as its value
    if isinstance(x, float):
        return float(x) if math.isfinite(x) else {"float": repr(float(x))}
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or x.device.type == "meta":
            raise ValueError(f"state{where} is a {x.layout} tensor on {x.device}; save a dense tensor with data")
        # A fresh contiguous CPU copy: views and tensors sharing storage save as separate, independent tensors.
        tensors.append(x.detach().to("cpu", copy=True, memory_format=torch.contiguous_format))
        return {"tensor": len(tensors) - 1}
    if isinstance(x, dict):
        pairs = []
        for k, v in x.items():
            if type(k) is not str and type(k) is not int:
                raise ValueError(f"state{where} has the key {k!r}; checkpoint dict keys must be str or int")
            pairs.append([k, _encode(v, tensors, f"{where}[{k!r}]", depth + 1)])
        return {"dict": pairs}
    if isinstance(x, (list, tuple)):
        items = [_encode(v, tensors, f"{where}[{i}]", depth + 1) for i, v in enumerate(x)]
        return items if isinstance(x, list) else {"tuple": items}
    raise ValueError(f"state{where} is a {type(x).__name__}, which a checkpoint cannot hold; convert it to a "
                     "tensor, a list or a plain number")


def _decode(node: Any, tensors: list[torch.Tensor], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise _Unusable(f"its skeleton is nested deeper than {_MAX_DEPTH} levels")
    if not isinstance(node, (dict, list)):
        return node  # None, bool, int, float or str: JSON holds nothing else
    if isinstance(node, list):
        return [_decode(v, tensors, depth + 1) for v in node]
    [(tag, value)] = node.items() if len(node) == 1 else [(None, None)]
    if tag == "dict" and isinstance(value, list) and all(
            isinstance(p, list) and len(p) == 2 and type(p[0]) in (str, int) for p in value):
        return {k: _decode(v, tensors, depth + 1) for k, v in value}
    if tag == "tuple" and isinstance(value, list):
        return tuple(_decode(v, tensors, depth + 1) for v in value)
    if tag == "tensor" and type(value) is int:
        if not 0 <= value < len(tensors):
            raise _Unusable(f"its skeleton refers to tensor {value}, which the file does not hold")
        return tensors[value]
    if tag == "float" and value in ("nan", "inf", "-inf"):
        return float(value)
    raise _Unusable("its skeleton holds an entry of unknown form")


def checkpoint_digest(skeleton: str, meta: str, tensors: list[torch.Tensor]) -> str:
    """SHA-256 over the format, skeleton, meta, each tensor's dtype and shape (which fix where one tensor's bytes end
    and the next begin), then every tensor's bytes in key order. safetensors itself checks no checksum."""
    specs = [[str(t.dtype), list(t.shape)] for t in tensors]
    h = hashlib.sha256(json.dumps([CHECKPOINT_FORMAT, CHECKPOINT_VERSION, skeleton, meta, specs]).encode())
    for t in tensors:
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # native byte order, as safetensors writes on x86/ARM
    return h.hexdigest()


def save_checkpoint(directory: str | Path, run: int, step: int, state: dict, meta: dict, keep: int) -> Path:
    """Write `state` and `meta` to directory/ckpt-RUN-STEP.safetensors atomically, then keep only the newest
    `keep` checkpoints there. Returns the path written. A crash at any point leaves the previous checkpoints."""
    directory = Path(directory)
    final = directory / checkpoint_name(run, step)
    if type(keep) is not int or keep < 1:
        raise ValueError(f"keep={keep!r} checkpoints must be an integer >= 1; keep at least the newest one")
    tensors: list[torch.Tensor] = []
    skeleton = json.dumps(_encode(state, tensors, "", 0), allow_nan=False, separators=(",", ":"))
    meta_text = json.dumps(meta, separators=(",", ":"))  # the caller's own dict: a TypeError here is our bug
    metadata = {"format": CHECKPOINT_FORMAT, "version": str(CHECKPOINT_VERSION), "skeleton": skeleton,
                "meta": meta_text, "sha256": checkpoint_digest(skeleton, meta_text, tensors)}
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"checkpoint directory {directory} is a file; give a directory with "
                         "--checkpoint-dir, or move the file away")
    tmp = None
    try:
        make_dirs(directory)
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".part", dir=directory)
        os.close(fd)
        safetensors.torch.save_file({str(i): t for i, t in enumerate(tensors)}, tmp, metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp makes it private; a checkpoint is as readable as a result
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        tmp = None
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename is durable only once the directory entry is
        finally:
            os.close(fd)
    except (OSError, safetensors.SafetensorError) as e:
        why = getattr(e, "strerror", None) or _one_line(e)
        raise ValueError(f"could not write checkpoint {final} ({why}); free some disk space, or give a "
                         "writable --checkpoint-dir") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    # Never `final` itself: saving an older (run, step) than one already there must not delete what was just written.
    # Failing to delete (removed by someone else, or not ours to remove) costs only disk space.
    for old in [p for p in list_checkpoints(directory) if p != final][keep - 1:]:
        with contextlib.suppress(OSError):
            old.unlink()
    for tmp_path in directory.glob(_TMP_PREFIX + "*"):
        with contextlib.suppress(OSError):
            if time.time() - tmp_path.stat().st_mtime > _STALE_TMP_S:
                tmp_path.unlink()
    return final


def _read(path: Path, shown: str) -> tuple[dict, dict]:
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise _Unusable("not a regular file")  # a FIFO would block the read forever
        try:
            limits.check_memory(st.st_size, f"checkpoint {shown}", f"load it where there is more memory, {_FIX}")
        except ValueError as e:
            raise CheckpointError(str(e), "too large for the memory available") from None
        with open(path, "rb") as f:
            head = f.read(8)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {shown} does not exist; give an existing checkpoint file or the "
                                "directory holding them") from None
    except OSError as e:
        raise _Unusable(e.strerror or _one_line(e)) from None
    claimed = int.from_bytes(head, "little")
    if len(head) < 8 or claimed > st.st_size - 8:  # a torch.save zip starts "PK\x03\x04...": 578 PB
        raise _Unusable(f"not a safetensors file: its header claims {claimed:,} bytes, the file has {st.st_size:,}")
    if claimed > _MAX_HEADER_BYTES:
        raise _Unusable(f"its header claims {claimed:,} bytes, over the {_MAX_HEADER_BYTES:,} a checkpoint's takes")
    try:
        with safetensors.safe_open(path, framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            count = len(f.keys())
            if metadata.get("format") != CHECKPOINT_FORMAT:
                raise _Unusable(f"not a speedrun checkpoint: no format {CHECKPOINT_FORMAT!r} in its metadata")
            version = str(metadata.get("version"))[:20]
            if version != str(CHECKPOINT_VERSION):
                raise _Unusable(f"checkpoint version {version!r}; this speedrun reads version {CHECKPOINT_VERSION}")
            # Keys other than 0 .. count-1 fail here. clone(): get_tensor maps the file; a copy leaves nothing
            # mapped once the file is closed.
            tensors = [f.get_tensor(str(i)).clone() for i in range(count)]
    except (_Unusable, MemoryError):
        raise
    # Broad on purpose: safetensors reports a bad header, offsets or dtype as SafetensorError, but its I/O and the
    # tensor conversion may raise others; every one means "this file cannot be used".
    except Exception as e:  # noqa: BLE001
        raise _Unusable(f"not a valid safetensors file: {_one_line(e)}") from None
    skeleton, meta_text, digest = (metadata.get(k) for k in ("skeleton", "meta", "sha256"))
    if not (isinstance(skeleton, str) and isinstance(meta_text, str) and isinstance(digest, str)):
        raise _Unusable("its metadata lacks the skeleton, meta or sha256")
    if checkpoint_digest(skeleton, meta_text, tensors) != digest:
        raise _Unusable("checksum mismatch: the file is corrupt")
    try:
        # The C JSON parser raises RecursionError, not a crash, on deep nesting; _decode bounds the rest.
        tree, meta = json.loads(skeleton), json.loads(meta_text)
    except (ValueError, RecursionError) as e:
        raise _Unusable(f"its metadata is not valid JSON: {_one_line(e)}") from None
    if not isinstance(meta, dict):
        raise _Unusable("its meta is not a JSON object")
    return _decode(tree, tensors, 0), meta


def load_checkpoint(path: str | Path) -> tuple[dict, dict]:
    """(state, meta) from a checkpoint file, tensors on the CPU; a file that cannot be used raises CheckpointError."""
    path = Path(path)
    shown = str(path)
    try:
        return _read(path, shown)
    except _Unusable as e:
        raise CheckpointError(f"checkpoint {shown} is unusable ({e}); {_FIX}", str(e)) from None


def find_checkpoint(where: str | Path, log: Callable[[str], None],
                    afresh: str = AFRESH) -> tuple[dict, dict, Path] | None:
    """The checkpoint to resume from: `where` itself if it is a file, else the newest usable one in the directory
    `where` (each unusable one is logged, and the one before it tried). None where there is none to resume.
    afresh: how to start afresh instead, for the flags given, where none is usable."""
    where = Path(where)
    if not where.is_dir():
        if not where.exists() and where.suffix != ".safetensors":
            return None  # a --checkpoint-dir this run will create
        try:
            state, meta = load_checkpoint(where)
        except CheckpointError as e:  # a file the user named: not theirs to delete, perhaps not a checkpoint at all
            raise CheckpointError(f"{where} is not a usable speedrun checkpoint ({e.reason}); give a "
                                  "checkpoint file (ckpt-RUN-STEP.safetensors) or its folder to --resume",
                                  e.reason) from None
        return state, meta, where
    found = list_checkpoints(where)
    if not found:
        return None
    reasons = []
    for i, path in enumerate(found):
        try:
            state, meta = load_checkpoint(path)
            return state, meta, path
        except CheckpointError as e:
            reasons.append(e.reason)
        except FileNotFoundError:
            reasons.append("it was removed while being read")
        if i + 1 < len(found):
            log(f"checkpoint {path.name} is unusable ({reasons[-1]}); trying the previous one")
    raise CheckpointError(f"no usable checkpoint in {where}: newest {found[0].name}: "
                          f"{reasons[0]}; {afresh}", reasons[0])


def check_compatible(meta: dict, expected: dict, path: Path, may_differ: frozenset[str] = frozenset(),
                     afresh: str = AFRESH, defaults: dict | None = None) -> None:
    """Raise ValueError naming the first setting of `expected` (a dict value: field by field) that differs in `meta`,
    skipping fields named in `may_differ` (bare or dotted: "data.name"). Config fields are named bare, as --set takes
    them (`lr_per_1024=11.5`); others as key.field (`data.num_classes=10`). afresh: how to start afresh instead, for
    the flags given (resume.py's Plan.afresh). defaults: the config fields' defaults (config.field_defaults): a
    field the checkpoint's config lacks, a setting added since it was made, is taken at its default, which is the
    behaviour before the setting existed."""
    def same(a: Any, b: Any) -> bool:  # as JSON: a tuple equals its list, nan equals nan, 1 differs from 1.0 and True
        return json.dumps(a, sort_keys=True, default=repr) == json.dumps(b, sort_keys=True, default=repr)

    def differ(field: str, old: Any, new: Any) -> ValueError:
        old_text, new_text = ("missing" if v is _MISSING else repr(v)[:100] for v in (old, new))
        same_again = "resume with the same settings"
        if field == "model":  # the user's network is named by --model, not --set (models/custom.py)
            same_again = (f"resume with --model giving {old_text}" if isinstance(old, str) and old else
                          "resume without --model")
        return ValueError(f"checkpoint {Path(path).name} was made with {field}={old_text}; this run has "
                          f"{field}={new_text}: {same_again}, or {afresh}")

    for key, new in expected.items():
        if key in may_differ:
            continue
        old = meta.get(key, _MISSING)
        if isinstance(old, dict) and isinstance(new, dict):
            for field in [*new, *(f for f in old if f not in new)]:
                name = str(field) if key == "config" else f"{key}.{field}"
                if field in may_differ or name in may_differ:
                    continue
                a, b = old.get(field, _MISSING), new.get(field, _MISSING)
                if a is _MISSING and key == "config" and defaults is not None:
                    a = defaults.get(field, _MISSING)
                if a is _MISSING or b is _MISSING or not same(a, b):
                    raise differ(name, a, b)
        elif old is _MISSING or not same(old, new):
            raise differ(key, old, new)
