"""The prepared command for the minutes a GPU is lent: the measurements that need one, most important first, each
result written under --out the moment it exists, none started that the time budget cannot finish.

    # here, once: airbench's sdist and cifar10-jpeg packed into one file, both git-ignored, carried to the device
    python benchmarks/gpu_session.py pack --data ../shared/datasets/cifar10-jpeg --out third_party/cifar10-jpeg.pack
    # on the device (the `run` tool, carry ["third_party"], timeout_s a minute over the budget; nothing installed:
    # the steps run this tree's src/ with PYTHONPATH, on the device image's torch):
    PYTHONUNBUFFERED=1 python benchmarks/gpu_session.py run --budget-s 480 --out $OUT
    # in CI and here, the same steps at tiny sizes on the CPU (no GPU, no airbench needed):
    python benchmarks/gpu_session.py run --dry-run-cpu --out /tmp/gpu-dry

The steps, in order (a step whose estimate does not fit in what is left is skipped and named in session.json):
 1. sync-debug: one epoch of cifar10-94 under torch.cuda.set_sync_debug_mode("warn"): every synchronizing call the
    loop makes, counted and located (the lean-step test counts them on meta; this checks it on the device).
 2. kernels: `speedrun profile cifar10-94` at fp16 with half weights (the CUDA default) and at bf16 autocast: the
    operators' time side by side.
 3. race: benchmarks/vs_airbench.py, ours against airbench94 0.1.8, eager, n = 10 a side; then ours compiled
    (compile_mode=default; the dry run passes compile=false, as compiling takes a minute on a CPU), ours with
    autocast instead of half weights (half_weights=off) and ours pooling without indices in evaluation
    (index_free_eval_pool=true), n = 5 a side each.
 4. muon: cifar10-94-muon beside airbench94_muon, when the sdist holds airbench94_muon (0.1.8 does not: the step
    then trains cifar10-94-muon alone, n = 5, and says so).
 5. transfer: `speedrun ablate cifar10-resnet18` at 5 epochs, n = 2: which of airbench's tricks transfer.
 6. loader: `speedrun bench-loader` with TorchCodec's nvJPEG where it is installed, else Pillow, on shards of the
    packed images.
session.json lists each step: done (its file), failed (its last lines) or skipped (why); session.log the output.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # the device runs the tree as it is, nothing installed (its image has torch)
    sys.path.insert(0, str(ROOT / "src"))
AIRBENCH = ROOT / "third_party" / "airbench-0.1.8"
PACK = ROOT / "third_party" / "cifar10-jpeg.pack"

# A pack: MAGIC, the header's length (8 bytes, little-endian), the header (JSON: format, version, files as
# [relative path, bytes]), then every file's bytes in the header's order. Read back as a file from elsewhere:
# bounded sizes, names checked before anything is written, nothing in it executed.
MAGIC = b"SPEEDRUN-PACK\x00\x01\x00"
MAX_HEADER_BYTES = 16 << 20
MAX_FILES = 200_000
MAX_FILE_BYTES = 16 << 20
# {train,test}/<class>/<image>: no part only dots ("." or ".." would climb or alias a folder)
NAME = re.compile(r"(train|test)/(?!\.+/)[A-Za-z0-9_.-]{1,64}/[A-Za-z0-9_.-]{1,64}\.(jpg|jpeg|png)")


def pack(data: Path, out: Path) -> int:
    """Every image of `data` ({train,test}/<class>/<file>) into one file; returns the number of images."""
    files = sorted(p for p in data.rglob("*") if p.is_file())
    entries = [[p.relative_to(data).as_posix(), p.stat().st_size] for p in files]
    bad = [name for name, _ in entries if not NAME.fullmatch(name) or ".." in name]
    if bad or not entries:
        raise ValueError(f"{data}: expected only {{train,test}}/<class>/<image> files, found {bad[:3] or 'none'}")
    header = json.dumps({"format": "speedrun-pack", "version": 1, "files": entries}).encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_suffix(".part")  # ours: a failed earlier pack's part is written over
    try:
        with open(part, "wb") as f:
            f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            for p in files:
                f.write(p.read_bytes())
        part.replace(out)
    finally:
        part.unlink(missing_ok=True)
    return len(entries)


def unpack(pack_file: Path, dest: Path) -> int:
    """A pack's images into the new, empty folder `dest`, checked first; returns the number of images."""
    with open(pack_file, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError(f"{pack_file} is not a speedrun pack (made by `gpu_session.py pack`)")
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= MAX_HEADER_BYTES:
            raise ValueError(f"{pack_file}: a header of {size} bytes (at most {MAX_HEADER_BYTES})")
        try:
            header = json.loads(f.read(size))
        except RecursionError:  # a header nested thousands deep
            raise ValueError(f"{pack_file}: a header nested too deep to be a pack's") from None
        if not isinstance(header, dict):
            header = {}
        files = header.get("files")
        if header.get("format") != "speedrun-pack" or header.get("version") != 1 or not isinstance(files, list) \
                or not 0 < len(files) <= MAX_FILES:
            raise ValueError(f"{pack_file}: not a version-1 speedrun pack of 1 to {MAX_FILES} files")
        body = os.fstat(f.fileno()).st_size - f.tell()
        for entry in files:
            ok = (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and type(entry[1]) is int
                  and NAME.fullmatch(entry[0]) and ".." not in entry[0] and 0 < entry[1] <= MAX_FILE_BYTES)
            if not ok:
                raise ValueError(f"{pack_file}: a bad entry {str(entry)[:80]}")
        if len({e[0] for e in files}) != len(files) or sum(e[1] for e in files) != body:
            raise ValueError(f"{pack_file}: duplicate names, or sizes that do not add up to the {body} bytes held")
        if dest.exists():
            raise FileExistsError(f"{dest} exists: unpack writes only into a new folder")
        part = dest.with_name(dest.name + ".part")  # the folder appears whole or not at all
        part.mkdir(parents=True)
        try:
            for name, length in files:
                target = part / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(f.read(length))
            part.rename(dest)
        except BaseException:
            shutil.rmtree(part, ignore_errors=True)
            raise
    return len(files)


class Session:
    """Runs steps within a budget, writing session.json after each."""

    def __init__(self, out: Path, budget_s: float, dry: bool):
        self.out, self.dry, self.deadline = out, dry, time.monotonic() + budget_s
        self.record: dict = {"dry_run_cpu": dry, "budget_s": budget_s, "steps": []}
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "session.log", "a")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        (self.out / "session.json").write_text(json.dumps(self.record, indent=1) + "\n")

    def step(self, name: str, estimate_s: float, fn) -> None:
        entry = {"step": name, "estimate_s": estimate_s}
        if not self.dry and self.left() < estimate_s:
            entry.update(status="skipped", why=f"{self.left():.0f} s left, {estimate_s:.0f} s needed")
        else:
            start = time.monotonic()
            try:
                entry.update(status="done", **(fn() or {}))
            except Exception as e:  # a step's failure is recorded and the next step runs
                entry.update(status="failed", error=f"{type(e).__name__}: {e}"[-2000:])
            entry["seconds"] = round(time.monotonic() - start, 1)
        self.record["steps"].append(entry)
        print(f"[gpu_session] {name}: {entry['status']} {entry.get('why') or entry.get('error') or ''}",
              file=sys.stderr, flush=True)
        self.save()

    def command(self, args: list[str], name: str, timeout_s: float | None = None) -> dict:
        """A command with PYTHONPATH on src/ and the sdist; its output into session.log; a failure raises."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(AIRBENCH), str(ROOT / "benchmarks"),
                                                            os.environ.get("PYTHONPATH", "")]))
        limit = max(10.0, min(timeout_s or self.left(), self.left())) if not self.dry else None
        self.log.write(f"$ {' '.join(args)}\n")
        self.log.flush()
        done = subprocess.run(args, env=env, stdout=self.log, stderr=subprocess.STDOUT, timeout=limit, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"{name}: exit {done.returncode} (session.log has its output)")
        return {"command": " ".join(args)}


def sync_debug(device: str, dataset: str, epochs: float, extra: list[str]) -> dict:
    """One cifar10-94 run with CUDA's sync debug mode at "warn": each warning is a synchronizing call."""
    import torch

    import speedrun
    overrides = dict(item.split("=", 1) for item in extra)
    caught = io.StringIO()
    with warnings.catch_warnings(record=True) as seen, contextlib.redirect_stdout(caught):
        warnings.simplefilter("always")
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            speedrun.train("cifar10-94", dataset, device=device, epochs=epochs, overrides=overrides)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.empty_cache()  # the timed steps after it run in other processes: leave them the memory
    syncs = [str(w.message).splitlines()[0] for w in seen if "synchroniz" in str(w.message)]
    return {"synchronizing_calls": len(syncs), "first": syncs[:10]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("pack", help="pack an image tree into one file")
    p.add_argument("--data", required=True, help="a {train,test}/<class>/<image> tree")
    p.add_argument("--out", default=str(PACK), help="the pack to write")
    r = sub.add_parser("run", help="run the session's steps")
    r.add_argument("--out", required=True, help="folder for every result (the device's $OUT)")
    r.add_argument("--budget-s", type=float, default=480.0, help="seconds the steps may take in all")
    r.add_argument("--pack", default=str(PACK), help="the packed data set")
    r.add_argument("--dry-run-cpu", action="store_true", help="every step at tiny sizes on the CPU")
    args = parser.parse_args(argv)
    try:
        return _main(args)
    except (ValueError, OSError) as e:  # a bad pack, a missing folder: one line, not a traceback
        print(f"gpu_session: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    if args.what == "pack":
        print(f"{pack(Path(args.data), Path(args.out))} images packed into {args.out}")
        return 0
    out = Path(args.out)
    session = Session(out, args.budget_s, args.dry_run_cpu)
    py = sys.executable
    with tempfile.TemporaryDirectory() as scratch:
        if args.dry_run_cpu:
            # a tiny image tree packed and unpacked as the real one is: the pack's code runs in CI too
            from speedrun.data.synthetic import make
            tree = Path(scratch) / "tree"
            tiny = make("synthetic:train=40,test=20")
            from PIL import Image
            for split in ("train", "test"):
                images, labels = getattr(tiny, f"{split}_images"), getattr(tiny, f"{split}_labels")
                for i, (image, label) in enumerate(zip(images, labels)):
                    folder = tree / split / f"c{int(label)}"
                    folder.mkdir(parents=True, exist_ok=True)
                    Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"{i:04d}.jpg", quality=75)
            pack_file = Path(scratch) / "tiny.pack"
            pack(tree, pack_file)
        else:
            pack_file = Path(args.pack)
        data = Path(scratch) / "cifar10-jpeg"
        count = unpack(pack_file, data)
        session.record["data"] = {"pack": str(pack_file), "images": count}
        device = "cpu" if args.dry_run_cpu else "cuda"
        tiny = ["batch_size=16", "widths=8,16,16", "eval_batch_size=16", "whiten_images=16"] if args.dry_run_cpu \
            else []
        sets = [x for item in tiny for x in ("--set", item)]
        epochs = "0.5" if args.dry_run_cpu else "1"

        session.step("sync-debug", 60, lambda: _dump(out / "sync-debug.json", sync_debug(
            device, str(data), float(epochs), tiny)))
        for precision, half in (("fp16", "auto"), ("bf16", "off")):
            name = f"kernels-{precision}"
            session.step(name, 60, lambda p=precision, h=half, n=name: session.command(
                [py, "-m", "speedrun.cli.program", "profile", "cifar10-94", "--dataset",
                 "synthetic:train=2048,test=512" if args.dry_run_cpu else "synthetic", "--device", device,
                 "--steps", "2" if args.dry_run_cpu else "5", "--set", f"precision={p}", "--set", f"half_weights={h}",
                 *sets, "--json", str(out / f"{n}.json"), "--trace", str(out / f"{n}.trace.json")], n))
        race = [py, "benchmarks/vs_airbench.py", "--data", str(data)]
        if args.dry_run_cpu:
            race += ["--dry-run-cpu", *sets, "--set", "epochs=0.5", "--set", "eval_each_epoch=false"]
        else:
            race += ["--set", "eval_each_epoch=false"]
        for name, runs, extra, estimate in (("race-eager", 10, [], 150),
                                            ("race-compiled", 5, ["--set", "compile=true", "--set",
                                                                  "compile_mode=default"], 180),
                                            ("race-autocast", 5, ["--set", "half_weights=off"], 80),
                                            ("race-index-free-pool", 5, ["--set", "index_free_eval_pool=true"], 80)):
            if args.dry_run_cpu and name == "race-compiled":  # compiling takes a minute on a CPU: its flags only
                extra = ["--set", "compile=false", "--set", "compile_mode=default"]
            session.step(name, estimate, lambda n=name, k=runs, e=extra: session.command(
                [*race, "--runs", "2" if args.dry_run_cpu else str(k), *e, "--out", str(out / f"{n}.json")], n))
        session.step("muon", 90, lambda: {"note": "airbench 0.1.8's sdist holds no airbench94_muon: ours alone",
                                          **session.command(
            [py, "-m", "speedrun.cli.program", "train", "cifar10-94-muon", "--dataset", str(data), "--device", device,
             "--runs", "1" if args.dry_run_cpu else "5", *sets, *(["--epochs", epochs] if args.dry_run_cpu else []),
             "--quiet", "--db", str(out / "muon.db"), "--json", str(out / "muon.json")], "muon")})
        resnet = ["--set", "batch_size=16", "--set", "eval_batch_size=16", "--set", "widths=8,8,16,16"] \
            if args.dry_run_cpu else []
        session.step("transfer", 240, lambda: session.command(
            [py, "-m", "speedrun.cli.program", "ablate", "cifar10-resnet18", "--dataset", str(data), "--device",
             device, "--runs", "1" if args.dry_run_cpu else "2", "--epochs", "0.5" if args.dry_run_cpu else "5",
             *resnet, "--db", str(out / "transfer.db"), "--json", str(out / "transfer.json")], "transfer"))
        shards = Path(scratch) / "shards"
        session.step("loader", 90, lambda: (session.command(
            [py, "-m", "speedrun.cli.program", "data", "prepare", str(data), str(shards)], "prepare"),
            session.command([py, "-m", "speedrun.cli.program", "bench-loader", str(shards), "--device", device,
                             "--workers", "2" if args.dry_run_cpu else "4,8", "--res", "32", "--decode-px", "32",
                             "--batches", "3" if args.dry_run_cpu else "30", "--runs", "1" if args.dry_run_cpu
                             else "3", "--json", str(out / "loader.json")], "loader"))[1])
    session.save()
    shutil.copy(out / "session.json", out / "session.final.json")
    failed = [s["step"] for s in session.record["steps"] if s["status"] == "failed"]
    print(f"[gpu_session] done; failed: {', '.join(failed) or 'none'}", file=sys.stderr)
    return 1 if failed and args.dry_run_cpu else 0


def _dump(path: Path, report: dict) -> dict:
    path.write_text(json.dumps(report, indent=1) + "\n")
    return {"file": path.name, **report}


if __name__ == "__main__":
    raise SystemExit(main())
