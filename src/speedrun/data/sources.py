"""Where datasets come from: `load_dataset(spec)` turns a name or a path into a `Dataset`.

Named datasets are downloaded once (MD5-verified, from the first of their mirrors that gives the file:
`download.mirror_urls`) into `<cache_dir>/downloads/`; every decoded dataset
except `synthetic` is then saved as one torch file in `<cache_dir>/cache/` and read from there next time (a sample
of an image folder, a smoke test's, is decoded alone and never cached: a cache file stands for the whole source).
The cache (`cache.py`) is keyed by a fingerprint of the source, so editing an image folder or swapping files in
--data-dir rebuilds it.
"""

from __future__ import annotations

import heapq
import operator
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from speedrun.data import cifar, folder, idx, limits, synthetic
from speedrun.data.archive import safe_extract
from speedrun.data.cache import CACHED_AFTERWARDS, cache_path, cached, fingerprint_files
from speedrun.data.dataset import Dataset, check_data_limit, check_dataset, sample_order
from speedrun.data.download import Remote, fetch, md5_file, mirror_urls
from speedrun.errors import escaped_log, escaped_refusals, printable, warn
from speedrun.paths import data_root, make_folder, user_path

# Every named dataset's published files; tests point the entries at local file:// archives.
SOURCES: dict[str, Remote] = {**cifar.REMOTES, **idx.REMOTES}

Log = Callable[[str], None]


def _no_log(_: str) -> None:
    pass


@escaped_refusals
def load_dataset(
    spec: str,
    *,
    data_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    download: bool = True,
    log: Log | None = None,
    image_size: int | None = None,
    sample: tuple[int, int] | None = None,
) -> Dataset:
    """Load a dataset by name (cifar10, cifar100, mnist, fashion-mnist, kmnist, synthetic[:k=v,...]) or path.

    A path may be an image folder (ROOT/{train,test}/<class>/<image>, or val/ for test/: the test split then comes
    from val/, and describe() says so), a folder of CIFAR python batches,
    a cifar-*-python.tar.gz (or a folder holding one), or a folder of IDX files.
    data_dir: where a named dataset's raw files already are. Nothing is downloaded then: a folder without them is
    refused, saying what it holds, and files that are not the published ones (MD5, or the set of batch files) load
    with a warning, their Dataset's `unofficial` saying how they differ.
    cache_dir: downloads and caches go here; default $SPEEDRUN_DATA, else ~/.cache/speedrun.
    download: False never touches the network (cache, data_dir or files already in downloads/ only).
    log: receives progress lines (downloads, first-read decoding, cache hits), escaped (errors.printable) as
    what it refuses is.
    image_size: image folders only: scale every image so its shorter side is this many pixels, then centre-crop
    it square. Without it, the images of a folder must share one size.
    sample: (train, test): only that many images of each split, Dataset.sample's (a smoke test's). An image folder
    then decodes those images alone, and neither reads nor writes the cache: a cache file stands for the whole
    folder, and the few images cost less to decode than the cache to read.
    Every dataset returned, from the cache or freshly read, has passed `check_dataset` and `check_data_limit`.
    """
    for name, value in (("dataset", spec), ("data_dir", data_dir), ("cache_dir", cache_dir)):
        if not isinstance(value, (str, bytes, os.PathLike)) and not (value is None and name != "dataset"):
            raise ValueError(f"{name}={value!r:.80} is not a path or name; pass a string or a pathlib.Path")
    log = _no_log if log is None else escaped_log(log)
    limits.max_dataset_bytes()  # a bad SPEEDRUN_MAX_DATA_BYTES is one error now, not a cache "rebuilt" later
    text = os.fsdecode(spec).strip()  # a bytes path that is not UTF-8 keeps its bytes as surrogates
    lowered = text.lower()
    image_size = _check_image_size(image_size)
    if lowered == "synthetic" or lowered.startswith("synthetic:"):
        if image_size is not None:
            raise ValueError("image_size (--image-size) applies to image folders only, not to synthetic data; "
                             "leave it out and set the spec's shape=3xNxN instead")
        return _accept(_sampled(synthetic.make(text), sample), text)
    cache_root = data_root(cache_dir, "cache_dir")
    if lowered in SOURCES:
        if image_size is not None:
            raise ValueError(f"image_size (--image-size) applies to image folders only, not to {lowered}; leave it "
                             "out")
        return _accept(_sampled(_load_named(lowered, data_dir, cache_root, download, log), sample), lowered)
    path = user_path(text, "--dataset")
    if text and _exists(path):
        return _accept(_load_path(path, cache_root, log, image_size, sample), str(path))
    raise ValueError(
        f"unknown dataset {text!r}: use one of {', '.join(SOURCES)}, synthetic or synthetic:key=val,..., "
        f"or a path that exists (image folder with train/ and test/ or val/, CIFAR batches or .tar.gz, IDX files)"
    )


def _accept(ds: Dataset, source: str) -> Dataset:
    return check_data_limit(check_dataset(ds, source), source)


def _sampled(ds: Dataset, sample: tuple[int, int] | None) -> Dataset:
    return ds if sample is None else ds.sample(*sample)


def _check_image_size(image_size: object) -> int | None:
    if image_size is None:
        return None
    try:
        n = operator.index(image_size)  # ints, numpy ints; not floats, strings or bools (below)
    except TypeError:
        n = None
    # 8 px: the CIFAR nets halve the resolution three times, leaving them one pixel. The largest side is the one
    # an in-memory folder keeps without resizing (limits.MAX_IMAGE_SIDE_PX).
    if n is None or isinstance(image_size, bool) or not 8 <= n <= limits.MAX_IMAGE_SIDE_PX:
        raise ValueError(f"image_size (--image-size) must be a whole number of pixels from 8 to "
                         f"{limits.MAX_IMAGE_SIDE_PX}, got {image_size!r}; pass e.g. image_size=32 (--image-size 32)")
    return n


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError as e:  # Path.exists ignores ENOENT, ENOTDIR and ELOOP, not EACCES
        shown = str(path)
        raise ValueError(f"cannot look at {shown} ({e.strerror}); check its permissions") from None


# ---- named datasets ---------------------------------------------------------------------------------------------


def _load_named(name: str, data_dir: str | os.PathLike | None, cache_root: Path, download: bool, log: Log) -> Dataset:
    remote = SOURCES[name]
    if data_dir is not None:
        root = user_path(data_dir, "--data-dir")
        if root.is_file():  # --data-dir may name the archive itself: only CIFAR comes as one, each its own
            if remote.kind == "idx":
                raise ValueError(
                    f"{name} is read from a folder holding its four IDX files ({', '.join(idx.FILES.values())}, "
                    f".gz or not), but {root} is a file; pass the folder holding them as data_dir (--data-dir)"
                )
            other = next((k for k, n in cifar.ARCHIVE_NAMES.items() if n == root.name and k != name), None)
            if other is not None or not root.name.endswith((".tar.gz", ".tgz", ".tar")):
                raise ValueError(
                    f"{root} is {f'the {other} archive' if other else 'not a .tar.gz archive'}; for {name} pass "
                    f"{cifar.ARCHIVE_NAMES[name]} (or the folder holding it) as data_dir (--data-dir)"
                )
            # A renamed archive of the other CIFAR is caught after extraction, where _read_archive checks the kind.
            return _published_or_warned(_Found("archive", root, (root,)), root, name, remote, cache_root, log)
        if not root.is_dir():
            if os.path.lexists(root):  # a symlink loop, a device, a FIFO ...
                raise ValueError(f"data dir {root} is neither a folder nor an archive file; pass data_dir "
                                 "(--data-dir) as the folder or the archive")
            raise FileNotFoundError(f"data dir {root} does not exist; create it or fix data_dir (--data-dir)")
        found = _find_local(name, remote, root)
        if found is None:
            # The user said where the files are: downloading them elsewhere instead (170 MB for CIFAR) is not what
            # was asked, and the useful line is what this folder lacks.
            raise FileNotFoundError(_not_in_data_dir(name, remote, root, cache_root))
        return _published_or_warned(found, root, name, remote, cache_root, log)
    downloads = cache_root / "downloads" / ("" if remote.kind == "cifar" else name)

    def build(note: str) -> Dataset:
        paths = []
        for url, md5 in remote.files:
            dest = downloads / url.rsplit("/", 1)[-1]
            if not download and not dest.exists():
                raise FileNotFoundError(
                    f"{dest.name} is not in {downloads} and downloading is off; put {dest.name} (md5 {md5}) "
                    f"there or pass --data-dir"
                )
            paths.append(fetch(mirror_urls(url, remote.mirrors), dest, md5, log))
        if remote.kind == "cifar":
            return _dataset(name, *_read_archive(paths[0], cache_root, log, expect=name, note=note)[1])
        return _dataset(name, *_read_idx(dict(zip(idx.FILES, paths)), remote.classes))

    md5s = "\n".join(md5 for _, md5 in remote.files)
    return cached(cache_path(cache_root, name, "official", md5s), build, log)


def _published_or_warned(found: _Found, root: Path, name: str, remote: Remote, cache_root: Path, log: Log) -> Dataset:
    """`name` from the files found in data_dir `root`, checked against the published ones (_unpublished).

    A copy that differs (a hand-made or modified archive, a subset of the batches) is not `name`: it loads, as the
    same files given as a path dataset do, but carries how it differs (Dataset.unofficial, kept in the cache, said
    by describe()) and is warned about on every load, naming the fix. Loaded with a warning rather than refused:
    small hand-made copies through data_dir are how scripts and tests run offline, and Dataset.unofficial lets
    whatever records a run tell it from the published data, which the Dataset's name cannot (a CIFAR archive given
    as a path is named "cifar10" by its kind, too).
    """
    ds = _load_found(found, cache_root, log, name=name, classes=remote.classes, published=remote)
    if ds.unofficial:
        warn(f"data_dir (--data-dir) {root} is not the published {name} ({ds.unofficial}), so its results are not "
             f"{name}'s: use the published files, or give it as a path dataset (--dataset {root}) to have it "
             "recorded under its own name")
    return ds


def _unpublished(found: _Found, remote: Remote) -> str:
    """How the files of a data_dir copy differ from `remote`'s published ones; empty when they are those. Reads
    every byte once more (about 0.3 s for CIFAR's 170 MB), on the first read only: the cache keeps the answer."""
    try:
        if found.kind == "archive":
            ((url, md5),) = remote.files
            actual = md5_file(found.path)
            return "" if actual == md5 else f"{found.path.name} has md5 {actual}, not the published {md5}"
        if found.kind == "idx":
            published = dict(zip(idx.FILES, (md5 for _, md5 in remote.files)))
            for role, path in found.idx_files:
                if not path.name.endswith(".gz"):
                    return f"{path.name} is not gzipped, and only the published .gz files have an md5 to check"
                actual = md5_file(path)
                if actual != published[role]:
                    return f"{path.name} has md5 {actual}, not the published {published[role]}"
            return ""
        return cifar.unpublished(found.kind, found.path)
    except OSError as e:
        raise ValueError(f"cannot read {found.path} to check it against the published files ({e.strerror or e}); "
                         "check its permissions") from None


def _not_in_data_dir(name: str, remote: Remote, root: Path, cache_root: Path) -> str:
    """The refusal of a data_dir `root` without `name`'s files: what was looked for, and what is there."""
    if remote.kind == "cifar":
        needs = (f"{cifar.ARCHIVE_NAMES[name]}, or its extracted batches ({', '.join(cifar.PUBLISHED_BATCHES[name])}) "
                 f"in {root} or {root / cifar.SUBDIRS[name]}")
        downloads = cache_root / "downloads"
    else:
        needs = (f"its four IDX files ({', '.join(idx.FILES.values())}, .gz or not) in {root} or {root / name}, "
                 "or in a raw/ folder of either")
        downloads = cache_root / "downloads" / name
    return (f"data_dir (--data-dir) {root} holds no {name} files: {name} needs {needs}; {_holds(root, name)}: put "
            f"{name}'s files there, or leave out data_dir (--data-dir) to download them once (md5-checked) into "
            f"{downloads}")


def _holds(root: Path, name: str) -> str:
    """What the folder `root` holds, for _not_in_data_dir: another named dataset's files by whose they are, else its
    first few entries by name."""
    others = [f"{archive}, which is {kind}'s" for kind, archive in cifar.ARCHIVE_NAMES.items()
              if kind != name and (root / archive).is_file()]
    try:
        batches = cifar.find_batches(root)
        if batches is not None and batches[0] != name:
            others.append(f"{batches[0]}'s extracted batches ({batches[1]})")
        if SOURCES[name].kind != "idx" and idx.find_files(root) is not None:
            others.append("the four IDX files of an MNIST-style dataset")
    except OSError:  # a folder it cannot list, or only some IDX files: the listing below says what is there
        pass
    if others:
        return f"it holds {' and '.join(others)}"
    try:
        with os.scandir(root) as it:
            count, first = 0, []
            for e in it:  # the first few by name, without holding a listing of millions
                count += 1
                first = heapq.nsmallest(_SHOWN_ENTRIES, [*first, e.name + ("/" if _is_dir(e) else "")])
    except OSError as e:
        return f"it cannot be listed ({e.strerror or e})"
    if not count:
        return "it is empty"
    more = f" and {count - len(first)} more" if count > len(first) else ""
    return f"it holds {', '.join(first)}{more}"


_SHOWN_ENTRIES = 5


def _is_dir(e: os.DirEntry) -> bool:
    try:
        return e.is_dir()
    except OSError:  # a symlink loop
        return False


@dataclass(frozen=True)
class _Found:
    kind: str  # "cifar10" / "cifar100" (extracted batches), "archive", "idx" or "folder"
    path: Path
    files: tuple[Path, ...] = ()  # what the cache fingerprint covers (folders list their own)
    idx_files: tuple[tuple[str, Path], ...] = ()


def _find_local(name: str, remote: Remote, root: Path) -> _Found | None:
    """The raw files for `name` in a --data-dir, if there."""
    if remote.kind == "cifar":
        batches = cifar.find_batches(root)
        if batches is not None and batches[0] == name:
            return _Found(batches[0], batches[1], tuple(cifar.source_files(*batches)))
        archive = root / cifar.ARCHIVE_NAMES[name]
        return _Found("archive", archive, (archive,)) if archive.is_file() else None
    for d in (root, root / name):
        files = idx.find_files(d)
        if files is not None:
            return _Found("idx", d, tuple(files.values()), tuple(files.items()))
    return None


def _detect(path: Path) -> _Found:
    """What kind of dataset lives at a user-given path; raises with the accepted layouts if none."""
    if path.is_file():
        if path.name.endswith((".tar.gz", ".tgz", ".tar")):
            return _Found("archive", path, (path,))
        raise ValueError(f"{path} is a file but not a .tar.gz archive; pass a CIFAR archive or "
                         "a dataset folder")
    try:
        if folder.is_image_folder(path):
            return _Found("folder", path)
        layout = None
    except ValueError as e:  # train/ without test/ or val/, or with both: said unless another kind is here
        layout = e
    batches = cifar.find_batches(path)
    if batches is not None:
        return _Found(batches[0], batches[1], tuple(cifar.source_files(*batches)))
    archive = cifar.find_archive(path)
    if archive is not None:
        return _Found("archive", archive[1], (archive[1],))
    files = idx.find_files(path)
    if files is not None:
        return _Found("idx", path, tuple(files.values()), tuple(files.items()))
    if layout is not None:
        raise layout
    if any((path / name).is_file() for name in ("manifest.json", "train-index.npy", "val-index.npy")):
        raise ValueError(f"{path} is a prepared shards folder (written by `speedrun data prepare`), which the "
                         f"in-memory recipes do not read; use an imagenet-* recipe (e.g. `speedrun train "
                         f"imagenet-resnet18 --dataset {path}`)")
    raise ValueError(
        f"{path} holds no dataset: expected train/ and test/ (or val/) class folders, CIFAR python "
        f"batches (data_batch_N + test_batch, or train + test + meta), a cifar-*-python.tar.gz, or IDX files"
    )


def _load_path(path: Path, cache_root: Path, log: Log, image_size: int | None = None,
               sample: tuple[int, int] | None = None) -> Dataset:
    found = _detect(path)
    if image_size is not None and found.kind != "folder":
        holds = "a CIFAR archive" if found.kind == "archive" else f"{found.kind} files"
        raise ValueError(f"image_size (--image-size) applies to image folders only, but {path} "
                         f"holds {holds}; leave it out")
    # Extracted CIFAR batches are named by kind; other sources by their folder or archive name (an
    # archive's kind is known only after extraction, and build() names the Dataset then).
    base = path.resolve().name
    base = base[: -len(".tar.gz")] if base.endswith(".tar.gz") else Path(base).stem if path.is_file() else base
    # Escaped once, as a stored name: results, the cache and model cards keep it (a folder name that is not UTF-8
    # could not be written as UTF-8), and every message shows it as it is stored.
    name = found.kind if found.kind in cifar.ARCHIVE_NAMES else printable(base) or "dataset"
    if found.kind == "folder" and sample is not None:
        return _folder_sample(found.path, log, name, image_size, sample)
    return _sampled(_load_found(found, cache_root, log, name=name, classes=(), image_size=image_size), sample)


def _folder_sample(root: Path, log: Log, name: str, image_size: int | None, sample: tuple[int, int]) -> Dataset:
    """Dataset.sample of the image folder at `root`, decoding only the images it keeps: the same images, in the same
    order, as sampling the whole folder's dataset (the listing's order is the dataset's), and the same pixels but
    where a folder mixes grey and colour images and the sample drew grey ones alone (decode makes those one
    channel). Never cached."""
    listing = folder.list_images(root)
    picked = []
    for split, n in zip(("train", "test"), sample):
        files = listing.splits[split]
        order = sample_order(len(files), n)
        picked.append(files if order is None else [files[i] for i in order.tolist()])
    train, test = picked
    log(f"decoding {len(train) + len(test)} of {sum(len(f) for f in listing.splits.values())} images from {root} "
        "(a sample; not cached)")
    x = folder.decode([f.path for f in train + test], image_size=image_size, source=str(root))
    labels = [np.array([f.label for f in files], np.int64) for files in (train, test)]
    ds = _dataset(name, x[: len(train)], labels[0], x[len(train) :], labels[1], listing.classes)
    whole = (len(listing.splits["train"]), len(listing.splits["test"]))
    return replace(ds, test_from="" if listing.test_folder == "test" else f"{listing.test_folder}/",
                   left_out=listing.left_out.text(), sampled_from=None if whole == (len(train), len(test)) else whole)


def _load_found(found: _Found, cache_root: Path, log: Log, *, name: str, classes: tuple[str, ...],
                image_size: int | None = None, published: Remote | None = None) -> Dataset:
    """The dataset in `found`, named `name`. published: the named dataset these files stand for (a data_dir copy),
    whose published files they are checked against (_unpublished: Dataset.unofficial)."""
    source_id = f"{name}@{found.path.resolve()}"
    if published is not None:  # checked against the published files: Dataset.unofficial is in this cache file alone
        source_id += f"@as-published-{published.kind}"
    shown = str(found.path)
    if found.kind == "folder":
        listing = folder.list_images(found.path)
        class_names, splits = listing.classes, listing.splits
        content = folder.fingerprint(found.path, splits)
        if image_size is not None:  # its own cache file: switching sizes back and forth rebuilds neither
            source_id += f"@{image_size}px"

        def build(note: str) -> Dataset:
            n = sum(len(files) for files in splits.values())
            log(f"decoding {n} images from {shown} ({note})")
            start = time.perf_counter()
            train, test = splits["train"], splits["test"]
            # One decode for both splits, so they agree on the channel count (1 only if every image is grey).
            x = folder.decode([f.path for f in train + test], image_size=image_size, source=shown)
            log(f"decoded {n} images in {time.perf_counter() - start:.1f} s")
            labels = [np.array([f.label for f in files], np.int64) for files in (train, test)]
            return _dataset(name, x[: len(train)], labels[0], x[len(train) :], labels[1], class_names)

        # What the listing found is said each time, the cache's copy included: it holds only the pixels.
        ds = cached(cache_path(cache_root, name, source_id, content), build, log, source=shown)
        return ds.noted(test_from="" if listing.test_folder == "test" else f"{listing.test_folder}/",
                        left_out=listing.left_out.text())
    else:
        content = fingerprint_files(found.files)

        def build(note: str) -> Dataset:
            if found.kind == "archive":
                expect = name if name in SOURCES else None
                kind, arrays = _read_archive(found.path, cache_root, log, expect=expect, note=note)
                ds = _dataset(expect or kind, *arrays)
            elif found.kind == "idx":
                ds = _dataset(name, *_read_idx(dict(found.idx_files), classes))
            else:
                log(f"reading CIFAR batches from {shown} ({note})")
                ds = _dataset(name, *cifar.read_batches(found.kind, found.path))
            # Checked once the files have been read whole, so a damaged one is refused for what is wrong in it.
            return ds if published is None else replace(ds, unofficial=_unpublished(found, published))

    return cached(cache_path(cache_root, name, source_id, content), build, log, source=shown)


# ---- readers -----------------------------------------------------------------------------------------------------


def _read_archive(archive: Path, cache_root: Path, log: Log, *, expect: str | None,
                  note: str = CACHED_AFTERWARDS) -> tuple[str, tuple]:
    """Extract a CIFAR archive next to the downloads, read its batches, and delete the extracted copy. `note`: what
    the first-read line says of the cache (cache.cached's)."""
    scratch = cache_root / "downloads"
    make_folder(scratch, "the downloads folder", "remove or rename what is in the way, or set SPEEDRUN_DATA to "
                "another folder")
    if expect is not None and expect not in cifar.ARCHIVE_NAMES:
        # Only CIFAR comes as an archive; a named IDX dataset reaching here is a caller's bug, not the user's.
        raise ValueError(f"{archive} is a CIFAR archive, but {expect} is read from IDX files; pass its folder")
    # The scratch copy is removed on every exit (TemporaryDirectory), refused archives included.
    with tempfile.TemporaryDirectory(prefix=".extract-", dir=scratch) as tmp:
        log(f"extracting {archive} ({note})")
        # The official archives' sizes bound what one may write (limits.py); a bigger claim is refused unread.
        safe_extract(archive, tmp, max_member_bytes=limits.MAX_CIFAR_MEMBER_BYTES,
                     max_total_bytes=limits.MAX_CIFAR_ARCHIVE_BYTES, max_members=limits.MAX_ARCHIVE_MEMBERS)
        found = cifar.find_batches(Path(tmp))
        if found is None:
            raise ValueError(
                f"{archive} holds no CIFAR python batches; use cifar-10-python.tar.gz or cifar-100-python.tar.gz"
            )
        if expect is not None and found[0] != expect:
            raise ValueError(f"{archive} holds {found[0]} batches, not {expect}; pass {cifar.ARCHIVE_NAMES[expect]} "
                             f"as data_dir (--data-dir), or load it as {found[0]}")
        return found[0], cifar.read_batches(*found)


def _read_idx(files: dict[str, Path], classes: tuple[str, ...]) -> tuple:
    train_x, train_y = idx.read_split(files["train_images"], files["train_labels"])
    test_x, test_y = idx.read_split(files["test_images"], files["test_labels"])
    if train_x.shape[1:] != test_x.shape[1:]:
        raise ValueError(f"train images are {train_x.shape[1:]} but test images {test_x.shape[1:]}; mixed datasets?")
    top = int(max(train_y.max(initial=0), test_y.max(initial=0)))
    if classes and top >= len(classes):
        raise ValueError(f"{files['train_labels']}: label {top} but the dataset has {len(classes)} classes")
    if not classes:
        idx.check_inferred_classes(train_y, test_y, files["train_labels"], files["test_labels"])
    return train_x, train_y, test_x, test_y, list(classes) or [str(i) for i in range(top + 1)]


def _dataset(name: str, train_x, train_y, test_x, test_y, classes: list[str]) -> Dataset:
    def t(a: np.ndarray, dtype: np.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))

    return Dataset(name, t(train_x, np.uint8), t(train_y, np.int64), t(test_x, np.uint8), t(test_y, np.int64), classes)
