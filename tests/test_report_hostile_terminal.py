"""Text from outside that reaches the terminal is escaped (errors.printable): an ESC, a BEL or a newline in the
SPEEDRUN_PRICES table (its path, a device-name key, a value) or in a device's name reaches stdout and stderr as an
escape, whether the command refuses it (one line) or runs with it (the train table, `results`, `report`), and the
result stores the price's source escaped. The CLI runs in-process; a Python caller's refusal is escaped too."""

import json
from types import SimpleNamespace

import pytest
from test_cost import SMALL

import speedrun
from speedrun import errors
from speedrun.cli.program import main
from speedrun.records import cost
from speedrun.records import environment as environment_module
from speedrun.run.display import Display

HOSTILE = "a\x1b[31m\x1b]0;owned\x07\nb"  # colour red, retitle the window, then a new line
SHOWN = errors.printable(HOSTILE)
QUIET = [arg for arg in SMALL if arg != "--quiet"]  # the progress lines and the table shown too


def clean(captured) -> str:
    """stdout and stderr together, after checking that neither holds a control character but its line ends."""
    for text in (captured.out, captured.err):
        assert all(line.isprintable() for line in text.split("\n")), text
    return captured.out + captured.err


@pytest.fixture
def hostile_dir(tmp_path):
    folder = tmp_path / HOSTILE
    folder.mkdir()
    return folder


TABLES = [  # (what, file name, its text): each refused in one escaped line naming it
    ("a key's value out of range", "prices.json", json.dumps({HOSTILE: -1})),
    ("not JSON", "prices.json", "{" + HOSTILE),
    ("not an object", "prices.json", json.dumps([HOSTILE])),
    ("an empty key", "prices.json", json.dumps({"": 1.0, HOSTILE: 1.0})),
    ("a value that is text", "prices.json", json.dumps({"H100": HOSTILE})),
    ("a missing file", f"{HOSTILE}.json", None),
]


@pytest.mark.parametrize("what, name, text", TABLES, ids=[t[0] for t in TABLES])
def test_a_refused_price_table_is_one_escaped_line(hostile_dir, tmp_path, capsys, monkeypatch, what, name, text):
    path = hostile_dir / name
    if text is not None:
        path.write_text(text)
    monkeypatch.setenv("SPEEDRUN_PRICES", str(path))
    assert main(["train", *QUIET, "--json", str(tmp_path / "r.json"), "--db", str(tmp_path / "r.db")]) == 2
    shown = clean(capsys.readouterr())
    assert shown.count("\n") == 1 and shown.startswith("speedrun: error: SPEEDRUN_PRICES")
    assert SHOWN.split("\\n")[0] in shown  # the name, escaped
    assert not (tmp_path / "r.json").exists()


def test_a_python_caller_gets_the_refusal_escaped(hostile_dir, tmp_path, monkeypatch):
    (hostile_dir / "prices.json").write_text(json.dumps({HOSTILE: -1}))
    monkeypatch.setenv("SPEEDRUN_PRICES", str(hostile_dir / "prices.json"))
    with pytest.raises(ValueError) as refused:
        speedrun.train("cifar10-94", dataset="synthetic:train=64,test=16", device="cpu", epochs=1,
                       db=str(tmp_path / "r.db"))
    assert str(refused.value).isprintable() and SHOWN.split("\\n")[0] in str(refused.value)


def test_a_hostile_price_table_and_device_name_reach_no_terminal_raw(hostile_dir, tmp_path, capsys, monkeypatch):
    """A table whose key matches a device named with control characters: the run is priced, and what train, results
    and report show, and what the result stores as the price's source, are escaped."""
    table = hostile_dir / "prices.json"
    table.write_text(json.dumps({HOSTILE: 3.6, f"other{HOSTILE}": 1.0}))
    monkeypatch.setenv("SPEEDRUN_PRICES", str(table))
    monkeypatch.setattr(environment_module, "_device_name", lambda device: f"CPU {HOSTILE} v2")
    database, out = str(tmp_path / "r.db"), tmp_path / "r.json"
    assert main(["train", *QUIET, "--json", str(out), "--db", database]) == 0
    clean(capsys.readouterr())
    result = json.loads(out.read_text())
    assert result["cost"]["price_per_hour"] == 3.6
    assert result["cost"]["price_source"] == f"SPEEDRUN_PRICES ({errors.printable(str(table))})"
    assert main(["results", "--db", database]) == 0
    assert f"CPU {SHOWN} v2" in clean(capsys.readouterr())
    assert main(["report", "--db", database, "--out", str(tmp_path / "r.html")]) == 0
    clean(capsys.readouterr())
    assert cost.price_for(f"CPU {HOSTILE} v2").source == result["cost"]["price_source"]


def test_the_summary_caption_is_escaped_and_not_read_as_markup(capsys):
    run = SimpleNamespace(train_seconds=1.5)
    result = SimpleNamespace(recipe="cifar10-94", dataset="d", device="cpu", finished=[run], runs=[run],
                             accuracies=[0.9], smoke_test=False, target_accuracy=0.94, diverged_runs=0,
                             interrupted=False, runs_requested=1, timed_region=f"steps {HOSTILE} [bold]x[/bold] [/]",
                             data_seconds=0.1, warmup_seconds=0.2)
    Display(verbose=False, summary=True).summary(result)
    shown = clean(capsys.readouterr())
    assert "[bold]x[/bold] [/]" in shown.replace("\n", "") and "\\x1b[31m" in shown
