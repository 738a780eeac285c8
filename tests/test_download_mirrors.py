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
import time
import warnings

import numpy as np
import pytest
from test_data_sources import _archive

from speedrun.cli import train_commands
from speedrun.cli.parser import build_parser
from speedrun.cli.program import main
from speedrun.data import download, sources
from speedrun.data.download import Remote, fetch, given_mirrors, mirror_url, mirror_urls, progress_line
from speedrun.data.sources import load_dataset
from speedrun.errors import SpeedrunWarning

PAYLOAD = bytes(range(251)) * 1200  # 301,200 bytes; 251 is prime, so no two offsets hold the same run of bytes
MD5 = hashlib.md5(PAYLOAD).hexdigest()
OTHER = PAYLOAD[::-1]  # the same size, another file
OTHER_MD5 = hashlib.md5(OTHER).hexdigest()
CUT = 100_000  # bytes a cutting or stalling route sends before it stops
STALL_S = 0.3  # the read timeout the tests use; a stalled route waits until the test ends
DRIP_S = 0.05  # a dripping route's byte interval: well inside STALL_S, so only the rate check can end it


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves server.routes[path]: body, and how to misbehave: "cut" (close after that many bytes, the first time),
    "stall" ("head": before the headers, "body": after CUT bytes), "ranges" (False: ignore Range, answer 200),
    "bad_range" (answer a Range with a 206 that starts elsewhere), "drip" ("head": the status line and headers, "body":
    the body, a byte every DRIP_S until the test ends)."""

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
        if route.get("drip"):
            head = f"HTTP/1.0 200 OK\r\nContent-Length: {len(route['body'])}\r\n\r\n".encode()
            if route["drip"] == "body":
                self.wfile.write(head)
            for byte in (head if route["drip"] == "head" else route["body"]):
                if server.release.wait(DRIP_S):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
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


def test_the_bar_is_drawn_on_a_terminal_only_and_erased(tmp_path, server, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("TERM", "xterm")  # rich draws no bar on a dumb terminal, nor where these say no terminal
    for name in ("TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    terminal, pipe, lines = Terminal(), io.StringIO(), []
    for stream in (terminal, pipe):
        bar = download._Progress("c.tgz", lines.append, stream)
        bar.update(50, 100, 10.0)
        bar.close()
    drawn = terminal.getvalue()
    assert "c.tgz" in drawn and " 50%" in drawn and "50/100 bytes" in drawn  # rich's bar: the name, share, bytes
    assert drawn.endswith("\x1b[2K")  # and at the end the line it took is erased, for the caller's final line
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


# ---- the files beside dest: only ever our own --------------------------------------------------------------------


def _not_ours(kind: str, path, victim) -> None:
    """Put at `path` something a download did not make: a link to `victim` (or to nothing), a folder, a FIFO, a
    second name of `victim`."""
    if kind == "link":
        os.symlink(victim, path)
    elif kind == "dangling-link":
        os.symlink(victim.parent / "nowhere" / "x", path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "hard-link":
        os.link(victim, path)


@pytest.mark.parametrize("kind", ["link", "dangling-link", "folder", "fifo", "hard-link"])
@pytest.mark.parametrize("which", [".archive.bin.part", ".archive.bin.lock"])
def test_a_part_or_lock_file_we_did_not_make_is_refused_untouched(tmp_path, server, which, kind):
    if kind == "fifo" and not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    server.routes["/archive.bin"] = {"body": PAYLOAD, "ranges": False}
    folder, victim = tmp_path / "dl", tmp_path / "victim.txt"
    folder.mkdir()
    victim.write_bytes(b"precious data\n" * 100)
    _not_ours(kind, folder / which, victim)
    before = _files(folder)
    with pytest.raises(ValueError) as err:
        fetch(server.url + "/archive.bin", folder / "archive.bin", MD5, timeout=STALL_S)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{folder / which} is ") and "remove it" in message
    assert victim.read_bytes() == b"precious data\n" * 100 and _files(folder) == before  # nothing made, nothing gone
    assert server.requests == [] and not os.path.lexists(folder / "nowhere")


@pytest.mark.parametrize("swap", ["link", "other-file"])
def test_a_part_replaced_after_it_was_verified_is_never_published(tmp_path, server, monkeypatch, swap):
    """Another program puts something at the part's name between the check and the publishing: the name dest gets
    is taken back, and what was put there is left alone."""
    server.routes["/archive.bin"] = {"body": PAYLOAD}
    victim, dest = tmp_path / "victim.txt", tmp_path / "dl" / "archive.bin"
    victim.write_bytes(b"precious data\n")
    promote = download._Parts.promote

    def swapping_promote(parts):
        promote(parts)
        stand_in = tmp_path / "stand-in"
        if swap == "link":
            os.symlink(victim, stand_in)
        else:
            stand_in.write_bytes(OTHER)
        os.replace(stand_in, parts.path)

    monkeypatch.setattr(download._Parts, "promote", swapping_promote)
    with pytest.raises(ValueError, match=r"\.archive\.bin\.part was replaced by another program .* remove "):
        fetch(server.url + "/archive.bin", dest, MD5, timeout=STALL_S)
    assert _files(dest.parent) == [".archive.bin.part"] and victim.read_bytes() == b"precious data\n"
    assert os.path.islink(dest.parent / ".archive.bin.part") == (swap == "link")


# ---- a mirror starting again from byte 0 never costs the part kept -------------------------------------------------


@pytest.mark.parametrize("route", [
    {"body": b"<html>captive portal: log in</html>", "ranges": False},
    {"body": OTHER, "ranges": False},
    {"body": PAYLOAD, "ranges": False, "cut": 2 * CUT},  # the right file, cut short past the kept length
    {"body": PAYLOAD[:CUT] + OTHER[CUT:]},  # continues the part, but is another file: the restart gets the same
], ids=["portal-page", "other-file", "cut-restart", "wrong-then-restart"])
def test_a_mirror_that_starts_again_keeps_the_part_until_its_file_is_verified(tmp_path, server, route):
    part = tmp_path / ".archive.bin.part"
    part.write_bytes(PAYLOAD[:CUT])
    server.routes["/bad/archive.bin"] = dict(route)  # a copy: a "cut" is used up by the first request
    server.routes["/good/archive.bin"] = {"body": PAYLOAD}
    dest = tmp_path / "archive.bin"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpeedrunWarning)
        with pytest.raises((FileNotFoundError, ValueError), match=f"the {CUT} bytes received are kept in"):
            fetch(server.url + "/bad/archive.bin", dest, MD5, timeout=STALL_S)
        assert part.read_bytes() == PAYLOAD[:CUT] and _files(tmp_path) == [".archive.bin.part"]  # no temporary left
        server.routes["/bad/archive.bin"] = dict(route)
        lines = []
        assert fetch([server.url + "/bad/archive.bin", server.url + "/good/archive.bin"], dest, MD5, lines.append,
                     timeout=STALL_S) == dest
    assert dest.read_bytes() == PAYLOAD and _files(tmp_path) == ["archive.bin"]
    assert ("/good/archive.bin", f"bytes={CUT}-") in server.requests
    assert f"resumed from byte {CUT}" in lines[-1]


def test_a_restarted_file_that_is_verified_replaces_the_part(tmp_path, server):
    (tmp_path / ".archive.bin.part").write_bytes(OTHER[:CUT])  # a wrong start: only a whole file from 0 can fix it
    server.routes["/archive.bin"] = {"body": PAYLOAD, "ranges": False}
    lines = []
    assert fetch(server.url + "/archive.bin", tmp_path / "archive.bin", MD5, lines.append, timeout=STALL_S)
    assert (tmp_path / "archive.bin").read_bytes() == PAYLOAD and _files(tmp_path) == ["archive.bin"]
    assert lines[-1].startswith(f"downloaded archive.bin: {download._size(len(PAYLOAD))} in ")
    assert "resumed" not in lines[-1]


# ---- a mirror that sends, but too slowly ---------------------------------------------------------------------------


@pytest.mark.parametrize("drip", ["head", "body"])
def test_a_mirror_dripping_bytes_is_too_slow_and_the_next_is_tried(tmp_path, server, drip):
    server.routes["/drip/archive.bin"] = {"body": PAYLOAD, "drip": drip}
    server.routes["/fast/archive.bin"] = {"body": PAYLOAD}
    dest = tmp_path / "archive.bin"
    began = time.monotonic()
    with pytest.warns(SpeedrunWarning, match=r"/drip/archive.bin failed \(too slow: "):
        fetch([server.url + "/drip/archive.bin", server.url + "/fast/archive.bin"], dest, MD5, timeout=STALL_S,
              min_rate=1000)
    assert dest.read_bytes() == PAYLOAD and time.monotonic() - began < 5  # 2 x STALL_S, not a byte per DRIP_S
    assert server.requests[1][0] == "/fast/archive.bin"


def test_only_dripping_mirrors_is_one_line_saying_too_slow(tmp_path, server, monkeypatch):
    server.routes["/a/archive.bin"] = {"body": PAYLOAD, "drip": "head"}
    server.routes["/b/archive.bin"] = {"body": PAYLOAD, "drip": "body"}
    monkeypatch.setenv("SPEEDRUN_DOWNLOAD_MIN_RATE", "500")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpeedrunWarning)
        with pytest.raises(FileNotFoundError) as err:
            fetch([server.url + "/a/archive.bin", server.url + "/b/archive.bin"], tmp_path / "archive.bin", MD5,
                  timeout=STALL_S)
    message = str(err.value)
    assert "\n" not in message and f"/a/archive.bin (too slow: no response headers within {2 * STALL_S:g} s" in message
    assert re.search(r"/b/archive\.bin \(too slow: \d+ bytes in [\d.]+ s, under 500 B/s", message), message


def test_the_minimum_rate_setting(monkeypatch):
    assert download.download_min_rate() == download.DEFAULT_MIN_RATE == 1000
    for text, value in (("2500", 2500), ("0", 0), (" 1e3 ", 1000)):
        monkeypatch.setenv("SPEEDRUN_DOWNLOAD_MIN_RATE", text)
        assert download.download_min_rate() == value
    for bad in ("-1", "nan", "inf", "fast", "1e13"):
        monkeypatch.setenv("SPEEDRUN_DOWNLOAD_MIN_RATE", bad)
        with pytest.raises(ValueError, match=r"^SPEEDRUN_DOWNLOAD_MIN_RATE=.* set e\.g\. 500") as err:
            download.download_min_rate()
        assert "\n" not in str(err.value)


# ---- a link to nothing at dest -------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["nowhere/x", "archive.bin"], ids=["to-nothing", "to-itself"])
def test_a_broken_link_at_dest_is_refused_before_any_download(tmp_path, server, target):
    server.routes["/archive.bin"] = {"body": PAYLOAD}
    dest = tmp_path / "archive.bin"
    os.symlink(tmp_path / target, dest)
    with pytest.raises(ValueError) as err:
        fetch(server.url + "/archive.bin", dest, MD5, timeout=STALL_S)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{dest} is a symbolic link to ") and "remove the link" in message
    assert server.requests == [] and _files(tmp_path) == ["archive.bin"] and os.path.islink(dest)


def test_a_verified_part_outlives_a_failed_publish(tmp_path, server, monkeypatch):
    """dest appears, wrong, as the verified file is published: the error names it, and the verified part stays for
    the next fetch to publish without a download."""
    server.routes["/archive.bin"] = {"body": PAYLOAD}
    dest = tmp_path / "archive.bin"
    publish = download.publish

    def racing_publish(part, target):
        target.write_bytes(b"someone else's file")
        return publish(part, target)

    monkeypatch.setattr(download, "publish", racing_publish)
    with pytest.raises(ValueError, match="exists but its md5"):
        fetch(server.url + "/archive.bin", dest, MD5, timeout=STALL_S)
    assert (tmp_path / ".archive.bin.part").read_bytes() == PAYLOAD
    monkeypatch.setattr(download, "publish", publish)
    dest.unlink()
    lines = []
    assert fetch(server.url + "/archive.bin", dest, MD5, lines.append) == dest and len(server.requests) == 1
    assert dest.read_bytes() == PAYLOAD and _files(tmp_path) == ["archive.bin"]
    assert "downloaded" not in lines[-1] and "left by an earlier download" in lines[-1]


# ---- mirror URLs are URLs, not strings ----------------------------------------------------------------------------


@pytest.mark.parametrize("mirror, expected", [
    ("https://h/get?dir=x", "https://h/get/c.tgz?dir=x"),
    ("https://h/get/?dir=x&y=%2F", "https://h/get/c.tgz?dir=x&y=%2F"),
    ("https://h?dir=x", "https://h/c.tgz?dir=x"),
    ("https://h/d/c.tgz?token=1", "https://h/d/c.tgz?token=1"),
    ("https://h:8080/a%20b", "https://h:8080/a%20b/c.tgz"),
    ("file:///srv/data", "file:///srv/data/c.tgz"),
])
def test_the_file_name_joins_the_mirrors_path_not_its_query(mirror, expected):
    assert mirror_url(mirror, "c.tgz") == expected


def test_a_mirror_with_a_query_is_fetched_from(tmp_path, server):
    server.routes["/get/archive.bin?dir=x"] = {"body": PAYLOAD}
    with given_mirrors([server.url + "/get?dir=x"]):
        urls = mirror_urls("https://example.invalid/archive.bin")
    assert fetch(urls[0], tmp_path / "archive.bin", MD5, timeout=STALL_S) == tmp_path / "archive.bin"
    assert server.requests == [("/get/archive.bin?dir=x", None)]


@pytest.mark.parametrize("bad", ["https://h/d#x", "https://h/d/#", "https://h/get?dir=x#top"])
def test_a_mirror_with_a_fragment_is_refused_in_one_line(monkeypatch, bad):
    monkeypatch.setenv("SPEEDRUN_MIRRORS", bad)
    with pytest.raises(ValueError, match=r"^SPEEDRUN_MIRRORS entry .* has a #fragment.*remove it") as err:
        mirror_urls("https://h/c.tgz")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^mirror .* has a #fragment"):
        with given_mirrors([bad]):
            pass


# ---- the final line says what this fetch did -----------------------------------------------------------------------


@pytest.mark.parametrize("held", [0, CUT, len(PAYLOAD)], ids=["fresh", "resumed", "whole-part"])
def test_the_final_line_counts_only_this_fetchs_bytes(tmp_path, server, held):
    server.routes["/archive.bin"] = {"body": PAYLOAD}
    if held:
        (tmp_path / ".archive.bin.part").write_bytes(PAYLOAD[:held])
    lines = []
    fetch(server.url + "/archive.bin", tmp_path / "archive.bin", MD5, lines.append, timeout=STALL_S)
    got = len(PAYLOAD) - held
    if got:
        assert re.fullmatch(rf"downloaded archive\.bin: {download._size(got)} in \d+\.\d s"
                            + (f", resumed from byte {held}" if held else "") + ", md5 ok", lines[-1]), lines[-1]
    else:
        assert server.requests == [] and "downloaded" not in lines[-1] and lines[-1].endswith("md5 ok")
