"""What the user is told about the paths a command writes, the settings file, the measured-peak cache and a failed
download: a deep output path, two outputs naming one file, a symlink loop, a settings file that JSON reads leniently,
a hostile peak cache, a mirror that gives no complete response, and counts with their nouns, each in one true line
(exit 2 for the CLI), never an internal error, a value read unseen or a number trusted unchecked."""

from __future__ import annotations

import ast
import hashlib
import http.server
import json
import os
import re
import threading
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from speedrun.data.download import fetch
from speedrun.engine import peak
from speedrun.errors import SpeedrunWarning
from speedrun.paths import MAX_PATH_DEPTH
from speedrun.records.settings_file import TOP_KEYS, read_settings
from speedrun.run import model_files

TINY = ["--dataset", "synthetic:train=64,test=16", "--device", "cpu", "--set", "batch_size=16", "--set",
        "widths=8,8,8", "--set", "whiten_images=32", "--epochs", "0.1"]
SRC = Path(__file__).resolve().parents[1] / "src" / "speedrun"


pytestmark = pytest.mark.usefixtures("in_tmp")


def _one_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "internal error" not in lines[0], (code, err)
    return lines[0]


# ---- 1. a path too deep for os.makedirs, whatever option or variable names it ----------------------------------

DEEP = "/".join(["d"] * 2000)


@pytest.mark.parametrize("argv,env,named", [
    (["train", *TINY, "--tensorboard", DEEP], {}, "--tensorboard"),
    (["train", *TINY, "--checkpoint-dir", DEEP], {}, "--checkpoint-dir"),
    (["train", *TINY, "--json", DEEP + "/r.json"], {}, "--json"),
    (["train", *TINY, "--save", DEEP + "/m"], {}, "--save"),
    (["train", *TINY, "--db", DEEP + "/r.db"], {}, "--db"),
    (["train", *TINY], {"SPEEDRUN_RESULTS": DEEP}, "SPEEDRUN_RESULTS"),
    (["train", *TINY], {"SPEEDRUN_DB": DEEP + "/r.db"}, "SPEEDRUN_DB"),
    (["profile", *TINY[:4], "--trace", DEEP + "/t.json"], {}, "--trace"),
    (["profile", *TINY[:4], "--json", DEEP + "/t.json"], {}, "--json"),
    (["tune", *TINY, "--apply", DEEP + "/s.json"], {}, "--apply"),
    (["sweep", *TINY, "--space", "lr=0.1,0.2", "--write-settings", DEEP + "/s.json"], {}, "--write-settings"),
    (["report", "--out", DEEP + "/r.html"], {}, "--out"),
    (["results", "--db", DEEP + "/r.db"], {}, "--db"),
    (["data", "prepare", "src", DEEP], {}, "DST"),
    (["train", *TINY, "--json", "/".join(["a", ".."] * 600) + "/r.json"], {}, "--json"),  # shallow once resolved
])
def test_an_output_path_too_deep_is_one_line_and_a_deep_one_within_bounds_is_made(argv, env, named, tmp_path,
                                                                                   monkeypatch, capsys):
    (tmp_path / "src" / "train" / "a").mkdir(parents=True)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    line = _one_line(*run_cli(argv, capsys)[::2])
    assert f"{named} " in line and "folders deep" in line and f"more than the {MAX_PATH_DEPTH}" in line, line
    assert not (tmp_path / "d").exists()  # refused before anything was made
    if named == "--tensorboard":  # within the bound, every output of a run is made, one level at a time
        deep = ["/".join(["e"] * (MAX_PATH_DEPTH - 30)) + f"/{i}" for i in range(4)]
        code, _, err = run_cli(["train", *TINY, "--quiet", "--tensorboard", deep[0], "--checkpoint-dir", deep[1],
                                "--checkpoint-every", "1", "--json", deep[2] + "/r.json", "--save", deep[3] + "/m"],
                               capsys)
        assert code == 0, err
        assert any(Path(deep[0]).iterdir()) and Path(deep[1]).is_dir()
        assert json.loads(Path(deep[2], "r.json").read_text())["runs"] and Path(deep[3], "m.json").exists()


# ---- 2. two outputs of one command naming one file, and a symlink loop --------------------------------------------


@pytest.mark.parametrize("argv,words", [
    (["profile", *TINY[:4], "--trace", "x.json", "--json", "x.json"], "--json and --trace name the same file"),
    (["profile", *TINY[:4], "--trace", "link.json", "--json", "sub/../x.json"], "--json and --trace name the same"),
    (["train", *TINY, "--json", "x.json", "--db", "x.json"], "--json and --db name the same file"),
    (["train", *TINY, "--json", "m.json", "--save", "m"], "--json and --save name the same file"),
    (["train", *TINY, "--json", "x", "--tensorboard", "x"], "a folder for --tensorboard and a file for --json"),
    (["tune", *TINY, "--apply", "x.json", "--json", "x.json"], "--json and --apply name the same file"),
    (["sweep", *TINY, "--space", "lr=0.1,0.2", "--write-settings", "x.json", "--json", "x.json"],
     "--json and --write-settings name the same file"),
    (["report", "--out", "x.html", "--readme", "x.html"], "--out and --readme name the same file"),
    (["train", *TINY, "--tensorboard", "loop"], "loop is a symlink loop"),
    (["train", *TINY, "--tensorboard", "loop/runs"], "loop is a symlink loop"),
    (["train", *TINY, "--checkpoint-dir", "loop"], "loop is a symlink loop"),
    (["train", *TINY, "--json", "loop"], "loop is a symlink loop"),
    (["train", *TINY, "--json", "loop/r.json"], "loop is a symlink loop"),
    (["train", *TINY, "--db", "loop/r.db"], "loop is a symlink loop"),
    (["train", *TINY, "--save", "loop/m"], "loop is a symlink loop"),
    (["profile", *TINY[:4], "--trace", "loop"], "loop is a symlink loop"),
    (["train", *TINY, "--quiet", "--tensorboard", "f", "--checkpoint-dir", "f"], None),  # two folders may be one
])
def test_outputs_that_collide_or_loop_are_said_as_such(argv, words, tmp_path, capsys):
    os.symlink("loop", tmp_path / "loop")
    os.symlink("x.json", tmp_path / "link.json")
    (tmp_path / "sub").mkdir()
    code, _, err = run_cli(argv, capsys)
    if words is None:
        assert code == 0, err
        return
    line = _one_line(code, err)
    assert words in line and "already exists" not in line and "File exists" not in line, line
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "results").exists()


# ---- 3. a settings file that JSON would read leniently ---------------------------------------------------------


def _settings_text(**extra) -> str:
    return json.dumps({"speedrun_settings": 1, "recipe": "cifar10-94", "device": "cpu",
                       "settings": {"batch_size": "64"}, **extra})


@pytest.mark.parametrize("text,words", [
    (_settings_text()[:-1] + ', "recipe": "cifar10-96"}', "the key 'recipe' appears twice in one object"),
    (_settings_text().replace('"64"}', '"64", "batch_size": "512"}'), "the key 'batch_size' appears twice"),
    (_settings_text(epochs=3), "unknown key 'epochs'; a settings file holds " + ", ".join(TOP_KEYS)),
    (_settings_text()[:-1] + ', "x": ' + "[" * 900 + "]" * 900 + "}", "unknown key 'x'"),
    ("[" * 32_000 + "]" * 32_000, "JSON nested 32,000 levels deep, too deep to read"),
    ('{"a": ["[[[", ' + '{"b": ' * 8000 + "1" + "}" * 8000 + "]}", "JSON nested 8,002 levels deep"),
    (_settings_text()[:40], "not JSON (Unterminated string starting at: line 1 column 36 (char 35))"),
    ('{"speedrun_settings": 1, "n": ' + "9" * 5000 + "}", "not JSON (Exceeds the limit (4300 digits)"),
])
def test_a_settings_file_json_would_read_leniently_is_refused_naming_why(text, words, tmp_path):
    path = tmp_path / "s.json"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        read_settings(path)
    message = str(e.value)
    assert words in message and "\n" not in message, message
    assert not message.startswith(f"settings file {path}: not JSON;"), message  # a reason, never the bare verdict


# ---- 4. a measured-peak cache that is not a measurement of this device --------------------------------------------


@pytest.mark.parametrize("dtypes,why", [
    ({"bf16": {"flops_per_s": 50e12, "kernel": "matmul", "kernels": {"matmul": 200e9}}},
     "is not the fastest of its kernels' (matmul 200.0 GFLOP/s)"),
    ({"bf16": {"flops_per_s": 50e12, "kernel": "matmul", "kernels": {"matmul": 50e12, "conv3x3": 1e12}}},
     "its bf16 peak 50.0 TFLOP/s is more than this device can do, 24.6 TFLOP/s at most"),
    ({"fp32": {"flops_per_s": float("nan"), "kernel": "matmul", "kernels": {"matmul": 1e9}}}, "peak nan is not"),
    ({"fp32": {"flops_per_s": True, "kernel": "matmul", "kernels": {"matmul": 1e9}}}, "peak True is not"),
    ({"fp32": {"flops_per_s": 1e9, "kernel": "matmul", "kernels": {"matmul": False}}}, "kernels are not rates"),
    ({"int8": {"flops_per_s": 1e9, "kernel": "matmul", "kernels": {"matmul": 1e9}}}, "'int8' is not one measured"),
    ("another", "its fingerprint"),  # an entry copied from another device's key
])
def test_a_peak_cache_entry_that_is_no_measurement_here_is_refused_with_a_warning(dtypes, why, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # a 2-core CPU: 24.6 TFLOP/s at most
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    key = peak.fingerprint(torch.device("cpu"), "Some CPU")
    if dtypes == "another":
        dtypes, fingerprint = {"fp32": {"flops_per_s": 1e9, "kernel": "matmul", "kernels": {"matmul": 1e9}}}, "x"
    else:
        fingerprint = key
    peak.cache_path().parent.mkdir(parents=True)
    peak.cache_path().write_text(json.dumps({key: {"fingerprint": fingerprint, "measured_utc": "t",
                                                    "dtypes": dtypes}}))
    with pytest.warns(SpeedrunWarning) as warned:
        assert peak.cached(torch.device("cpu"), "Some CPU") is None  # what bench and train use: ignored
    text = str(warned[0].message)
    assert str(peak.cache_path()) in text and why in text and "run speedrun peak" in text, text
    measured = {"fp32": {"flops_per_s": 2e9, "kernel": "matmul", "kernels": {"matmul": 2e9}}}
    monkeypatch.setattr(peak, "measure", lambda device, log=None: measured)
    with pytest.warns(SpeedrunWarning, match="measuring again"):
        assert peak.peak(torch.device("cpu"), "Some CPU")["dtypes"] == measured  # what profile uses: measured
    assert json.loads(peak.cache_path().read_text())[key]["dtypes"] == measured
    monkeypatch.setattr(peak, "measure", lambda device, log=None: pytest.fail("measured twice"))
    assert peak.cached(torch.device("cpu"), "Some CPU")["dtypes"] == measured  # its own measurement is trusted


# ---- 5. messages: what a mirror gave, counts and their nouns, values as they are, reasons cut at a word --------------

# Modules whose messages their own change rewords (the sweep, the report pages): each leaves this list with it.
PAYLOAD = bytes(range(251)) * 400
MD5 = hashlib.md5(PAYLOAD).hexdigest()


class _Mirror(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if self.path.startswith("/loop"):
            self.send_response(302)
            self.send_header("Location", self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        if self.path.startswith("/chunked"):
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"3e8\r\n" + PAYLOAD[:1000] + b"\r\n")  # one chunk of many, then the close
        else:  # no length: a close ends the response, here a fifth of the file in
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(PAYLOAD[:len(PAYLOAD) // 5])
        self.close_connection = True

    def log_message(self, *args):
        pass


def test_messages_say_what_happened_in_words(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Mirror)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        said = {}
        for route in ("loop", "dribble", "chunked"):
            with pytest.raises(OSError) as e:
                fetch([f"{url}/{route}/a.bin"], tmp_path / route / "a.bin", MD5, timeout=5, min_rate=0)
            said[route] = str(e.value)
    finally:
        server.shutdown()
        server.server_close()
    assert "\\n" not in said["loop"] and "its redirects go round in a loop" in said["loop"], said["loop"]
    assert f"no complete response: it sent {len(PAYLOAD) // 5:,} bytes without a Content-Length" in said["dribble"]
    assert "no complete response: the connection closed after 1,000 bytes" in said["chunked"], said["chunked"]
    assert "None" not in said["chunked"]

    card = {"format": model_files.MODEL_FORMAT, "version": model_files.MODEL_VERSION, "recipe": "cifar10-94",
            "family": "cifar", "config": {}, "classes": ["a", "b"], "image_shape": [3, 0, 32]}
    with pytest.raises(model_files.Unusable, match=re.escape("got [3, 0, 32]")):
        model_files.parse_card(card)
    with pytest.raises(model_files.Unusable, match=re.escape("got ['a', 'a', 'a', 'a', 'a', 'a', ...] (100,001")):
        model_files.parse_card({**card, "classes": ["a"] * 100_001})

    peak.cache_path().parent.mkdir(parents=True)
    peak.cache_path().write_text("[" * 100_000)
    with pytest.warns(SpeedrunWarning, match=r"is not usable \(JSON nested too deep to read\)"):
        peak.cached(torch.device("cpu"), "Some CPU")

    # No "run(s)" or "mean(s)" left in what speedrun says: each count is written with its noun (errors.counted).
    hedged = [f"{path.relative_to(SRC)}:{line}" for path in SRC.rglob("*.py")
              for line, text in _message_texts(path) if re.search(r"[a-z]\((s|es)\)", text)]
    assert not hedged, hedged


def _message_texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each string literal in the module at `path` (f-strings' literal parts too), docstrings
    left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    return [(node.lineno, node.value) for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docstrings]


# ---- 6. a peak cache's numbers, of any size or type, and an MFU over 100% ---------------------------------------


def _peak_entry(rate, kernel_rate=None, kernel="matmul") -> tuple[str, dict]:
    key = peak.fingerprint(torch.device("cpu"), "Some CPU")
    return key, {"fingerprint": key, "measured_utc": "t", "dtypes": {"fp32": {
        "flops_per_s": rate, "kernel": kernel, "kernels": {kernel: rate if kernel_rate is None else kernel_rate}}}}


@pytest.mark.parametrize("rate,kernel_rate", [
    (10**400, None), (-10**400, None), (1e12, 10**400), ("1e12", None), (1e12, "1e12"), (None, None), ([1e12], None),
    (2e6, None),  # below any device speedrun runs on: a peak that would give an MFU over 100%
])
def test_a_peak_cache_number_of_any_size_or_type_is_refused_never_raised(rate, kernel_rate):
    key, entry = _peak_entry(rate, kernel_rate)
    peak.cache_path().parent.mkdir(parents=True)
    peak.cache_path().write_text(json.dumps({key: entry}))
    with pytest.warns(SpeedrunWarning) as warned:
        assert peak.cached(torch.device("cpu"), "Some CPU") is None
    assert "is not a measurement of this device" in str(warned[0].message)


def test_a_peak_cache_integer_too_large_for_a_float_is_one_warning_in_train(capsys):
    dev = torch.device("cpu")
    from speedrun.records.environment import environment

    key = peak.fingerprint(dev, environment(dev)["device_name"])
    peak.cache_path().parent.mkdir(parents=True)
    peak.cache_path().write_text(json.dumps({key: _peak_entry(10**400)[1] | {"fingerprint": key}}))
    code, _, err = run_cli(["train", *TINY, "--quiet", "--json", "r.json"], capsys)
    assert code == 0 and "internal error" not in err and "OverflowError" not in err, err
    assert json.loads(Path("r.json").read_text())["mfu"]["mfu_measured"] is None


@pytest.mark.parametrize("rate", [2e6, 1e9])
def test_an_mfu_over_100_percent_is_never_reported(rate, capsys):
    """2e6: refused as no device's peak; 1e9 (a plausible peak, below what this run achieves): the MFU against it
    would be over 1, so it is dropped, with one warning naming the cache and how to measure again."""
    dev = torch.device("cpu")
    from speedrun.records.environment import environment

    key = peak.fingerprint(dev, environment(dev)["device_name"])
    peak.cache_path().parent.mkdir(parents=True)
    entry = {"fingerprint": key, "measured_utc": "t",
             "dtypes": {d: {"flops_per_s": rate, "kernel": "matmul", "kernels": {"matmul": rate, "conv3x3": rate}}
                        for d in ("fp32", "bf16")}}
    peak.cache_path().write_text(json.dumps({key: entry}))
    code, out, err = run_cli(["train", *TINY, "--set", "widths=16,32,32", "--json", "r.json"], capsys)
    assert code == 0, err
    m = json.loads(Path("r.json").read_text())["mfu"]
    assert m["achieved_flops_per_s"] > 1e9 and m["mfu_measured"] is None, m
    peak_lines = [line for line in err.splitlines() if "peak" in line and "warning" in line]
    assert len(peak_lines) == 1 and str(peak.cache_path()) in peak_lines[0] and "speedrun peak" in peak_lines[0], err
    if rate == 1e9:
        assert "below what this run achieved" in peak_lines[0] and m["measured_peak_flops_per_s"] == rate
        assert "is below it: no peak of this device" in out  # the summary says why it shows no MFU
    with pytest.warns(SpeedrunWarning, match="datasheet"):  # a datasheet figure below the rate: dropped too
        sheet = peak.mfu(2e15, None, "bf16", "NVIDIA H100 PCIe")
    assert sheet["mfu_datasheet"] is None and "not this device's figure" in peak.mfu_text(sheet)


def test_peak_says_cached_only_when_the_cache_was_written(monkeypatch, capsys):
    monkeypatch.setattr(peak, "measure", lambda device, log=None: {
        "fp32": {"flops_per_s": 2e9, "kernel": "matmul", "kernels": {"matmul": 2e9}}})
    peak.cache_path().mkdir(parents=True)  # a folder where the cache file goes
    code, out, err = run_cli(["peak", "--device", "cpu"], capsys)
    assert code == 0 and "not written (Is a directory)" in err and "cached in" not in err, err
    assert "fp32  peak" in out
    peak.cache_path().rmdir()
    code, _, err = run_cli(["peak", "--device", "cpu"], capsys)
    assert code == 0 and f"cached in {peak.cache_path()}" in err, err


# ---- 7. text no result can store (a lone surrogate) in a file speedrun reads -------------------------------------


@pytest.mark.parametrize("extra,where", [({"device_name": "\udc80"}, "device_name"),
                                         ({"measured": {"a": ["x", "\udc80"]}}, "measured.a[1]"),
                                         ({"settings": {"batch_size": "6\udc804"}}, "settings.batch_size"),
                                         ({"measured": {"\udc80": 1}}, "a key in measured")])
def test_text_no_result_can_store_is_refused_where_a_file_is_read(extra, where, tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text(_settings_text(**extra))  # json.dumps writes the surrogate as the escape \udc80
    with pytest.raises(ValueError, match=re.escape(f"the string at {where} is no text UTF-8 can hold")):
        read_settings(path)
    line = _one_line(*run_cli(["train", *TINY, "--settings", str(path)], capsys)[::2])
    assert "UTF-8" in line and str(path) in line, line
    assert not (tmp_path / "results.db").exists() and not (tmp_path / "results").exists()
    # the same in a peak cache (a result records its kernel's name) and a checkpoint's finished run
    key, entry = _peak_entry(1e12, kernel="m\udc80")
    peak.cache_path().parent.mkdir(parents=True, exist_ok=True)
    peak.cache_path().write_text(json.dumps({key: entry}))
    with pytest.warns(SpeedrunWarning, match="no text UTF-8 can hold"):
        assert peak.cached(torch.device("cpu"), "Some CPU") is None
    from speedrun.run import resume

    run = {"seed": 0, "accuracy": None, "train_seconds": None, "epochs": 1.0, "steps": 1, "history": [],
           "diverged": {"step": 1, "total_steps": 2, "loss": "nan", "message": "\udc80"}}
    with pytest.raises(TypeError, match="diverged.message is no text UTF-8 can hold"):
        resume._check_run(run, 0)


def test_a_row_the_database_refuses_is_not_said_to_be_importable_later(monkeypatch, capsys):
    from speedrun.records import db

    def refuse(conn, result, source=None):
        raise ValueError("result cannot be stored as strict JSON (a reason)")

    monkeypatch.setattr(db, "insert_result", refuse)
    code, _, err = run_cli(["train", *TINY, "--quiet", "--json", "r.json"], capsys)
    assert code == 0 and "was not stored in the database" in err and "r.json" in err, err
    assert "results import" not in err, err
    monkeypatch.setattr(db, "insert_result", lambda *a, **k: (_ for _ in ()).throw(db.UnusableDatabase("locked")))
    code, _, err = run_cli(["train", *TINY, "--quiet", "--json", "r2.json"], capsys)
    assert code == 0 and "`speedrun results import` adds it later" in err, err


# ---- 8. a result path refused before anything else is made ---------------------------------------------------------


def _unwritable(monkeypatch, folder: str):
    """`folder` refuses new files, as a folder of another user's does (root's tests: simulated at os.open, the
    claim's system call, and os.access, the checks' question)."""
    real_open, real_access = os.open, os.access

    def inside(path) -> bool:
        return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))

    def open_(path, flags, *args, **kwargs):
        if inside(path) and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "access", lambda path, mode, **k: not (inside(path) and mode & os.W_OK)
                        and real_access(path, mode, **k))


@pytest.mark.parametrize("argv,env,words", [
    (["train", *TINY, "--json", "ro/x.json", "--checkpoint-dir", "ck", "--tensorboard", "tb"], {},
     "cannot create the result file ro/x.json (Permission denied); choose a writable path (--json)"),
    (["train", *TINY, "--json", "old.json", "--checkpoint-dir", "ck"], {}, "already exists and is never replaced"),
    (["train", *TINY, "--checkpoint-dir", "ck"], {"SPEEDRUN_RESULTS": "ro/results"}, "may not create folders in"),
    (["train", *TINY, "--json", "ro/x.json", "--resume", "r.pt"], {}, "ro: this process may not write it"),
    (["bench", *TINY, "--vary", "lookahead=false", "--json", "old.json"], {}, "already exists"),
    (["bench", *TINY, "--vary", "lookahead=false", "--json", "ro/x.json"], {}, "Permission denied"),
])
def test_a_result_path_that_cannot_be_claimed_leaves_no_database_or_folder(argv, env, words, tmp_path, monkeypatch,
                                                                          capsys):
    (tmp_path / "ro").mkdir()
    (tmp_path / "old.json").write_text("{}")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    _unwritable(monkeypatch, "ro")
    line = _one_line(*run_cli(argv, capsys)[::2])
    assert words in line and "json_path" not in line, line
    assert sorted(os.listdir(tmp_path)) == ["old.json", "ro"] and not os.listdir(tmp_path / "ro"), os.listdir(tmp_path)


# ---- 9. a file of `report` that cannot be written: one line naming it and a fix that works ----------------------


@pytest.fixture
def _report_db(tmp_path):
    from speedrun.records import db

    db.connect(tmp_path / "r.db").close()
    return str(tmp_path / "r.db")


def test_a_report_file_that_cannot_be_written_is_one_line_with_a_true_fix(_report_db, tmp_path, monkeypatch, capsys):
    from speedrun.report import markdown as md
    from speedrun.report import publish

    text = "a\n" + "\n".join(md.markers("records")) + "\nb\n"
    (tmp_path / "ro").mkdir()
    for name in ("ro/R.md", "R.md"):
        (tmp_path / name).write_text(text)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **k: os.path.abspath(path) != str(tmp_path / "ro")
                        and real_access(path, mode, **k))
    line = _one_line(*run_cli(["report", "--db", _report_db, "--readme", "ro/R.md"], capsys)[::2])
    assert "--readme ro/R.md: this process may not make files in the folder" in line and "make the folder" in line
    line = _one_line(*run_cli(["report", "--db", _report_db, "--out", "ro/x.html"], capsys)[::2])
    assert "--out ro/x.html: this process may not make files in the folder" in line, line
    # an immutable file (chattr +i) stops root too: the system, not the mode, refuses; chmod would not help
    monkeypatch.setattr(os, "access", lambda path, mode, **k: os.path.abspath(path) != str(tmp_path / "R.md")
                        and real_access(path, mode, **k))
    line = _one_line(*run_cli(["report", "--db", _report_db, "--readme", "R.md"], capsys)[::2])
    assert "the system refuses" in line and "lsattr" in line and "chmod u+w" not in line, line
    monkeypatch.setattr(os, "access", real_access)

    def refused(path, text, mode=0o644):
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(publish, "write_text", refused)  # what the write itself meets: EPERM from the rename
    line = _one_line(*run_cli(["report", "--db", _report_db, "--readme", "R.md"], capsys)[::2])
    assert f"cannot write --readme {tmp_path / 'R.md'} (left as it was): the system refused it" in line, line
    assert (tmp_path / "R.md").read_text() == text and (tmp_path / "ro" / "R.md").read_text() == text
    assert not (tmp_path / "ro" / "x.html").exists()


# ---- 10. a file option given a folder's form ("db/x/") -------------------------------------------------------------


@pytest.mark.parametrize("argv,env,named", [
    (["train", *TINY, "--db", "db/x/"], {}, "--db"),
    (["results", "--db", "db/x/"], {}, "--db"),
    (["train", *TINY], {"SPEEDRUN_DB": "db/x/"}, "SPEEDRUN_DB"),
    (["train", *TINY, "--json", "db/x/"], {}, "--json"),
    (["profile", *TINY[:4], "--trace", "db/x/"], {}, "--trace"),
    (["report", "--out", "db/x/"], {}, "--out"),
    (["report", "--readme", "db/x/"], {}, "--readme"),
    (["report", "--readme", "db/x/."], {}, "--readme"),
    (["tune", *TINY, "--apply", "db/x/"], {}, "--apply"),
    (["sweep", *TINY, "--space", "lr=0.1,0.2", "--write-settings", "db/x/"], {}, "--write-settings"),
])
def test_a_file_option_given_a_folders_form_is_refused_for_every_option(argv, env, named, tmp_path, monkeypatch,
                                                                        capsys):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    line = _one_line(*run_cli(argv, capsys)[::2])
    assert f"{named} 'db/x/" in line and "names a folder; give a file name, e.g. db/x/" in line, line
    assert not (tmp_path / "db").exists() and not (tmp_path / "results").exists()
    if named == "--db":  # the Python API's too
        from speedrun import train

        with pytest.raises(ValueError, match="names a folder"):
            train("cifar10-94", "synthetic:train=64,test=16", device="cpu", db="db/x/")
        assert not (tmp_path / "db").exists()
