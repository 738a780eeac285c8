"""The lean-step contract, counted on the meta device (engine/launches.py, instruments/launch_count.py): a steady-state
training step of every in-memory recipe copies nothing from the host, reads nothing back and waits on no data-
dependent shape; an epoch copies its draws once; cifar10-94's step launches no more kernels than airbench94's own
step (counted live when third_party/airbench-0.1.8 is there, else its pinned counts). A copy put back into the loop
fails the contract with the operator and the line named."""

import json
import sys
from pathlib import Path

import pytest
import torch

from speedrun.engine.launches import Counter
from speedrun.instruments import launch_count as lc
from speedrun.recipes import RECIPES, get_recipe
from speedrun.recipes.cifar import loop as cifar_loop

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
AIRBENCH_SDIST = ROOT / "third_party" / "airbench-0.1.8"
IN_MEMORY = [name for name, r in RECIPES.items() if r.family in ("cifar", "cifar_resnet")]


def count(name: str) -> lc.StepCounts:
    r = get_recipe(name)
    return lc.count_family(r.module(), r.make_config())


@pytest.fixture(scope="module")
def airbench_ops() -> dict[str, int]:
    """airbench94's steady-state step, op -> launches: counted now from its sdist when it is there, else pinned."""
    if AIRBENCH_SDIST.is_dir():
        sys.path.insert(0, str(AIRBENCH_SDIST))
        try:
            return dict(load_benchmark("launch_counts").count_airbench94().step.kernels)
        finally:
            sys.path.remove(str(AIRBENCH_SDIST))
    return json.loads((ROOT / "benchmarks/airbench94_launches.json").read_text())["step"]["ops"]


def test_cifar10_94_step_is_lean_and_no_heavier_than_airbench94s(airbench_ops):
    counts = count("cifar10-94")
    assert lc.lean_problems(counts, airbench_ops) == []
    assert counts.step.totals() == {"kernels": counts.step.launches, "host_to_device": 0, "device_to_host": 0,
                                    "data_dependent": 0}
    assert len(counts.epoch.host_to_device) == 1  # the epoch's draws, in one copy
    assert counts.step.launches <= sum(airbench_ops.values()) == 87


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in IN_MEMORY if n != "cifar10-94"])
def test_every_in_memory_recipe_step_is_lean(name):
    counts = count(name)
    assert lc.lean_problems(counts) == []
    # a read every check_finite_every_steps steps (8) at most, and the per-epoch table row's
    assert len(counts.epoch.device_to_host) <= 2


def test_a_copy_put_back_into_the_step_fails_naming_the_op_and_the_line(monkeypatch, airbench_ops):
    real_step = cifar_loop.train_step

    def step_with_copy(forward, optimizers, inputs, targets, label_smoothing, amp):
        scale = torch.tensor([1.0, 2.0]).to(inputs.device)  # a per-step host-to-device copy
        return real_step(forward, optimizers, inputs * scale[0], targets, label_smoothing, amp)

    monkeypatch.setattr(cifar_loop, "train_step", step_with_copy)
    problems = lc.lean_problems(count("cifar10-94"), airbench_ops)
    assert any(p.startswith("a copy from the host every step: _to_copy at") and "test_lean_step.py" in p
               for p in problems), problems
    # the multiply it feeds is an extra kernel: the comparison with airbench names it
    assert any("more than the anchor's 87" in p and "mul +1" in p for p in problems), problems


def test_a_read_back_and_a_boolean_mask_each_step_are_named(monkeypatch):
    real_step = cifar_loop.train_step

    def step_with_sync(forward, optimizers, inputs, targets, label_smoothing, amp):
        logits, loss = real_step(forward, optimizers, inputs, targets, label_smoothing, amp)
        float(loss.detach())  # .item() by another name
        _ = targets[targets > 0]  # a boolean mask: its size is data
        return logits, loss

    monkeypatch.setattr(cifar_loop, "train_step", step_with_sync)
    counts = count("cifar10-94")
    assert len(counts.step.device_to_host) == 1 and "test_lean_step.py" in counts.step.device_to_host[0]
    assert any(p.startswith("a data-dependent sync every step: nonzero at") or
               p.startswith("a data-dependent sync every step: index at") for p in lc.lean_problems(counts))


def test_the_counter_tells_copies_reads_syncs_and_kernels_apart():
    host = torch.ones(4)
    with Counter() as c:
        x = host.to("meta")  # a copy onto the device
        y = (x * 2).sum()  # two kernels
        y.item()  # a read back
        x.view(2, 2).t()  # views: nothing launched
        x[x > 0]  # a data-dependent size
        x.cpu()  # a read back
        torch.ones(3) + 1  # host work: not counted
        c.mark()
    w = c.stretches[0]
    assert (len(w.host_to_device), len(w.device_to_host), len(w.data_dependent)) == (1, 2, 1)
    assert w.kernels["mul"] == 1 and w.kernels["sum"] == 1 and "view" not in w.kernels and "t" not in w.kernels
