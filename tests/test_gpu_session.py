"""benchmarks/gpu_session.py: the pack that carries cifar10-jpeg to a lent GPU, read back as a hostile file, and the
whole session's dry run on the CPU (every step at tiny sizes), so that it works the first time a GPU is lent."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_benchmark

gs = load_benchmark("gpu_session")
ROOT = Path(__file__).resolve().parents[1]


def tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def test_pack_round_trips_every_image(tmp_path):
    files = {"train/cat/0000.jpg": b"\xff\xd8one", "train/dog/0001.jpg": b"\xff\xd8two!", "test/cat/0002.jpg": b"x"}
    src = tree(tmp_path / "src", files)
    assert gs.pack(src, tmp_path / "d.pack") == 3
    assert gs.unpack(tmp_path / "d.pack", tmp_path / "out") == 3
    assert {p.relative_to(tmp_path / "out").as_posix(): p.read_bytes()
            for p in (tmp_path / "out").rglob("*") if p.is_file()} == files


def test_pack_refuses_what_is_not_an_image_tree(tmp_path):
    src = tree(tmp_path / "src", {"train/cat/0.jpg": b"a", "notes.txt": b"b"})
    with pytest.raises(ValueError, match="expected only"):
        gs.pack(src, tmp_path / "d.pack")


def _forged(tmp_path: Path, header: object, body: bytes = b"", magic: bytes = gs.MAGIC, size: int | None = None):
    raw = json.dumps(header).encode()
    path = tmp_path / "forged.pack"
    path.write_bytes(magic + (len(raw) if size is None else size).to_bytes(8, "little") + raw + body)
    return path


@pytest.mark.parametrize("header,body,match", [
    ({"format": "speedrun-pack", "version": 1, "files": [["train/../../etc/x.jpg", 1]]}, b"a", "bad entry"),
    ({"format": "speedrun-pack", "version": 1, "files": [["/abs/c/x.jpg", 1]]}, b"a", "bad entry"),
    ({"format": "speedrun-pack", "version": 1, "files": [["train/c/x.exe", 1]]}, b"a", "bad entry"),
    ({"format": "speedrun-pack", "version": 1, "files": [["train/./x.jpg", 1]]}, b"a", "bad entry"),
    ({"format": "speedrun-pack", "version": 1, "files": [["train/../x.jpg", 1]]}, b"a", "bad entry"),
    ({"format": "speedrun-pack", "version": 1, "files": [["train/c/x.jpg", 5]]}, b"a", "add up"),
    ({"format": "speedrun-pack", "version": 1, "files": [["train/c/x.jpg", 1], ["train/c/x.jpg", 1]]}, b"ab",
     "duplicate"),
    ({"format": "speedrun-pack", "version": 1, "files": [["train/c/x.jpg", -1]]}, b"", "bad entry"),
    ({"format": "speedrun-pack", "version": 1, "files": [["train/c/x.jpg", True]]}, b"a", "bad entry"),
    ({"format": "other", "version": 1, "files": []}, b"", "version-1"),
    ({"format": "speedrun-pack", "version": 1, "files": "x"}, b"", "version-1"),
    (["a", "list"], b"", "version-1"),
    ("a string", b"", "version-1"),
])
def test_a_forged_pack_is_refused_before_anything_is_written(tmp_path, header, body, match):
    with pytest.raises(ValueError, match=match):
        gs.unpack(_forged(tmp_path, header, body), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_header_nested_thousands_deep_is_one_value_error(tmp_path):
    path = tmp_path / "deep.pack"
    raw = b"[" * 200_000 + b"]" * 200_000
    path.write_bytes(gs.MAGIC + len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(ValueError):
        gs.unpack(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_pack_with_a_wrong_magic_or_a_huge_header_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a speedrun pack"):
        gs.unpack(_forged(tmp_path, {}, magic=b"PK\x03\x04" + b"\0" * 12), tmp_path / "out")
    with pytest.raises(ValueError, match="header of"):
        gs.unpack(_forged(tmp_path, {}, size=1 << 40), tmp_path / "out")


def test_a_bad_pack_is_one_line_from_the_command(tmp_path, capsys):
    path = _forged(tmp_path, {"format": "speedrun-pack", "version": 1, "files": [["../x.jpg", 1]]}, b"a")
    assert gs.main(["run", "--pack", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu_session: error: ") and "bad entry" in err and err.count("\n") == 1


def test_unpack_never_writes_into_an_existing_folder(tmp_path):
    src = tree(tmp_path / "src", {"train/c/0.jpg": b"a"})
    gs.pack(src, tmp_path / "d.pack")
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError):
        gs.unpack(tmp_path / "d.pack", tmp_path / "out")


@pytest.mark.slow
def test_the_whole_session_runs_on_the_cpu_at_tiny_sizes(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_session.py"), "run", "--dry-run-cpu",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "session.json").read_text())
    assert [s["step"] for s in record["steps"]] == [
        "sync-debug", "kernels-fp16", "kernels-bf16", "race-eager", "race-compiled", "race-autocast",
        "race-index-free-pool", "muon", "transfer", "loader"]
    assert all(s["status"] == "done" for s in record["steps"]), record["steps"]
    for name in ("sync-debug.json", "kernels-fp16.json", "race-eager.json", "muon.json", "transfer.json",
                 "loader.json"):
        assert (out / name).is_file(), name
    fp16 = json.loads((out / "kernels-fp16.json").read_text())
    assert fp16["launches"]["per_step"]["host_to_device"] == 0
