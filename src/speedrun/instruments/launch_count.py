"""A recipe's training loop counted on the meta device (engine/launches.py): per steady-state step and per epoch,
the kernels a CUDA run launches, its copies onto the device, its reads back and its data-dependent syncs.

The family's own train_run runs, unchanged, with device "meta" (which resolves precision and layout as CUDA does)
on tiny synthetic data of the recipe's image shape: STEPS_PER_EPOCH full batches an epoch, EPOCHS epochs. Counts do
not depend on batch size or width, so the table holds for the full recipe. The per-epoch table evaluation is
switched off: it lies outside the timed region. Steps are cut where the loop reports each step (Steps.on_step):
step k's stretch runs from the end of step k - 1, so it holds the loader's work for its batch, and an epoch's
first step holds the epoch's shuffle and augmentation.

What is a steady-state step: the commonest count among the steps that neither start an epoch nor update
Lookahead's slow weights (those extras are in the per-epoch numbers).
"""

from __future__ import annotations

import dataclasses
from collections import Counter as Tally
from dataclasses import dataclass
from typing import Any

import torch

from speedrun.data.synthetic import make
from speedrun.engine.launches import Counter, Work
from speedrun.engine.loop import RunHooks

STEPS_PER_EPOCH = 10
EPOCHS = 4
FREEZE_EPOCH = 2  # the whitening bias learns for the first 2 epochs: a step of each phase is counted
BATCH = 16


@dataclass
class StepCounts:
    """The counts of one loop: `step` a steady-state step (the whitening bias frozen, as for most of a recipe's
    steps), `learning_step` one while it learns, `epoch` the whole of epoch FREEZE_EPOCH (bias frozen, no set-up in
    it), every step's Work for diagnosis (the first holds the set-up), and `final`, after the last step: the final
    averaging and the TTA evaluation."""

    step: Work
    learning_step: Work
    epoch: Work
    steps: list[Work]
    final: Work


def extras(lookahead_every: int) -> set[int]:
    """Steps (0-based) that carry more than a step's work: each epoch's first (shuffle, augmentation) and, when
    Lookahead is on, each of its updates."""
    return {i for i in range(EPOCHS * STEPS_PER_EPOCH)
            if i % STEPS_PER_EPOCH == 0 or (lookahead_every and (i + 1) % lookahead_every == 0)}


def steady(steps: list[Work]) -> Work:
    """The commonest kernel count among `steps`; the first step with it."""
    key = Tally(frozenset(w.kernels.items()) for w in steps).most_common(1)[0][0]
    return next(w for w in steps if frozenset(w.kernels.items()) == key)


def split(stretches: list[Work], extra: set[int]) -> StepCounts:
    """Stretches as a loop marked them (one per step, then the rest after the last) -> StepCounts."""
    *steps, final = stretches
    assert len(steps) == EPOCHS * STEPS_PER_EPOCH, f"{len(steps)} steps counted, {EPOCHS * STEPS_PER_EPOCH} expected"
    frozen_from = FREEZE_EPOCH * STEPS_PER_EPOCH
    plain = [w for i, w in enumerate(steps) if i not in extra]
    epoch = Work()
    for w in steps[frozen_from:frozen_from + STEPS_PER_EPOCH]:
        epoch = epoch + w
    return StepCounts(step=steady([w for i, w in enumerate(steps) if i not in extra and i >= frozen_from]),
                      learning_step=steady([w for i, w in enumerate(steps) if i not in extra and i < frozen_from]
                                           or plain), epoch=epoch, steps=steps, final=final)


def count_family(family: Any, cfg: Any, image_shape: tuple[int, int, int] = (3, 32, 32),
                 num_classes: int = 10) -> StepCounts:
    """Count `cfg`'s training loop (an in-memory family's train_run) on meta, at tiny shapes."""
    n_train = STEPS_PER_EPOCH * BATCH
    c, h, w = image_shape
    data = make(f"synthetic:train={n_train},test={BATCH * 2},shape={c}x{h}x{w},classes={num_classes}")
    changes = {"epochs": float(EPOCHS), "batch_size": BATCH, "eval_batch_size": BATCH, "eval_each_epoch": False,
               "whiten_bias_epochs": float(FREEZE_EPOCH)}
    fields = {f.name for f in dataclasses.fields(cfg)}
    if "whiten_images" in fields:
        changes["whiten_images"] = min(cfg.whiten_images, n_train)
    cfg = dataclasses.replace(cfg, **{k: v for k, v in changes.items() if k in fields})
    every = getattr(cfg, "lookahead_every_steps", 0) if getattr(cfg, "lookahead", False) else 0
    counter = Counter()
    with counter:
        family.train_run(cfg, data, torch.device("meta"), seed=0,
                         hooks=RunHooks(on_step=lambda step, total: counter.mark()))
    counter.mark()
    return split(counter.stretches, extras(every))


def lean_problems(counts: StepCounts, anchor_ops: dict[str, int] | None = None) -> list[str]:
    """What keeps a loop from being lean, one line each, naming the operator and where it was issued: a copy from
    the host or a data-dependent sync in a steady-state step, more than one read back a step, a copy or a sync
    each epoch beyond the one copy of its draws; and with `anchor_ops` (a lean loop's steady-state step, op ->
    launches, such as airbench94's), each operator launched more often than there."""
    step, epoch = counts.step, counts.epoch
    problems = [f"a copy from the host every step: {w}" for w in sorted(set(step.host_to_device))]
    problems += [f"a data-dependent sync every step: {w}" for w in sorted(set(step.data_dependent))]
    if len(step.device_to_host) > 1:
        problems.append(f"{len(step.device_to_host)} reads back every step (at most 1): "
                        f"{', '.join(sorted(set(step.device_to_host)))}")
    if len(epoch.host_to_device) > 1:
        problems.append(f"{len(epoch.host_to_device)} copies from the host an epoch (at most 1, the epoch's draws): "
                        f"{', '.join(sorted(set(epoch.host_to_device)))}")
    problems += [f"a data-dependent sync every epoch: {w}" for w in sorted(set(epoch.data_dependent))]
    if anchor_ops is not None and step.launches > sum(anchor_ops.values()):
        extra = {op: n - anchor_ops.get(op, 0) for op, n in step.kernels.items() if n > anchor_ops.get(op, 0)}
        problems.append(f"{step.launches} kernels a step, more than the anchor's {sum(anchor_ops.values())}; "
                        f"launched more often: {', '.join(f'{op} +{n}' for op, n in sorted(extra.items()))}")
    return problems
