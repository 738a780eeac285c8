"""Every chart `speedrun report` draws carries information (a user's report: learning "curves" of one dot a run,
leaderboards of random synthetic data beside real data, no chart for a `bench`). Each class is checked on what the
page really draws: every matplotlib figure is inspected as it is saved (no empty axes, no line of one point), and
the page says why a chart it leaves out is missing."""

import dataclasses
import re

import pytest
from test_report import TINY, make_result, with_curve

from speedrun.cli.program import main
from speedrun.recipes import RECIPES
from speedrun.records import db as db
from speedrun.report import charts, html
from speedrun.report import queries as rep

KINDS = ("accuracy_vs_time", "learning_curves", "ablation_bars", "waterfall", "epochs_bars", "settings")


@pytest.fixture
def drawn(monkeypatch):
    """[(chart function, its figure)] of every chart drawn while the test runs, each figure checked as it is saved:
    every axes shows a mark in data coordinates (a point, a bar), and every drawn line has two points or more (a
    target's or a baseline's axhline/axvline is no data)."""
    figures, current = [], [None]
    png = charts.png

    def checked_png(fig):
        for ax in fig.axes:
            lines = [line for line in ax.lines if line.get_transform() == ax.transData]
            marks = sum(len(line.get_xdata()) for line in lines) + len(ax.patches)
            assert marks > 0, f"{current[0]}: an empty axes ({ax.get_title() or fig.get_suptitle()})"
            for line in lines:
                if line.get_linestyle() not in ("None", "", " "):
                    assert len(set(line.get_xdata())) >= 2, f"{current[0]}: a line of one point"
        figures.append((current[0], fig))
        return png(fig)

    def recording(name, function):
        def draw(*args, **kwargs):
            current[0] = name
            return function(*args, **kwargs)
        return draw

    monkeypatch.setattr(charts, "png", checked_png)
    for name in KINDS:
        monkeypatch.setattr(charts, name, recording(name, getattr(charts, name)))
    return figures


def summary(mean, half, n=3):
    return {"n": n, "mean": mean, "std": half, "ci95_low": None if n < 2 else mean - half,
            "ci95_high": None if n < 2 else mean + half, "min": mean - half, "max": mean + half}


def bench_report(dataset="../data/cifar10", settings=None, benchmark="bench", command="speedrun bench x"):
    """A bench report as instruments/bench.py stores it: the baseline first, then each --vary setting."""
    settings = settings if settings is not None else [
        ("baseline", summary(0.94, 0.004), summary(3.8, 0.1), None),
        ("lookahead=false", summary(0.936, 0.006), summary(3.6, 0.1),
         {"accuracy": {"diff": -0.004, "ci95": [-0.01, 0.002], "p": 0.2},
          "train_seconds": {"ratio": 0.947, "ratio_ci95": [0.92, 0.97]}})]
    return {"benchmark": benchmark, "recipe": "cifar10-94", "dataset": dataset, "device": "cuda", "runs": 3,
            "complete": True, "interrupted": False, "command": command,
            "environment": {"timestamp_utc": "2026-11-20T12:00:00+00:00"},
            "settings": [{"name": name, "n": 0 if acc is None else acc["n"], "accuracy": acc, "train_seconds": secs,
                          "versus_baseline": versus} for name, acc, secs, versus in settings]}


def page_of(tmp_path, *stored) -> str:
    path = tmp_path / "r.db"
    with db.connect(path) as conn:
        for item in stored:
            db.insert_result(conn, item)
    out = tmp_path / "r.html"
    assert main(["report", "--db", str(path), "--out", str(out)]) == 0
    return out.read_text()


def chart_kinds(text: str) -> list[str]:
    return re.findall(r'data-chart="([^"]+)"', text)


# ---- learning curves: only where a run has more than its final point ---------------------------------------------


def test_results_evaluated_only_at_the_end_draw_no_curve_and_the_page_says_how_to_get_one(tmp_path, drawn):
    text = page_of(tmp_path, make_result(0, 0.93, 3.0), make_result(1, 0.94, 2.0),
                   make_result(2, 0.95, 1.0, dataset="other/data"))
    assert "learning-curves" not in chart_kinds(text) and "accuracy-vs-time" in chart_kinds(text)
    curves = text.split('id="curves"')[1].split("<h2")[0]
    assert "No learning curve is shown:" in curves and "--set eval_each_epoch=true" in curves
    assert [name for name, _ in drawn] == ["accuracy_vs_time"] * 2  # per dataset; no curve


def test_a_curve_is_drawn_where_a_run_has_two_epochs_and_only_its_results_are_on_it(tmp_path, drawn):
    text = page_of(tmp_path, with_curve(make_result(0, 0.93, 3.0)), make_result(1, 0.94, 2.0),
                   make_result(2, 0.95, 1.0, dataset="other/data"))
    assert chart_kinds(text).count("learning-curves") == 1
    (fig,) = [fig for name, fig in drawn if name == "learning_curves"]
    (ax,) = fig.axes
    assert len(ax.lines) == 1 and list(ax.lines[0].get_xdata()) == [1.0, 2.0, 3.0]
    note = text.split('id="curves"')[1].split("<h2")[0]
    assert "No learning curve is shown for data (cifar family):" in note  # the dataset without one is named


@pytest.mark.parametrize("epochs", [[], [1.0], [2.0, 2.0]])
def test_curves_of_fewer_than_two_epochs_are_not_drawn(epochs):
    curve = {"label": "x", "epochs": epochs, "accuracy": [0.5] * len(epochs)}
    assert charts.learning_curves("t", [curve]) is None and charts.learning_curves("t", []) is None


def test_the_setting_the_page_names_exists_in_every_recipe():
    """The note tells the user `--set eval_each_epoch=true`: every recipe's config must take that name."""
    assert "eval_each_epoch=true" in html.NO_CURVE_NOTE
    for name, recipe in RECIPES.items():
        assert "eval_each_epoch" in {f.name for f in dataclasses.fields(recipe.make_config())}, name


# ---- synthetic data: speed only, never beside real data's accuracy ----------------------------------------------

SYNTHETIC = ["synthetic", "synthetic:train=256,test=32", "Synthetic:train=64", " synthetic "]


def test_synthetic_results_are_off_the_accuracy_boards_and_charts_and_in_a_speed_section(tmp_path, drawn):
    real = [make_result(0, 0.93, 3.0), make_result(1, 0.94, 2.0)]
    fake = [make_result(10 + i, 0.99, 0.5 + i, dataset=name, command=f"speedrun train fake{i}")
            for i, name in enumerate(SYNTHETIC)]
    # a folder whose name starts so is real data: the loader reads images from it (data/sources.py's rule)
    folder = make_result(20, 0.9, 4.0, dataset="synthetic-faces/", command="speedrun train folder")
    text = page_of(tmp_path, *real, *fake, folder)
    boards = text.split('id="leaderboard"')[1].split("<h2")[0]
    speed = text.split('id="speed"')[1].split("<h2")[0]
    assert "fake" not in boards and "folder" in boards
    for i in range(len(SYNTHETIC)):
        assert f"speedrun train fake{i}" in speed
    assert "test acc" not in speed and "speed only" in speed.lower()
    points = [fig for name, fig in drawn if name == "accuracy_vs_time"]
    assert len(points) == 2  # the real datasets' charts only (cifar10-jpeg and the folder)
    assert all("synthetic:" not in fig.axes[0].get_title() and "synthetic (" not in fig.axes[0].get_title()
               for fig in points)


def test_the_readme_records_are_real_data_only(tmp_path):
    path, readme = tmp_path / "r.db", tmp_path / "README.md"
    with db.connect(path) as conn:
        db.insert_result(conn, make_result(0, 0.95, 3.0))  # reaches its 94% target: a record
        db.insert_result(conn, make_result(1, 0.99, 0.5, dataset="synthetic:train=256,test=32"))
    readme.write_text("<!-- records:begin -->\n<!-- records:end -->\n")
    assert main(["report", "--db", str(path), "--readme", str(readme)]) == 0
    table = readme.read_text()
    assert "cifar10-jpeg" in table and "synthetic" not in table


def test_only_synthetic_results_draw_no_accuracy_chart(tmp_path, drawn):
    text = page_of(tmp_path, *[make_result(i, 0.5, 1.0 + i, dataset="synthetic") for i in range(3)])
    assert chart_kinds(text) == [] and drawn == []
    assert 'id="speed"' in text and "No result on real data is stored yet." in text


@pytest.mark.parametrize("name, expected", [("synthetic", True), ("synthetic:train=1,test=1", True),
                                            (" SYNTHETIC:x ", True), ("synthetic-faces", False),
                                            ("data/synthetic", False), (None, False), (5, False)])
def test_what_counts_as_synthetic_is_the_loaders_rule(name, expected):
    assert rep.is_synthetic(name) is expected


# ---- bench and ablate: each setting's accuracy and time side by side ----------------------------------------------


def test_a_bench_report_draws_its_settings_with_intervals_and_the_baseline_marked(tmp_path, drawn):
    text = page_of(tmp_path, bench_report(), bench_report("synthetic", command="speedrun bench syn"))
    assert chart_kinds(text).count("settings") == 2
    real, fake = [fig for name, fig in drawn if name == "settings"][::-1]  # newest report first: the synthetic one
    assert [ax.get_xlabel().split(",")[0] for ax in real.axes] == ["test accuracy", "timed seconds per run"]
    assert [ax.get_xlabel().split(",")[0] for ax in fake.axes] == ["timed seconds per run"]  # speed only
    for ax in real.axes:
        assert len(ax.containers) == 2 and all(c.has_xerr for c in ax.containers)  # two settings, each its CI
        baseline = [line for line in ax.lines if line.get_transform() != ax.transData]  # the dashed line at its mean
        assert len(baseline) == 1 and baseline[0].get_linestyle() == "--"
    acc = real.axes[0]
    assert sorted(round(float(c[0].get_xdata()[0]), 2) for c in acc.containers) == [93.6, 94.0]  # means, in %
    section = text.split('id="ablation"')[1].split('id="reports"')[0]
    assert "93.60 (93.00 .. 94.20)" in section and "-0.40 (-1.00 .. +0.20)" in section
    assert "0.947 (0.920 .. 0.970)" in section and "3.80 (3.70 .. 3.90)" in section


def test_benches_of_different_settings_are_each_shown(tmp_path):
    other = bench_report(settings=[("baseline", summary(0.94, 0.004), summary(3.8, 0.1), None),
                                   ("precision=bf16", summary(0.93, 0.004), summary(2.0, 0.1), None)],
                         command="speedrun bench --vary precision=bf16")
    text = page_of(tmp_path, bench_report(), other)
    assert chart_kinds(text).count("settings") == 2 and "lookahead=false" in text and "precision=bf16" in text


BARREN = [  # (what, settings): nothing to put side by side in a panel, or at all
    ("every other setting diverged", [("baseline", summary(0.94, 0.004), summary(3.8, 0.1), None),
                                      ("lookahead=false", None, None, None)]),
    ("the baseline alone", [("baseline", summary(0.94, 0.004), summary(3.8, 0.1), None)]),
    ("no settings", []),
    ("implausible numbers", [("baseline", summary(5.0, 0.1), summary(-3.0, 0.1), None),
                             ("x=1", summary(float("1e300"), 0.1), summary(-1.0, 0.1), None)]),
]


@pytest.mark.parametrize("what, settings", BARREN, ids=[b[0] for b in BARREN])
def test_a_bench_without_two_settings_to_compare_draws_no_chart(tmp_path, drawn, what, settings):
    text = page_of(tmp_path, bench_report(settings=settings))
    assert "settings" not in chart_kinds(text) and not drawn


def test_one_run_a_setting_draws_means_without_error_bars(tmp_path, drawn):
    one = bench_report(settings=[("baseline", summary(0.94, 0.0, n=1), summary(3.8, 0.0, n=1), None),
                                 ("x=1", summary(0.93, 0.0, n=1), summary(3.0, 0.0, n=1), None)])
    assert chart_kinds(page_of(tmp_path, one)) == ["settings"]
    ((_, fig),) = drawn
    assert all(not c.has_xerr for ax in fig.axes for c in ax.containers)


def test_a_real_bench_is_drawn_from_what_it_stores(tmp_path, drawn):
    """What instruments/bench.py really stores is what the chart reads (speed only: synthetic data); test_report.py's
    filled_db does the same for a real ablation."""
    path = tmp_path / "r.db"
    assert main(["bench", *TINY, "--epochs", "0.5", "--set", "tta_level=0", "--vary", "lookahead=false", "--runs", "2",
                 "--db", str(path), "--json", str(tmp_path / "b.json")]) in (0, 3)  # 3: a tiny run diverged
    out = tmp_path / "r.html"
    assert main(["report", "--db", str(path), "--out", str(out)]) == 0
    assert chart_kinds(out.read_text()) == ["settings"]
    ((_, fig),) = drawn
    (ax,) = fig.axes
    assert ax.get_xlabel().startswith("timed seconds per run") and len(ax.containers) == 2


# ---- every other chart: nothing drawn from data that carries nothing ----------------------------------------------


def test_degenerate_reports_draw_nothing_empty(tmp_path, drawn):
    """An ablation with no measured trick, a waterfall of one step, a search with no probe: no chart for them, and
    every chart that is drawn passes the figure checks."""
    base = {"recipe": "cifar10-94", "dataset": "d", "device": "cpu", "runs": 2, "complete": True,
            "interrupted": False, "command": "c", "environment": {"timestamp_utc": "2026-11-20T12:00:00+00:00"}}
    reports = [{**base, "benchmark": "ablate", "tricks": [{"trick": "t", "measured": False}], "settings": []},
               {**base, "benchmark": "waterfall", "waterfall": [{"step": "plain", "accuracy": {"mean": 0.5}}]},
               {**base, "benchmark": "to_target", "variants": [{"name": "v", "probes": []}]}]
    text = page_of(tmp_path, *reports)
    assert chart_kinds(text) == [] and not drawn
    # a result whose summary states no times: the database takes them from its runs (every finished run has its
    # seconds), so its point is drawn, and passes the figure checks
    timeless = make_result(0, 0.9, 1.0, train_seconds={"mean": None, "std": None})
    assert chart_kinds(page_of(tmp_path / "t", timeless)) == ["accuracy-vs-time"]


@pytest.mark.parametrize("seconds, std, right", [(100.0, 0.0, 200.0), (3234.35, 0.0, 6468.7), (2.0, 3.0, 6.0),
                                                 (0.0, 0.0, 1.0)])
def test_a_single_time_gets_an_axis_from_zero_that_shows_its_size(drawn, seconds, std, right):
    """One point (or every point at one time): matplotlib's own limits would be 5% either side of it, an axis of a
    few seconds around a time of hundreds; from 0 to twice the time instead, wider where an error bar reaches."""
    point = {"recipe": "cifar10-94", "seconds": seconds, "std_seconds": std, "accuracy": 0.9, "std_accuracy": 0.01}
    assert charts.accuracy_vs_time("one result", [point], [0.94]) is not None
    ax = drawn[0][1].axes[0]
    assert ax.get_xlim() == pytest.approx((0.0, right)) and ax.get_xscale() == "linear"
    two = [point, {**point, "seconds": seconds + 50.0}]  # two times: the data sets the axis, as before
    charts.accuracy_vs_time("two results", two, [0.94])
    low, high = drawn[1][1].axes[0].get_xlim()
    assert low < seconds < seconds + 50.0 < high and (low, high) != pytest.approx((0.0, right))


def test_the_fingerprint_names_cuda_and_the_driver_on_a_gpu_only():
    row = {"commit": "0123456789abcdef", "dirty": True, "torch": "2.13.0+cpu", "cuda": None, "driver": None,
           "processes": 1, "device": "cpu"}
    assert rep.fingerprint_text(row) == "commit 0123456789+dirty · torch 2.13.0+cpu · 1 process"
    gpu = {**row, "torch": "2.13.0+cu128", "cuda": "12.8", "driver": "570.1", "processes": 8, "device": "cuda"}
    assert rep.fingerprint_text(gpu) == ("commit 0123456789+dirty · torch 2.13.0+cu128 · CUDA 12.8 · "
                                         "driver 570.1 · 8 processes")
