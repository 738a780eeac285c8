"""One training run of the cifar_resnet family: ResNet-18 (model.py) by SGD on the in-memory, on-device loader
(data/loader.py), written out top to bottom; the bookkeeping every family shares (the timer, the table's rows,
checkpoints, the finite-loss guard, evaluation) comes from engine/loop.py.

Timed region (as airbench and the cifar family): from the patch-whitening init of the stem to the end of the final
(TTA) evaluation, with device synchronization. Data loading, the upload to the device, model construction, the
per-epoch evaluations for the table, checkpoint writes and the compile warm-up run are outside it.

The loss each process differentiates is its share's summed cross-entropy divided by the global batch, so the
gradients dist.py sums over processes are those of the mean loss over the global batch: lr and weight_decay are
PyTorch's, as kuangliu/pytorch-cifar states them, at any number of processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from speedrun import dist
from speedrun.data.dataset import Dataset
from speedrun.data.loader import DeviceLoader, channel_stats, normalize, steps_for
from speedrun.engine import flops as run_flops
from speedrun.engine.checkpoint import load_optimizer, restoring
from speedrun.engine.flops import RunFlops
from speedrun.engine.loop import (FiniteLossGuard, LoopState, RunResult, Steps, Timer, evaluate, last_batch_row,
                                  stop_at_step_end, untimed_warmup)
from speedrun.engine.phases import phase, phased
from speedrun.engine.system import seed_everything, setup_system
from speedrun.recipes.cifar_resnet.config import ResnetConfig
from speedrun.recipes.cifar_resnet.model import CifarResNet, whiten_stem_
from speedrun.tricks.label_smoothing import cross_entropy
from speedrun.tricks.lookahead import Lookahead, lookahead_decay
from speedrun.tricks.optimizer_kernel import optimizer_kernel_kwargs
from speedrun.tricks.schedule import triangle


def build_model(cfg: ResnetConfig, in_channels: int, num_classes: int, image_px: int | None = None) -> CifarResNet:
    return CifarResNet(in_channels, num_classes, cfg.widths)

def flops(cfg: ResnetConfig, data: Dataset) -> RunFlops:
    """What one run computes (engine/flops.py): every step's batch forward and backward, the final evaluation."""
    model = run_flops.on_meta(lambda: build_model(cfg, data.image_shape[0], data.num_classes))
    return run_flops.in_memory_run(model, data.image_shape, cfg.batch_size,
                                   steps_for(cfg.epochs, data.num_train, cfg.batch_size, cfg.drop_last_batch),
                                  len(data.test_labels),
                                   cfg.tta_level)


def build_optimizers(cfg: ResnetConfig, model: CifarResNet) -> list[torch.optim.Optimizer]:
    """One SGD over every parameter with the same weight decay, as kuangliu/pytorch-cifar (BN and biases
    included); "initial_lr" keeps the base lr that the schedule multiplies."""
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                          weight_decay=cfg.weight_decay, **optimizer_kernel_kwargs(cfg.optimizer_kernel))
    for group in opt.param_groups:
        group["initial_lr"] = group["lr"]
    return [opt]


def lr_mult(cfg: ResnetConfig, step: int, total_steps: int) -> float:
    """The lr multiplier at `step`: airbench's triangle, or the published step schedule (x lr_drop_factor at each
    drop, the drops at fractions of the run as 150 and 250 are of 350 epochs)."""
    if cfg.lr_schedule == "triangle":
        return triangle(step, total_steps, cfg.lr_start_mult, cfg.lr_peak_frac, cfg.lr_end_mult)
    drops = sum(step >= frac * total_steps for frac in (cfg.lr_drop1_frac, cfg.lr_drop2_frac))
    return cfg.lr_drop_factor ** drops


def train_step(forward: Callable[[torch.Tensor], torch.Tensor], optimizers: list[torch.optim.Optimizer],
               inputs: torch.Tensor, targets: torch.Tensor, label_smoothing: float, batch_size: int,
               amp: Callable[[], contextlib.AbstractContextManager]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step on this process's share of a global batch of `batch_size`: forward under amp(), backward of the
    label-smoothed loss summed over the share and divided by the global batch, every optimizer's step.

    Returns (logits, summed loss) for the per-epoch table and the finite-loss guard.
    """
    with phase("forward"):
        with amp():
            logits = forward(inputs)
        loss = cross_entropy(logits, targets, label_smoothing)  # summed over the share
    with phase("backward"):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        (loss / batch_size).backward()
    with phase("optimizer"):
        for opt in optimizers:
            opt.step()
    return logits, loss


@dataclass
class TrainState(LoopState):
    """Everything a resumed run restores: the bare model (no DDP, no compile wrapper), its optimizer, Lookahead's
    slow weights, and the loop's bookkeeping (engine.loop.LoopState). The loader needs only `step`: its batches are
    a pure function of (seed, step)."""

    model: CifarResNet
    optimizers: list[torch.optim.Optimizer]
    lookahead: Lookahead | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizers": [o.state_dict() for o in self.optimizers],
                "lookahead": None if self.lookahead is None else list(self.lookahead.slow), **self.loop_state()}

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
                torch._foreach_copy_(self.lookahead.slow, [t.to(self.model.stem.weight.device) for t in slow])
            self.load_loop_state(state, total_steps)


def train_run(cfg: ResnetConfig, data: Dataset, device: torch.device, seed: int, *, shuffle_labels: bool = False,
              world: dist.World | None = None, on_step: Callable[[int, int], None] | None = None,
              on_epoch: Callable[[dict], None] | None = None, checkpoints=None,
              resume: dict[str, Any] | None = None, on_scalars=None) -> RunResult:
    """One training run of `cfg` on `data`; returns the final (TTA) accuracy and the timed seconds.

    shuffle_labels: train on permuted labels (the untimed compile/autotune warm-up run, as airbench does).
    world: the torchrun world (dist.py); each process trains on its share of every global batch.
    checkpoints: the runner's Checkpoints (saves TrainState every N steps, at the last step and on a signal), or None.
    resume: a TrainState.state_dict() to continue from (checkpoint.find_checkpoint).
    on_scalars: each step's loss and lr (engine.loop.Steps), or None.
    """
    cfg.validate()
    world = world or dist.World()
    seed_everything(seed)
    system = setup_system(cfg, device)
    in_channels, _, _ = data.image_shape

    # Untimed: statistics, upload, model construction.
    mean, std = channel_stats(data.train_images)
    train_labels = data.train_labels
    if shuffle_labels:
        train_labels = train_labels[torch.randperm(len(train_labels), generator=torch.Generator().manual_seed(seed))]
    loader = DeviceLoader(data.train_images, train_labels, batch_size=cfg.batch_size, epochs=cfg.epochs,
                          num_classes=data.num_classes, device=device, mean=mean, std=std, dtype=system.dtype,
                          channels_last=system.channels_last, flip=cfg.flip, translate_px=cfg.translate_px,
                          seed=seed, share=dist.share(cfg.batch_size, world) if world.size > 1 else None,
                          drop_last=cfg.drop_last_batch)
    mean, std = loader.mean, loader.std  # (C,) on the device, once
    test_images, test_labels = data.test_images.to(device), data.test_labels.to(device)
    # prepare returns the module it is given, converted in place: still a CifarResNet
    model, forward = cast("tuple[CifarResNet, torch.nn.Module]",
                          system.prepare(build_model(cfg, in_channels, data.num_classes), cfg))
    state = TrainState(model, build_optimizers(cfg, model))
    total_steps = loader.steps

    def scored(tta_level: int) -> float:  # test accuracy; every process takes rank 0's BatchNorm statistics first
        dist.broadcast_model(model, world)
        return evaluate(forward, test_images, test_labels, mean=mean, std=std, dtype=system.dtype,
                        channels_last=system.channels_last, tta_level=tta_level, batch_size=cfg.eval_batch_size,
                        autocast=system.amp, world=world)

    timer = Timer(device)
    if resume is None:
        timer.start()  # ---- timed region: whitening init ... final evaluation ----
        if cfg.whiten_init:
            # A random sample, not the first images: image folders list their files class by class. Every process
            # draws the same sample (seeded), so every one starts from the same stem.
            pick = torch.randperm(loader.num_examples, generator=torch.Generator().manual_seed(seed))
            sample = loader.images[pick[:cfg.whiten_images].to(device)]
            whiten_stem_(model.stem, normalize(sample, mean, std, torch.float32), cfg.whiten_eps)
        state.lookahead = Lookahead(model) if cfg.lookahead else None  # slow weights start from the initialized net
    else:
        state.lookahead = Lookahead(model) if cfg.lookahead else None
        state.load_state_dict(resume, total_steps)
        timer.seconds = state.seconds
        timer.start()
    train_forward = dist.wrap(forward, world, device, cfg.sync_bn)  # DDP for K processes; `forward` itself for one

    model.train()
    steps = Steps(timer, total_steps, checkpoints=checkpoints, on_step=on_step, on_epoch=on_epoch,
                  on_scalars=on_scalars)
    with stop_at_step_end(keep_state=checkpoints is not None or world.size > 1) as stop:
        guard = FiniteLossGuard(device, total_steps, "lr", enabled=cfg.check_finite_loss, world=world, stop=stop,
                                every_steps=cfg.check_finite_every_steps)
        for inputs, targets in phased(loader.batches(state.step)):
            mult = lr_mult(cfg, state.step, total_steps)
            for opt in state.optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["initial_lr"] * mult
            logits, loss = train_step(train_forward, state.optimizers, inputs, targets, cfg.label_smoothing,
                                      cfg.batch_size, system.amp)
            state.step += 1
            stopping = guard.check(state.step, loss, cfg.lr * mult)
            if state.lookahead is not None and state.step % cfg.lookahead_every_steps == 0:
                state.lookahead.update(lookahead_decay(state.step, total_steps, cfg.lookahead_base,
                                                       cfg.lookahead_every_steps))
            epoch = loader.epoch_at(state.step)

            def batch_row(seconds: float) -> dict:
                return last_batch_row(epoch, state.step, loss, logits, targets, seconds, world)

            def table_row(seconds: float) -> dict:
                return {**batch_row(seconds), "val_acc": scored(0) if cfg.eval_each_epoch else None}

            steps.after(state, epoch, stopping, batch_row=batch_row, table_row=table_row, loss=loss,
                        loss_scale=1 / len(targets), lr=cfg.lr * mult,  # loss: summed over this share
                        settle=guard.finish)
            if stopping:  # a signal (on any process): the state is whole, and saved when a folder was given
                raise stop.interrupt()
        guard.finish()
    if state.lookahead is not None:
        state.lookahead.update(1.0)  # final sync: the live net takes the averaged weights
    accuracy = scored(cfg.tta_level)
    train_seconds = timer.stop()  # ---- end of timed region ----
    # A run resumed from its last step's checkpoint took no step here: its last row was kept in that checkpoint.
    steps.final(state, accuracy, train_seconds, lambda seconds: last_batch_row(
        loader.epoch_at(state.step), state.step, loss, logits, targets, seconds, world))
    return RunResult(seed=seed, accuracy=accuracy, train_seconds=train_seconds, epochs=cfg.epochs,
                     steps=total_steps, history=state.history, model=model)


def warmup(cfg: ResnetConfig, data: Dataset, device: torch.device, world: dist.World | None = None) -> float:
    """An untimed run on shuffled labels before the timed ones (engine.loop.untimed_warmup); its seconds."""
    # Without the finite-loss guard: a warm-up whose loss turns NaN still runs to its end, so that everything the
    # timed runs compile or autotune (the final evaluation's graph too) happens here, outside their timer.
    unguarded = dataclasses.replace(cfg, check_finite_loss=False)
    return untimed_warmup(device, cfg.compile, lambda: train_run(unguarded, data, device, seed=0, shuffle_labels=True,
                                                                 world=world))
