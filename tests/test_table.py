"""benchmarks/table.py: BENCHMARKS.md rows come from stored result JSONs."""

from pathlib import Path

from conftest import load_benchmark
from speedrun.cli.program import main as speedrun_main

table = load_benchmark("table")


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


def _step_time_report(path):
    assert load_benchmark("step_time").main(["--device", "cpu", "--batch-size", "4", "--steps", "2", "--variant", "widths=8,8,8",
                    "--variant", "widths=8,8,8 channels_last=off", "--out", str(path)]) == 0


def test_each_kind_goes_to_its_own_section_and_others_stay(tmp_path, capsys):
    train = tmp_path / "train.json"
    assert speedrun_main(["train", "--dataset", "synthetic:train=32,test=8", "--device", "cpu", "--epochs", "1",
                          "--set", "batch_size=32", "--set", "widths=8,8,8", "--set", "whiten_images=16",
                          "--json", str(train), "--quiet"]) == 0
    steps = tmp_path / "steps.json"
    _step_time_report(steps)
    doc = tmp_path / "B.md"
    vs_begin, vs_end = table.markers("vs_airbench")
    st_begin, st_end = table.markers("step_time")
    doc.write_text(f"{table.BEGIN}\nold\n{table.END}\n{vs_begin}\nkept\n{vs_end}\n{st_begin}\nold\n{st_end}\n")
    capsys.readouterr()
    assert table.main(["--write", str(doc), str(train), str(steps)]) == 0
    text = doc.read_text()
    assert "old" not in text and "kept" in text  # no vs_airbench result given: its section is left alone
    results = text.split(table.BEGIN)[1].split(table.END)[0]
    assert "synthetic" in results and "| 1 | " in results and "n/a (n = 1)" in results  # one run: no spread
    step_rows = [line for line in text.split(st_begin)[1].split(st_end)[0].splitlines() if line.startswith("| 20")]
    assert len(step_rows) == 2 and step_rows[0].endswith("| 1 (reference) |")


def test_a_missing_section_leaves_the_file_untouched(tmp_path, capsys):
    steps = tmp_path / "steps.json"
    _step_time_report(steps)
    doc = tmp_path / "B.md"
    doc.write_text(f"{table.BEGIN}\nold\n{table.END}\n")
    capsys.readouterr()
    assert table.main(["--write", str(doc), str(steps)]) == 2
    assert doc.read_text() == f"{table.BEGIN}\nold\n{table.END}\n"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "<!-- step_time:begin -->" in err[0]


def test_unknown_benchmark_kind_is_a_one_line_error(tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text('{"benchmark": "mystery", "environment": {"timestamp_utc": "2026-01-01"}}')
    assert table.main([str(other)]) == 2
    assert "unknown benchmark 'mystery'" in capsys.readouterr().err


def test_smoke_tests_are_refused_and_diverged_runs_are_shown(tmp_path, capsys):
    base = ["train", "--dataset", "synthetic:train=64,test=16", "--device", "cpu", "--set", "batch_size=32",
            "--set", "widths=8,8,8", "--set", "whiten_images=32", "--quiet"]
    smoke, diverged = tmp_path / "smoke.json", tmp_path / "diverged.json"
    assert speedrun_main([*base, "--smoke", "--json", str(smoke)]) == 0
    assert table.main([str(smoke)]) == 2
    assert "is not a result" in capsys.readouterr().err
    assert speedrun_main([*base, "--epochs", "1", "--set", "precision=fp16", "--set", "logit_scale=10000",
                          "--json", str(diverged)]) == 3
    assert table.main([str(diverged)]) == 0
    assert "| 0 | all 1 run diverged | n/a | n/a | n/a |" in capsys.readouterr().out


def test_every_stored_file_renders_and_speedruns_own_reports_are_left_to_it():
    """The README's command over every file in benchmarks/results: each kind has its table (shard formats and
    bench-loader included); ablate and waterfall reports are `speedrun report --benchmarks`'s, not this script's."""
    files = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results").rglob("*.json"))
    sections = table.tables(files)
    assert {"results", "vs_airbench", "step_time", "ab_commits", "shard_formats", "bench_loader"} <= set(sections)
    assert not set(sections) & set(table.SPEEDRUN_REPORTS)
    rows = [line for line in sections["shard_formats"].splitlines() if line.startswith("| 20")]
    assert [row.split(" | ")[3] for row in rows] == ["webdataset", "litdata", "indexed-tar"]
