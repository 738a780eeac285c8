"""`speedrun data prepare SRC DST`: bad arguments are one line and exit 2; the report, warnings, up to date, signals."""

import os
import signal
import subprocess
import sys
import time

import pytest
from test_prepare import IMAGENET_SAMPLE, _files, _tree

from speedrun.cli.program import main


def _run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors leave through SystemExit
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv,fragment", [
    ([], "required: SRC, DST"),
    (["SRC"], "required: DST"),
    (["SRC", "DST", "--quality", "high"], "--quality: invalid int value"),
    (["SRC", "DST", "--on-error", "maybe"], "--on-error: invalid choice"),
    (["SRC", "DST", "--max-side", "64"], "unrecognized arguments: --max-side"),  # no abbreviations
    (["{src}", "DST", "--quality", "0"], "JPEG quality (--quality) must be 1 to 100"),
    (["{src}", "DST", "--max-side-px", "8"], "max side (--max-side-px) must be 16 to 8192"),
    (["{src}", "DST", "--workers", "-1"], "--workers must be 0 to"),
    (["{tmp}/missing", "DST"], "missing does not exist"),
    (["{src}", "{src}/train/shards"], "inside SRC"),
    (["{src}", "{src}/train/cat/rgb.JPEG"], "inside SRC"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, fragment, capsys, tmp_path, monkeypatch):
    src = _tree(tmp_path)
    monkeypatch.chdir(tmp_path)  # DST, where a test gets that far, is relative: it must stay uncreated
    argv = [a.format(src=src, tmp=tmp_path) for a in argv]
    code, out, err = _run(["data", "prepare", *argv], capsys)
    assert code == 2 and fragment in err, err
    assert err.count("\n") == 1 and err.startswith("speedrun") and out == ""
    assert not (tmp_path / "DST").exists() and not (src / "train" / "shards").exists()


def test_prepare_reports_warns_and_then_is_up_to_date(capsys, tmp_path):
    src, dst = _tree(tmp_path), tmp_path / "dst"
    code, out, err = _run(["data", "prepare", str(src), str(dst), "--max-side-px", "64", "--workers", "2"], capsys)
    assert code == 0
    lines = err.splitlines()  # the corrupt file: one warning line naming it
    assert len(lines) == 1 and lines[0].startswith("speedrun: warning: train: skipped: cannot read ")
    assert "broken.JPEG" in lines[0]
    assert "train: 8 written" in out and "1 skipped (dog/broken.JPEG)" in out and "val: 2 written" in out
    assert "1 EXIF-rotated, 1 resized, 1 PNG named .jpg/.jpeg" in out and "images/s with 2 worker" in out
    before = _files(dst)
    code, out, err = _run(["data", "prepare", str(src), str(dst), "--max-side-px", "64"], capsys)
    assert code == 0 and err == "" and "up to date: nothing to do" in out
    assert _files(dst) == before
    (src / "train" / "dog" / "phone.jpg").touch()
    code, out, err = _run(["data", "prepare", str(src), str(dst), "--max-side-px", "64", "--on-error", "stop"], capsys)
    assert code == 2 and err.count("\n") == 1 and "broken.JPEG" in err and "--on-error skip" in err
    assert _files(dst) == before


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_leaves_dst_as_it_was_and_no_process_behind(stop, tmp_path):
    """Ctrl-C (SIGINT to the whole foreground group) or SIGTERM to the group, while 2 workers prepare real photos:
    one line, exit 130 or 143, DST as it was (here: not there), no staging folder, no worker left."""
    if not IMAGENET_SAMPLE.is_dir():
        pytest.skip(f"{IMAGENET_SAMPLE} not present")
    dst = tmp_path / "dst"
    proc = subprocess.Popen([sys.executable, "-m", "speedrun.cli", "data", "prepare", str(IMAGENET_SAMPLE), str(dst),
                             "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().startswith("val: preparing 1,000 images")  # seconds of work ahead
        os.killpg(proc.pid, stop)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # the sample holds val/ alone: a warning that train refuses such shards, said before the work; then one line
    warned, line = err.splitlines()
    assert proc.returncode == 128 + stop and out == "" and "has no train/ folder" in warned, err
    assert line.startswith("speedrun: interrupted" if stop == signal.SIGINT else "speedrun: terminated")
    assert not dst.exists()
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):  # the group is empty: its workers ended with it
        os.killpg(proc.pid, 0)
