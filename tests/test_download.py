"""fetch(): verify, atomic write, reuse, offline errors; safe_extract(): refuse anything that escapes."""

from __future__ import annotations

import hashlib
import http.client
import io
import os
import tarfile
import urllib.error
import urllib.request

import pytest

from speedrun.data import download
from speedrun.data.archive import safe_extract
from speedrun.data.download import fetch, md5_file

PAYLOAD = bytes(range(256)) * 4000  # ~1 MB: spans a chunk boundary of the 1 MiB reader
PAYLOAD_MD5 = hashlib.md5(PAYLOAD).hexdigest()


@pytest.fixture
def served(tmp_path):
    """A file reachable through a file:// URL, as a stand-in for the dataset server."""
    src = tmp_path / "server" / "archive.tar.gz"
    src.parent.mkdir()
    src.write_bytes(PAYLOAD)
    return src.as_uri()


def _no_network(*args, **kwargs):
    raise AssertionError("urlopen must not be called")


class _FakeResponse:
    """A urlopen() result whose body stops early, as a dropped connection would leave it."""

    def __init__(self, body: bytes, length: int, incomplete: bool = False):
        self.stream = io.BytesIO(body)
        self.headers = {"Content-Length": str(length)}
        self.incomplete = incomplete

    def read(self, n):
        chunk = self.stream.read(n)
        if not chunk and self.incomplete:
            raise http.client.IncompleteRead(b"", 1)
        return chunk

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_fetch_downloads_verifies_and_logs(tmp_path, served):
    dest = tmp_path / "dl" / "archive.tar.gz"
    lines = []
    assert fetch(served, dest, PAYLOAD_MD5, lines.append) == dest
    assert dest.read_bytes() == PAYLOAD
    assert md5_file(dest) == PAYLOAD_MD5
    assert not (tmp_path / "dl" / "archive.tar.gz.part").exists()
    assert any("downloading" in line for line in lines) and any("md5 ok" in line for line in lines)


def test_fetch_wrong_checksum_leaves_no_file(tmp_path, served):
    dest = tmp_path / "archive.tar.gz"
    with pytest.raises(ValueError) as err:
        fetch(served, dest, "0" * 32)
    message = str(err.value)
    assert "archive.tar.gz" in message and "0" * 32 in message and PAYLOAD_MD5 in message
    assert "\n" not in message
    assert sorted(os.listdir(tmp_path)) == ["server"]  # neither dest nor dest.part


@pytest.mark.parametrize("incomplete", [False, True], ids=["short-body", "incomplete-read"])
def test_fetch_truncated_download_is_kept_to_resume_never_as_the_file(tmp_path, monkeypatch, incomplete):
    half = PAYLOAD[: len(PAYLOAD) // 2]
    monkeypatch.setattr(
        download.urllib.request, "urlopen", lambda url, timeout: _FakeResponse(half, len(PAYLOAD), incomplete)
    )
    dest = tmp_path / "archive.tar.gz"
    with pytest.raises(FileNotFoundError, match=rf"closed after {len(half)} of {len(PAYLOAD)} bytes.*{PAYLOAD_MD5}"):
        fetch("https://example.invalid/archive.tar.gz", dest, PAYLOAD_MD5)
    assert os.listdir(tmp_path) == [".archive.tar.gz.part"]  # never at dest's name
    assert (tmp_path / ".archive.tar.gz.part").read_bytes() == half


def test_fetch_reuses_a_good_file_without_network(tmp_path, monkeypatch):
    monkeypatch.setattr(download.urllib.request, "urlopen", _no_network)
    dest = tmp_path / "archive.tar.gz"
    dest.write_bytes(PAYLOAD)
    before = dest.stat().st_mtime_ns
    lines = []
    fetch("https://example.invalid/archive.tar.gz", dest, PAYLOAD_MD5, lines.append)
    assert dest.read_bytes() == PAYLOAD and dest.stat().st_mtime_ns == before
    assert lines == [f"using {dest} (md5 ok)"]


def test_fetch_keeps_an_existing_bad_file_and_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(download.urllib.request, "urlopen", _no_network)
    dest = tmp_path / "archive.tar.gz"
    dest.write_bytes(b"not the archive")
    with pytest.raises(ValueError, match=rf"delete {dest}.*--data-dir"):
        fetch("https://example.invalid/archive.tar.gz", dest, PAYLOAD_MD5)
    assert dest.read_bytes() == b"not the archive"


def test_fetch_offline_names_file_md5_and_directory(tmp_path, monkeypatch):
    def offline(url, timeout):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(download.urllib.request, "urlopen", offline)
    dest = tmp_path / "downloads" / "cifar-10-python.tar.gz"
    with pytest.raises(FileNotFoundError) as err:
        fetch("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", dest, PAYLOAD_MD5)
    message = str(err.value)
    assert f"put cifar-10-python.tar.gz (md5 {PAYLOAD_MD5}) in {tmp_path / 'downloads'}" in message
    assert "--data-dir" in message and "name resolution" in message and "\n" not in message
    assert os.listdir(tmp_path / "downloads") == []


# ---- safe_extract ------------------------------------------------------------------------------------------------


def _tar(path, members):
    """members: (name, kind, payload) with kind "file" (payload: bytes), "dir", "sym"/"hard" (payload: link
    target) or "chr" (a character device)."""
    with tarfile.open(path, "w:gz") as tf:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE,
                         "chr": tarfile.CHRTYPE}[kind]
            if kind == "dir":
                info.mode = 0o755
            if kind in ("sym", "hard"):
                info.linkname = payload
            tf.addfile(info)
    return path


def test_safe_extract_extracts_plain_archives(tmp_path):
    archive = _tar(tmp_path / "ok.tar.gz", [("top", "dir", None), ("top/a.bin", "file", b"abc"),
                                            ("top/sub", "dir", None), ("top/sub/b.bin", "file", b"de")])
    out = safe_extract(archive, tmp_path / "out")
    assert (out / "top" / "a.bin").read_bytes() == b"abc" and (out / "top" / "sub" / "b.bin").read_bytes() == b"de"


@pytest.mark.parametrize("kind, target", [("sym", "a.bin"), ("hard", "top/a.bin")])
def test_safe_extract_refuses_links_even_inside(tmp_path, kind, target):
    """No archive we read holds links, and links get around the size limits (a hard link repeats a member
    without counting against them) and the path checks (see the two-step escape below)."""
    archive = _tar(tmp_path / "links.tar.gz", [("top", "dir", None), ("top/a.bin", "file", b"abc"),
                                               ("top/link", kind, target)])
    with pytest.raises(ValueError, match=r"member 'top/link' is a link to"):
        safe_extract(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # what safe_extract created, it removed


@pytest.mark.parametrize(
    "members, bad",
    [
        ([("../evil", "file", b"x")], "../evil"),
        ([("/tmp/speedrun-test-evil-abs", "file", b"x")], "/tmp/speedrun-test-evil-abs"),
        ([("up", "sym", "../outside")], "up"),
        ([("abs", "sym", "/etc")], "abs"),
        ([("hl", "hard", "../outside")], "hl"),
        # Lexically d/s/../evil is d/evil (inside); on disk d/s is the target root, so it lands one level up.
        ([("d", "dir", None), ("d/s", "sym", ".."), ("d/s/../evil", "file", b"x")], "d/s"),
        # Checked while d/p does not exist, l looks inside; then d/p becomes a link to the root, and l reads
        # whatever file lies two levels above it.
        ([("d", "dir", None), ("l", "sym", "d/p/../../../secret"), ("d/p", "sym", "..")], "l"),
        ([("dev", "chr", None)], "dev"),
    ],
    ids=["dotdot", "absolute", "symlink-out", "symlink-absolute", "hardlink-out", "symlink-chain",
         "symlink-made-later", "device"],
)
@pytest.mark.parametrize("python_filter", [True, False], ids=["with-tarfile-filter", "own-checks-only"])
def test_safe_extract_refuses_escapes(tmp_path, monkeypatch, members, bad, python_filter):
    if not python_filter:
        # Pythons before 3.10.12 / 3.11.4 have no extraction filter: our own checks must suffice.
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    archive = _tar(tmp_path / "evil.tar.gz", members)
    target = tmp_path / "sandbox" / "out"
    with pytest.raises(ValueError) as err:
        safe_extract(archive, target)
    assert repr(bad) in str(err.value) and "evil.tar.gz" in str(err.value)
    assert not (tmp_path / "sandbox" / "evil").exists() and not (tmp_path / "evil").exists()
    assert not os.path.exists("/tmp/speedrun-test-evil-abs")


def test_safe_extract_rejects_a_file_that_is_not_a_tar(tmp_path):
    bad = tmp_path / "broken.tar.gz"
    bad.write_bytes(b"\x1f\x8b" + b"garbage" * 10)
    with pytest.raises(ValueError, match="broken.tar.gz"):
        safe_extract(bad, tmp_path / "out")
