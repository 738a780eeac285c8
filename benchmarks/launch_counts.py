"""Per steady-state step and per epoch: kernels, copies onto the device, reads back and data-dependent syncs of our
recipes' training loops beside airbench94 0.1.8's own loop, all counted on PyTorch's meta device (engine/launches.py,
instruments/launch_count.py), so no GPU is needed and the numbers are those a CUDA run would issue.

    PYTHONPATH=src:third_party/airbench-0.1.8 python benchmarks/launch_counts.py \
        --json benchmarks/results/launch_counts/counts.json

airbench94 (third_party/airbench-0.1.8, the unpacked PyPI sdist: python tools/fetch_airbench.py) runs its own
train() unchanged: its CifarLoader loads tiny synthetic data onto meta (its `gpu` argument), make_net94's .cuda()
becomes .to("meta"), its CUDA events read the host clock. Both sides: STEPS_PER_EPOCH batches of 16 an epoch (the
last partial batch dropped by both), 4 epochs, the whitening bias frozen after 2, no per-epoch evaluation.
Without the sdist only our rows are counted; tests/test_lean_step.py then holds ours against the pinned airbench
numbers in benchmarks/airbench94_launches.json (written by this script with --pin). BENCHMARKS.md's table is
rendered from the --json report by benchmarks/table.py (between the launch_counts markers).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
for _folder in (ROOT / "src", ROOT / "benchmarks"):  # once: a test that loads this script twice adds nothing
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from speedrun.data.synthetic import make as synthetic  # noqa: E402
from speedrun.engine.launches import Counter, Work  # noqa: E402
from speedrun.instruments import launch_count as lc  # noqa: E402
from speedrun.records.environment import environment  # noqa: E402
from speedrun.recipes import get_recipe  # noqa: E402

PINNED = ROOT / "benchmarks" / "airbench94_launches.json"
RECIPES = ("cifar10-94", "cifar10-94-muon", "cifar10-94-hiverge", "cifar10-95", "cifar10-96", "cifar10-resnet18")


def airbench_available() -> bool:
    return importlib.util.find_spec("airbench") is not None


@contextlib.contextmanager
def airbench_on_meta():
    """airbench 0.1.8's CUDA calls pointed at the meta device, its source untouched (see vs_airbench's
    airbench_on_cpu for the places: .cuda(), the loader's gpu=0, torch.cuda.Event/synchronize, torchvision)."""
    import vs_airbench as vs
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.nn.Module, "cuda", lambda self, device=None: self.to("meta")))
        stack.enter_context(mock.patch.object(torch.cuda, "Event", vs._HostEvent))
        stack.enter_context(mock.patch.object(torch.cuda, "synchronize", lambda device=None: None))
        if importlib.util.find_spec("torchvision") is None:
            stack.enter_context(vs._torchvision_stand_in())
        yield


def count_airbench94() -> lc.StepCounts:
    """airbench94's own train() on meta, cut at every batch its loader hands out."""
    import vs_airbench as vs
    with airbench_on_meta():
        from airbench import lib_airbench94 as ab
        from airbench import utils
        n = lc.STEPS_PER_EPOCH * lc.BATCH
        data = synthetic(f"synthetic:train={n},test={2 * lc.BATCH}")
        counter = Counter()
        real_iter = utils.CifarLoader.__iter__

        def marked(self):  # a stretch ends when the loop asks for its next batch
            for batch in real_iter(self):
                yield batch
                counter.mark()

        with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
            vs.write_airbench_cache(data, tmp)
            defaults = utils.CifarLoader.__init__.__defaults__  # (..., gpu=0): the last is the device
            meta_default = mock.patch.object(utils.CifarLoader.__init__, "__defaults__", (*defaults[:-1], "meta"))
            with meta_default, mock.patch.object(utils.CifarLoader, "__iter__", marked):
                loader = utils.CifarLoader("cifar10", train=True, batch_size=lc.BATCH, aug=ab.hyp["aug"],
                                           altflip=True)
                with counter:
                    model = ab.train94(loader, epochs=lc.EPOCHS, whiten_bias_epochs=lc.FREEZE_EPOCH, verbose=False)
                    counter.mark()
                    utils.evaluate(model, utils.CifarLoader("cifar10", train=False, batch_size=2000), tta_level=2)
                    counter.mark()
    return lc.split(counter.stretches, lc.extras(5))


def count_ours(recipe: str) -> lc.StepCounts:
    r = get_recipe(recipe)
    return lc.count_family(r.module(), r.make_config())


def work_dict(w: Work) -> dict:
    return {**w.totals(), "ops": dict(sorted(w.kernels.items())), "copies": sorted(set(w.host_to_device)),
            "reads": sorted(set(w.device_to_host)), "syncs": sorted(set(w.data_dependent))}


def counts_dict(c: lc.StepCounts) -> dict:
    return {"step": work_dict(c.step), "learning_step": work_dict(c.learning_step), "epoch": work_dict(c.epoch),
            "final": work_dict(c.final), "steps_per_epoch": lc.STEPS_PER_EPOCH}


def markdown(report: dict) -> str:
    """BENCHMARKS.md's table of one report (benchmarks/table.py renders it between the launch_counts markers)."""
    env = report["environment"]
    lines = [f"{env['timestamp_utc'][:10]}, torch {env.get('torch', '')}, counted on the meta device (no GPU "
             f"needed): `{report['command']}`", "",
             "| loop | kernels / step | copies to device / step | reads back / step | data-dependent / step | "
             "kernels / epoch | copies / epoch | reads / epoch | data-dependent / epoch |", "|---|" + "---|" * 8]
    for name, c in report["counts"].items():
        s, e = c["step"], c["epoch"]
        lines.append(f"| {name} | {s['kernels']} | {s['host_to_device']} | {s['device_to_host']} | "
                     f"{s['data_dependent']} | {e['kernels']} | {e['host_to_device']} | {e['device_to_host']} | "
                     f"{e['data_dependent']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="*", default=list(RECIPES), help="our recipes to count")
    parser.add_argument("--json", help="write every count here")
    parser.add_argument("--pin", action="store_true", help=f"write airbench94's counts to {PINNED.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    rows = {}
    if airbench_available():
        rows["airbench94 0.1.8"] = counts_dict(count_airbench94())
        if args.pin:
            PINNED.parent.mkdir(parents=True, exist_ok=True)
            pinned = {"airbench": "0.1.8", "torch": torch.__version__, **rows["airbench94 0.1.8"]}
            PINNED.write_text(json.dumps(pinned, indent=1) + "\n")
    else:
        print("airbench is not importable (PYTHONPATH=src:third_party/airbench-0.1.8): counting ours only",
              file=sys.stderr)
    for recipe in args.recipes:
        rows[recipe] = counts_dict(count_ours(recipe))
    command = ["python", "benchmarks/launch_counts.py", *(sys.argv[1:] if argv is None else argv)]
    report = {"benchmark": "launch_counts", "environment": environment(torch.device("cpu")),
              "command": " ".join(command), "epochs": lc.EPOCHS, "steps_per_epoch": lc.STEPS_PER_EPOCH,
              "counts": rows}
    print(markdown(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
