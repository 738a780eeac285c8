"""The user's own network: `--model MODULE:FUNCTION` on the command line, `speedrun.train(model=build)` in Python.

FUNCTION builds an nn.Module from (in_channels, num_classes, image_px), called positionally: a network that takes
(N, in_channels, image_px, image_px) images and gives (N, num_classes) logits. MODULE is a Python file
(`examples/mobile_net.py`) or an importable module (`mynets.small`), imported much as `python FILE` imports a
script or `python -m` finds a module: the file's folder (the working folder) is on sys.path while it is imported,
last, so that it hides no installed module, and a file named like one is refused. It is the user's own code,
named by the user: importing it runs it, as running the script would.

A builder is known by its name, `<module>:<qualname>` with a file's module named by its stem
(`examples/mobile_net.py:build` is `mobile_net:build`), whatever path reached it: that name is what a config, a
result, a checkpoint and a saved model record. Only `use_builder` (from the user's flag or argument) imports or
registers one; a name read from a file is looked up among those and never imported (`builder`'s refusal says
which flag to give), so no code is run because a file names it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from speedrun.errors import clip

# name -> builder, for this process; filled only by use_builder / register (the user's explicit choice)
_BUILDERS: dict[str, Callable[..., nn.Module]] = {}
_LOADED: set[str] = set()  # module names this process took from --model files
_GIVEN: list[str] = []  # eval / predict's --model, the one builder the command line gave (giving)
_NAME = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*(<locals>[\w.]*)?")
_FIX = ("give --model MODULE:FUNCTION: a Python file or an importable module, and the function in it that "
        "builds the network from (in_channels, num_classes, image_px)")
PROBE_BATCH = 2  # images the shape check runs (BatchNorm in training refuses one per channel)


def check_name(name: str) -> None:
    """Refuse (ValueError) a recorded builder name that is not `module:function` (a config's `model` field)."""
    if not isinstance(name, str) or (name and not _NAME.fullmatch(name)):
        raise ValueError(f"model={clip_name(name)} is not a builder's name (module:function); a network of your own "
                         "is named with --model MODULE:FUNCTION")


def clip_name(name) -> str:
    text = repr(name)
    return text if len(text) <= 80 else text[:60] + "..."


def name_of(fn: Callable[..., nn.Module]) -> str:
    """`<module>:<qualname>`: the name a builder is recorded by (see the module). A function of the script being
    run (`python myscript.py`, module __main__) is named by the script's stem, as `--model myscript.py:build`
    names it, so that its saved model can be loaded from the command line."""
    module = getattr(fn, "__module__", None) or "__main__"
    if module == "__main__":
        script = getattr(sys.modules.get("__main__"), "__file__", None)
        module = Path(script).stem if script and Path(script).stem.isidentifier() else module
    return f"{module}:{getattr(fn, '__qualname__', None) or getattr(fn, '__name__', 'builder')}"


def register(fn: Callable[..., nn.Module]) -> str:
    """A builder the user handed over in Python (`speedrun.train(model=build)`), known from now on by its name."""
    if not inspect.isfunction(fn) or fn.__name__ == "<lambda>":
        # A lambda, a partial, a callable instance or a class has no name of its own that a saved model could
        # record and a later process could be given again.
        raise ValueError(f"model must be a function defined with def (its name is recorded, and a saved model is "
                         f"loaded by giving it again), got {type(fn).__name__} {getattr(fn, '__name__', '')}".rstrip())
    name = name_of(fn)
    check_name(name)
    _BUILDERS[name] = fn
    return name


def use_builder(spec: str | Callable[..., nn.Module]) -> str:
    """The user's `--model MODULE:FUNCTION` (or a function) imported, checked to be a function and registered;
    its name. One-line ValueError for a spec that is malformed, a module that cannot be imported or raises while
    importing, and a FUNCTION that is missing or not callable."""
    if callable(spec):
        return register(spec)
    if isinstance(spec, str) and spec in _BUILDERS:  # given before in this process (a name recorded from it)
        return spec
    if not isinstance(spec, str) or spec.count(":") < 1 or not spec.rpartition(":")[2] or not spec.rpartition(":")[0]:
        raise ValueError(f"--model {spec!r} is not MODULE:FUNCTION; {_FIX}")
    where, _, attr = spec.rpartition(":")
    module = _import(where, spec)
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"--model {spec}: {where} has no {attr!r}; {_FIX}")
        fn = getattr(fn, part)
    if isinstance(fn, type) and issubclass(fn, nn.Module) or not callable(fn):
        what = "an nn.Module class" if isinstance(fn, type) else type(fn).__name__
        raise ValueError(f"--model {spec}: {attr} is {what}, not a function; {_FIX} (a class works through a "
                         "function that returns an instance)")
    name = f"{module.__name__}:{attr}"
    check_name(name)
    _BUILDERS[name] = fn
    return name


def _import(where: str, spec: str):
    """The module `where` names: a .py file (or a path with a separator), else a module name."""
    is_file = where.endswith(".py") or os.sep in where or "/" in where
    try:
        if is_file:
            path = Path(where).expanduser()
            if not path.is_file():
                raise ValueError(f"--model {spec}: {where} is not a file; {_FIX}")
            name = path.stem
            loader_spec = importlib.util.spec_from_file_location(name, path)
            if loader_spec is None or loader_spec.loader is None or not name.isidentifier():
                raise ValueError(f"--model {spec}: {where} is not a Python file whose name is a module name; {_FIX}")
            if name not in _LOADED and _hides(name, path):
                raise ValueError(f"--model {spec}: a file named {path.name} would hide the module {name} that "
                                 "Python, torch or speedrun import; rename the file")
            _LOADED.add(name)  # a --model file: the next one of this name replaces it
            module = importlib.util.module_from_spec(loader_spec)
            folder = str(path.resolve().parent)
            added = folder not in sys.path
            if added:  # while it is imported, its sibling modules import; last, so it hides no installed module
                sys.path.append(folder)
            sys.modules[name] = module  # pickling and torch.compile find its classes by module name
            try:
                loader_spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                raise
            finally:
                if added and folder in sys.path:
                    sys.path.remove(folder)
            return module
        here = os.getcwd()
        added = here not in sys.path and "" not in sys.path
        if added:  # as `python -m` finds modules in the working folder (the console script does not)
            sys.path.append(here)
        try:
            return importlib.import_module(where)
        finally:
            if added and here in sys.path:
                sys.path.remove(here)
    except ValueError as e:
        if str(e).startswith("--model "):
            raise
        raise ValueError(f"--model {spec}: importing {where} raised {_one_line(e)}; fix it there") from None
    except ModuleNotFoundError as e:
        raise ValueError(f"--model {spec}: cannot import {where} ({_one_line(e)}); {_FIX}") from None
    except (Exception, SystemExit) as e:  # the user's module failed as it ran: its own error, on one line
        raise ValueError(f"--model {spec}: importing {where} raised {_one_line(e)}; fix it there") from None


def _hides(name: str, path: Path) -> bool:
    """Whether a module `name` taken from the file `path` would stand in for another module (the standard
    library's, an installed package's, one already imported) where Python, torch or speedrun import `name`."""
    if name in sys.stdlib_module_names:
        return True
    here = path.resolve()
    loaded = getattr(sys.modules.get(name), "__file__", None)
    if name in sys.modules and (loaded is None or Path(loaded).resolve() != here):
        return True
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a broken module of that name elsewhere: it would be hidden too
        return True
    return found is not None and (found.origin is None or Path(found.origin).resolve() != here)


def _one_line(e: BaseException) -> str:
    """The user's error as `Type: message` on one line of at most 200 characters."""
    return clip(" ".join(f"{type(e).__name__}: {e}".split()), 200)


@contextlib.contextmanager
def giving(spec: str | None) -> Iterator[None]:
    """eval / predict's --model for the command's length: the builder registered and remembered as the one the
    user gave, so that loading a saved model compares it with the card's (export.load); None: none given."""
    _GIVEN[:] = [] if spec is None else [use_builder(spec)]
    try:
        yield
    finally:
        _GIVEN.clear()


def given() -> str | None:
    """The builder the command line gave (giving), or None."""
    return _GIVEN[0] if _GIVEN else None


def builder(name: str) -> Callable[..., nn.Module]:
    """The builder recorded as `name`, which this process must have been given (use_builder, register): a name
    read from a file (a saved model, a checkpoint) is never imported (see the module)."""
    check_name(name)
    if name not in _BUILDERS:
        raise ValueError(f"this network was built by {name}, which speedrun does not import by itself (no code "
                         f"runs because a file names it); give --model with the file or module of {name} (or "
                         "model= in Python)")
    return _BUILDERS[name]


def build(name: str, in_channels: int, num_classes: int, image_px: int) -> nn.Module:
    """The user's network, untrained: builder(name)(in_channels, num_classes, image_px), checked to be an
    nn.Module; one-line ValueError otherwise, and for an error the builder raises."""
    fn = builder(name)
    try:
        net = fn(in_channels, num_classes, image_px)
    except (Exception, SystemExit) as e:  # the user's code: sys.exit there must not end speedrun silently
        raise ValueError(f"--model {name}: building the network for ({in_channels}, {num_classes}, {image_px}) "
                         f"raised {_one_line(e)}; the builder is called as FUNCTION(in_channels, num_classes, "
                         "image_px)") from None
    if not isinstance(net, nn.Module):
        raise ValueError(f"--model {name} returned {type(net).__name__}, not a torch.nn.Module; the builder must "
                         "return the network")
    if any(nn.parameter.is_lazy(t) for t in (*net.parameters(), *net.buffers())):
        _materialize(name, net, in_channels, image_px)
    return net


def _materialize(name: str, net: nn.Module, in_channels: int, image_px: int) -> None:
    """A network with lazy modules (nn.LazyConv2d, nn.LazyLinear, ...) learns its parameters' shapes in its first
    forward; the optimizers and every check need them before that. So, as PyTorch advises, one forward of
    PROBE_BATCH zero images: in eval mode (no BatchNorm statistics move), without gradients, on the device the
    network is being built on (the caller's default device)."""
    was_training = net.training
    net.eval()
    try:
        with torch.no_grad():
            net(torch.zeros(PROBE_BATCH, in_channels, image_px, image_px))
    except (Exception, SystemExit) as e:
        raise ValueError(f"--model {name}: its lazy modules' first forward, on a batch of {PROBE_BATCH} "
                         f"{in_channels}x{image_px}x{image_px} zero images, raised {_one_line(e)}") from None
    finally:
        net.train(was_training)
    if any(nn.parameter.is_lazy(t) for t in (*net.parameters(), *net.buffers())):
        raise ValueError(f"--model {name}: its network keeps lazy parameters after a forward (a lazy module its "
                         "forward never calls); build it with shapes, or call every module in forward")


def check_network(name: str, image_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Build the network on the CPU and run PROBE_BATCH zero images through it (training mode, no gradient): its
    output must be logits (PROBE_BATCH, num_classes). Refuses in one line before any training: non-square images,
    a builder that fails or returns something else, a forward that raises or gives another shape. The network."""
    c, h, w = image_shape
    if h != w:
        raise ValueError(f"--model takes square images (the builder gets one image_px), and these are {h}x{w}; "
                         "give --image-size PX")
    with torch.device("cpu"):
        net = build(name, c, num_classes, h)
    if not any(p.requires_grad for p in net.parameters()):
        raise ValueError(f"--model {name}: its network has no trainable parameters; the builder must return a "
                         "network with parameters that require gradients")
    for mode in ("training", "evaluation"):  # a network may answer differently in eval mode (BatchNorm, dropout)
        net.train(mode == "training")
        try:
            with torch.no_grad():
                out = net(torch.zeros(PROBE_BATCH, c, h, w))
        except (Exception, SystemExit) as e:
            raise ValueError(f"--model {name}: its network's forward ({mode} mode) on a batch of {PROBE_BATCH} "
                             f"{c}x{h}x{w} images raised {_one_line(e)}") from None
        want = [PROBE_BATCH, num_classes]
        if not isinstance(out, torch.Tensor) or list(out.shape) != want:
            got = f"shape {list(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
            raise ValueError(f"--model {name}: its network gives {got} ({mode} mode) for a batch of {PROBE_BATCH} "
                             f"{c}x{h}x{w} images; it must give logits (batch, num_classes) = {want}")
        if not out.is_floating_point():
            raise ValueError(f"--model {name}: its network gives {out.dtype} output; logits must be floating point")
    return net


def raised_in(exc: BaseException) -> tuple[str, str] | None:
    """Where the user's code (a file or module a builder of this process came from) raised `exc` or what led to it
    (its __cause__ / __context__): (the builder's name, "FILE:LINE in FUNCTION") for the innermost such frame, or
    None where no frame of it is on the traceback. A network's forward that fails mid-training is the user's error
    to mend, not speedrun's bug to report."""
    files = {name: _file_of(fn) for name, fn in _BUILDERS.items()}
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        found = None
        tb = chain.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            here = os.path.realpath(code.co_filename)
            owner = next((name for name, path in files.items() if path and here == path), None)
            if owner is not None:
                found = (owner, f"{Path(code.co_filename).name}:{tb.tb_lineno} in {code.co_name}")
            tb = tb.tb_next
        if found is not None:
            return found
        chain = chain.__cause__ or chain.__context__
    return None


def _file_of(fn: Callable[..., nn.Module]) -> str | None:
    """The source file of the module a builder is defined in (its network's classes are usually beside it)."""
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    path = getattr(module, "__file__", None) or getattr(getattr(fn, "__code__", None), "co_filename", None)
    return os.path.realpath(path) if path else None
