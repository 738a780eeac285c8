"""Names from elsewhere travel through messages as they are and are escaped where they are shown: an ESC, a control
sequence or a newline in a file, folder or dataset name reaches the terminal escaped, on its line, whether it is in
(a) an error raised deep in the library, (b) a warning, (c) a progress line of `speedrun train` or its summary, or
(d) a cell of a table that a file command prints."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import numpy as np
from PIL import Image
from test_db import make_result
from test_hostile_folder import _folder

from speedrun import errors
from speedrun.cli.program import main
from speedrun.run.display import Display

HOSTILE = "a\x1b[31m\x1b]0;owned\x07\nb"  # colour red, retitle the window, then a new line
SHOWN = errors.printable(HOSTILE)


def _clean(text: str, lines: int) -> None:
    """`text` is `lines` lines, each of printable characters only (no ESC, BEL or stray newline)."""
    assert text.count("\n") == lines and text.endswith("\n"), text
    assert all(line.isprintable() for line in text.split("\n")), text


def test_the_escaped_form_shows_every_character():
    assert SHOWN == "a\\x1b[31m\\x1b]0;owned\\x07\\nb"


def test_a_library_error_names_the_file_escaped_on_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    root = _folder(tmp_path / "pics")
    (root / "train" / "a" / f"{HOSTILE}.png").write_bytes(b"not an image")  # refused by folder.open_image
    code = main(["train", "--dataset", str(root), "--device", "cpu", "--epochs", "0.5", "--json",
                 str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("speedrun: error: ") and f"{SHOWN}.png is not a JPEG or PNG image" in err
    _clean(err, 1)


def test_a_library_error_in_a_path_the_user_gave_is_escaped(tmp_path, capsys):
    code = main(["data", "prepare", str(tmp_path / HOSTILE), str(tmp_path / "dst")])
    err = capsys.readouterr().err
    assert code == 2 and f"SRC {tmp_path}/{SHOWN} does not exist" in err
    _clean(err, 1)


def test_a_warning_is_escaped_on_its_line(tmp_path, capsys):
    src = tmp_path / "src"
    for name in ("ok", HOSTILE):
        (src / name).mkdir(parents=True)
    Image.fromarray(np.full((8, 8, 3), 90, np.uint8)).save(src / "ok" / "1.png")
    assert main(["data", "prepare", str(src), str(tmp_path / "dst"), "--workers", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("speedrun: warning: ") and f"class folder {SHOWN} holds no images" in captured.err
    _clean(captured.err, 2)  # and one that train refuses shards of class folders without split folders
    _clean(captured.out, captured.out.count("\n"))


def test_a_warning_is_escaped_for_a_python_caller_too():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        errors.warn(f"cache {HOSTILE} is unreadable")
    assert [str(w.message) for w in caught] == [f"cache {SHOWN} is unreadable"]


def test_a_display_line_is_escaped_held_or_not(capsys):
    show = Display(verbose=True)
    show.line(f"decoding 4 images from {HOSTILE} [bold]as typed[/bold]")  # held until release()
    show.release()
    show.line(f"loaded {HOSTILE} from cache")
    show.close()
    err = capsys.readouterr().err
    assert err.splitlines() == [f"decoding 4 images from {SHOWN} [bold]as typed[/bold]", f"loaded {SHOWN} from cache"]
    _clean(err, 2)


def test_the_summary_title_is_escaped_and_not_read_as_markup(capsys):
    run = SimpleNamespace(train_seconds=1.5)
    result = SimpleNamespace(recipe="cifar10-94", dataset=f"{HOSTILE}[/x]", device="cpu", finished=[run],
                             runs=[run], accuracies=[0.9], smoke_test=False, target_accuracy=0.94, diverged_runs=0,
                             interrupted=False, runs_requested=1, timed_region="the training steps",
                             data_seconds=0.1, warmup_seconds=0.2)
    Display(verbose=False, summary=True).summary(result)
    out = capsys.readouterr().out
    assert f"cifar10-94 on {SHOWN}[/x] (cpu), n=1" in out
    _clean(out, out.count("\n"))


def test_a_table_cell_and_a_file_name_of_a_file_command_are_escaped(tmp_path, capsys):
    path = tmp_path / f"{HOSTILE}.json"
    path.write_text(json.dumps(make_result(dataset=HOSTILE)))
    database = str(tmp_path / "r.db")
    assert main(["results", "import", str(path), "--db", database]) == 0
    out = capsys.readouterr().out
    assert out == f"imported {tmp_path}/{SHOWN}.json as #1\n"
    assert main(["results", "--db", database]) == 0
    out = capsys.readouterr().out
    _clean(out, 2)  # the header and the one row
    assert f" {SHOWN} " in out.splitlines()[1]
