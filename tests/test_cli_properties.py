"""Property-based tests of `speedrun train`: random flags, keys, values, recipes and datasets.

For every input: either the run starts (exit 0), having passed every check, or the command refuses it with exit 2
and exactly one line on stderr, no traceback, and no run started. Where the generator knows an input is bad (a
non-finite float, an unknown key, a run count of 0 ...), the refusal is required; where it knows every part is
good, the run is required to start.

Training itself is replaced by a recorder that checks, independently of the code under test, that what reached it
is trainable: a validated config with finite numbers, a net that fits the images, non-empty splits, labels in range
and a freshly claimed result file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import tempfile
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from speedrun.cli.program import main
from speedrun.engine.loop import RunResult
from speedrun.models.cifar_net import output_side
from speedrun.recipes import cifar
from speedrun.run import runner as runs

FIELDS = {f.name: f for f in dataclasses.fields(cifar.CifarConfig)}
SMALL = "synthetic:train=48,test=16,shape=3x16x16"  # a net of widths 8,8,8 fits 16 px


def _set_parts() -> dict:
    """`--set KEY=VALUE` items by verdict."""
    floats = sorted(k for k, f in FIELDS.items() if f.type == "float")
    literals = ["flip", "activation", "optimizer", "precision", "channels_last", "compile_mode"]
    good = st.one_of(
        st.tuples(st.sampled_from(["label_smoothing", "lookahead_base", "lr_per_1024", "weight_decay_per_1024"]),
                  st.floats(0.01, 0.5)).map(lambda kv: f"{kv[0]}={kv[1]:.6g}"),
        st.sampled_from(["flip=random", "flip=none", "lookahead=false", "tta_level=1", "activation=relu",
                         "optimizer=muon", "precision=fp32", "channels_last=off", "compile_mode=default",
                         "whiten_init=no", "cutout_px=3", "widths=8,8", "eval_each_epoch=false"]))
    bad = st.one_of(
        st.tuples(st.sampled_from(floats), st.sampled_from(["nan", "inf", "-inf", "NaN", "1e400", "abc", ""]))
        .map(lambda kv: f"{kv[0]}={kv[1]}"),
        st.tuples(st.sampled_from(["batch_size", "whiten_images", "eval_batch_size", "lookahead_every_steps"]),
                  st.sampled_from(["1.5", "x", "", "10" * 30, "-5", "0"])).map(lambda kv: f"{kv[0]}={kv[1]}"),
        st.tuples(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12).filter(lambda k: k not in FIELDS),
                  st.text(max_size=5)).map(lambda kv: f"{kv[0]}={kv[1]}"),
        st.sampled_from(["seed=1", "device=cpu", "runs=2", "dataset=x", "json=y", "novalue", "=3"]),
        st.tuples(st.sampled_from(literals), st.sampled_from(["bogus", "", "NONE", "o n"]))
        .map(lambda kv: f"{kv[0]}={kv[1]}"),
        st.sampled_from(["widths=8,16,100000", "widths=", "tta_level=3", "bn_eps=0", "translate_px=-1",
                         "lr_per_1024=0", "label_smoothing=1", "momentum=1", "convs_per_group=4",
                         "muon_ns_steps=0"]))
    either = st.tuples(st.sampled_from(sorted(FIELDS)), st.text(max_size=12)).map(lambda kv: f"{kv[0]}={kv[1]}")
    return {k: v.map(lambda item: ["--set", item]) for k, v in (("good", good), ("bad", bad), ("either", either))}


def _parts(root: str) -> list[dict]:
    """Every part of a command as {verdict: strategy of token lists}; verdicts "good", "bad" and "either"."""
    missing = st.text(min_size=1, max_size=20).filter(
        lambda t: not t.startswith("-") and not os.path.exists(t) and not t.strip().lower().startswith("synth"))
    json_paths = {"fresh": os.path.join(root, "out", "r.json"), "existing": os.path.join(root, "existing.json"),
                  "dir": root, "under-file": os.path.join(root, "existing.json", "r.json"),
                  "too-long": os.path.join(root, "x" * 300)}
    ckpt = os.path.join(root, "ckpt")
    return [
        # The cifar family's recipes: the datasets below are its kinds (the imagenet family reads prepared shards;
        # tests/test_imagenet.py refuses everything else there).
        {"good": st.one_of(st.sampled_from(sorted(n for n, r in runs.RECIPES.items() if r.family == "cifar"))
                           .map(lambda r: [r]), st.just([])),
         "bad": st.text("abcxyz-0123456789", min_size=1, max_size=10).filter(
             lambda r: r not in runs.RECIPES and not r.startswith("-")).map(lambda r: [r])},
        # Datasets: small synthetic ones with random options (good ones at least 16 px, which cifar10-96's 12-px
        # cutout needs), named ones (there is no network here), junk and missing paths.
        {"good": st.one_of(st.just(SMALL), st.tuples(st.integers(2, 80), st.integers(1, 40), st.integers(16, 40),
                                                     st.integers(2, 12)).map(
            lambda t: f"synthetic:train={t[0]},test={t[1]},shape=3x{t[2]}x{t[2]},classes={t[3]}")),
         "bad": st.one_of(
             st.tuples(st.integers(-3, 0), st.integers(-2, 40), st.integers(0, 40), st.integers(-1, 12)).map(
                 lambda t: f"synthetic:train={t[0]},test={t[1]},shape=3x{t[2]}x{t[2]},classes={t[3]}"),
             st.tuples(st.integers(1, 80), st.integers(-2, 0), st.integers(0, 8), st.integers(-1, 1)).map(
                 lambda t: f"synthetic:train={t[0]},test={t[1]},shape=3x{t[2]}x{t[2]},classes={t[3]}"),
             st.sampled_from(["cifar10", "cifar100", "mnist", "fashion-mnist", "kmnist", "synthetic:train=10**12",
                              "synthetic:train=1000000000000", "synthetic:shape=3x9", "y" * 300]),
             missing),
         "either": st.text(max_size=20).map(lambda t: "synthetic:" + t)},
        {"good": st.one_of(st.just(None), st.floats(0.05, 3.0).map(lambda e: f"{e:.3f}")),
         "bad": st.sampled_from(["0", "-1", "nan", "inf", "-inf", "1e300", "x", ""])},
        {"good": st.one_of(st.just(None), st.integers(1, 3).map(str)), "bad": st.sampled_from(["0", "-2", "1.5", "x"])},
        {"good": st.one_of(st.just(None), st.integers(0, 2**31).map(str)),
         "bad": st.sampled_from(["-1", "x", str(2**70)])},
        {"good": st.sampled_from(["cpu", "auto"]), "bad": st.sampled_from(["cuda", "cuda:3", "mps", "tpu", ""])},
        # No dataset here is an image folder, so any --image-size is refused.
        {"good": st.just(None), "bad": st.integers(-5, 5000).map(str)},
        _set_parts(), _set_parts(), _set_parts(),
        {"good": st.sampled_from([[], ["--quiet"], ["--smoke"], ["--quiet", "--smoke"]]),
         "bad": st.sampled_from([["--bogus"], ["-x"], ["--epoch", "1"], ["--runs"]])},
        {"good": st.just(json_paths["fresh"]), "bad": st.sampled_from(sorted(set(json_paths) - {"fresh"})).map(
            json_paths.get)},
        # Checkpoints and resume (a fresh folder; `auto` in an empty one starts afresh).
        {"good": st.sampled_from([[], ["--checkpoint-dir", ckpt], ["--checkpoint-dir", ckpt, "--resume", "auto"],
                                  ["--checkpoint-dir", ckpt, "--checkpoint-every", "3", "--keep-checkpoints", "1"]]),
         "bad": st.sampled_from([["--resume", "auto"], ["--checkpoint-every", "5"], ["--checkpoint-dir", ""],
                                 ["--checkpoint-dir", ckpt, "--checkpoint-every", "0"],
                                 ["--checkpoint-dir", ckpt, "--keep-checkpoints", "0"],
                                 ["--checkpoint-dir", json_paths["existing"]],
                                 ["--resume", os.path.join(root, "none.safetensors")],
                                 ["--resume", json_paths["existing"]], ["--resume", ""]])},
        {"good": st.sampled_from([[], ["--save", os.path.join(root, "model")]]),
         "bad": st.sampled_from([["--save", json_paths["existing"]], ["--save", root], ["--save", ""]])},
    ]


FLAGS = [None, "--dataset", "--epochs", "--runs", "--seed", "--device", "--image-size", None, None, None, None,
         "--json", None, None]  # the flag before each part's value (None: the part is its own tokens)


@st.composite
def commands(draw, root):
    """(argv, expected): expected is "refusal", "run" or "either". Modes: every part good; exactly one bad; wild."""
    parts = _parts(root)
    mode = draw(st.sampled_from(["clean", "one_bad", "wild"]))
    bad_index = draw(st.integers(0, len(parts) - 1))
    argv, verdicts, values = ["train"], [], []
    for i, (flag, options) in enumerate(zip(FLAGS, parts)):
        if mode == "clean":
            verdict = "good"
        elif mode == "one_bad":
            verdict = "bad" if i == bad_index else "good"
        else:
            verdict = draw(st.sampled_from(sorted(options)))
        value = draw(options[verdict])
        verdicts.append(verdict)
        values.append(value if isinstance(value, list) else [])
        if flag is None:
            argv += value
        elif value is not None:
            argv += [flag, value]
    # A repeated --set key takes its last value, so an earlier value of a config key is never parsed.
    sets = [(i, argv_part[1].partition("=")[0].strip()) for i, argv_part in enumerate(values)
            if argv_part and argv_part[0] == "--set" and "=" in argv_part[1]]
    for i, key in sets:
        if key in FIELDS and any(j > i and k == key for j, k in sets):
            verdicts[i] = "good"
    expected = "refusal" if "bad" in verdicts else "run" if set(verdicts) == {"good"} else "either"
    return argv, expected


def _checking_run(started: list):
    def run(cfg, data, device, seed, **kwargs):
        # What must hold for every run that starts, checked here without the code under test's own checks.
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            assert not (isinstance(value, float) and not math.isfinite(value)), (f.name, value)
        cfg.validate()
        c, h, w = data.image_shape
        assert output_side(min(h, w), cfg.widths, cfg.whiten_kernel_px) >= 1
        assert len(data.train_labels) >= 1 and len(data.test_labels) >= 1 and data.num_classes >= 2
        assert int(data.train_labels.max()) < data.num_classes and int(data.train_labels.min()) >= 0
        assert cfg.translate_px < min(h, w)
        started.append(seed)
        return RunResult(seed=seed, accuracy=0.5, train_seconds=0.01, epochs=cfg.epochs, steps=1)
    return run


# SPEEDRUN_HYPOTHESIS_EXAMPLES=5000 for a longer search than CI's.
@pytest.mark.slow
@settings(max_examples=int(os.environ.get("SPEEDRUN_HYPOTHESIS_EXAMPLES", "300")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_input_either_runs_or_is_one_line_exit_2(data):
    with tempfile.TemporaryDirectory() as root, _patched(root) as started:
        with open(os.path.join(root, "existing.json"), "w") as f:
            f.write("keep me")
        argv, expected = data.draw(commands(root))
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse's errors leave through SystemExit
                code = e.code
        err_text = err.getvalue()
        event(f"exit {code}, expected {expected}")
        assert "Traceback" not in err_text, err_text
        if code == 0:
            assert started, (argv, err_text)
            assert expected != "refusal", (argv, "should have been refused")
        else:
            lines = err_text.splitlines()
            assert code == 2, (argv, code, err_text)
            assert len(lines) == 1 and lines[0].startswith("speedrun"), (argv, err_text)
            assert not started, (argv, "a run started before the refusal")
            assert expected != "run", (argv, err_text)
        with open(os.path.join(root, "existing.json")) as f:
            assert f.read() == "keep me"  # never replaced


@contextlib.contextmanager
def _patched(root):
    """Recorder runs, no warm-up, no network, caches and results inside `root`."""
    started: list = []
    saved = (cifar.train_run, cifar.warmup)
    env = {k: os.environ.get(k) for k in ("SPEEDRUN_DATA", "SPEEDRUN_RESULTS")}
    real_urlopen = urllib.request.urlopen

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network in tests")

    try:
        cifar.train_run, cifar.warmup = _checking_run(started), lambda *a, **k: 0.0  # every recipe's family
        os.environ["SPEEDRUN_DATA"] = os.path.join(root, "cache")
        os.environ["SPEEDRUN_RESULTS"] = os.path.join(root, "results")
        urllib.request.urlopen = offline
        yield started
    finally:
        cifar.train_run, cifar.warmup = saved
        urllib.request.urlopen = real_urlopen
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
