"""Does cifar10-94 train as airbench94 does, step for step? Both systems from one start, on one stream of batches.

The races against airbench94 on a CPU (vs_airbench.py --on-cpu) found ours behind at short budgets: -2.34 points at
48 steps, -0.65 at 96, none at the full 476 on an H100. A race mixes everything: the two loaders' random draws,
precision, the normalization constants and the code. This script takes the draws and the precision out, so that
what is left is the code:
  - one initial network: airbench94's own make_net94 under the seed, its weights copied into our CifarNet by name;
  - one whitening: the same 5,000 standardized images go to airbench's init_whitening_conv (float32) and to ours
    (float64), compared by their Gram matrices W^T W = 2 (Sigma + eps I)^-1 (blind to each filter's sign, which an
    eigendecomposition leaves free); both networks then start from airbench's filters;
  - one stream of batches: our DeviceLoader's (flip, translate, alternating flip, drop-last), which airbench's own
    train() iterates through a stand-in for its CifarLoader;
  - fp32 and channels_last on both sides; airbench's train() runs its own code, unchanged, through
    vs_airbench.airbench_on_cpu.
It prints, per tensor, the largest difference between the two trained networks, and both networks' test accuracy
under both systems' evaluation (ours: the training set's channel statistics; airbench's: CIFAR-10's published
ones). Equal weights mean that the training steps are the same computation: the lr triangle, Nesterov SGD with
decoupled weight decay, the bias lr, Lookahead, label smoothing, the whitening bias's window and the network. On a
small network they agree to float32 rounding (tests/test_step_parity.py: 2.4e-7 after 16 steps); on the full one
over 48 steps rounding grows as training amplifies it, and the two accuracies are what to compare.

Run (airbench 0.1.8's sdist unpacked in third_party/ by python tools/fetch_airbench.py):
  PYTHONPATH=src:third_party/airbench-0.1.8 python benchmarks/step_parity.py \
      --data ../shared/datasets/cifar10-jpeg --train 50000 --test 10000 --epochs 1 --out FILE.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _folder in (ROOT / "src", ROOT / "benchmarks"):  # once: a test that loads this script twice adds nothing
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import vs_airbench  # noqa: E402  (benchmarks/ is not a package)

from speedrun.data.dataset import Dataset  # noqa: E402
from speedrun.data.loader import DeviceLoader, Normalization, channel_stats, steps_for  # noqa: E402
from speedrun.data.sources import load_dataset  # noqa: E402
from speedrun.engine.loop import evaluate  # noqa: E402
from speedrun.recipes.cifar.config import CifarConfig  # noqa: E402
from speedrun.recipes.cifar.loop import CifarHooks  # noqa: E402
from speedrun.recipes.in_memory.loop import train_run, whitening_sample  # noqa: E402
from speedrun.records.environment import device_label, environment  # noqa: E402
from speedrun.records.result_file import write_json  # noqa: E402

# airbench94's nn.Sequential names -> CifarNet's, for the recipe's three groups of two convs.
GROUP_PARTS = {"conv1": "convs.0", "conv2": "convs.1", "norm1": "norms.0", "norm2": "norms.1"}


def our_name(theirs: str) -> str:
    """'2.conv1.weight' -> 'groups.0.convs.0.weight'; '0.*' -> 'whiten.*'; '7.weight' (the Linear) -> 'head.weight'."""
    index, rest = theirs.split(".", 1)
    if index == "0":
        return f"whiten.{rest}"
    if index == "7":
        return f"head.{rest}"
    part, tail = rest.split(".", 1)
    return f"groups.{int(index) - 2}.{GROUP_PARTS[part]}.{tail}"


class StreamLoader:
    """What airbench's train() reads of its CifarLoader, over our loader's batches: batch_size, len() (batches an
    epoch), iteration over one epoch's batches per call (the stream continues across calls), epoch, and images
    with normalize for the whitening sample (here the sample itself, already standardized)."""

    def __init__(self, loader: DeviceLoader, sample: torch.Tensor):
        self.batch_size = loader.batch_size
        self.per_epoch = loader.num_examples // loader.batch_size
        self.stream = loader.batches(0)
        self.images = sample
        self.epoch = 0

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        return images

    def __len__(self) -> int:
        return self.per_epoch

    def __iter__(self):
        self.epoch += 1
        for _ in range(self.per_epoch):
            yield next(self.stream)


def whitening_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """How far apart two whitening weights (2d, C, k, k) are, blind to what an eigendecomposition leaves free (each
    filter's sign, a rotation within equal eigenvalues): the relative Frobenius distance of their Gram matrices W^T W,
    which are 2 (Sigma + eps I)^-1 for both."""
    a, b = ours.flatten(1).double(), theirs.flatten(1).double()
    return (torch.linalg.matrix_norm(a.T @ a - b.T @ b) / torch.linalg.matrix_norm(b.T @ b)).item()


def tensor_differences(ours: dict, theirs: dict) -> dict[str, dict[str, float]]:
    out = {}
    for name, t in theirs.items():
        if not t.is_floating_point():
            continue
        o = ours[our_name(name)].float()
        scale = t.float().abs().max().item()
        out[our_name(name)] = {"max_abs": (o - t.float()).abs().max().item(), "max_abs_value": scale}
    return out


def parity(data: Dataset, *, epochs: float, seed: int = 0, widths: tuple[int, int, int] = (64, 256, 256),
           batch_size: int = 1024, whiten_bias_epochs: float = 3.0, ours_changes: dict | None = None) -> dict:
    """Both systems trained from one start on one stream of batches (the module's docstring); the report: step
    count, whitening difference, both networks' accuracy under both evaluations, per-tensor weight differences.
    ours_changes: settings of our side changed from airbench's (a check that a difference shows)."""
    if len(data.train_labels) < batch_size:  # airbench's loader would have no batch (it drops partial ones)
        raise ValueError(f"{len(data.train_labels)} training images are fewer than a batch of {batch_size}")
    # airbench keeps whiten_bias_epochs=3 at any length; ours is given it as it is, not scaled by with_epochs
    cfg = CifarConfig(precision="fp32", channels_last="on", epochs=epochs, whiten_bias_epochs=whiten_bias_epochs,
                      widths=widths, batch_size=batch_size, eval_each_epoch=False, compile=False)
    ab, cfg = cfg, dataclasses.replace(cfg, **(ours_changes or {}))  # airbench's settings, ours
    cpu = torch.device("cpu")
    train94 = vs_airbench.import_train94(on_cpu=True)
    module = sys.modules[train94.__module__]
    utils = sys.modules[module.train.__module__]
    with tempfile.TemporaryDirectory(prefix="step_parity-") as work, contextlib.chdir(work), \
            vs_airbench.airbench_on_cpu(utils.CifarLoader):
        vs_airbench.write_airbench_cache(data, work)
        torch.manual_seed(seed)
        theirs = module.make_net94(widths=dict(zip(("block1", "block2", "block3"), widths)))  # fp32, channels_last
        mean, std = channel_stats(data.train_images)
        normalization = Normalization(mean, std, torch.float32, channels_last=True)

        def loader() -> DeviceLoader:  # train_run's, for airbench's settings and this seed
            return DeviceLoader(data.train_images, data.train_labels, batch_size=ab.batch_size, epochs=ab.epochs,
                                num_classes=data.num_classes, device=cpu, normalization=normalization,
                                augmentation=ab.augmentation(), seed=seed, drop_last=ab.drop_last_batch)

        sample = whitening_sample(loader(), ab.whiten_images, seed)
        reference = copy.deepcopy(theirs)
        utils.init_whitening_conv(reference[0], sample, eps=ab.whiten_eps)
        with torch.no_grad():  # both start from the whitened filters (airbench's Lookahead copies its net before
            theirs[0].weight.copy_(reference[0].weight)  # whitening: this keeps that copy equal to ours)
        start = {k: v.clone() for k, v in theirs.state_dict().items()}
        whitening: dict[str, float] = {}

        class ParityHooks(CifarHooks):
            def build(self, d):
                net = super().build(d)
                own = net.state_dict()
                net.load_state_dict({our_name(k): v.to(own[our_name(k)].dtype) for k, v in start.items()})
                return net

            def whiten(self, model, sample_fn):
                super().whiten(model, sample_fn)
                whitening["gram_relative_difference"] = whitening_difference(self.conv.weight, reference[0].weight)
                with torch.no_grad():
                    self.conv.weight.copy_(reference[0].weight)

        ours = train_run(ParityHooks(cfg), data, cpu, seed).model
        trained = utils.train(StreamLoader(loader(), sample), ab.epochs, ab.label_smoothing, ab.lr_per_1024,
                              ab.bias_lr_mult, ab.momentum, ab.weight_decay_per_1024, whiten_bias_epochs,
                              ab.tta_level, lambda: theirs, run=seed, verbose=False)
        test_loader = utils.CifarLoader("cifar10", train=False, batch_size=2000)
        accuracy = {}
        for name, net in (("ours", ours), ("airbench", trained)):
            accuracy[name] = {
                "our_evaluation": evaluate(net, data.test_images, data.test_labels, normalization=normalization,
                                           tta_level=ab.tta_level),
                "airbench_evaluation": utils.evaluate(net, test_loader, tta_level=ab.tta_level)}
    steps = steps_for(ab.epochs, len(data.train_labels), ab.batch_size, ab.drop_last_batch)
    return {"data": data.name, "train": len(data.train_labels), "test": len(data.test_labels), "steps": steps,
            "seed": seed, "widths": list(widths), "batch_size": batch_size, "whitening": whitening,
            "accuracy": accuracy, "weights": tensor_differences(ours.state_dict(), trained.state_dict())}


def run(args: argparse.Namespace, command: str) -> dict:
    data = vs_airbench.fixed_train_order(load_dataset(args.data, download=False, log=vs_airbench.log))
    data = Dataset(data.name, data.train_images[:args.train], data.train_labels[:args.train],
                   data.test_images[:args.test], data.test_labels[:args.test], list(data.classes))
    report = parity(data, epochs=args.epochs, seed=args.seed)
    return {"benchmark": "step_parity", "command": command, **report,
            "environment": environment(torch.device("cpu"))}


def markdown(report: dict) -> str:
    """A row for BENCHMARKS.md: both systems trained from one start on one stream, their weights and accuracies."""
    env = report["environment"]
    name, worst = max(((k, v["max_abs"]) for k, v in report["weights"].items()), key=lambda kv: kv[1])
    acc = report["accuracy"]
    cells = [env["timestamp_utc"][:10], device_label(env), f"`{report['command'].replace('|', chr(92) + '|')}`",
             f"{report['data']} ({report['train']:,} train / {report['test']:,} test), seed {report['seed']}",
             str(report["steps"]), f"{worst:.2g} ({name})", f"{report['whitening']['gram_relative_difference']:.2g}",
             f"{100 * acc['ours']['our_evaluation']:.2f} / {100 * acc['airbench']['our_evaluation']:.2f}",
             f"{100 * acc['ours']['airbench_evaluation']:.2f} / {100 * acc['airbench']['airbench_evaluation']:.2f}"]
    return "\n".join([
        "| date | device | command | data | steps | largest weight difference (tensor) | whitening, Gram relative "
        "difference | accuracy % ours / airbench94, our evaluation | the same, airbench's evaluation |",
        "|---|---|---|---|---|---|---|---|---|", "| " + " | ".join(cells) + " |"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="CIFAR-10 as speedrun's load_dataset takes it (3x32x32, 10 classes)")
    p.add_argument("--train", type=int, default=5120, help="training images (default 5120: 5 steps an epoch)")
    p.add_argument("--test", type=int, default=2000, help="test images (default 2000)")
    p.add_argument("--epochs", type=float, default=2.0, help="epochs of the run (default 2: Lookahead twice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the report as JSON here")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    try:
        report = run(args, vs_airbench.command_line("step_parity.py", argv))
    except (ValueError, FileNotFoundError) as e:
        print(f"step_parity.py: error: {e}", file=sys.stderr)
        return 2
    if args.out:
        write_json(Path(args.out), report)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
