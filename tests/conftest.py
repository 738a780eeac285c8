import pytest
import torch

from speedrun.data.dataset import Dataset


def make_tiny(n_train=256, n_test=64, shape=(3, 32, 32), classes=10, seed=0) -> Dataset:
    """Random uint8 images whose labels are learnable: class k brightens channel 0 in its own stripe."""
    g = torch.Generator().manual_seed(seed)
    c, h, w = shape

    def split(n):
        y = torch.randint(0, classes, (n,), generator=g)
        x = torch.randint(0, 128, (n, c, h, w), generator=g, dtype=torch.uint8)
        stripe = h // classes or 1
        for k in range(classes):
            rows = slice((k * stripe) % h, (k * stripe) % h + stripe)
            x[y == k, 0, rows, :] += 120
        return x, y

    (xtr, ytr), (xte, yte) = split(n_train), split(n_test)
    return Dataset("tiny", xtr, ytr, xte, yte, [f"c{i}" for i in range(classes)])


@pytest.fixture
def tiny() -> Dataset:
    return make_tiny()
