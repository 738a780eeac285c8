"""Stored text in the report's Markdown (--readme, --benchmarks) and HTML is shown as text: a dataset, recipe, device,
trick or setting named `[click](http://evil)`, `<script>`, `*x*`, `a|b`, a backtick, a newline or an ESC becomes no
link, image, tag, emphasis, code span, math or extra cell. The Markdown is rendered by a CommonMark parser with
GitHub's tables and strikethrough (markdown-it-py, which rich brings), and every cell's text is compared with the
name as the report shows it (errors.printable, whitespace folded)."""

import re
from html.parser import HTMLParser

import pytest
from markdown_it import MarkdownIt
from test_report import make_result
from test_report_hostile import ABLATE, WATERFALL

from speedrun.cli.program import main
from speedrun.records import db as db
from speedrun.report import markdown as md
from speedrun.report.queries import clip_text

NAMES = ["[click](http://evil.example)", "![img](http://evil.example/x.png)", "<script>alert(1)</script>",
         "<img src=x onerror=alert(1)>", "a | b | c", "`rm -rf` x", "``two`` `", "*bold* _em_ **strong** ~~gone~~",
         "line\nbreak\r\nthird", "http://bare.example www.bare.example me@bare.example", "$x^2$ and $$y$$",
         "&lt;b&gt; &amp; &#x3C;", "back\\slash\\|pipe\\", "<!-- records:end -->", "\x1b[31mred\x1b]0;t\x07",
         "<https://auto.example>", "[ref]: http://evil.example", "a\\*not em\\*", "label_smoothing _em_ a_ __b__"]
TUNE = {**ABLATE, "benchmark": "tune", "tricks": None,
        "tune": {"recommended": {name: name for name in NAMES[:3]},
                 "rows": [{"setting": name, "guide": name, "n": 3, "verdict": name, "changes_numbers": True,
                           "time": {"ratio": 0.9, "ratio_ci95": [0.8, 1.0], "p": 0.01},
                           "accuracy": {"diff": 0.0, "ci95": [-0.01, 0.01]}} for name in NAMES]}}


class Page(HTMLParser):
    """The tags, their attributes, the text, and the cells of each table row of an HTML document."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.tags, self.attrs, self.text, self.rows, self._cell = set(), [], [], [], None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.attrs.append((tag, dict(attrs)))
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)


def render(markdown: str) -> Page:
    return Page(MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(markdown))


@pytest.fixture(scope="module")
def hostile_db(tmp_path_factory):
    """A result per name (the name its dataset, recipe, device and command) and an ablation, waterfall and doctor's
    report whose every name is one of them."""
    path = tmp_path_factory.mktemp("markup") / "r.db"
    with db.connect(path) as conn:
        for i, name in enumerate(NAMES):
            # 0.99 on every run: each reaches its 94% target, so the README's records table shows it
            result = make_result(i, 0.99, 1.0 + i, dataset=name, recipe=name, command=f"speedrun train {name}")
            result["environment"]["device_name"] = name
            db.insert_result(conn, result)
        tricks = [{**ABLATE["tricks"][0], "trick": name, "off": name, "what": name} for name in NAMES]
        steps = [{**WATERFALL["waterfall"][1], "step": name} for name in NAMES]
        where = {"recipe": NAMES[0], "dataset": NAMES[2], "device": NAMES[4],
                 "environment": {**ABLATE["environment"], "device_name": NAMES[7], "torch": NAMES[9]}}
        for report in ({**ABLATE, **where, "tricks": tricks}, {**WATERFALL, **where, "waterfall": steps},
                       {**TUNE, **where}):
            db.insert_result(conn, report)
    return path


def _markdown(hostile_db, tmp_path, flag: str, marker: str) -> str:
    target = tmp_path / "doc.md"
    target.write_text(f"<!-- {marker}:begin -->\n<!-- {marker}:end -->\n")
    assert main(["report", "--db", str(hostile_db), flag, str(target)]) == 0
    text = target.read_text()
    assert text.count(f"<!-- {marker}:begin -->") == 1 and text.count(f"<!-- {marker}:end -->") == 1
    return text.split(f"<!-- {marker}:begin -->\n")[1].split(f"<!-- {marker}:end -->")[0]


def _no_bare_links(markdown: str) -> None:
    """GitHub links a bare URL, www. name or e-mail address by itself; outside code spans none may stay whole."""
    outside_code = re.sub(r"(`+)(?:(?!\1).)*\1", "", markdown)
    assert not re.search(r"(?i)https?://|www\.|[a-z]@[a-z]", outside_code), outside_code


def test_the_readme_table_shows_every_stored_name_as_text_in_its_own_cell(hostile_db, tmp_path):
    section = _markdown(hostile_db, tmp_path, "--readme", "records")
    page = render(section)
    assert page.tags <= {"table", "thead", "tbody", "tr", "th", "td", "code", "p"}, page.tags
    header, *rows = page.rows
    # 10 columns, the records rule's p among them
    assert len(rows) == len(NAMES) and all(len(row) == len(header) == 10 for row in rows)
    shown = {row[2]: row for row in rows}  # by recipe: the dataset's cell is its name, not the path stored
    for name in NAMES:
        _, _, recipe, device, *_, command = shown[clip_text(name, 40)]
        assert device == clip_text(name, 40)
        assert command == clip_text(f"speedrun train {name}", 300).replace("<!--", "<!- -").replace("-->", "- ->")
    _no_bare_links(section)
    assert "\x1b" not in section and "\x07" not in section


def test_the_benchmarks_tables_show_every_stored_name_as_text(hostile_db, tmp_path):
    section = _markdown(hostile_db, tmp_path, "--benchmarks", "ablation")
    page = render(section)
    assert page.tags <= {"h4", "p", "table", "thead", "tbody", "tr", "th", "td", "code"}, page.tags
    tables = [i for i, row in enumerate(page.rows) if row[0] in ("trick", "step", "setting")]
    assert len(tables) == 3
    for start, end in zip(tables, tables[1:] + [len(page.rows)]):
        header, *rows = page.rows[start:end]
        assert len(rows) == len(NAMES) and all(len(row) == len(header) for row in rows)
        assert [row[0] for row in rows] == [clip_text(name, 80 if header[0] == "setting" else 60) for name in NAMES]
    text = "".join(page.text)
    for name in (NAMES[0], NAMES[2], NAMES[4], NAMES[7], NAMES[9]):  # the titles' and the device line's names
        assert clip_text(name)[:18] in text
    _no_bare_links(section)
    assert "\x1b" not in section


@pytest.mark.slow
def test_the_html_page_shows_every_stored_name_as_text(hostile_db, tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", "--db", str(hostile_db), "--out", str(out)]) == 0
    raw = out.read_text()
    page = Page(raw)
    assert page.tags <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "a", "table",
                         "thead", "tbody", "tr", "th", "td", "code", "span", "img"}, page.tags
    for tag, attrs in page.attrs:
        assert not any(key.startswith("on") for key in attrs), (tag, attrs)
        assert tag != "a" or attrs["href"].startswith("#")
        assert tag != "img" or attrs["src"].startswith("data:image/png;base64,")
    text = "".join(page.text)
    for name in NAMES:
        assert clip_text(name, 60) in text, name
    assert "\x1b" not in raw and "\x07" not in raw


@pytest.mark.parametrize("plain", ["../shared/datasets/cifar10-jpeg", "label_smoothing", "AMD EPYC 7B13",
                                   "cifar10-94 on d (cpu): each trick off alone", "90.65 ± 0.62"])
def test_plain_names_stay_readable_in_the_file(plain):
    """Only what could act is escaped: a path, an identifier with underscores, our own ": " are written as they are."""
    assert md._md(plain) == plain
