"""No page of the repository names a file of the machine it was measured on: README.md, BENCHMARKS.md and every
text file under docs/ (docs/report.html included, its text and attributes as a reader meets them) hold no absolute
path of a machine (/tmp/..., /work/..., /root/..., /home/..., or any absolute path of two or more components),
save the few that are the same on every Unix machine (ALLOWED). The generators show stored commands' paths
portably (speedrun.report.portable); a failure names file:line and the path."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each the same on every Unix machine, and named on a page for that reason.
ALLOWED = {
    "/dev/null": "docs/results.md: a path that is not a regular file, POSIX's null device",
    "/proc/sys/vm/drop_caches": "BENCHMARKS.md: the kernel's switch that drops the page cache (a cold-cache run)",
}
# Where a machine keeps its files (Linux, macOS, clusters): named anywhere but inside a word or a relative path,
# after any run of slashes too (file:///tmp/x, sqlite:////tmp/x).
MACHINE = re.compile(r"(?<![\w.~-])/(?:tmp|work|root|home|Users|mnt|scratch|private|Volumes|media|var/tmp|"
                     r"var/folders)/[^\s'\"`:,;|&()\[\]{}<>]*")
# Any absolute path: a run of slashes where a shell word or a value begins (after a space, a quote, `=`, `:`, `(`,
# ...), then a first component and a second; after a colon two slashes are a URL's host (https://h/x), not a path.
ABSOLUTE = re.compile(r"(?<![^\s'\"`=:,;|&(\[{])(/+)([^\s/'\"`:,;|&()\[\]{}<>]+(?:/[^\s/'\"`:,;|&()\[\]{}<>]*)+)")


def pages() -> list[Path]:
    """README.md, BENCHMARKS.md and each text file under docs/ (a file that is not UTF-8, or holds a NUL byte, is
    an image or the like)."""
    found = [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
    for path in sorted((ROOT / "docs").rglob("*")):
        if path.is_file():
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            if "\0" not in text:
                found.append(path)
    return found


def shown_lines(path: Path) -> list[str]:
    """The lines of a page as a reader meets them: an HTML page's tags turned into the values of their attributes
    (an image's alt text), entities decoded, and its embedded data (base64 images) left out."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix.lower() not in (".html", ".htm"):
        return lines
    out = []
    for line in lines:
        line = re.sub(r"data:[^\"'\s]*", "", line)
        line = re.sub(r"<[^>]*>", lambda tag: " " + " ".join(re.findall(r'="([^"]*)"', tag.group())) + " ", line)
        out.append(html.unescape(line))
    return out


def machine_paths(line: str) -> list[str]:
    """The absolute paths of a machine in one line of text (ALLOWED left out)."""
    found = [m.group() for m in MACHINE.finditer(line)]
    for m in ABSOLUTE.finditer(line):
        url = m.start() > 0 and line[m.start() - 1] == ":" and len(m.group(1)) == 2
        if not url:
            found.append("/" + m.group(2))
    return [path for path in dict.fromkeys(found) if path.rstrip(".") not in ALLOWED]


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_names_a_path_of_the_machine_it_was_made_on(path):
    where = [f"{path.relative_to(ROOT)}:{number}: {found}" for number, line in enumerate(shown_lines(path), 1)
             for found in machine_paths(line)]
    assert not where, ("absolute paths of a machine on a page (show them with speedrun.report.portable, or write "
                       "a relative or ~/ path):\n" + "\n".join(where))


def test_the_pages_scanned_include_the_report():
    names = {str(p.relative_to(ROOT)) for p in pages()}
    assert {"README.md", "BENCHMARKS.md", "docs/report.html", "docs/cli.md"} <= names
    assert "docs/report.png" not in names


@pytest.mark.parametrize("line, expected", [
    ("`speedrun train --dataset /tmp/c10subsh --db ../x.db`", ["/tmp/c10subsh"]),
    ("--out=/root/out/vs.json and PYTHONPATH=src:/opt/ab/src", ["/root/out/vs.json", "/opt/ab/src"]),
    ("storage sqlite:////tmp/work/r.db", ["/tmp/work/r.db"]),
    ("see (/home/me/a) and '/data/imagenet'", ["/home/me/a", "/data/imagenet"]),
    ("| /work/c10shards | 1 |", ["/work/c10shards"]),
    ("https://pytorch.org/docs/stable/x.html ../shared/datasets/a ~/data/imagenet a/b/c 1/2 images/s", []),
    ("`sync; echo 3 > /proc/sys/vm/drop_caches`, `/dev/null`, #!/bin/bash", []),
    ("…/c10subsh --out …/vs_airbench.json DIR/<time>-<recipe>/trial-N", []),
])
def test_the_scan_finds_a_machines_paths_and_nothing_else(line, expected):
    assert machine_paths(line) == expected


def test_an_html_page_is_read_as_shown(tmp_path):
    page = tmp_path / "p.html"
    page.write_text('<p><code>--db /tmp/x/r.db</code></p>\n<img alt="on /work/data/c10" src="data:image/png;base64,'
                    'AAA/tmp/AAA+/work/BB=">\n<p>&#x27;/root/a b&#x27;</p>\n')
    found = [machine_paths(line) for line in shown_lines(page)]
    assert found == [["/tmp/x/r.db"], ["/work/data/c10"], ["/root/a"]]
