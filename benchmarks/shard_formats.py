"""Which shard format should `speedrun data prepare` write? WebDataset tar shards, LitData chunks, and
the same tar shards with speedrun's index of byte offsets (data/shards.py).

    python benchmarks/shard_formats.py --src ../shared/datasets/imagenet-sample/val --runs 5 \
        --json benchmarks/results/issue9/shard-formats-cpu.json

Both formats get the same bytes: every image of SRC (a class-folder tree) decoded once with Pillow, turned upright
(EXIF), converted to RGB, shrunk to --max-side pixels and re-encoded as JPEG at --quality (FFCV's `max_res` and
`jpeg_quality`; 256 and 90 here). Then, per format: the seconds to write the shards (once; it is a one-time cost),
and over --runs interleaved rounds (A B A B ...) the images per second of one reader process reading every sample
in order, without decoding (the format's own cost) and with Pillow decoding (what a loader worker pays), and the
seconds to read one sample near the end from a cold reader (what a resumed epoch pays to find its place).
WebDataset is imported as `webdataset`, LitData as `litdata` (installed with --no-deps here: its declared
dependencies include torchvision, which would replace this machine's CPU torch with a CUDA build).
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image, ImageOps

SUFFIXES = {".jpg", ".jpeg", ".png", ".JPEG", ".JPG", ".PNG"}


def prepared_samples(src: Path, max_side: int, quality: int) -> list[tuple[bytes, int]]:
    """(JPEG bytes, class index) for every image under src/<class>/, classes in sorted order."""
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    out = []
    for label, name in enumerate(classes):
        for path in sorted((src / name).iterdir()):
            if path.suffix not in SUFFIXES:
                continue
            with Image.open(path) as im:
                im = ImageOps.exif_transpose(im).convert("RGB")
                im.thumbnail((max_side, max_side), Image.Resampling.BILINEAR)
                buf = io.BytesIO()
                im.save(buf, format="JPEG", quality=quality)
            out.append((buf.getvalue(), label))
    return out


def _litdata_sample(item):  # module level: LitData's optimize() pickles its function into a worker
    return {"jpg": item[0], "cls": item[1]}


def write_webdataset(samples, root: Path) -> Path:
    import webdataset as wds

    root.mkdir(parents=True)
    with wds.ShardWriter(str(root / "shard-%05d.tar"), maxsize=64 * 2**20, verbose=0) as sink:
        for i, (jpg, label) in enumerate(samples):
            sink.write({"__key__": f"{i:08d}", "jpg": jpg, "cls": str(label).encode()})
    return root


def write_litdata(samples, root: Path) -> Path:
    from litdata import optimize

    optimize(fn=_litdata_sample, inputs=samples, output_dir=str(root), chunk_bytes="64MB", num_workers=1)
    return root


def read_webdataset(root: Path, decode: bool) -> int:
    import webdataset as wds

    count = 0
    for sample in wds.WebDataset(sorted(str(p) for p in root.glob("*.tar")), shardshuffle=False):
        if decode:
            Image.open(io.BytesIO(sample["jpg"])).convert("RGB").load()
        count += 1
    return count


def read_litdata(root: Path, decode: bool) -> int:
    from litdata import StreamingDataset

    count = 0
    for sample in StreamingDataset(str(root)):
        if decode:
            Image.open(io.BytesIO(bytes(sample["jpg"]))).convert("RGB").load()
        count += 1
    return count


def seek_webdataset(root: Path, index: int) -> None:
    """A tar has no index: the reader passes every sample before `index`."""
    import webdataset as wds

    for i, _ in enumerate(wds.WebDataset(sorted(str(p) for p in root.glob("*.tar")), shardshuffle=False)):
        if i == index:
            return


def seek_litdata(root: Path, index: int) -> None:
    """LitData's index.json maps a sample to its chunk and offset."""
    from litdata import StreamingDataset

    StreamingDataset(str(root))[index]


def markdown(report: dict) -> str:
    """BENCHMARKS.md's rows (benchmarks/table.py): per format, write time and size, read rates, cold seek."""
    from speedrun.records.environment import device_label
    from speedrun.records.stats import summarize

    env, cmd = report["environment"], report["command"].replace("|", "\\|")
    lines = ["| date | device | command | format | n | write s | MiB | read img/s, no decode | read img/s, "
             "Pillow decode | last sample, cold reader (ms) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in report["formats"].items():
        rates = [summarize(row[k]) for k in ("images_per_s", "decoded_images_per_s")]
        seek = summarize([1000 * x for x in row["seek_last_seconds"]])
        cells = [f"{r.mean:.0f} ± {r.std:.0f}" for r in rates] + [f"{seek.mean:.1f} ± {seek.std:.1f}"]
        lines.append(f"| {env['timestamp_utc'][:10]} | {device_label(env)} | `{cmd}` | {name} | {report['runs']} | "
                     f"{row['write_seconds']:.2f} | {row['bytes_on_disk'] / 2**20:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_indexed_tar(samples, root: Path) -> Path:
    """speedrun's own (data/shards.py): the same tar layout as WebDataset's, plus an index of byte offsets."""
    from speedrun.data.shards import write_split

    root.mkdir(parents=True)
    write_split(iter(samples), root, "val", shard_bytes=64 * 2**20)
    return root


def read_indexed_tar(root: Path, decode: bool) -> int:
    from speedrun.data.shards import Shards

    with Shards(root, "val") as shards:
        for i in range(len(shards)):
            data = shards.read(i)
            if decode:
                Image.open(io.BytesIO(data)).convert("RGB").load()
        return len(shards)


def seek_indexed_tar(root: Path, index: int) -> None:
    from speedrun.data.shards import Shards

    with Shards(root, "val") as shards:
        shards.read(index)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, required=True)
    parser.add_argument("--max-side", type=int, default=256)
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    from speedrun.records.environment import environment
    from speedrun.records.result_file import write_json

    start = time.perf_counter()
    samples = prepared_samples(args.src, args.max_side, args.quality)
    prepare_s = time.perf_counter() - start
    formats = {"webdataset": (write_webdataset, read_webdataset, seek_webdataset),
               "litdata": (write_litdata, read_litdata, seek_litdata),
               "indexed-tar": (write_indexed_tar, read_indexed_tar, seek_indexed_tar)}
    report = {"benchmark": "shard_formats", "command": " ".join(["python", *sys.argv]),
              "environment": environment("cpu"), "images": len(samples), "max_side": args.max_side,
              "quality": args.quality, "prepare_seconds": prepare_s, "runs": args.runs,
              "bytes_of_jpegs": sum(len(j) for j, _ in samples), "formats": {}}
    with tempfile.TemporaryDirectory() as tmp:
        roots = {}
        for name, (write, _, _) in formats.items():
            start = time.perf_counter()
            roots[name] = write(samples, Path(tmp) / name)
            report["formats"][name] = {"write_seconds": time.perf_counter() - start, "images_per_s": [],
                                       "decoded_images_per_s": [], "seek_last_seconds": [],
                                       "bytes_on_disk": sum(p.stat().st_size for p in roots[name].rglob("*")
                                                            if p.is_file())}
        for _ in range(args.runs):  # interleaved: drift on a shared machine falls on both
            for name, (_, read, seek) in formats.items():
                row = report["formats"][name]
                for decode, key in ((False, "images_per_s"), (True, "decoded_images_per_s")):
                    start = time.perf_counter()
                    assert read(roots[name], decode) == len(samples)
                    row[key].append(len(samples) / (time.perf_counter() - start))
                start = time.perf_counter()
                seek(roots[name], len(samples) - 1)
                row["seek_last_seconds"].append(time.perf_counter() - start)
    write_json(args.json, report)
    for name, row in report["formats"].items():
        mean = {k: sum(row[k]) / len(row[k]) for k in ("images_per_s", "decoded_images_per_s", "seek_last_seconds")}
        print(f"{name:10} write {row['write_seconds']:.2f} s, {row['bytes_on_disk'] / 2**20:.1f} MiB; read "
              f"{mean['images_per_s']:.0f} img/s raw, {mean['decoded_images_per_s']:.0f} img/s decoded; "
              f"last sample from cold {mean['seek_last_seconds'] * 1000:.1f} ms (n = {args.runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
