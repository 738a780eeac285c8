"""The instruments for every recipe family and under torchrun: bench, ablate (its waterfall and --to-target)
on the imagenet family; under torchrun every process trains each run and rank 0 alone stores and writes; the
commands that do not train refuse to run as K copies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speedrun.records import db as db
from speedrun.cli.program import main
from speedrun.recipes import imagenet
from speedrun.recipes.imagenet import data as imagenet_checks

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return imagenet_checks.write_synthetic_shards(tmp_path_factory.mktemp("inet"), 320, 80)


@pytest.mark.slow
def test_bench_ablate_waterfall_and_to_target_run_on_the_imagenet_family(shards, tmp_path, capsys):
    tiny = ["imagenet-debug", "--dataset", str(shards), "--device", "cpu", "--epochs", "1", "--db",
            str(tmp_path / "r.db")]
    assert main(["bench", *tiny, "--runs", "2", "--vary", "label_smoothing=0.0", "--json", str(tmp_path / "b.json")]) == 0
    assert main(["ablate", *tiny, "--runs", "2", "--json", str(tmp_path / "a.json")]) == 0
    report = json.loads((tmp_path / "a.json").read_text())
    assert sorted(r["trick"] for r in report["tricks"]) == sorted(key for key, _, _ in imagenet.TRICKS)
    # channels_last=auto is contiguous on a CPU in this family (ImagenetConfig.CHANNELS_LAST_AUTO_ON_CPU): already
    # off, not measured against itself; likewise bf16 (precision=auto is fp32 on a CPU)
    assert {"channels_last", "precision"} <= {r["trick"] for r in report["tricks"] if not r["measured"]}
    assert main(["ablate", *tiny, "--runs", "2", "--waterfall", "zero_init_residual,flip",
                 "--json", str(tmp_path / "w.json")]) == 0
    assert main(["ablate", *tiny, "--runs", "1", "--to-target", "--max-probes", "2",
                 "--json", str(tmp_path / "t.json")]) == 0
    searched = json.loads((tmp_path / "t.json").read_text())
    # 1 epoch of 320 images at batch 64: 5 steps; each variant's first probe is the recipe's own count
    assert all(v["probes"][0]["steps"] == 5 for v in searched["variants"])
    assert len(searched["variants"]) == 1 + sum(r["measured"] for r in report["tricks"])
    with db.connect(tmp_path / "r.db") as conn:
        assert [r["kind"] for r in db.query_reports(conn)] == ["to_target", "waterfall", "ablate", "bench"]
    assert "epochs needed" in capsys.readouterr().out


def _torchrun(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", SPEEDRUN_DATA=str(cwd / "cache"), SPEEDRUN_RESULTS=str(cwd / "results"))
    return subprocess.run([*TORCHRUN, "-m", "speedrun", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_under_torchrun_each_run_is_the_jobs_and_rank_0_alone_stores_and_writes(shards, tmp_path):
    tiny = ["imagenet-debug", "--dataset", str(shards), "--device", "cpu", "--epochs", "1", "--db", "r.db"]
    # the default dataset in an empty cache: rank 0 writes the synthetic shards, then rank 1 reads them (both
    # writing at once renamed each other's files away: "No such file or directory: .../.train-00000.tar.tmp")
    assert not (tmp_path / "cache").exists()
    done = _torchrun(["bench", *tiny[:1], *tiny[3:], "--runs", "2", "--vary", "label_smoothing=0.0", "--json",
                      "b.json"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("against the baseline") == 1  # one table: rank 1 prints nothing
    assert "speedrun[rank 1]" not in done.stderr
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["world"]["processes"] == 2
    assert all(r["world"]["processes"] == 2 for r in report["results"])
    assert report["command"].startswith("torchrun --standalone --nproc_per_node=2 -m speedrun bench imagenet-debug")
    done = _torchrun(["ablate", *tiny, "--runs", "1", "--to-target", "--max-probes", "2", "--json", "t.json"],
                     tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    searched = json.loads((tmp_path / "t.json").read_text())
    with db.connect(tmp_path / "r.db") as conn:  # one copy of each result and each report, no second file
        assert [r["kind"] for r in db.query_reports(conn)] == ["to_target", "bench"]
        assert len(db.query(conn)) == len(report["results"]) + len(searched["results"])
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["b.json", "t.json"]
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("argv", [["report", "--out", "{tmp}/r.html"], ["results"], ["recipes"],
                                  ["compare", "1", "2"], ["data", "prepare", "{tmp}/src", "{tmp}/dst"],
                                  ["bench-loader", "{tmp}/dst"], ["eval", "{tmp}/m", "--dataset", "x"],
                                  ["predict", "{tmp}/m", "{tmp}/a.png"]])
def test_commands_that_do_not_train_refuse_to_run_as_k_copies(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("SPEEDRUN_DB", str(tmp_path / "r.db"))
    for rank, lines in (("0", 1), ("1", 0)):  # every process refuses; rank 0 says it, once for the job
        monkeypatch.setenv("RANK", rank)
        assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == lines
        assert not lines or (err.startswith("speedrun: error:") and "start it without torchrun" in err)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the database


def test_under_torchrun_usage_errors_and_help_are_rank_0s_to_show(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, shown in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit, match="2"):
            main(["train", "--bogus"])
        assert (capsys.readouterr().err == "speedrun: error: unrecognized arguments: --bogus (see speedrun "
                "--help)\n") is shown
        with pytest.raises(SystemExit):
            main(["train", "--help"])
        assert ("usage: speedrun train" in capsys.readouterr().out) is shown


@pytest.mark.slow
@pytest.mark.parametrize("command", [["bench", "--vary", "label_smoothing=0.0"], ["train"]])
def test_under_torchrun_rank_0s_refusal_ends_every_process_at_once(command, shards, tmp_path):
    """An existing --json (or a bad --db) is rank 0's to find; the other process learns it from rank 0 at once
    (dist.main_first), instead of waiting in the rendezvous until torchrun kills it (30 s later, SIGKILL)."""
    (tmp_path / "taken.json").write_text("{}")
    done = _torchrun([command[0], "imagenet-debug", "--dataset", str(shards), "--device", "cpu", *command[1:],
                      "--json", "taken.json", "--db", "r.db"], tmp_path)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("speedrun")]
    assert lines[0].startswith("speedrun: error: ") and "taken.json" in lines[0]
    assert not any(line.startswith("speedrun[rank 1]") for line in lines), lines  # rank 0 said it; once
    assert "-9" not in done.stderr and "SIGKILL" not in done.stderr, done.stderr[-2000:]
    assert (tmp_path / "taken.json").read_text() == "{}"
    if command[0] == "train":  # the checkpoint folder and --save path are rank 0's to check too (resume.Plan)
        (tmp_path / "m.safetensors").write_text("someone's model")
        done = _torchrun(["train", "imagenet-debug", "--dataset", str(shards), "--device", "cpu", "--save", "m",
                          "--db", "r.db"], tmp_path)
        assert done.returncode != 0 and "m.safetensors" in done.stderr
        assert "-9" not in done.stderr and "SIGKILL" not in done.stderr, done.stderr[-2000:]
        assert (tmp_path / "m.safetensors").read_text() == "someone's model"
    (tmp_path / "notes.db").write_text("my notes, not a database")
    done = _torchrun([command[0], "imagenet-debug", "--dataset", str(shards), "--device", "cpu", *command[1:],
                      "--db", "notes.db"], tmp_path)
    assert (tmp_path / "notes.db").read_text() == "my notes, not a database"
    assert done.returncode != 0 and "notes.db" in done.stderr and "-9" not in done.stderr and "SIGKILL" not in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_concurrent_writers_of_the_synthetic_cache_each_get_it_whole(tmp_path):
    """Two commands that find imagenet-debug's cache empty at once (two shells, or ranks): each writes its own
    copy and renames it into place whole; neither fails, and the cache is whole."""
    script = ("import sys; from pathlib import Path; from speedrun.recipes.imagenet import data as c; "
              "root = c._synthetic_shards(Path(sys.argv[1]), lambda line: None); "
              "assert (root / 'val-index.npy').exists() and (root / 'train-index.npy').exists()")
    for attempt in range(3):
        cache = tmp_path / f"cache{attempt}"
        procs = [subprocess.Popen([sys.executable, "-c", script, str(cache)], stderr=subprocess.PIPE, text=True)
                 for _ in range(3)]
        errors = [p.communicate(timeout=120)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], errors
        data = imagenet_checks.load_data("synthetic", data_dir=cache, log=lambda line: None)
        assert (data.num_train, data.num_eval) == (640, 160)
        assert sorted(p.name for p in cache.iterdir()) == ["imagenet-synthetic-v1"]  # no copy left behind


def test_a_per_process_batch_of_one_is_refused_before_any_run(shards, tmp_path, capsys):
    """BatchNorm cannot normalize one image (torch refuses it mid-run, after the runs before it had ended)."""
    assert main(["train", "imagenet-debug", "--dataset", str(shards), "--device", "cpu", "--set", "batch_size=1",
                 "--db", str(tmp_path / "r.db")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "batch_size 1" in err and "at least 2" in err


def test_rank_1_shows_no_warnings(monkeypatch, capsys):
    """Every process runs the same code, so a library's warning comes from each: rank 0 shows its copy."""
    import warnings

    from speedrun.cli import program as cli

    for rank, shown in (("1", False), ("0", True)):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        cli._show_warning(warnings.WarningMessage("deprecated thing", DeprecationWarning, "x.py", 1).message,
                          DeprecationWarning, "x.py", 1)
        err = capsys.readouterr().err
        assert err == ("speedrun: warning: deprecated thing (DeprecationWarning)\n" if shown else "")


CIFAR_TINY = ["cifar10-94", "--dataset", "synthetic:train=256,test=32", "--device", "cpu", "--epochs", "1", "--set",
              "batch_size=64", "--set", "widths=8,16,16", "--set", "whiten_images=64"]


def _second_call_fails(monkeypatch, module, name: str) -> list:
    """module.name raises a one-line ValueError at its second call; returns the list its calls are counted in."""
    real, calls = getattr(module, name), []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("this setting cannot train (--set x=...)")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, second_fails)
    return calls


@pytest.mark.parametrize("command", [["bench", "--runs", "2", "--vary", "lookahead=false"],
                                     ["ablate", "--runs", "1", "--to-target", "--max-probes", "2"],
                                     ["train", "--runs", "3"]])
def test_an_error_in_a_later_run_keeps_the_runs_that_ended(command, tmp_path, capsys, monkeypatch):
    """Any error part way (a later setting that cannot train, a full disk), not only Ctrl-C: the finished runs
    are stored and written, marked incomplete, and the one line says where."""
    from speedrun.instruments import bench, to_target
    from speedrun.recipes import cifar

    calls = _second_call_fails(monkeypatch, cifar, "train_run")
    # the instruments' warm-ups call train_run too: left out here, so that call 2 is the second timed run
    monkeypatch.setattr(bench, "warm_up", lambda *args: 0.0)
    monkeypatch.setattr(to_target, "warm_up", lambda *args: 0.0)
    out = tmp_path / "r.json"
    argv = [command[0], *CIFAR_TINY, *command[1:], "--db", str(tmp_path / "r.db"), "--json", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    stored = f" and in the results database {tmp_path / 'r.db'} (#1)" if command[0] == "train" else ""
    assert err == f"speedrun: error: this setting cannot train (--set x=...); 1 finished run kept in {out}{stored}"
    kept = json.loads(out.read_text())
    assert kept["complete"] is False
    with db.connect(tmp_path / "r.db") as conn:
        if command[0] == "train":
            [row] = db.query(conn)
            assert len(db.get_result(conn, row["id"])["runs"]) == 1
        else:
            [stored] = db.query_reports(conn)
            report = db.get_result(conn, stored["id"])
            assert report["interrupted"] is False and report["failed"].startswith("ValueError: this setting")
            assert len(report["order"]) == 1
    if command[0] == "train":  # no --json: the command's automatic result file, named
        calls.clear()
        monkeypatch.chdir(tmp_path)
        assert main(argv[:-2]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        named = Path(line.split("; 1 finished run kept in ")[1].split(" and in the results database ")[0])
        assert json.loads(named.read_text())["complete"] is False and len(json.loads(named.read_text())["runs"]) == 1


@pytest.mark.parametrize("command, rows", [(["ablate", "--runs", "2"], "tricks"),
                                           (["ablate", "--runs", "2", "--waterfall", "lookahead,flip"], "waterfall"),
                                           (["tune", "--runs", "2", "--only", "optimizer_kernel"], "tune")])
def test_an_instrument_stopped_part_way_keeps_its_own_rows(command, rows, tmp_path, monkeypatch):
    """ablate's trick rows, the waterfall's steps and the doctor's verdicts are given to the kept report of the
    runs that finished, as to a whole one: the stop does not leave a bench report under the instrument's name."""
    from speedrun.instruments import bench

    _second_call_fails(monkeypatch, bench, "measured_run")
    monkeypatch.setattr(bench, "warm_up", lambda *args: 0.0)
    out = tmp_path / "r.json"
    assert main([command[0], *CIFAR_TINY, *command[1:], "--db", str(tmp_path / "r.db"), "--json", str(out)]) == 2
    kept = json.loads(out.read_text())
    assert kept["complete"] is False and len(kept["order"]) == 1
    assert kept["benchmark"] == ("waterfall" if rows == "waterfall" else command[0]) and rows in kept


def test_rank_0s_failure_is_raised_even_when_the_peers_are_gone(monkeypatch):
    """torchrun stops the peers when it forwards a SIGTERM: telling them fails, and the SIGTERM is still what rank
    0 reports (not the failed send)."""
    from speedrun import dist
    from speedrun.errors import Terminated

    def gone(obj, world):
        raise RuntimeError("[gloo] Connection closed by peer")

    def load():
        raise Terminated()

    monkeypatch.setattr(dist, "broadcast_object", gone)
    with pytest.raises(Terminated):
        dist.main_first(dist.World(rank=0, size=2), load)
    monkeypatch.setattr(dist, "broadcast_object", lambda obj, world: "ValueError")
    with pytest.raises(dist.PeerFailed):  # another process: rank 0 failed, so this one ends quietly
        dist.main_first(dist.World(rank=1, size=2), lambda: pytest.fail("must not run"))


@pytest.mark.parametrize("batch, size, ok", [(1, 1, False), (2, 1, True), (2, 2, False), (4, 2, True)])
def test_every_family_refuses_a_per_process_batch_of_one(batch, size, ok):
    import torch

    from speedrun import dist

    world = dist.World(rank=0, size=size, local_size=size)
    if ok:
        dist.check(batch, world, torch.device("cpu"), False)
    else:
        with pytest.raises(ValueError, match="BatchNorm needs at least 2"):
            dist.check(batch, world, torch.device("cpu"), False)


def test_the_synthetic_cache_in_odd_states_is_named_or_written_again(tmp_path):
    lines = []

    def load(cache):
        return imagenet_checks.load_data("synthetic", data_dir=cache, log=lines.append)

    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "imagenet-synthetic-v1").write_text("mine")
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "imagenet-synthetic-v1").symlink_to(tmp_path / "nowhere")
    for cache in ("file", "link"):
        with pytest.raises(ValueError, match="is in the way of imagenet-debug's synthetic shards"):
            load(tmp_path / cache)
    assert (tmp_path / "file" / "imagenet-synthetic-v1").read_text() == "mine"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder; point --data-dir at a folder"):
        load(tmp_path / "afile")
    root = tmp_path / "ok" / "imagenet-synthetic-v1"
    assert load(tmp_path / "ok").num_train == 640
    (root / "train-index.npy").unlink()  # removed: written again
    assert load(tmp_path / "ok").num_train == 640
    with open(root / "train-00000.tar", "r+b") as f:  # cut short: found by the checksums, written again
        f.truncate(1000)
    lines.clear()
    assert load(tmp_path / "ok").num_train == 640
    assert any(line.startswith("writing synthetic shards") for line in lines), lines
    assert sorted(p.name for p in (tmp_path / "ok").iterdir()) == ["imagenet-synthetic-v1"]
