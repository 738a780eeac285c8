"""speedrun.report.portable: a stored command's absolute paths shown portably on a page, on hostile input (spaces,
quotes, escapes, unicode, URLs, markup), with relative and home paths kept, and every page generator using it."""

from __future__ import annotations

import pytest

from speedrun.report.portable import ELLIPSIS, portable_paths

E = ELLIPSIS


@pytest.mark.parametrize("stored, shown", [
    ("speedrun train --dataset /tmp/c10subsh --db /tmp/measure.db", f"speedrun train --dataset {E}/c10subsh --db "
                                                                    f"{E}/measure.db"),
    ("--out=/root/out/vs_airbench.json", f"--out={E}/vs_airbench.json"),
    ("PYTHONPATH=src:/opt/airbench-0.1.8 python x.py", f"PYTHONPATH=src:{E}/airbench-0.1.8 python x.py"),
    ("/tmp/work/ens/m0 /tmp/work/ens/m1", f"{E}/m0 {E}/m1"),
    ("--save /tmp/dir/", f"--save {E}/dir/"),  # a folder stays one
    ("/x", f"{E}/x"),
    # spaces: a quoted shell word runs to its closing quote; an escaped space is part of the name
    ("--out '/tmp/my data/run 1.json' --runs 2", f"--out '{E}/run 1.json' --runs 2"),
    ('--out "/tmp/a \\"q\\" b/x y.json"', f'--out "{E}/x y.json"'),
    ("'--out=/tmp/a b/c.json'", f"'--out={E}/c.json'"),
    ("/tmp/my\\ dir/x\\ y z", f"{E}/x\\ y z"),
    ("'unclosed /tmp/x y", f"'unclosed {E}/x y"),  # no closing quote: the word ends at the space
    # unicode, control characters, a NUL: kept as they are (escaping is the page's)
    ("/home/ü/données/résultats.json", f"{E}/résultats.json"),
    ("/home/名前/データ\x00x", f"{E}/データ\x00x"),
    # inside Markdown and shell punctuation
    ("`/tmp/x`", f"`{E}/x`"), ("| /work/c10shards |", f"| {E}/c10shards |"), ("(/a/b)", f"({E}/b)"),
    ("a;/tmp/x|/tmp/y&&/tmp/z", f"a;{E}/x|{E}/y&&{E}/z"), ("--models /a/b,/c/d", f"--models {E}/b,{E}/d"),
    # URLs: a host's path is not the machine's; an empty host's is
    ("https://example.com/a/b http://h:80/x", "https://example.com/a/b http://h:80/x"),
    ("file:///tmp/x", f"file://{E}/x"), ("storage sqlite:////tmp/w/r.db", f"storage sqlite://{E}/r.db"),
])
def test_absolute_paths_are_shown_portably(stored, shown):
    assert portable_paths(stored) == shown
    assert portable_paths(shown) == shown  # twice: no change


@pytest.mark.parametrize("kept", [
    "~/data/imagenet ~user/x", "../shared/datasets/cifar10-jpeg ./b a/b/c", "benchmarks/results/x.json",
    "1/2 images/s A/B", "<script>alert(1)</script> </td>", "/", "cd /", "a / b", "a//b",
    "cat /dev/null; echo 3 > /proc/sys/vm/drop_caches; /usr/bin/env python", "DIR/<time>-<recipe>/trial-N",
    f"{E}/c10subsh", "it's in docs/a.md", "", "no slash here",
])
def test_relative_home_and_portable_paths_stay(kept):
    assert portable_paths(kept) == kept


def test_a_sentence_with_an_apostrophe_keeps_its_words():
    assert portable_paths("it's in /tmp/x and docs/a.md") == f"it's in {E}/x and docs/a.md"


def test_paths_in_the_repository_are_shown_relative_to_it():
    root = "/work/main"
    assert portable_paths("--json /work/main/benchmarks/results/x.json --data-dir /work/main", root) == \
        "--json benchmarks/results/x.json --data-dir ."
    # a folder whose name starts alike is not inside it; nor is a path that leaves it
    assert portable_paths("/work/mainline/y /work/main/../z", root) == f"{E}/y {E}/z"
    assert portable_paths("/work/main/a", "relative/root") == f"{E}/a"  # a root that is no absolute path: none


@pytest.mark.parametrize("value, shown", [(None, ""), (5, "5"), (["/tmp/a/b"], f"['{E}/b']")])
def test_any_stored_value_is_shown_as_text(value, shown):
    assert portable_paths(value) == shown
