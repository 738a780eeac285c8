"""`speedrun ablate`: every registered trick, each variant differing from the baseline in exactly its switch."""

import json

from speedrun.cli import main
from speedrun.recipes import cifar

TINY = ["--dataset", "synthetic:train=256,test=32", "--device", "cpu", "--epochs", "1", "--set", "batch_size=64",
        "--set", "widths=8,16,16", "--set", "whiten_images=64"]


def test_ablate_lists_every_registered_trick_and_switches_exactly_one(tmp_path, capsys):
    out = tmp_path / "ablate.json"
    assert main(["ablate", *TINY, "--runs", "2", "--db", str(tmp_path / "r.db"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert sorted(r["trick"] for r in report["tricks"]) == sorted(key for key, _, _ in cifar.TRICKS)
    base = cifar.cifar10_94()
    already = {key for key, off, _ in cifar.TRICKS if getattr(base, key) == off}  # cutout and compile
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
