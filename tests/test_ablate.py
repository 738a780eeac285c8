"""`speedrun ablate`: every registered trick, each variant differing from the baseline in exactly its switch."""

import json

import pytest
import torch

from speedrun.cli.program import main
from speedrun.engine.system import resolve_system
from speedrun.recipes import cifar

# the 2025 record's switches (cifar10-94-hiverge), off in cifar10-94
RECORD_2025 = {"tta_select", "activation", "whiten_method", "jitter_brightness", "jitter_contrast",
               "muon_ns_batched", "muon_renorm_every_steps"}
TINY = ["--dataset", "synthetic:train=256,test=32", "--device", "cpu", "--epochs", "1", "--set", "batch_size=64",
        "--set", "widths=8,16,16", "--set", "whiten_images=64"]


@pytest.mark.slow
def test_ablate_lists_every_registered_trick_and_switches_exactly_one(tmp_path, capsys):
    out = tmp_path / "ablate.json"
    assert main(["ablate", *TINY, "--runs", "2", "--db", str(tmp_path / "r.db"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert sorted(r["trick"] for r in report["tricks"]) == sorted(key for key, _, _ in cifar.TRICKS)
    base = cifar.cifar10_94()
    # cutout, compile and the 2025 record's switches are off in the recipe; bf16 autocast is off on a CPU without
    # native bf16 (precision=auto is fp32 there) and on with it
    fp32_here = resolve_system(base, torch.device("cpu")).precision == "fp32"
    already = {key for key, off, _ in cifar.TRICKS if getattr(base, key) == off} | ({"precision"} if fp32_here
                                                                                     else set())
    already |= set() if resolve_system(base, torch.device("cpu")).half_weights else {"half_weights"}
    # half weights are on only at fp16 on CUDA; pooling without indices and Muon's compile are off in the recipe
    assert already == {"cutout_px", "compile", *RECORD_2025, "half_weights", "index_free_eval_pool",
                       "muon_ns_compile"} | ({"precision"} if fp32_here else set())
    assert {r["trick"] for r in report["tricks"] if not r["measured"]} == already
    baseline = report["results"][0]["config"]
    for setting, result in zip(report["settings"][1:], report["results"][1:]):
        changed = {k for k in baseline if baseline[k] != result["config"][k]}
        key = setting["name"].split("=")[0]
        assert changed == {key}, (key, changed)
        off = dict((k, o) for k, o, _ in cifar.TRICKS)[key]
        assert result["config"][key] == off
    measured = [r for r in report["tricks"] if r["measured"]]
    gains = [r["gain_accuracy"] for r in measured]
    assert gains == sorted(gains, reverse=True)  # sorted by contribution
    text = capsys.readouterr().out
    assert all(r["trick"] in text for r in report["tricks"])


def test_the_waterfall_adds_one_trick_per_row_and_ends_at_the_recipe(tmp_path, capsys):
    out = tmp_path / "w.json"
    order = ["whiten_init", "lookahead", "tta_level"]
    assert main(["ablate", *TINY, "--runs", "2", "--waterfall", ",".join(order), "--db", str(tmp_path / "r.db"),
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    configs = [r["config"] for r in report["results"]]
    assert [row["step"] for row in report["waterfall"]] == ["plain (all off)", *(f"+ {k}" for k in order)]
    offs = {key: off for key, off, _ in cifar.TRICKS}
    assert all(configs[0][key] == offs[key] for key in order)
    for key, before, after in zip(order, configs, configs[1:]):
        assert {k for k in before if before[k] != after[k]} == {key}
    recipe = {k: v for k, v in configs[-1].items()}
    assert recipe["whiten_init"] is True and recipe["lookahead"] is True and recipe["tta_level"] == 2
    assert all(row["bought"] is not None for row in report["waterfall"][1:])
    assert {r["kind"] for r in report["results"]} == {"waterfall"}
    for bad, fragment in (("nope", "unknown or repeated"), ("lookahead,lookahead", "unknown or repeated"),
                          ("cutout_px", "already off")):
        capsys.readouterr()
        assert main(["ablate", *TINY, "--waterfall", bad, "--db", str(tmp_path / "r.db")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and fragment in err
