"""speedrun: train neural networks as fast as the hardware allows, and prove it.

Public API:
    speedrun.train(recipe="cifar10-94", dataset="cifar10", device="auto", epochs=None, runs=1, seed=0,
                   data_dir=None, image_size=None, smoke=False, options=None, overrides=None, **keywords) -> Result
        keywords: config fields (lookahead=False) and the fields of speedrun.TrainOptions (json_path, save,
        checkpoint_dir, resume, db, tensorboard, verbose, ...), which `options` may hold instead
    speedrun.load(path, device="cpu") -> TrainedModel   (a network saved by train(save=...) / --save)
Nothing here runs at import time; torch is imported only when train() is called.
"""

from __future__ import annotations

from speedrun import _version

__version__ = _version.__version__

__all__ = ["train", "Result", "RECIPES", "load", "TrainOptions"]


def __getattr__(name: str):
    # Lazy re-exports: `import speedrun` (and `speedrun --help`) stay fast and import no torch.
    if name == "RECIPES":
        from speedrun.recipes import RECIPES

        return RECIPES
    if name in ("train", "Result", "TrainOptions"):
        from speedrun.run import runner

        return getattr(runner, name)
    if name == "load":
        from speedrun.run import export

        return export.load
    raise AttributeError(f"module 'speedrun' has no attribute {name!r}")
