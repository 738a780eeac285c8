"""Settings files (`train --settings FILE`, $SPEEDRUN_SETTINGS) from elsewhere: every refusal a file's value causes
names the file, where it came from, the key and the fix; a file holds only the performance settings `speedrun tune`
measures; the run says which file it applied and what it set; the version is exactly the int 1; a byte order mark
is read."""

from __future__ import annotations

import json

import pytest
import torch

from speedrun.cli.program import main
from speedrun.data import limits
from speedrun.instruments import tune as doctor
from speedrun.recipes import get_recipe
from speedrun.records import settings_file
from speedrun.records.settings_file import KEYS, read_settings, write_settings

TINY = ["--dataset", "synthetic:train=256,test=64", "--device", "cpu", "--epochs", "0.5",
        "--set", "widths=8,16,16", "--set", "whiten_images=32", "--set", "tta_level=0"]


def _file(path, **values):
    return write_settings(path, recipe="cifar10-94", device="cpu", device_name=None, settings=values,
                          measured={"command": "speedrun tune"})


def _refusal(capsys, argv, tmp_path) -> str:
    out = tmp_path / "r.json"
    assert main(["train", *TINY, *argv, "--json", str(out), "--db", str(tmp_path / "db")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("speedrun: error: "), err
    assert not out.exists()  # refused before the result was claimed
    return err[0]


@pytest.mark.parametrize("key,value", [("batch_size", "-1"), ("batch_size", "70000"), ("eval_batch_size", "0"),
                                       ("cpu_threads", "-5"), ("precision", "fp64"), ("compile", "maybe"),
                                       ("channels_last", "sideways")])
@pytest.mark.parametrize("from_environment", [False, True])
def test_a_bad_value_in_a_settings_file_names_the_file_its_source_the_key_and_the_fix(key, value, from_environment,
                                                                                     tmp_path, capsys,
                                                                                     monkeypatch):
    path = _file(tmp_path / "s.json", **{key: value})
    if from_environment:
        monkeypatch.setenv("SPEEDRUN_SETTINGS", str(path))
        line = _refusal(capsys, [], tmp_path)
        assert f"settings file {path} ($SPEEDRUN_SETTINGS)" in line and "unset SPEEDRUN_SETTINGS" in line
    else:
        monkeypatch.delenv("SPEEDRUN_SETTINGS", raising=False)
        line = _refusal(capsys, ["--settings", str(path)], tmp_path)
        assert f"settings file {path} (--settings)" in line and "leave out --settings" in line
    assert key in line and "edit the file" in line


def test_a_refusal_after_the_settings_are_checked_names_the_file_too(tmp_path, capsys, monkeypatch):
    # A batch that passes the config's ranges but not this machine's memory (a file tuned on a bigger device):
    # the family's check refuses it, and the line says the batch came from the file.
    monkeypatch.delenv("SPEEDRUN_SETTINGS", raising=False)
    monkeypatch.setattr(limits, "available_memory_bytes", lambda: 400 * 2**20)
    path = _file(tmp_path / "s.json", batch_size="60000")
    line = _refusal(capsys, ["--settings", str(path)], tmp_path)
    assert "would take" in line and f"batch_size=60000 from settings file {path} (--settings)" in line
    assert "edit the file, or leave out --settings" in line
    # The same refusal with the batch given by --set names no settings file: --set wins over the file.
    line = _refusal(capsys, ["--settings", str(path), "--set", "batch_size=60001"], tmp_path)
    assert "would take" in line and "settings file" not in line


@pytest.mark.parametrize("key,value", [("epochs", "0.01"), ("target_accuracy", "0.05"), ("tta_level", "0"),
                                       ("label_smoothing", "0.1"), ("lookahead", "false"), ("widths", "8,8,8")])
def test_a_settings_file_may_hold_only_tunes_performance_settings(key, value, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPEEDRUN_SETTINGS", raising=False)
    path = _file(tmp_path / "s.json", optimizer_kernel="foreach", **{key: value})
    line = _refusal(capsys, ["--settings", str(path)], tmp_path)
    assert f"settings file {path} (--settings): {key} is not a performance setting" in line
    assert "remove it from the file" in line and f"--set {key}=" in line and "leave out --settings" in line
    path = _file(tmp_path / "u.json", warp_speed="9")
    line = _refusal(capsys, ["--settings", str(path)], tmp_path)
    assert "unknown config key 'warp_speed'" in line and "remove it from the file" in line


def test_the_keys_a_settings_file_may_hold_are_the_ones_tune_measures():
    assert KEYS == set(doctor.GUIDE) | {"compile_mode"}
    for recipe in ("cifar10-94", "imagenet-debug"):
        for _, overrides in doctor.candidates(get_recipe(recipe).make_config(), torch.device("cpu")):
            assert set(overrides) <= KEYS, overrides


def test_the_run_says_which_settings_file_it_applied_and_what_it_set(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPEEDRUN_SETTINGS", raising=False)
    path = _file(tmp_path / "s.json", optimizer_kernel="foreach", eval_batch_size="32", batch_size="64")
    out = tmp_path / "r.json"
    assert main(["train", *TINY, "--smoke", "--settings", str(path), "--set", "batch_size=32", "--json", str(out),
                 "--db", str(tmp_path / "db")]) == 0
    err = capsys.readouterr().err
    assert (f"settings: {path} (--settings) applied: optimizer_kernel=foreach, eval_batch_size=32 "
            "(--set gave batch_size)") in err
    r = json.loads(out.read_text())
    assert r["config"]["optimizer_kernel"] == "foreach" and r["config"]["batch_size"] == 32
    assert r["settings"]["file"] == str(path) and r["settings"]["source"] == "--settings"
    assert r["settings"]["settings"] == {"optimizer_kernel": "foreach", "eval_batch_size": "32", "batch_size": "64"}


@pytest.mark.parametrize("version", ["true", "1.0", '"1"', "2", "0", "null", "[1]"])
def test_the_settings_version_is_exactly_the_int_1(version, tmp_path):
    path = tmp_path / "s.json"
    path.write_text(f'{{"speedrun_settings": {version}, "recipe": "cifar10-94", "device": "cpu", "settings": {{}}}}')
    with pytest.raises(ValueError, match="not a speedrun settings file"):
        read_settings(path)
    path.write_text('{"recipe": "cifar10-94", "device": "cpu", "settings": {}}')
    with pytest.raises(ValueError, match="not a speedrun settings file"):
        read_settings(path)


def test_a_byte_order_mark_is_read_and_other_encodings_are_not(tmp_path):
    text = '{"speedrun_settings": 1, "recipe": "cifar10-94", "device": "cpu", "settings": {"batch_size": "64"}}'
    path = tmp_path / "s.json"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert read_settings(path)["settings"] == {"batch_size": "64"}
    assert settings_file.overrides_from(path, "cifar10-94", "cpu")[0] == {"batch_size": "64"}
    for encoding in ("utf-16", "utf-32"):  # a BOM of another encoding is not UTF-8
        path.write_bytes(text.encode(encoding))
        with pytest.raises(ValueError, match="not JSON"):
            read_settings(path)
    path.write_bytes(b"\xef\xbb\xbf\xef\xbb\xbf" + text.encode())  # one mark, not two
    with pytest.raises(ValueError, match="not JSON"):
        read_settings(path)
