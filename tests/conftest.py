import importlib.util
from pathlib import Path

import pytest
import torch

from speedrun.data.dataset import Dataset


def make_tiny(n_train=256, n_test=64, shape=(3, 32, 32), classes=10, seed=0) -> Dataset:
    """Noisy uint8 images whose labels are learnable: each class adds its own colour (grey level for C=1).

    Colour, not position, carries the class: the nets end in a global max pool, which discards position.
    """
    g = torch.Generator().manual_seed(seed)
    c, h, w = shape
    colours = torch.randint(0, 128, (classes, c), generator=g, dtype=torch.uint8)
    if c == 1:
        colours[:, 0] = torch.arange(classes, dtype=torch.uint8) * (128 // classes)

    def split(n):
        y = torch.randint(0, classes, (n,), generator=g)
        x = torch.randint(0, 128, (n, c, h, w), generator=g, dtype=torch.uint8) + colours[y].view(n, c, 1, 1)
        return x, y

    (xtr, ytr), (xte, yte) = split(n_train), split(n_test)
    return Dataset("tiny", xtr, ytr, xte, yte, [f"c{i}" for i in range(classes)])


@pytest.fixture
def tiny() -> Dataset:
    return make_tiny()


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
