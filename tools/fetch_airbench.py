"""airbench 0.1.8's source, for the races and the tests that run its own code: `python tools/fetch_airbench.py`.

Writes third_party/airbench-0.1.8/ (git-ignored): the PyPI sdist of airbench 0.1.8, fetched from PyPI's file
host, checked against the SHA-256 that PyPI's index publishes for it, and unpacked with the standard library's
`data` filter (no links out of the folder, no device files, no permission bits beyond the owner's). Nothing in it is
run: `pip download airbench==0.1.8` would run its setup.py to read its metadata, which is why this fetches the file
itself. An unpacked copy already there is kept as it is; `--check` only says whether it is there.

benchmarks/vs_airbench.py (the races), benchmarks/launch_counts.py (airbench94's kernels a step) and
benchmarks/step_parity.py (ours and airbench's training steps from one start) import it with
PYTHONPATH=src:third_party/airbench-0.1.8; so do tests/test_step_parity.py and tests/test_lean_step.py, which CI
(.ci/run) runs after this.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "third_party"
NAME = "airbench-0.1.8"
# PyPI's file and its digest, as https://pypi.org/simple/airbench/ lists them
URL = ("https://files.pythonhosted.org/packages/44/dc/23899726cc27a80e0e1ddbc0c06cd97f8acba2c78dd56a8bdc3450e5e723/"
       "airbench-0.1.8.tar.gz")
SHA256 = "f85885d8afe9018b8da132a4224ad7b47d75c9f99fd985d0a687567a25cf4a33"
MAX_BYTES = 1 << 20  # the sdist is about 12 KB; a larger answer is not it
TIMEOUT_S = 60


def fetch(url: str = URL, timeout_s: float = TIMEOUT_S) -> bytes:
    """The sdist's bytes, at most MAX_BYTES read, checked against SHA256 (ValueError otherwise)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        data = answer.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ValueError(f"{url} sent more than {MAX_BYTES:,} bytes: not airbench 0.1.8's sdist")
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise ValueError(f"{url} sent a file whose SHA-256 is {digest}, not PyPI's {SHA256} for airbench 0.1.8")
    return data


def unpack(data: bytes, folder: Path = FOLDER) -> Path:
    """The checked sdist unpacked into folder/airbench-0.1.8, made whole in a temporary folder beside it and then
    renamed into place (an interrupted unpack leaves no half folder that would pass for the real one)."""
    if not hasattr(tarfile, "data_filter"):  # Python 3.10.12 / 3.11.4 and later have it
        raise ValueError("this Python's tarfile has no `data` extraction filter; use Python 3.10.12, 3.11.4 or later")
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / NAME
    with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as work, \
            tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        archive.extractall(work, filter="data")
        unpacked = Path(work) / NAME
        if not (unpacked / "airbench" / "lib_airbench94.py").is_file():
            raise ValueError(f"the sdist holds no {NAME}/airbench/lib_airbench94.py")
        unpacked.rename(target)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only say whether third_party/airbench-0.1.8 is there")
    args = p.parse_args(argv)
    target = FOLDER / NAME
    if (target / "airbench" / "lib_airbench94.py").is_file():
        print(f"{target.relative_to(ROOT)} is there")
        return 0
    if args.check:
        print(f"{target.relative_to(ROOT)} is missing: run python tools/fetch_airbench.py", file=sys.stderr)
        return 1
    try:
        where = unpack(fetch())
    except (OSError, ValueError, tarfile.TarError) as e:  # urllib's errors are OSErrors
        print(f"fetch_airbench.py: error: {e}", file=sys.stderr)
        return 2
    print(f"airbench 0.1.8 (SHA-256 {SHA256[:12]}…) unpacked into {where.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
