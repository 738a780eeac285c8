"""The imagenet family's training loop: build the ResNet and its optimizer (SGD, LARS or LAMB), evaluate on
centre crops, and one run written out top to bottom (progressive resizing, warm-up then linear decay, the weight
average) with the engine's shared bookkeeping (engine/loop.py)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from speedrun import dist
from speedrun.data.loader import Normalization, steps_for
from speedrun.data.shard_loader import CropAndFlip, Decoding, ShardImages, ShardLoader, device_decoder, eval_batches
from speedrun.engine import flops as run_flops
from speedrun.engine.checkpoint import load_optimizer, restoring
from speedrun.engine.flops import RunFlops
from speedrun.engine.loop import FiniteLossGuard, LoopState, RunHooks, RunResult, Steps, Timer, stop_at_step_end
from speedrun.engine.phases import phase, phased
from speedrun.engine.system import seed_everything, setup_system
from speedrun.errors import counted
from speedrun.models.resnet import norm_and_bias_params, resnet
from speedrun.recipes.imagenet.config import ImagenetConfig
from speedrun.recipes.imagenet.data import ShardData
# The family's answers to the runner (recipes/__init__.py lists the questions), kept apart from the loop:
from speedrun.tricks.ema import make_ema
from speedrun.tricks.label_smoothing import cross_entropy
from speedrun.tricks.lars import Lamb, Lars
from speedrun.tricks.optimizer_kernel import optimizer_kernel_kwargs
from speedrun.tricks.schedule import triangle


def build_model(cfg: ImagenetConfig, in_channels: int, num_classes: int,
                image_px: int | None = None) -> torch.nn.Module:
    return resnet(cfg.depth, num_classes, width=cfg.width, zero_init_residual=cfg.zero_init_residual,
                  blurpool=cfg.blurpool, in_channels=in_channels)


def res_at(cfg: ImagenetConfig, step: int, total_steps: int) -> int:
    """Training resolution at `step`: min_res_px until res_ramp_start_frac of the run, then linearly to max_res_px
    at res_ramp_end_frac, rounded to res_step_px (FFCV rounds to 32 px: sizes the kernels are tuned for)."""
    if not cfg.progressive_resizing:
        return cfg.max_res_px
    frac = step / max(1, total_steps)
    lo, hi = cfg.res_ramp_start_frac, cfg.res_ramp_end_frac
    t = 0.0 if frac <= lo else 1.0 if frac >= hi or hi == lo else (frac - lo) / (hi - lo)
    px = cfg.min_res_px + t * (cfg.max_res_px - cfg.min_res_px)
    return min(cfg.max_res_px, max(cfg.min_res_px, int(round(px / cfg.res_step_px)) * cfg.res_step_px))


def flops(cfg: ImagenetConfig, data: ShardData) -> RunFlops:
    """What one run computes (engine/flops.py): each step's batch forward and backward at that step's resolution
    (progressive resizing), and the final evaluation at eval_res_px, the mirror too when tta_flip."""
    model = run_flops.on_meta(lambda: build_model(cfg, 3, data.num_classes))
    total = steps_for(cfg.epochs, data.num_train, cfg.batch_size)
    at_res: dict[int, int] = {}  # px -> steps at it
    for step in range(total):
        px = res_at(cfg, step, total)
        at_res[px] = at_res.get(px, 0) + 1
    train = sum(run_flops.train_step(model, (3, px, px), cfg.batch_size) * n for px, n in at_res.items())
    views = 2 if cfg.tta_flip else 1
    evaluation = run_flops.evaluation(model, (3, cfg.eval_res_px, cfg.eval_res_px), data.num_eval * views, 0)
    return RunFlops(train=train, steps=total, evaluation=evaluation,
                    counted=f"{total} steps of {cfg.batch_size} images at " + ", ".join(
                        f"{px} px x {n}" for px, n in sorted(at_res.items())) + f" (forward and backward), "
                    f"{data.num_eval} evaluation images x {counted(views, 'view')} at {cfg.eval_res_px} px; "
                    "convolutions and matmuls only (torch.utils.flop_counter)")


def build_optimizer(cfg: ImagenetConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Two groups: weights, and BatchNorm/bias parameters (no weight decay when no_decay_norm_bias; no LARS/LAMB
    trust ratio for them either, as Goyal et al. and MLPerf's LARS). Each group keeps its peak lr as initial_lr."""
    peak = cfg.lr_per_256 * cfg.batch_size / 256
    norms = {id(p) for p in norm_and_bias_params(model)}
    rest = [p for p in model.parameters() if id(p) not in norms]
    norm_params = [p for p in model.parameters() if id(p) in norms]
    norm_wd = 0.0 if cfg.no_decay_norm_bias else cfg.weight_decay
    groups = [{"params": rest, "weight_decay": cfg.weight_decay, "initial_lr": peak, "adapt": True},
              {"params": norm_params, "weight_decay": norm_wd, "initial_lr": peak, "adapt": False}]
    if cfg.optimizer == "lars":
        return Lars(groups, lr=peak, momentum=cfg.momentum, trust_coefficient=cfg.lars_trust)
    if cfg.optimizer == "lamb":
        return Lamb(groups, lr=peak)
    for g in groups:
        del g["adapt"]
    # LARS and LAMB compute their trust ratios per tensor in their own step: the kernel choice is SGD's alone
    return torch.optim.SGD(groups, lr=peak, momentum=cfg.momentum, **optimizer_kernel_kwargs(cfg.optimizer_kernel))


@dataclass
class TrainState(LoopState):
    """What a resumed run restores: the bare model, its optimizer, the weight average when on, and the loop's
    bookkeeping (engine.loop.LoopState). The loader needs only `step`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ema: Any = None  # tricks/ema.WeightEma or None

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "ema": None if self.ema is None else self.ema.state_dict(), **self.loop_state()}

    def load_state_dict(self, state: dict[str, Any], total_steps: int) -> None:
        """Restore from a checkpoint's state, each part checked against this run (CheckpointError, one line)."""
        with restoring():
            self.model.load_state_dict(state["model"])
            load_optimizer(self.optimizer, state["optimizer"])
            if (self.ema is None) != (state["ema"] is None):
                raise ValueError("the checkpoint's EMA setting is not this run's")
            if self.ema is not None:
                self.ema.load_state_dict(state["ema"])
            self.load_loop_state(state, total_steps)


def eval_decode_px(cfg: ImagenetConfig) -> int:
    """The square the evaluation images are decoded to: at least the centre crop's full size, so that cropping
    eval_crop_ratio of it leaves eval_res_px of detail (256 px / (224/256) = 293 px for ImageNet)."""
    return min(1024, max(cfg.decode_px, math.ceil(cfg.eval_res_px / cfg.eval_crop_ratio)))


def evaluate_top1(forward: Callable, data: ShardData, cfg: ImagenetConfig, system, world: dist.World) -> float:
    """Top-1 accuracy on the evaluation split, centre crop at eval_res_px, the mirror averaged in when tta_flip.
    Each process scores a contiguous part; the counts are summed."""
    n = data.num_eval
    part = slice(world.rank * n // world.size, (world.rank + 1) * n // world.size)
    counts = torch.zeros(2, dtype=torch.float64, device=system.device)  # correct, seen
    images = ShardImages(data.root, data.eval_split, eval_decode_px(cfg))
    with torch.no_grad(), system.amp(), phase("evaluation"):
        for inputs, labels in eval_batches(images, batch_size=cfg.eval_batch_size, res=cfg.eval_res_px,
                                           crop_ratio=cfg.eval_crop_ratio, device=system.device, mean=data.mean_t,
                                           std=data.std_t, dtype=system.dtype, channels_last=system.channels_last,
                                           workers=min(cfg.workers, 4), part=part):
            logits = forward(inputs).float()
            if cfg.tta_flip:
                logits = logits + forward(inputs.flip(-1)).float()
            counts += torch.stack([(logits.argmax(1) == labels).sum().double(),
                                   torch.tensor(float(len(labels)), dtype=torch.float64, device=counts.device)])
    dist.sum_(counts, world)
    return float(counts[0] / counts[1])


def train_run(cfg: ImagenetConfig, data: ShardData, device: torch.device, seed: int, *,
              world: dist.World | None = None, hooks: RunHooks | None = None, resume: dict[str, Any] | None = None,
              on_batch: Callable[[int, torch.Tensor], None] | None = None) -> RunResult:
    """One run of `cfg` on prepared shards; returns the final top-1 accuracy and the timed seconds.
    hooks: what the caller hears of the run and keeps of it (engine.loop.RunHooks).
    on_batch(step, labels): called with each step's labels on this process (the exactly-once test)."""
    cfg.validate()
    world = world or dist.World()
    seed_everything(seed)
    system = setup_system(cfg, device)
    model, forward = system.prepare(build_model(cfg, 3, data.num_classes), cfg)
    state = TrainState(model, build_optimizer(cfg, model), make_ema(model, cfg.ema_decay, 1))
    loader = ShardLoader(data.root, data.train_split, batch_size=cfg.batch_size, epochs=cfg.epochs, device=device,
                         res_at=lambda s: res_at(cfg, s, total_steps),
                         normalization=Normalization(data.mean_t, data.std_t, system.dtype, system.channels_last),
                         augmentation=CropAndFlip(flip=cfg.flip, crop_area_frac=(cfg.crop_min_scale, 1.0)),
                         seed=seed, share=dist.share(cfg.batch_size, world) if world.size > 1 else None,
                         decoding=Decoding(decode_px=cfg.decode_px, workers=cfg.workers,
                                           device_decode=device_decoder(cfg.decoder, device)[0]))
    total_steps = loader.steps
    warmup_frac = min(1.0, cfg.warmup_epochs / cfg.epochs)
    if resume is not None:
        state.load_state_dict(resume, total_steps)
    timer = Timer(device)
    timer.seconds = state.seconds
    timer.start()  # ---- timed region ----
    train_forward = dist.wrap(forward, world, device, cfg.sync_bn)

    def scored() -> float:
        model.eval()
        swap = state.ema.swapped(model) if state.ema is not None else contextlib.nullcontext()
        with swap:  # the averaged weights in (when EMA is on), then restored
            # BatchNorm statistics (and their averages) are per process: every process takes rank 0's.
            dist.broadcast_model(model, world)
            accuracy = evaluate_top1(forward, data, cfg, system, world)
        model.train()
        return accuracy

    model.train()
    loss = torch.zeros(())
    steps = Steps(timer, total_steps, hooks)
    with stop_at_step_end(keep_state=steps.checkpoints is not None or world.size > 1) as stop:
        guard = FiniteLossGuard(device, total_steps, "lr_per_256", enabled=cfg.check_finite_loss, world=world,
                                stop=stop, every_steps=cfg.check_finite_every_steps)
        for inputs, targets in phased(loader.batches(state.step)):
            if on_batch is not None:
                on_batch(state.step, targets)
            mult = triangle(state.step, total_steps, 0.0, warmup_frac, 0.0)
            for group in state.optimizer.param_groups:
                group["lr"] = group["initial_lr"] * mult
            with phase("forward"):
                with system.amp():
                    logits = train_forward(inputs)
                # Summed over this share, divided by the global batch: gradients summed over processes = the mean.
                loss = cross_entropy(logits, targets, cfg.label_smoothing) / cfg.batch_size
            with phase("backward"):
                state.optimizer.zero_grad(set_to_none=True)
                loss.backward()
            with phase("optimizer"):
                state.optimizer.step()
                if state.ema is not None:
                    state.ema.update(state.step + 1)
            state.step += 1
            stopping = guard.check(state.step, loss, cfg.lr_per_256 * mult)
            epoch = loader.epoch_at(state.step)

            def batch_row(seconds: float) -> dict:
                return {"epoch": round(epoch, 4), "step": state.step, "train_loss": _global_loss(loss, world),
                        "train_acc": None, "val_acc": None, "train_seconds": seconds}

            def table_row(seconds: float) -> dict:
                return {**batch_row(seconds), "val_acc": scored() if cfg.eval_each_epoch else None,
                        "res_px": res_at(cfg, state.step - 1, total_steps)}

            # loss: this share's sum over the global batch, so x batch / share is the mean over the share
            steps.after(state, epoch, stopping, batch_row=batch_row, table_row=table_row, loss=loss,
                        loss_scale=cfg.batch_size / len(targets), lr=cfg.lr_per_256 * mult, settle=guard.finish)
            if stopping:
                raise stop.interrupt()
        guard.finish()
    accuracy = scored()
    train_seconds = timer.stop()  # ---- end of timed region ----
    steps.final(state, accuracy, train_seconds, lambda seconds: {
        "epoch": round(loader.epoch_at(state.step), 4), "step": state.step, "train_loss": _global_loss(loss, world),
        "train_acc": None, "val_acc": None, "train_seconds": seconds})
    return RunResult(seed=seed, accuracy=accuracy, train_seconds=train_seconds, epochs=cfg.epochs,
                     steps=total_steps, history=state.history, model=model)


def _global_loss(loss: torch.Tensor, world: dist.World) -> float:
    """The last step's loss per example over the global batch (each process holds its share's sum / batch)."""
    total = loss.detach().double().reshape(1).clone()
    dist.sum_(total, world)
    return float(total)
