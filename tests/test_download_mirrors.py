"""Downloads that survive a slow mirror, against a local HTTP server on 127.0.0.1 (no network): resuming a cut
transfer with a Range request, a server that ignores the Range, mirrors tried in order past a wrong file and a
stalled connection, the progress bar, the one-line failure, and that nothing partial is ever taken as the file."""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import re
import socket
import threading
import warnings

import numpy as np
import pytest
from test_data_sources import _archive

from speedrun.cli import train_commands
from speedrun.cli.parser import build_parser
from speedrun.cli.program import main
from speedrun.data import download, sources
from speedrun.data.download import Remote, fetch, given_mirrors, mirror_urls, progress_line
from speedrun.data.sources import load_dataset
from speedrun.errors import SpeedrunWarning

PAYLOAD = bytes(range(251)) * 1200  # 301,200 bytes; 251 is prime, so no two offsets hold the same run of bytes
MD5 = hashlib.md5(PAYLOAD).hexdigest()
OTHER = PAYLOAD[::-1]  # the same size, another file
OTHER_MD5 = hashlib.md5(OTHER).hexdigest()
CUT = 100_000  # bytes a cutting or stalling route sends before it stops
STALL_S = 0.3  # the read timeout the tests use; a stalled route waits until the test ends


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves server.routes[path]: body, and how to misbehave: "cut" (close after that many bytes, the first time),
    "stall" ("head": before the headers, "body": after CUT bytes), "ranges" (False: ignore Range, answer 200),
    "bad_range" (answer a Range with a 206 that starts elsewhere)."""

    def do_GET(self):
        server = self.server
        asked = self.headers.get("Range")
        server.requests.append((self.path, asked))
        route = server.routes.get(self.path)
        if route is None:
            self.send_error(404, "Not Found")
            return
        if route.get("stall") == "head":
            server.release.wait(10)
            return
        body, start = route["body"], 0
        if asked and route.get("ranges", True):
            start = int(re.fullmatch(r"bytes=(\d+)-", asked)[1])
            shown = start + 1 if route.get("bad_range") else start
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {shown}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        rest = body[start:]
        cut = route.pop("cut", None)
        if cut is not None:
            self.wfile.write(rest[:cut])  # HTTP/1.0: the connection closes when this returns, short of the length
            return
        if route.get("stall") == "body":
            self.wfile.write(rest[:CUT])
            self.wfile.flush()
            server.release.wait(10)
            return
        self.wfile.write(rest)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.routes, httpd.requests, httpd.release = {}, [], threading.Event()
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield httpd
    httpd.release.set()
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def _no_mirrors_from_outside(monkeypatch):
    monkeypatch.delenv("SPEEDRUN_MIRRORS", raising=False)
    monkeypatch.delenv("SPEEDRUN_DOWNLOAD_TIMEOUT", raising=False)


def _closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on: connecting is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files(folder) -> list[str]:
    return sorted(os.listdir(folder))


# ---- resuming ---------------------------------------------------------------------------------------------------


def test_a_cut_transfer_is_kept_and_the_next_fetch_asks_only_for_the_rest(tmp_path, server):
    server.routes["/a/archive.bin"] = {"body": PAYLOAD, "cut": CUT}
    url, dest = server.url + "/a/archive.bin", tmp_path / "dl" / "archive.bin"
    with pytest.raises(FileNotFoundError) as err:
        fetch(url, dest, MD5, timeout=STALL_S)
    assert f"closed after {CUT} of {len(PAYLOAD)} bytes" in str(err.value) and "to resume" in str(err.value)
    assert _files(dest.parent) == [".archive.bin.part"]  # never dest's name, no lock file left
    assert (dest.parent / ".archive.bin.part").read_bytes() == PAYLOAD[:CUT]
    lines = []
    assert fetch(url, dest, MD5, lines.append, timeout=STALL_S) == dest
    assert dest.read_bytes() == PAYLOAD and _files(dest.parent) == ["archive.bin"]
    assert server.requests == [("/a/archive.bin", None), ("/a/archive.bin", f"bytes={CUT}-")]
    assert any(f"resuming archive.bin from byte {CUT}" in line for line in lines)


def test_a_cut_on_one_mirror_is_resumed_by_the_next(tmp_path, server):
    server.routes["/a/archive.bin"] = {"body": PAYLOAD, "cut": CUT}
    server.routes["/b/archive.bin"] = {"body": PAYLOAD}
    dest = tmp_path / "archive.bin"
    with pytest.warns(SpeedrunWarning, match=rf"mirror {server.url}/a/archive.bin failed .*closed after {CUT}"):
        fetch([server.url + "/a/archive.bin", server.url + "/b/archive.bin"], dest, MD5, timeout=STALL_S)
    assert dest.read_bytes() == PAYLOAD
    assert server.requests[1] == ("/b/archive.bin", f"bytes={CUT}-")


@pytest.mark.parametrize("route", [{"ranges": False}, {"bad_range": True}], ids=["200-ignores-range", "206-elsewhere"])
def test_a_server_that_does_not_continue_the_part_starts_again_from_zero(tmp_path, server, route):
    dest = tmp_path / "archive.bin"
    (tmp_path / ".archive.bin.part").write_bytes(b"x" * 5000)  # not the file's start: must not survive
    server.routes["/archive.bin"] = {"body": PAYLOAD, **route}
    assert fetch(server.url + "/archive.bin", dest, MD5, timeout=STALL_S) == dest
    assert dest.read_bytes() == PAYLOAD and _files(tmp_path) == ["archive.bin"]
    assert server.requests[0] == ("/archive.bin", "bytes=5000-")


def test_a_resumed_part_with_a_wrong_start_is_fetched_again_whole(tmp_path, server):
    """The server continues the part as asked, but the part's start was not this file: the checksum catches it."""
    dest = tmp_path / "archive.bin"
    (tmp_path / ".archive.bin.part").write_bytes(OTHER[:CUT])
    server.routes["/archive.bin"] = {"body": PAYLOAD}
    assert fetch(server.url + "/archive.bin", dest, MD5, timeout=STALL_S) == dest
    assert dest.read_bytes() == PAYLOAD
    assert server.requests == [("/archive.bin", f"bytes={CUT}-"), ("/archive.bin", None)]


def test_ctrl_c_keeps_the_part_for_the_next_resume(tmp_path, monkeypatch):
    class Interrupted:
        headers = {"Content-Length": str(len(PAYLOAD))}
        status = 200

        def __init__(self):
            self.stream = io.BytesIO(PAYLOAD[:CUT])

        def read(self, n):
            chunk = self.stream.read(n)
            if not chunk:
                raise KeyboardInterrupt
            return chunk

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(download.urllib.request, "urlopen", lambda request, timeout: Interrupted())
    dest = tmp_path / "archive.bin"
    with pytest.raises(KeyboardInterrupt):
        fetch("https://example.invalid/archive.bin", dest, MD5)
    assert _files(tmp_path) == [".archive.bin.part"] and len((tmp_path / ".archive.bin.part").read_bytes()) == CUT


def test_a_whole_part_left_unchecked_is_published_without_network(tmp_path, monkeypatch):
    (tmp_path / ".archive.bin.part").write_bytes(PAYLOAD)
    monkeypatch.setattr(download.urllib.request, "urlopen", lambda *a, **k: pytest.fail("no request expected"))
    assert fetch("https://example.invalid/archive.bin", tmp_path / "archive.bin", MD5) == tmp_path / "archive.bin"
    assert _files(tmp_path) == ["archive.bin"]


# ---- mirrors ----------------------------------------------------------------------------------------------------


def test_a_mirror_serving_another_file_is_skipped_with_a_warning(tmp_path, server):
    server.routes["/bad/archive.bin"] = {"body": OTHER}
    server.routes["/good/archive.bin"] = {"body": PAYLOAD}
    dest = tmp_path / "archive.bin"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fetch([server.url + "/bad/archive.bin", server.url + "/good/archive.bin"], dest, MD5, timeout=STALL_S)
    said = [str(w.message) for w in caught if issubclass(w.category, SpeedrunWarning)]
    assert len(said) == 1 and "\n" not in said[0]
    assert f"{server.url}/bad/archive.bin" in said[0] and OTHER_MD5 in said[0] and MD5 in said[0]
    assert dest.read_bytes() == PAYLOAD and _files(tmp_path) == ["archive.bin"]


@pytest.mark.parametrize("when", ["head", "body"])
def test_a_stalled_mirror_times_out_to_the_next(tmp_path, server, when):
    server.routes["/slow/archive.bin"] = {"body": PAYLOAD, "stall": when}
    server.routes["/fast/archive.bin"] = {"body": PAYLOAD}
    dest = tmp_path / "archive.bin"
    with pytest.warns(SpeedrunWarning, match=rf"/slow/archive.bin failed \(stalled: no data for {STALL_S:g} s"):
        fetch([server.url + "/slow/archive.bin", server.url + "/fast/archive.bin"], dest, MD5, timeout=STALL_S)
    assert dest.read_bytes() == PAYLOAD
    # what the stalled mirror sent before it stopped is resumed by the next
    assert server.requests[1] == ("/fast/archive.bin", f"bytes={CUT}-" if when == "body" else None)


def test_the_download_timeout_setting(monkeypatch):
    assert download.download_timeout() == download.DEFAULT_TIMEOUT_S == 30
    monkeypatch.setenv("SPEEDRUN_DOWNLOAD_TIMEOUT", "2.5")
    assert download.download_timeout() == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon", "1e9"):
        monkeypatch.setenv("SPEEDRUN_DOWNLOAD_TIMEOUT", bad)
        with pytest.raises(ValueError, match=r"^SPEEDRUN_DOWNLOAD_TIMEOUT=.* set e\.g\. 120") as err:
            download.download_timeout()
        assert "\n" not in str(err.value)


def test_every_mirror_failing_is_one_line_naming_each(tmp_path, server):
    server.routes["/wrong/archive.bin"] = {"body": OTHER}
    server.routes["/slow/archive.bin"] = {"body": PAYLOAD, "stall": "head"}
    urls = [server.url + "/missing/archive.bin", f"http://127.0.0.1:{_closed_port()}/archive.bin",
            server.url + "/wrong/archive.bin", server.url + "/slow/archive.bin"]
    dest = tmp_path / "downloads" / "archive.bin"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpeedrunWarning)
        with pytest.raises(FileNotFoundError) as err:
            fetch(urls, dest, MD5, timeout=STALL_S)
    message = str(err.value)
    assert "\n" not in message
    reasons = ["HTTP 404", "refused", f"md5 {OTHER_MD5}, not the published {MD5}", f"stalled: no data for {STALL_S:g}"]
    for url, reason in zip(urls, reasons):
        assert re.search(re.escape(url) + r" \([^)]*" + re.escape(reason), message), (url, reason, message)
    assert f"put archive.bin (md5 {MD5}) in {dest.parent}" in message and "--mirror" in message
    assert _files(dest.parent) == []  # the wrong file deleted, nothing else arrived


def test_only_wrong_files_is_a_value_error(tmp_path, server):
    server.routes["/wrong/archive.bin"] = {"body": OTHER}
    with pytest.raises(ValueError, match=rf"archive.bin.*{OTHER_MD5}.*{MD5}"):
        fetch(server.url + "/wrong/archive.bin", tmp_path / "archive.bin", MD5, timeout=STALL_S)
    assert _files(tmp_path) == []


def test_the_order_of_mirrors_and_folder_or_file_urls(monkeypatch):
    published = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
    monkeypatch.setenv("SPEEDRUN_MIRRORS", " https://env.example/a/ ,https://env.example/b/cifar-10-python.tar.gz ")
    with given_mirrors(["https://given.example/data", "file:///srv/cifar-10-python.tar.gz"]):
        urls = mirror_urls(published, ("https://shipped.example/c", "https://given.example/data/"))
    assert urls == ["https://given.example/data/cifar-10-python.tar.gz", "file:///srv/cifar-10-python.tar.gz",
                    "https://env.example/a/cifar-10-python.tar.gz", "https://env.example/b/cifar-10-python.tar.gz",
                    published, "https://shipped.example/c/cifar-10-python.tar.gz"]
    assert mirror_urls(published) == urls[2:5]  # given_mirrors lasts for its block only


@pytest.mark.parametrize("bad", ["ftp://host/x", "host/folder", "https://", "https://host/a b", "https://[::1/x"])
def test_a_mirror_that_is_no_url_is_refused_in_one_line(monkeypatch, capsys, bad):
    monkeypatch.setenv("SPEEDRUN_MIRRORS", f"https://ok.example/ {bad}" if " " not in bad else bad)
    with pytest.raises(ValueError, match=r"^SPEEDRUN_MIRRORS entry .* is not an http, https or file URL"):
        mirror_urls("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz")
    monkeypatch.delenv("SPEEDRUN_MIRRORS")
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["train", "--mirror", bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--mirror" in err and "not an http, https or file URL" in err


def test_the_commands_that_download_take_mirror_and_only_their_handler_sees_it(monkeypatch):
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices
    takes = {name for name, p in subcommands.items()
             if any("--data-dir" in action.option_strings for action in p._actions)}
    lacking = [name for name in takes if not any("--mirror" in a.option_strings for a in subcommands[name]._actions)]
    assert {"train", "bench", "ablate", "tune", "profile", "eval"} <= takes and lacking == []
    seen = []
    monkeypatch.setattr(train_commands, "train_command",
                        lambda args, argv: seen.append(mirror_urls("https://h/f.tgz")) or 0)
    assert main(["train", "--mirror", "https://a.example/", "--mirror", "https://b.example/x"]) == 0
    assert seen[0][:2] == ["https://a.example/f.tgz", "https://b.example/x/f.tgz"]
    assert mirror_urls("https://h/f.tgz") == ["https://h/f.tgz"]  # one command's mirrors never reach the next


# ---- the progress bar -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "done, total, rate, expected",
    [
        (0, 170_498_071, None, "c.tgz [--------------------]   0%  0 B/170.5 MB  -- B/s  ETA --:--"),
        (42_624_518, 170_498_071, 1_200_000, "c.tgz [#####---------------]  25%  42.6 MB/170.5 MB  1.2 MB/s  ETA 1:47"),
        (1_000, 170_498_071, 20_000, "c.tgz [--------------------]   0%  1.0 kB/170.5 MB  20.0 kB/s  ETA 2:22:05"),
        (170_498_071, 170_498_071, 5e6, "c.tgz [####################] 100%  170.5 MB/170.5 MB  5.0 MB/s  ETA 0:00"),
        (3_500, None, 700.0, "c.tgz  3.5 kB  700 B/s"),
        (0, None, 0.0, "c.tgz  0 B  -- B/s"),
    ],
    ids=["start", "quarter", "slow-hours", "done", "unknown-size", "unknown-nothing-yet"],
)
def test_progress_line(done, total, rate, expected):
    assert progress_line("c.tgz", done, total, rate) == expected


def test_the_bar_is_drawn_on_a_terminal_only_and_erased(tmp_path, server):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal, pipe, lines = Terminal(), io.StringIO(), []
    for stream in (terminal, pipe):
        bar = download._Progress("c.tgz", lines.append, stream)
        bar.update(50, 100, 10.0)
        bar.close()
    assert terminal.getvalue() == f"\r{progress_line('c.tgz', 50, 100, 10.0)}\x1b[K\r\x1b[K"
    assert pipe.getvalue() == "" and lines == []  # not a terminal: the caller's final line is all


def test_under_a_live_display_the_bar_goes_to_the_log_at_each_tenth():
    class Proxy(io.StringIO):  # what rich puts in sys.stderr while its status line is shown
        rich_proxied_file = None

        def isatty(self):
            return True

    proxy, lines = Proxy(), []
    bar = download._Progress("c.tgz", lines.append, proxy)
    for done in range(0, 1001, 50):
        bar.update(done, 1000, 100.0)
    bar.close()
    assert proxy.getvalue() == ""
    assert lines == [progress_line("c.tgz", done, 1000, 100.0) for done in range(100, 1000, 100)]


# ---- the loader: only a verified download ever becomes the archive -----------------------------------------------


def test_load_dataset_takes_only_a_verified_archive(tmp_path, server, monkeypatch):
    """A mirror serving junk before the official host, which cuts the transfer half way the first time: the first
    load fails naming both and leaves only the partial file; the second resumes it past the junk mirror (which
    continues it wrongly, and only its own bytes are dropped) from the official host, and verifies it."""
    archive, md5, _ = _archive(tmp_path, "cifar10", np.random.default_rng(0))
    body = archive.read_bytes()
    half = len(body) // 2
    server.routes["/junk/cifar-10-python.tar.gz"] = {"body": body[::-1]}
    server.routes["/official/cifar-10-python.tar.gz"] = {"body": body, "cut": half}
    official = server.url + "/official/cifar-10-python.tar.gz"
    monkeypatch.setitem(sources.SOURCES, "cifar10", Remote("cifar", ((official, md5),)))
    monkeypatch.setenv("SPEEDRUN_MIRRORS", server.url + "/junk")
    cache = tmp_path / "cache"
    downloads = cache / "downloads"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpeedrunWarning)
        with pytest.raises(FileNotFoundError) as err:
            load_dataset("cifar10", cache_dir=cache)
    message = str(err.value)
    assert f"{server.url}/junk/cifar-10-python.tar.gz (its cifar-10-python.tar.gz has md5" in message
    assert f"{official} (the connection closed after {half} of {len(body)} bytes)" in message
    assert f"put cifar-10-python.tar.gz (md5 {md5}) in {downloads}" in message and "\n" not in message
    assert not (downloads / "cifar-10-python.tar.gz").exists()  # the loader's path: only ever a verified file
    assert [n for n in _files(downloads) if not n.startswith(".extract")] == [".cifar-10-python.tar.gz.part"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpeedrunWarning)
        ds = load_dataset("cifar10", cache_dir=cache)
    assert len(ds.train_labels) == 5 and (downloads / "cifar-10-python.tar.gz").read_bytes() == body
    assert server.requests[-2:] == [("/junk/cifar-10-python.tar.gz", f"bytes={half}-"),
                                    ("/official/cifar-10-python.tar.gz", f"bytes={half}-")]
    assert not (downloads / ".cifar-10-python.tar.gz.part").exists()


def test_an_unwritable_folder_is_refused_before_any_request(tmp_path, server, monkeypatch):
    server.routes["/archive.bin"] = {"body": PAYLOAD}
    blocked = tmp_path / "ro"
    blocked.mkdir()
    real_open, real_mkstemp = os.open, download.tempfile.mkstemp

    def refusing_open(path, *args, **kwargs):
        if os.path.dirname(os.fspath(path)) == str(blocked):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, *args, **kwargs)

    def refusing_mkstemp(*args, dir=None, **kwargs):
        if os.fspath(dir) == str(blocked):
            raise PermissionError(13, "Permission denied", os.fspath(dir))
        return real_mkstemp(*args, dir=dir, **kwargs)

    # Running as root, chmod would not keep us out: the refusals a read-only folder gives, simulated.
    monkeypatch.setattr(download.os, "open", refusing_open)
    monkeypatch.setattr(download.tempfile, "mkstemp", refusing_mkstemp)
    with pytest.raises(ValueError, match=r"cannot write in .*ro \(.*Permission denied.*fix its permissions"):
        fetch(server.url + "/archive.bin", blocked / "archive.bin", MD5)
    assert server.requests == [] and _files(blocked) == []
