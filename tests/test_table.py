"""benchmarks/table.py: BENCHMARKS.md rows come from stored result JSONs."""

import importlib.util
from pathlib import Path

from speedrun.cli import main as speedrun_main

spec = importlib.util.spec_from_file_location("table", Path(__file__).parents[1] / "benchmarks" / "table.py")
table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table)


def test_rows_are_generated_between_the_markers(tmp_path):
    result = tmp_path / "r.json"
    assert speedrun_main(["train", "--dataset", "synthetic:train=64,test=16", "--device", "cpu", "--epochs", "0.5",
                          "--runs", "2", "--set", "batch_size=32", "--set", "widths=8,8,8", "--set",
                          "whiten_images=32", "--json", str(result), "--quiet"]) == 0
    doc = tmp_path / "B.md"
    doc.write_text(f"# title\n{table.BEGIN}\nold\n{table.END}\ntail\n")
    assert table.main(["--write", str(doc), str(result)]) == 0
    text = doc.read_text()
    assert "old" not in text and text.startswith("# title\n") and text.endswith("tail\n")
    row = [line for line in text.splitlines() if "synthetic" in line]
    assert len(row) == 1 and "| 2 |" in row[0] and "cpu: " in row[0] and "`speedrun train --dataset" in row[0]


def test_missing_markers_and_bad_files_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert table.main([str(bad)]) == 2
    doc = tmp_path / "B.md"
    doc.write_text("no markers")
    good = tmp_path / "r.json"
    speedrun_main(["train", "--dataset", "synthetic:train=32,test=8", "--device", "cpu", "--epochs", "1",
                   "--set", "batch_size=32", "--set", "widths=8,8,8", "--set", "whiten_images=16",
                   "--json", str(good), "--quiet"])
    assert table.main(["--write", str(doc), str(good)]) == 2
    assert doc.read_text() == "no markers"
    assert all(line.startswith("table: error:") for line in capsys.readouterr().err.strip().splitlines())
