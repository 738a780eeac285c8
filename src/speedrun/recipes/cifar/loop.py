"""The cifar family's training loop: build the network and optimizers, then one run written out top to bottom
(whitening init, steps with the triangle schedule and Lookahead, the TTA evaluation) with the engine's shared
bookkeeping (engine/loop.py: timer, finite-loss guard, table rows and checkpoints)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

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
from speedrun.models import CifarNet, custom
from speedrun.recipes.cifar.config import CifarConfig
# The family's answers to the runner (recipes/__init__.py), kept apart from the loop:
from speedrun.tricks.bn_momentum import set_bn_momentum_
from speedrun.tricks.color_jitter import JitterTable
from speedrun.tricks.decoupled_sgd import decoupled_sgd
from speedrun.tricks.label_smoothing import cross_entropy
from speedrun.tricks.lookahead import Lookahead, lookahead_decay
from speedrun.tricks.muon import Muon
from speedrun.tricks.optimizer_kernel import optimizer_kernel_kwargs
from speedrun.tricks.schedule import triangle
from speedrun.tricks.tta import selected_count
from speedrun.tricks.whitening import patch_whitening_init_, whitenable_first_conv


def build_model(cfg: CifarConfig, in_channels: int, num_classes: int, image_px: int | None = None) -> nn.Module:
    """The recipe's network, or the user's (cfg.model: models/custom.py), which needs the images' side."""
    if cfg.model:
        if image_px is None:
            raise ValueError(f"--model {cfg.model}: the network's builder needs the images' size")
        net = custom.build(cfg.model, in_channels, num_classes, image_px)
        set_bn_momentum_(net, cfg.bn_momentum)  # the recipe's short runs need statistics of the last steps
        return net
    return CifarNet(in_channels, num_classes, cfg.widths, cfg.convs_per_group, cfg.whiten_kernel_px, cfg.bn_momentum,
                    cfg.bn_eps, cfg.bn_scale_frozen, cfg.dirac_init, cfg.logit_scale, cfg.activation,
                    cfg.index_free_eval_pool)


def whitening_conv(cfg: CifarConfig, model: nn.Module, in_channels: int) -> nn.Conv2d | None:
    """The conv patch whitening initializes: the recipe's `whiten`, or the user's network's first conv where it has
    the whitening's shape (tricks/whitening.py); None where it has not: whiten_init and whiten_bias_epochs then do
    nothing (data.idle_tricks says so)."""
    return whitenable_first_conv(model, in_channels) if cfg.model else cast(CifarNet, model).whiten


def flops(cfg: CifarConfig, data: Dataset) -> RunFlops:
    """What one run computes (engine/flops.py): every step's batch forward and backward, the final evaluation."""
    try:
        model = run_flops.on_meta(lambda: build_model(cfg, data.image_shape[0], data.num_classes,
                                                      data.image_shape[1]))
    except Exception as e:  # the user's code may not build on the meta device: the run goes on without a count
        if not cfg.model:
            raise
        raise ValueError(f"--model {cfg.model} does not build on the meta device ({type(e).__name__})") from None
    run = run_flops.in_memory_run(model, data.image_shape, cfg.batch_size,
                                  steps_for(cfg.epochs, data.num_train, cfg.batch_size, cfg.drop_last_batch),
                                  len(data.test_labels),
                                  cfg.tta_level)
    if not (cfg.tta_level and cfg.tta_select and cfg.tta_select < 1):
        return run
    # Selective TTA: the plain pass for every image, the other views for the selected ones (tricks/tta.py)
    n = len(data.test_labels)
    plain = run_flops.evaluation(model, data.image_shape, n, 0)
    views = (run.evaluation - plain) * selected_count(n, cfg.tta_select) // n if n else 0
    return dataclasses.replace(run, evaluation=plain + views,
                               counted=f"{run.counted}; the views beyond the plain pass for "
                                       f"{selected_count(n, cfg.tta_select):,} of the {n:,} test images (tta_select)")


def _parameter_groups(cfg: CifarConfig, model: nn.Module, whiten: nn.Conv2d | None) -> tuple[list, list, list, list]:
    """(whitening bias, norms, filters, head): the recipe's network by its parts' names; the user's by shape (the
    bias lr multiplier's parameters are those of fewer than 2 dimensions, biases and norms, as BatchNorm's in the
    recipe's; Muon takes the conv filters, 4-dimensional; the rest, linear layers and embeddings, the head's lr)."""
    if not cfg.model:  # the recipe's own network: build_model made a CifarNet
        net = cast(CifarNet, model)
        return ([net.whiten.bias], [p for n, p in model.named_parameters() if "norms" in n and p.requires_grad],
                [p for n, p in model.named_parameters() if "convs" in n], [net.head.weight])
    first = [] if whiten is None or whiten.bias is None else [whiten.bias]
    taken = {id(p) for p in first}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    return (first, [p for p in rest if p.dim() < 2], [p for p in rest if p.dim() == 4],
            [p for p in rest if p.dim() in (2, 3) or p.dim() > 4])


def build_optimizers(cfg: CifarConfig, model: nn.Module, in_channels: int = 3) -> list[torch.optim.Optimizer]:
    """Parameter groups as airbench. SGD (airbench94): BN parameters get the bias lr multiplier; the whitening
    bias, conv filters and head the base lr. Muon (airbench94_muon): Muon on the conv filters; SGD with one lr
    for the whitening and BN biases and another for the head. The user's network: by shape (_parameter_groups)."""
    whiten_bias, norms, filters, head = _parameter_groups(cfg, model, whitening_conv(cfg, model, in_channels))
    if cfg.optimizer == "sgd":
        return [decoupled_sgd([{"params": norms, "lr_mult": cfg.bias_lr_mult},
                               {"params": whiten_bias + filters + head, "lr_mult": 1.0}],
                              lr_per_1024=cfg.lr_per_1024, weight_decay_per_1024=cfg.weight_decay_per_1024,
                              momentum=cfg.momentum, batch_size=cfg.batch_size,
                              kernel=optimizer_kernel_kwargs(cfg.optimizer_kernel))]
    wd = cfg.muon_weight_decay_per_example * cfg.batch_size
    biases = whiten_bias + norms
    sgd = torch.optim.SGD([{"params": biases, "lr": cfg.muon_bias_lr, "weight_decay": wd / cfg.muon_bias_lr},
                           {"params": head, "lr": cfg.muon_head_lr, "weight_decay": wd / cfg.muon_head_lr}],
                          momentum=cfg.momentum, nesterov=True, **optimizer_kernel_kwargs(cfg.optimizer_kernel))
    muon = Muon(filters, lr=cfg.muon_lr, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                ns_steps=cfg.muon_ns_steps, batched=cfg.muon_ns_batched,
                renorm_every_steps=cfg.muon_renorm_every_steps, compiled=cfg.muon_ns_compile)
    for opt in (sgd, muon):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return [sgd, muon]


def train_step(forward: Callable[[torch.Tensor], torch.Tensor], optimizers: list[torch.optim.Optimizer],
               inputs: torch.Tensor, targets: torch.Tensor, label_smoothing: float,
               amp: Callable[[], contextlib.AbstractContextManager]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step on a batch: forward under amp(), label-smoothed summed loss, backward, every optimizer's step.

    Returns (logits, loss) for the per-epoch table. benchmarks/step_time.py times exactly this.
    """
    with phase("forward"):
        with amp():
            logits = forward(inputs)
        loss = cross_entropy(logits, targets, label_smoothing)
    with phase("backward"):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
    with phase("optimizer"):
        for opt in optimizers:
            opt.step()
    return logits, loss


@dataclass
class TrainState(LoopState):
    """Everything a resumed run restores: the bare model (no DDP, no compile wrapper), its optimizers, Lookahead's
    slow weights, the whitening bias's frozen flag, and the loop's bookkeeping (engine.loop.LoopState)."""

    model: nn.Module  # models.CifarNet, or the user's (models/custom.py)
    optimizers: list[torch.optim.Optimizer]
    lookahead: Lookahead | None = None
    whiten_bias_frozen: bool = False  # the whitening bias stopped learning (cfg.whiten_bias_epochs)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizers": [o.state_dict() for o in self.optimizers],
                "lookahead": None if self.lookahead is None else list(self.lookahead.slow),
                "whiten_bias_frozen": self.whiten_bias_frozen, **self.loop_state()}

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
            if type(state["whiten_bias_frozen"]) is not bool:
                raise ValueError("the whitening bias's frozen flag is not true or false")
            self.whiten_bias_frozen = state["whiten_bias_frozen"]
            self.load_loop_state(state, total_steps)


def train_run(cfg: CifarConfig, data: Dataset, device: torch.device, seed: int, *, shuffle_labels: bool = False,
              world: dist.World | None = None, on_step: Callable[[int, int], None] | None = None,
              on_epoch: Callable[[dict], None] | None = None, checkpoints=None,
              resume: dict[str, Any] | None = None, on_scalars=None) -> RunResult:
    """One training run of `cfg` on `data`; returns the final TTA accuracy and the timed seconds.

    shuffle_labels: train on permuted labels (the untimed compile/autotune warm-up run, as airbench does).
    world: the torchrun world (dist.py); each process trains on its share of every global batch.
    checkpoints: runs.Checkpoints (saves TrainState every N steps, at the last step and on a signal), or None.
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
                          cutout_px=cfg.cutout_px, cutmix_px=cfg.cutmix_px, seed=seed,
                          share=dist.share(cfg.batch_size, world) if world.size > 1 else None,
                          drop_last=cfg.drop_last_batch)
    mean, std = loader.mean, loader.std  # (C,) on the device, once
    test_images, test_labels = data.test_images.to(device), data.test_labels.to(device)
    net = build_model(cfg, in_channels, data.num_classes, data.image_shape[1])
    whiten = whitening_conv(cfg, net, in_channels)
    if whiten is not None and cfg.whiten_init:  # frozen as the recipe's own (models/cifar_net.py): its bias learns
        whiten.weight.requires_grad_(False)
    model, forward = system.prepare(net, cfg)
    state = TrainState(model, build_optimizers(cfg, model, in_channels))
    total_steps = loader.steps
    # The lr the divergence message names: the setting a user would lower.
    lr_name, base_lr = ("lr_per_1024", cfg.lr_per_1024) if cfg.optimizer == "sgd" else ("muon_lr", cfg.muon_lr)

    def scored(tta_level: int) -> float:  # test accuracy; every process takes rank 0's BatchNorm statistics first
        dist.broadcast_model(model, world)
        return evaluate(forward, test_images, test_labels, mean=mean, std=std, dtype=system.dtype,
                        channels_last=system.channels_last, tta_level=tta_level, batch_size=cfg.eval_batch_size,
                        autocast=system.amp, world=world, tta_select=cfg.tta_select)

    timer = Timer(device)
    if resume is None:
        timer.start()  # ---- timed region: whitening init ... TTA evaluation ----
        if cfg.whiten_init and whiten is not None:
            # A random sample, not the first images: image folders list their files class by class.
            pick = torch.randperm(loader.num_examples, generator=torch.Generator().manual_seed(seed))
            sample = loader.images[pick[:cfg.whiten_images].to(device)]
            patch_whitening_init_(whiten, normalize(sample, mean, std, torch.float32), cfg.whiten_eps,
                                  cfg.whiten_method)
        state.lookahead = Lookahead(model) if cfg.lookahead else None  # slow weights start from the initialized net
    else:
        state.lookahead = Lookahead(model) if cfg.lookahead else None
        state.load_state_dict(resume, total_steps)
        timer.seconds = state.seconds
        timer.start()
    whiten_bias = None if whiten is None else whiten.bias  # the user's first conv may have none
    if whiten_bias is not None:
        whiten_bias.requires_grad_(not state.whiten_bias_frozen)
    train_forward = dist.wrap(forward, world, device, cfg.sync_bn)  # DDP for K processes; `forward` itself for one

    jitter = None
    if cfg.jitter_brightness or cfg.jitter_contrast:
        jitter = JitterTable(seed=seed, steps=total_steps, batch_size=cfg.batch_size, brightness=cfg.jitter_brightness,
                             contrast=cfg.jitter_contrast, std=std, device=device, dtype=system.dtype,
                             share=loader.share)
    model.train()
    steps = Steps(timer, total_steps, checkpoints=checkpoints, on_step=on_step, on_epoch=on_epoch,
                  on_scalars=on_scalars)
    with stop_at_step_end(keep_state=checkpoints is not None or world.size > 1) as stop:
        guard = FiniteLossGuard(device, total_steps, lr_name, enabled=cfg.check_finite_loss, world=world, stop=stop,
                                every_steps=cfg.check_finite_every_steps)
        for inputs, targets in phased(loader.batches(state.step)):
            if not state.whiten_bias_frozen and loader.epoch_at(state.step) >= cfg.whiten_bias_epochs:
                state.whiten_bias_frozen = True
                if whiten_bias is not None:
                    whiten_bias.requires_grad_(False)
                    train_forward = dist.rewrap(train_forward, world, device)  # DDP's reducer: one parameter fewer
            mult = triangle(state.step, total_steps, cfg.lr_start_mult, cfg.lr_peak_frac, cfg.lr_end_mult)
            for opt in state.optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["initial_lr"] * mult
            if jitter is not None:
                inputs = jitter(inputs, state.step)
            logits, loss = train_step(train_forward, state.optimizers, inputs, targets, cfg.label_smoothing,
                                      system.amp)
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
    accuracy = scored(cfg.tta_level)
    train_seconds = timer.stop()  # ---- end of timed region ----
    steps.final(state, accuracy, train_seconds, lambda seconds: last_batch_row(
        loader.epoch_at(state.step), state.step, loss, logits, targets, seconds, world))
    return RunResult(seed=seed, accuracy=accuracy, train_seconds=train_seconds, epochs=cfg.epochs,
                     steps=total_steps, history=state.history, model=model)


def warmup(cfg: CifarConfig, data: Dataset, device: torch.device, world: dist.World | None = None) -> float:
    """An untimed run on shuffled labels before the timed ones (engine.loop.untimed_warmup); its seconds."""
    # Without the finite-loss guard: a warm-up whose loss turns NaN still runs to its end, so that everything the
    # timed runs compile or autotune (the final evaluation's graph too) happens here, outside their timer.
    unguarded = dataclasses.replace(cfg, check_finite_loss=False)
    return untimed_warmup(device, cfg.compile, lambda: train_run(unguarded, data, device, seed=0, shuffle_labels=True,
                                                                 world=world))
