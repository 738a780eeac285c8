"""A command that stops leaves none of the empty folders it made (paths.tidy_folders, around every CLI command):
refused after its output folders were made, they are gone; folders it did not make, and folders holding a file,
stay."""

from __future__ import annotations

import pytest
from conftest import run_cli

from speedrun import paths

pytestmark = pytest.mark.usefixtures("in_tmp")

BAD_NET = """from torch import nn

def build(c, k, px):
    return nn.Sequential(nn.Flatten(), nn.Linear(c * px * px, 7))
"""


def test_a_refused_train_leaves_no_folder_it_made(tmp_path, capsys):
    (tmp_path / "bad.py").write_text(BAD_NET)
    (tmp_path / "mine").mkdir()  # the user's own folder: kept
    code, _, err = run_cli(["train", "--model", "bad.py:build", "--dataset", "synthetic:train=64,test=16",
                            "--device", "cpu", "--epochs", "1", "--checkpoint-dir", "ck/deep", "--json",
                            "out/r.json", "--tensorboard", "mine/tb"], capsys)
    assert code == 2 and "its network gives shape [2, 7]" in err, err
    # results.db: the results database ($SPEEDRUN_DB here) opened before the check, as every train opens it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.py", "mine", "results.db"]
    assert list((tmp_path / "mine").iterdir()) == []


def test_only_empty_folders_made_inside_the_block_go(tmp_path):
    (tmp_path / "old").mkdir()
    with pytest.raises(KeyboardInterrupt), paths.tidy_folders():
        paths.make_dirs(tmp_path / "a" / "b" / "c")
        paths.make_dirs(tmp_path / "old" / "new")
        paths.make_dirs(tmp_path / "kept" / "sub")
        (tmp_path / "kept" / "sub" / "result.json").write_text("{}")
        raise KeyboardInterrupt
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "kept", "kept/sub", "kept/sub/result.json", "old"]
    with paths.tidy_folders():  # a block that ends normally keeps what it made
        paths.make_dirs(tmp_path / "done")
    assert (tmp_path / "done").is_dir()
