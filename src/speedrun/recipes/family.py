"""The recipe-family contract: everything the runner, the instruments, checkpoints and saved models use of a family.

A family is a package under speedrun/recipes/ (cifar, imagenet, cifar_resnet) whose `__init__` provides the names
below; nothing outside a family reads any other name of it, nor a config field that FamilyConfig does not name.
tests/test_architecture.py checks every registered family against `Family` (names, and each function's parameters),
so a new family that forgets one fails there rather than in the middle of a run; mypy checks the types of each
family's answers against it (conformance.py: Family[its config, its data], the data a TrainingData), so one that
answers with the wrong type fails the type check.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:  # for the annotations alone: importing this module imports no torch
    import os

    import torch

    from speedrun import dist
    from speedrun.engine.flops import RunFlops
    from speedrun.engine.loop import RunHooks, RunResult

# (config key, its "off" value, one line of what it is): every trick of a family, switched off in turn by ablate.
Trick = tuple[str, Any, str]


@runtime_checkable
class FamilyConfig(Protocol):
    """The config fields read outside the family (the rest of a family's config is its own business). Every family
    config is a frozen dataclass inheriting config.SystemConfig, whose device-side fields (precision,
    channels_last, compile, ...) mean the same in every family."""

    epochs: float  # the training budget; with_epochs changes it
    batch_size: int  # examples per optimizer step, all processes together
    target_accuracy: float  # fraction of the test set, judged by the result and the leaderboards
    eval_batch_size: int

    def validate(self) -> None:
        """Raise ValueError (one line naming the setting and its range) for a setting no run can use."""


@runtime_checkable
class TrainingData(Protocol):
    """What the runner, the instruments and a saved model's checks read of a family's data (load_data's answer);
    the rest of it (tensors, shard paths, normalization) is the family's own business. A copy of a named dataset
    that is not its published files also says so in `unofficial` (the reason), which the runner reads where present."""

    @property
    def name(self) -> str: ...  # what the data is called in lines and results

    @property
    def num_train(self) -> int: ...  # training examples: step counts and FLOPs follow from it

    @property
    def num_classes(self) -> int: ...

    @property
    def classes(self) -> Sequence[str]: ...  # a class name per label, in label order

    def fingerprint(self) -> str: ...  # what the data holds ("sha256:..."), whatever path it was read from


Cfg = TypeVar("Cfg")  # a family's config type (a FamilyConfig)
Data = TypeVar("Data", bound=TrainingData)  # what its load_data answers


@runtime_checkable
class Family(Protocol[Cfg, Data]):
    """A recipe family, as the runner (run/runner.py), the instruments (bench, ablate, to_target), checkpoints
    (run/resume.py) and saved models (run/export.py) use it."""

    TRICKS: list[Trick]
    MAY_DIFFER_ON_RESUME: frozenset[str]  # config fields a resumed run may change (not what is trained)

    def idle_tricks(self, cfg: Cfg) -> list[str]:
        """The TRICKS keys that do nothing for cfg's network (the user's, --model: those acting inside the
        recipe's own); ablate and --to-target leave them out, naming them."""

    def timed_region(self, cfg: Cfg) -> str:
        """What train_seconds covers, for the result file and the summary."""

    def final_evaluation(self, cfg: Cfg) -> str:
        """What the last row of the progress table measures ("final evaluation with TTA level 2")."""

    def with_epochs(self, cfg: Cfg, epochs: float) -> Cfg:
        """cfg trained for `epochs`, every epoch-denominated setting scaled alike."""

    def run_steps(self, cfg: Cfg, num_train: int) -> int:
        """The optimizer steps of a run of cfg on `num_train` training examples, as its loader counts them."""

    def epochs_for_steps(self, cfg: Cfg, num_train: int, steps: int) -> float:
        """The epochs at which run_steps is exactly `steps` (a schedule compressed to a step count)."""

    def load_data(self, dataset: str, *, data_dir: str | os.PathLike | None, image_size: int | None,
                  log: Callable[[str], None], smoke: bool = False) -> Data:
        """The dataset (refusing what the family cannot train on with one line); `.num_train` its examples. smoke:
        for a smoke test, which may then read only what smoke() keeps of it."""

    def describe(self, data: Data) -> str:
        """One line: the data's name, sizes and image shape."""

    def smoke(self, cfg: Cfg, data: Data) -> tuple[Cfg, Data]:
        """(cfg, data) cut to a few steps on a little data: does the pipeline run?"""

    def check(self, cfg: Cfg, data: Data, device: torch.device, world: dist.World) -> list[str]:
        """Refuse (ValueError) what cannot train on this data and device; return warnings for the odd."""

    def notes(self, cfg: Cfg, data: Data, smoke: bool = False) -> list[str]:
        """Lines shown before training (what a smoke test is, advice)."""

    def own_data(self, named: str, dataset: str, data: Data) -> bool:
        """Whether `data`, loaded from `dataset` as the user gave it, is the data set `named` (a recipe's
        default_dataset) as published: the one its target accuracy is measured on. A result on other data has no
        target unless the user gives one (run/prepared.py)."""

    def data_signature(self, data: Data) -> dict:
        """What a checkpoint must agree on with the data it resumes on."""

    def warmup(self, cfg: Cfg, data: Data, device: torch.device, world: dist.World | None = None) -> float:
        """Seconds of an untimed run (compile, autotune) before the timed ones; 0.0 when none is needed."""

    def train_run(self, cfg: Cfg, data: Data, device: torch.device, seed: int, *, world: dist.World | None = None,
                  hooks: RunHooks | None = None, resume: dict[str, Any] | None = None) -> RunResult:
        """One run: its accuracy, timed seconds, history and the trained model. hooks: what the caller hears of the
        run and keeps of it (engine.loop.RunHooks: progress, table rows, each step's numbers, checkpoints), None
        for none; resume: a checkpoint's training state to continue from."""

    def model_card(self, cfg: Cfg, data: Data) -> dict:
        """What a saved model needs besides its weights: classes, image shape, normalization, TTA level."""

    def build_model(self, cfg: Cfg, in_channels: int, num_classes: int,
                    image_px: int | None = None) -> torch.nn.Module:
        """The untrained network for cfg (a saved model is rebuilt with it, then given its weights); image_px, the
        images' side, for a network whose shape depends on it (the user's: models/custom.py)."""

    def flops(self, cfg: Cfg, data: Data) -> RunFlops:
        """What one run computes on this data (counted on the meta device): its training steps and final
        evaluation, for MFU (`speedrun profile`, and every result)."""


def mismatches(module: Any) -> list[str]:
    """Where `module` (a family's package) departs from Family: missing names, and functions whose parameters
    lack one the contract passes. Empty when it conforms."""
    problems = []
    for name in Family.__annotations__:
        if not hasattr(module, name):
            problems.append(f"{name} is missing")
    for name, member in vars(Family).items():
        if name.startswith("_") or not callable(member) or name in ("mismatches",):
            continue
        found = getattr(module, name, None)
        if not callable(found):
            problems.append(f"{name}() is missing")
            continue
        wanted = [p for p in inspect.signature(member).parameters.values() if p.name != "self"]
        have = inspect.signature(found).parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in have.values())
        for p in wanted:
            if p.name not in have and not (p.kind is p.KEYWORD_ONLY and takes_kwargs):
                problems.append(f"{name}() does not take {p.name}")
    return problems
