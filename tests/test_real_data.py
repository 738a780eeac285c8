"""Short learning runs on real images: the CIFAR-10 JPEG folder from shared/datasets (lossy q75 CIFAR-10).

In CI (CI=true) the folder must be there (shared/ sits beside the clone); elsewhere the test is skipped when
it is absent, since the official CIFAR-10 cannot be downloaded on these machines.
"""

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from speedrun.data.dataset import Dataset
from speedrun.data.sources import load_dataset
from speedrun.recipes import cifar

# Real-data learning runs (the data alone takes seconds to decode): outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow

JPEG = Path(os.environ.get("SPEEDRUN_CIFAR10_JPEG", Path(__file__).resolve().parents[2] / "shared" / "datasets"
                           / "cifar10-jpeg"))


@pytest.fixture(scope="module")
def cifar10_jpeg(tmp_path_factory) -> Dataset:
    if not JPEG.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"CI needs {JPEG} (shared/datasets/cifar10-jpeg beside the clone)")
        pytest.skip(f"{JPEG} not present")
    return load_dataset(str(JPEG), cache_dir=tmp_path_factory.mktemp("cache"))


def test_the_jpeg_folder_loads_as_cifar10_shaped_data(cifar10_jpeg):
    assert cifar10_jpeg.train_images.shape == (50000, 3, 32, 32)
    assert cifar10_jpeg.test_images.shape == (10000, 3, 32, 32)
    assert torch.bincount(cifar10_jpeg.train_labels).tolist() == [5000] * 10
    assert cifar10_jpeg.classes[0] == "airplane"


def test_a_small_net_learns_real_images_in_two_epochs(cifar10_jpeg):
    d = cifar10_jpeg
    g = torch.Generator().manual_seed(0)
    # Random subsets: the folder lists its images class by class, so a prefix would hold one or two classes.
    train, test = torch.randperm(50000, generator=g)[:5000], torch.randperm(10000, generator=g)[:2000]
    subset = Dataset("cifar10-jpeg-5k", d.train_images[train], d.train_labels[train], d.test_images[test],
                     d.test_labels[test], d.classes)
    cfg = dataclasses.replace(cifar.cifar10_94(), batch_size=256, epochs=2.0, widths=(32, 64, 64),
                              whiten_images=2000, eval_each_epoch=False, tta_level=1)
    result = cifar.train_run(cfg, subset, torch.device("cpu"), seed=0)
    assert result.accuracy > 0.33  # chance 0.10; seeds 0-2 gave 0.422, 0.420, 0.401
