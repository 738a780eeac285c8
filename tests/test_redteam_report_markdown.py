"""`speedrun report --readme/--benchmarks` (a red-team round's findings, each a class): the sections meant for one
file, by whatever names it is given, are written in one write; the rewrite changes nothing but the lines between two
live markers (a marker is a line of its own, outside fenced code blocks), whatever the file's newlines, encoding
mark or last line."""

import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_report_hostile import base_db

from speedrun.cli.program import main
from speedrun.report import markdown as md

RECORDS, ABLATION = md.markers("records"), md.markers("ablation")
NO_RECORD = "No record is claimed yet"  # the records section's first line: no result of base_db reaches its target
BOTH = ("intro\n" + "\n".join(RECORDS) + "\nmiddle\n" + "\n".join(ABLATION) + "\nend\n")


@pytest.fixture(scope="module")
def database(tmp_path_factory):
    return base_db(tmp_path_factory.mktemp("markdown") / "base.db")


def _between(text: str, begin: str, end: str) -> str:
    return text.split(begin, 1)[1].split(end, 1)[0]


def _link(at, target) -> str:
    at.symlink_to(target)
    return str(at)


NAMES = [  # (what, how the second flag names the file the first flag names as tmp/docs/both.md)
    ("the same name", lambda real: str(real)),
    ("a symlink", lambda real: _link(real.parent.parent / "link.md", real)),
    ("a symlink to a symlink", lambda real: _link(real.parent.parent / "link2.md",
                                                  _link(real.parent.parent / "link.md", real))),
    ("a relative symlink", lambda real: _link(real.parent / "rel.md", "both.md")),
    ("a path through ..", lambda real: str(real.parent / ".." / real.parent.name / real.name)),
    ("a relative name", lambda real: os.path.relpath(real)),
]


@pytest.mark.parametrize("what, name", NAMES, ids=[n[0] for n in NAMES])
def test_two_flags_naming_one_file_write_both_sections_once(database, tmp_path, capsys, monkeypatch, what, name):
    monkeypatch.chdir(tmp_path)
    real = tmp_path / "docs" / "both.md"
    real.parent.mkdir()
    real.write_text(BOTH)
    other = name(real)
    assert main(["report", "--db", str(database), "--readme", str(real), "--benchmarks", other]) == 0
    text = real.read_text()
    assert NO_RECORD in _between(text, *RECORDS)  # the records section, and
    assert "#### Ablation" in _between(text, *ABLATION)  # the ablation section: neither write undid the other
    assert text.startswith("intro\n") and "\nmiddle\n" in text and text.endswith("\nend\n")
    err = capsys.readouterr().err
    assert err.count("rewrote") == 1 and "records and ablation sections" in err, err
    # the other order: the same file, the same text
    assert main(["report", "--db", str(database), "--readme", other, "--benchmarks", str(real)]) == 0
    assert real.read_text() == text


def test_two_hard_links_each_get_both_sections(database, tmp_path, capsys):
    first, second = tmp_path / "a.md", tmp_path / "b.md"
    first.write_text(BOTH)
    os.link(first, second)
    assert main(["report", "--db", str(database), "--readme", str(first), "--benchmarks", str(second)]) == 0
    for path in (first, second):  # an atomic write replaces a name: each name holds the whole new text
        assert NO_RECORD in _between(path.read_text(), *RECORDS)
        assert "#### Ablation" in _between(path.read_text(), *ABLATION)
    assert capsys.readouterr().err.count("rewrote") == 2


def test_the_page_is_never_written_over_a_markdown_file(database, tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text('<meta name="generator" content="speedrun report">\n' + BOTH)  # check_out's mark, by chance
    before = readme.read_bytes()
    for flags in (["--readme", str(readme)], ["--benchmarks", str(tmp_path / "." / "README.md")]):
        assert main(["report", "--db", str(database), "--out", str(readme), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "same file" in err
        assert readme.read_bytes() == before


# --- the rewrite changes the lines between the live markers only -------------------------------------------------

SECTIONS = {"records": "| a | b |\n|---|---|\n| ü | 1 |\n"}
NEWLINES = st.sampled_from(["\n", "\r\n", "\r"])
# no backtick or tilde (a fence is drawn separately below); odd characters that other splitters take for line ends
PLAIN = st.lists(st.one_of(st.characters(blacklist_characters="\r\n`~", blacklist_categories=("Cs",)),
                           st.sampled_from(["\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\ufeff", "é", "<!--", " "])),
                 max_size=20).map("".join)


@st.composite
def block(draw) -> str:
    """A plain line, or a fenced code block (backticks or tildes, indented up to three spaces) that may hold
    marker lines: examples, not markers."""
    newline = draw(NEWLINES)
    if draw(st.booleans()):
        return draw(PLAIN) + newline
    fence = draw(st.sampled_from(["```", "````", "~~~", "~~~~~"]))
    indent, info = draw(st.sampled_from(["", " ", "   "])), draw(st.sampled_from(["", "markdown", " text"]))
    inside = draw(st.lists(st.one_of(PLAIN, st.sampled_from([*RECORDS, f"  {RECORDS[0]}"])), max_size=4))
    close = fence + draw(st.sampled_from(["", fence[0], "  "]))  # as long or longer, spaces after
    return (indent + fence + info + newline + "".join(line + newline for line in inside) + indent + close
            + draw(NEWLINES))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bom=st.booleans(), head=st.lists(block(), max_size=5), tail=st.lists(block(), max_size=5),
       last=PLAIN, old=st.lists(PLAIN, max_size=3), begin_newline=NEWLINES, end_newline=NEWLINES,
       pad=st.sampled_from(["", " ", "\t", "  "]))
def test_every_byte_outside_the_markers_is_kept(bom, head, tail, last, old, begin_newline, end_newline, pad):
    before = ("\ufeff" if bom else "") + "".join(head) + pad + RECORDS[0] + pad + begin_newline
    body = "".join(line + begin_newline for line in old if RECORDS[1] not in line)
    after = pad + RECORDS[1] + pad + (end_newline + "".join(tail) + last if tail or last else "")
    new = md.replace_marked(before + body + after, SECTIONS, "README.md")
    generated = "".join(line + begin_newline for line in SECTIONS["records"].rstrip("\n").split("\n"))
    assert new == before + generated + after  # the section in the begin line's newline; the rest byte for byte
    assert md.replace_marked(new, SECTIONS, "README.md") == new  # and again: the same text


CASES = [  # (what, the file's bytes): rewritten through `speedrun report --readme`, all but the section kept
    ("CRLF", b"# T\r\n\r\n<!-- records:begin -->\r\nold\r\n<!-- records:end -->\r\nafter\r\n"),
    ("no newline at the end", b"top\n<!-- records:begin -->\n<!-- records:end -->"),
    ("a byte-order mark, marker first", b"\xef\xbb\xbf<!-- records:begin -->\r\n<!-- records:end -->\r\n\xc3\xbc"),
    ("lone CRs", b"a\r<!-- records:begin -->\r<!-- records:end -->\rb\r"),
    ("mixed, the begin line's newline used", b"a\n<!-- records:begin -->\r\nx\n<!-- records:end -->\nb \xe2\x80\xa8\n"),
]


@pytest.mark.parametrize("what, data", CASES, ids=[c[0] for c in CASES])
def test_the_file_keeps_its_bytes_and_newlines(database, tmp_path, what, data):
    readme = tmp_path / "README.md"
    readme.write_bytes(data)
    assert main(["report", "--db", str(database), "--readme", str(readme)]) == 0
    new = readme.read_bytes()
    begin, end = (marker.encode() for marker in RECORDS)
    head, tail = data.split(begin)[0], data.split(end)[1]
    newline = re.match(rb"\r\n|\r|\n", data.split(begin)[1]).group()
    assert new.startswith(head + begin + newline) and new.endswith(end + tail)
    section = new[len(head + begin + newline):-len(end + tail)]
    assert NO_RECORD.encode() in section and section.endswith(newline)
    assert len(re.findall(rb"\r\n|\r|\n", section)) == section.count(newline)  # one newline convention throughout
    assert main(["report", "--db", str(database), "--readme", str(readme)]) == 0
    assert readme.read_bytes() == new


SHARED = [  # (the file, the line named): a marker beside other text is refused, the file unchanged
    ("x <!-- records:begin --> inline\n<!-- records:end -->\n", 1),
    ("<!-- records:begin --> tail\n<!-- records:end -->\n", 1),
    ("a\n<!-- records:begin -->\nold <!-- records:end -->\n", 3),
    ("a\n\n<!-- records:begin --><!-- records:end -->\n", 3),
    ("<!-- records:begin -->\r\n<!-- records:end -->\r\nsee `<!-- records:end -->` above\r\n", 3),
    ("```\n<!-- records:begin -->\n```\nsay <!-- records:begin --> here\n<!-- records:end -->\n", 4),
]


@pytest.mark.parametrize("doc, line", SHARED)
def test_a_marker_beside_other_text_is_refused_naming_its_line(database, tmp_path, capsys, doc, line):
    readme = tmp_path / "README.md"
    readme.write_bytes(doc.encode())
    assert main(["report", "--db", str(database), "--readme", str(readme)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"line {line} holds" in err and "line of its own" in err, err
    assert readme.read_bytes() == doc.encode()


FENCED = [  # (the file, the indices of its live begin and end lines): markers inside fenced code blocks are
    # examples, kept as they are; the live pair's section is rewritten
    ("```\n<!-- records:begin -->\nexample\n<!-- records:end -->\n```\n<!-- records:begin -->\n<!-- records:end -->\n",
     5, 6),
    ("<!-- records:begin -->\n<!-- records:end -->\n~~~\n<!-- records:begin -->\n~~~\n", 0, 1),
    ("   ````markdown\n<!-- records:end -->\n```\nstill code\n`````\n<!-- records:begin -->\n<!-- records:end -->\n",
     5, 6),
    ("~~~~\n~~~\n<!-- records:begin -->\n~~~~~  \n<!-- records:begin -->\nold\n<!-- records:end -->\nend\n", 4, 6),
]


@pytest.mark.parametrize("doc, begin, end", FENCED)
def test_markers_inside_fenced_code_are_examples(database, tmp_path, doc, begin, end):
    readme = tmp_path / "README.md"
    readme.write_text(doc)
    assert main(["report", "--db", str(database), "--readme", str(readme)]) == 0
    lines, new = doc.split("\n"), readme.read_text().split("\n")
    assert new[:begin + 1] == lines[:begin + 1] and new[begin + 1].startswith(NO_RECORD)
    assert new[-(len(lines) - end):] == lines[end:]  # the live end line and everything after it


@pytest.mark.parametrize("doc", [
    "```\n<!-- records:begin -->\n<!-- records:end -->\n```\n",
    "~~~\n<!-- records:begin -->\n<!-- records:end -->\n",  # a fence never closed runs to the end of the file
    "  ```\n<!-- records:begin -->\n```\n<!-- records:end -->\n",  # the end marker alone is live
])
def test_only_fenced_markers_is_no_markers(database, tmp_path, capsys, doc):
    readme = tmp_path / "README.md"
    readme.write_text(doc)
    assert main(["report", "--db", str(database), "--readme", str(readme)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs one line <!-- records:begin -->" in err and "fenced code" in err
    assert readme.read_text() == doc


def test_sections_that_overlap_are_refused_and_several_are_placed_in_one_text():
    doc = "\n".join([RECORDS[0], ABLATION[0], RECORDS[1], ABLATION[1], ""])
    with pytest.raises(ValueError, match="begins inside the records section"):
        md.replace_marked(doc, {"records": "r", "ablation": "a"}, "BENCHMARKS.md")
    doc = "\r\n".join(["x", *ABLATION, "y", *RECORDS, "z"])
    assert md.replace_marked(doc, {"records": "r", "ablation": "a"}, "f") == "\r\n".join(
        ["x", ABLATION[0], "a", ABLATION[1], "y", RECORDS[0], "r", RECORDS[1], "z"])
