"""One training run of an in-memory family, written out top to bottom: the data on the device (data/loader.py),
the family's network and optimizers, patch whitening, steps on the family's schedule with Lookahead, and the final
(TTA) evaluation, with the engine's shared bookkeeping (engine/loop.py: timer, finite-loss guard, table rows and
checkpoints). What differs between families is a Hooks object the family passes in: its network and optimizers, its
lr schedule and step, and the tricks this loop does not know (cifar's whitening bias window, its jitter).

Timed region (as airbench): from the patch-whitening init to the end of the final (TTA) evaluation, with device
synchronization. Data loading, the upload to the device, model construction, the per-epoch evaluations for the
table, checkpoint writes and the compile warm-up run are outside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from speedrun import dist
from speedrun.data.dataset import Dataset
from speedrun.data.loader import DeviceLoader, Normalization, channel_stats, normalize
from speedrun.engine.checkpoint import load_optimizer, restoring
from speedrun.engine.loop import (FiniteLossGuard, LoopState, RunHooks, RunResult, Steps, Timer, evaluate,
                                  last_batch_row, stop_at_step_end, untimed_warmup)
from speedrun.engine.phases import phase, phased
from speedrun.engine.system import System, seed_everything, setup_system
from speedrun.recipes.in_memory.config import C, InMemoryConfig
from speedrun.tricks.label_smoothing import cross_entropy
from speedrun.tricks.lookahead import Lookahead, lookahead_decay
from speedrun.tricks.schedule import triangle
from speedrun.tricks.tta import passes as tta_passes

Amp = Callable[[], contextlib.AbstractContextManager]


def train_step(forward: Callable[[torch.Tensor], torch.Tensor], optimizers: list[torch.optim.Optimizer],
               inputs: torch.Tensor, targets: torch.Tensor, label_smoothing: float, amp: Amp,
               batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step on a batch (this process's share of it under torchrun): forward under amp(), the label-smoothed
    loss summed over the share, backward, every optimizer's step. batch_size: the global batch the summed loss is
    divided by before the backward pass (the gradients of the mean loss, PyTorch's convention for lr and weight
    decay); None: the summed loss's own (airbench's, whose lrs are per 1024 examples), with no division launched.

    Returns (logits, summed loss) for the per-epoch table and the finite-loss guard. benchmarks/step_time.py times
    exactly this.
    """
    with phase("forward"):
        with amp():
            logits = forward(inputs)
        loss = cross_entropy(logits, targets, label_smoothing)  # summed over the share
    with phase("backward"):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        (loss if batch_size is None else loss / batch_size).backward()
    with phase("optimizer"):
        for opt in optimizers:
            opt.step()
    return logits, loss


def with_initial_lr(*optimizers: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers, each group's lr kept as its "initial_lr": the base lr the schedule multiplies (train_run)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return list(optimizers)


@dataclass
class TrainState(LoopState):
    """Everything a resumed run restores: the bare model (no DDP, no compile wrapper), its optimizers, Lookahead's
    slow weights, what the family adds (own_state) and the loop's bookkeeping (engine.loop.LoopState). The loader
    needs only `step`: its batches are a pure function of (seed, step)."""

    model: nn.Module
    optimizers: list[torch.optim.Optimizer]
    lookahead: Lookahead | None = None

    def own_state(self) -> dict[str, Any]:
        """The family's own parts of the state (a subclass's fields), between Lookahead's and the loop's."""
        return {}

    def load_own_state(self, state: dict[str, Any]) -> None:
        """Restore own_state's parts from a checkpoint's state, each checked (ValueError)."""

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizers": [o.state_dict() for o in self.optimizers],
                "lookahead": None if self.lookahead is None else list(self.lookahead.slow), **self.own_state(),
                **self.loop_state()}

    def load_state_dict(self, state: dict[str, Any], total_steps: int) -> None:
        """Restore from a checkpoint's state, every part checked against this run (CheckpointError, one line)."""
        with restoring():
            self.model.load_state_dict(state["model"])  # copies into the live tensors: Lookahead's views stay valid
            if len(state["optimizers"]) != len(self.optimizers):
                raise ValueError(f"{len(state['optimizers'])} optimizer states for {len(self.optimizers)} optimizers")
            for opt, saved in zip(self.optimizers, state["optimizers"]):
                load_optimizer(opt, saved)
            if self.lookahead is not None:
                slow = state["lookahead"]
                if [t.shape for t in slow] != [t.shape for t in self.lookahead.slow]:
                    raise ValueError("Lookahead's averages do not match the network")
                device = next(self.model.parameters()).device
                torch._foreach_copy_(self.lookahead.slow, [t.to(device) for t in slow])
            self.load_own_state(state)
            self.load_loop_state(state, total_steps)


S = TypeVar("S", bound=TrainState)


class Hooks(ABC, Generic[C, S]):
    """What a family adds to one run of train_run: its network and optimizers, its schedule and step, and the
    tricks the shared loop does not know. One object per run, made from the run's config: it may keep what it
    finds in the network it builds (cifar's whitening conv) for the later hooks."""

    state_type: type[S]  # the family's TrainState: this one, or a subclass with the family's own parts

    def __init__(self, cfg: C):
        self.cfg = cfg

    @abstractmethod
    def build(self, data: Dataset) -> nn.Module:
        """The untrained network for images of `data`, on the host (the loop moves and prepares it in place). Keep
        its modules for the later hooks, not its parameters: a move to another device may make new ones."""

    @abstractmethod
    def optimizers(self, model: nn.Module) -> list[torch.optim.Optimizer]:
        """The optimizers of the prepared network; each group keeps its base lr in "initial_lr"."""

    @abstractmethod
    def lr_setting(self) -> tuple[str, float]:
        """The setting a user would lower when the loss diverges, and its value (the base lr the schedule
        multiplies, for the finite-loss guard's message and the per-step scalars)."""

    @abstractmethod
    def whiten(self, model: nn.Module, sample: Callable[[], torch.Tensor]) -> None:
        """Patch-whitening init of the prepared network's first conv (whiten_init; a fresh run only, timed) from
        sample(), the training images whitening_sample draws."""

    def step(self, forward: nn.Module, state: S, inputs: torch.Tensor, targets: torch.Tensor,
             amp: Amp) -> tuple[torch.Tensor, torch.Tensor]:
        """Optimizer step `state.step` on a batch: train_step, on the loss the family's lrs are for (MEAN_LOSS)."""
        cfg = self.cfg
        return train_step(forward, state.optimizers, inputs, targets, cfg.label_smoothing, amp,
                          cfg.batch_size if cfg.MEAN_LOSS else None)

    def lr_mult(self, step: int, total_steps: int) -> float:
        """The lr multiplier at `step`: airbench's triangle (tricks/schedule.py)."""
        return triangle(step, total_steps, self.cfg.lr_start_mult, self.cfg.lr_peak_frac, self.cfg.lr_end_mult)

    def ready(self, state: S, loader: DeviceLoader, system: System) -> None:
        """Before the first step of this process (a fresh run or a resumed one): the family's setup from the
        restored state and the loader (timed, before the model is wrapped for torchrun)."""

    def before_step(self, state: S, epoch: float) -> bool:
        """Before each step, at `epoch` epochs of data; True where the trainable parameters changed (DDP rewraps)."""
        return False


def whitening_sample(loader: DeviceLoader, images: int, seed: int) -> torch.Tensor:
    """`images` training images standardized in float32 (N, C, H, W) for patch whitening: a random sample, not the
    first images (image folders list their files class by class), the same on every process (seeded), so every
    one starts from the same filters."""
    pick = torch.randperm(loader.num_examples, generator=torch.Generator().manual_seed(seed))
    sample = loader.images[pick[:images].to(loader.device)]
    return normalize(sample, loader.normalization.mean, loader.normalization.std, torch.float32)


def train_run(hooks: Hooks[Any, Any], data: Dataset, device: torch.device, seed: int, *, shuffle_labels: bool = False,
              world: dist.World | None = None, run_hooks: RunHooks | None = None,
              resume: dict[str, Any] | None = None) -> RunResult:
    """One training run of `hooks.cfg` on `data`; returns the final (TTA) accuracy and the timed seconds.

    shuffle_labels: train on permuted labels (the untimed compile/autotune warm-up run, as airbench does).
    world: the torchrun world (dist.py); each process trains on its share of every global batch.
    run_hooks: what the caller hears of the run and keeps of it (progress, table rows, scalars, checkpoints).
    resume: a TrainState.state_dict() to continue from (checkpoint.find_checkpoint).
    """
    cfg: InMemoryConfig = hooks.cfg
    cfg.validate()
    world = world or dist.World()
    seed_everything(seed)
    system = setup_system(cfg, device)

    # Untimed: statistics, upload, model construction.
    mean, std = channel_stats(data.train_images)
    train_labels = data.train_labels
    if shuffle_labels:
        train_labels = train_labels[torch.randperm(len(train_labels), generator=torch.Generator().manual_seed(seed))]
    loader = DeviceLoader(data.train_images, train_labels, batch_size=cfg.batch_size, epochs=cfg.epochs,
                          num_classes=data.num_classes, device=device,
                          normalization=Normalization(mean, std, system.dtype, system.channels_last),
                          augmentation=cfg.augmentation(), seed=seed,
                          share=dist.share(cfg.batch_size, world) if world.size > 1 else None,
                          drop_last=cfg.drop_last_batch)
    test_images, test_labels = data.test_images.to(device), data.test_labels.to(device)
    model, forward = system.prepare(hooks.build(data), cfg)  # prepare converts the module in place
    state = hooks.state_type(model, hooks.optimizers(model))
    total_steps = loader.steps
    lr_name, base_lr = hooks.lr_setting()

    def scored(tta_level: int, progress: Callable[[int, int], None] | None = None) -> float:
        """Test accuracy; every process takes rank 0's BatchNorm statistics first. progress(done, total): passes."""
        dist.broadcast_model(model, world)
        mine = dist.part(len(test_labels), world)  # the images evaluate scores here
        share = mine.stop - mine.start
        fraction = cfg.tta_fraction() or 1.0  # 0 or None: every image gets the views (as evaluate reads it)
        total, done = tta_passes(share, tta_level, fraction if 0 < fraction < 1 else 1.0), [0]

        def on_batch(passes: int) -> None:
            done[0] += passes
            if progress is not None:
                progress(done[0], total)

        if progress is not None:
            progress(0, total)  # begun: its first batch may take many seconds on a CPU

        return evaluate(forward, test_images, test_labels, normalization=loader.normalization, tta_level=tta_level,
                        batch_size=cfg.eval_batch_size, autocast=system.amp, world=world,
                        tta_select=cfg.tta_fraction(), on_batch=None if progress is None else on_batch)

    timer = Timer(device)
    if resume is None:
        timer.start()  # ---- timed region: whitening init ... final evaluation ----
        if cfg.whiten_init:
            hooks.whiten(model, lambda: whitening_sample(loader, cfg.whiten_images, seed))
        state.lookahead = Lookahead(model) if cfg.lookahead else None  # slow weights start from the initialized net
    else:
        state.lookahead = Lookahead(model) if cfg.lookahead else None
        state.load_state_dict(resume, total_steps)
        timer.seconds = state.seconds
        timer.start()
    hooks.ready(state, loader, system)
    train_forward = dist.wrap(forward, world, device, cfg.sync_bn)  # DDP for K processes; `forward` itself for one

    model.train()
    steps = Steps(timer, total_steps, run_hooks)
    with stop_at_step_end(keep_state=steps.checkpoints is not None or world.size > 1) as stop:
        guard = FiniteLossGuard(device, total_steps, lr_name, enabled=cfg.check_finite_loss, world=world, stop=stop,
                                every_steps=cfg.check_finite_every_steps)
        for inputs, targets in phased(loader.batches(state.step)):
            if hooks.before_step(state, loader.epoch_at(state.step)):
                train_forward = dist.rewrap(train_forward, world, device)  # DDP's reducer: the parameters changed
            mult = hooks.lr_mult(state.step, total_steps)
            for opt in state.optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["initial_lr"] * mult
            logits, loss = hooks.step(train_forward, state, inputs, targets, system.amp)
            state.step += 1
            stopping = guard.check(state.step, loss, base_lr * mult)
            if state.lookahead is not None and state.step % cfg.lookahead_every_steps == 0:
                state.lookahead.update(lookahead_decay(state.step, total_steps, cfg.lookahead_base,
                                                       cfg.lookahead_every_steps))
            epoch = loader.epoch_at(state.step)

            def batch_row(seconds: float) -> dict:
                return last_batch_row(epoch, state.step, loss, logits, targets, seconds, world)

            def table_row(seconds: float) -> dict:
                return {**batch_row(seconds), "val_acc": scored(0) if cfg.eval_each_epoch else None}

            steps.after(state, epoch, stopping, batch_row=batch_row, table_row=table_row, loss=loss,
                        loss_scale=1 / len(targets), lr=base_lr * mult,  # loss: summed over this share
                        settle=guard.finish)
            if stopping:  # a signal (on any process): the state is whole, and saved when a folder was given
                raise stop.interrupt()
        guard.finish()
    if state.lookahead is not None:
        state.lookahead.update(1.0)  # final sync: the live net takes the averaged weights
    accuracy = scored(cfg.tta_level, None if run_hooks is None else run_hooks.on_evaluation)
    train_seconds = timer.stop()  # ---- end of timed region ----
    # A run resumed from its last step's checkpoint took no step here: its last row was kept in that checkpoint.
    steps.final(state, accuracy, train_seconds, lambda seconds: last_batch_row(
        loader.epoch_at(state.step), state.step, loss, logits, targets, seconds, world))
    return RunResult(seed=seed, accuracy=accuracy, train_seconds=train_seconds, epochs=cfg.epochs,
                     steps=total_steps, history=state.history, model=model)


def warmup(run: Callable[..., RunResult], cfg: InMemoryConfig, data: Dataset, device: torch.device,
           world: dist.World | None = None) -> float:
    """An untimed run (the family's train_run, `run`) on shuffled labels before the timed ones
    (engine.loop.untimed_warmup); its seconds."""
    # Without the finite-loss guard: a warm-up whose loss turns NaN still runs to its end, so that everything the
    # timed runs compile or autotune (the final evaluation's graph too) happens here, outside their timer.
    unguarded = dataclasses.replace(cfg, check_finite_loss=False)
    return untimed_warmup(device, cfg.compile, lambda: run(unguarded, data, device, seed=0, shuffle_labels=True,
                                                           world=world))



class FamilyRun(Generic[C]):
    """A family's train_run (recipes/family.py's Family): the shared loop, given for each run a new Hooks of the
    family's made from that run's config. A family's module names the bound method
    (`train_run = FamilyRun(CifarHooks).train_run`), and its warmup calls it by that name."""

    def __init__(self, hooks: Callable[[C], Hooks[C, Any]]):
        self.hooks = hooks

    def train_run(self, cfg: C, data: Dataset, device: torch.device, seed: int, *, shuffle_labels: bool = False,
                  world: dist.World | None = None, hooks: RunHooks | None = None,
                  resume: dict[str, Any] | None = None) -> RunResult:
        """One training run of `cfg` on `data`: the shared loop (train_run) with the family's hooks; hooks: what
        the caller hears of the run and keeps of it (engine.loop.RunHooks)."""
        return train_run(self.hooks(cfg), data, device, seed, shuffle_labels=shuffle_labels, world=world,
                         run_hooks=hooks, resume=resume)
