"""A report of a database whose results are all left off the leaderboards says why, not "nothing is stored"."""

from __future__ import annotations

import contextlib

from test_db import make_result

from speedrun.records import db
from speedrun.report import html, markdown, queries


def test_smoke_tests_and_interrupted_results_are_named_as_what_they_are(tmp_path):
    path = tmp_path / "r.db"
    with contextlib.closing(db.connect(path)) as conn:
        assert queries.unranked_text(conn) == "No result is stored yet."
        for i in range(3):
            db.insert_result(conn, make_result(i, smoke_test=True))
        db.insert_result(conn, make_result(5, complete=False))
        text = queries.unranked_text(conn)
        assert text.startswith("No stored result is ranked: of the 4 stored, 3 smoke tests") and \
            "1 incomplete" in text and "without --smoke" in text, text
        assert "No result is stored yet" not in html.page(conn)
        assert "3 smoke tests" in html.page(conn)
        assert markdown.readme_lines(conn) == [text]
