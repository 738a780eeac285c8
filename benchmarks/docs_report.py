"""Regenerate the committed report and the generated Markdown from the stored results in benchmarks/results/.

    python benchmarks/docs_report.py            # docs/report.html, docs/report.png, README.md, BENCHMARKS.md

A fresh database is filled with every JSON under benchmarks/results/ (`speedrun results import`: the training
results, the instruments' reports and benchmarks/vs_airbench.py's races), then `speedrun report` writes
docs/report.html and rewrites README.md's generated section (the races side by side with airbench94, then the
records) and BENCHMARKS.md's ablation section; headless Chromium (Debian's chromium, driven by playwright) takes
docs/report.png, the page's first screen as a reader opens it (1280 × 900 pixels): a picture of the whole page
would be a strip too tall to read.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Chromium on a machine with a closed network (the machine's notes): no background fetches or updates.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def screenshot(html: Path, png: Path, chromium: str, width_px: int = 1280, height_px: int = 900,
               full_page: bool = False) -> dict:
    """The page's first screen (a `width_px` × `height_px` window; full_page: the whole page) as a PNG; returns
    what the browser saw: each chart's kind, load state and sizes, the leaderboard rows shown, and every URL the
    page requested."""
    from playwright.sync_api import sync_playwright

    seen: dict = {"requests": []}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width_px, "height": height_px})
            page.on("request", lambda r: seen["requests"].append(r.url))
            page.goto(html.resolve().as_uri())
            seen["charts"] = page.evaluate(
                "Array.from(document.images).map(i => ({kind: i.dataset.chart, done: i.complete, "
                "w: i.naturalWidth, h: i.naturalHeight, shown: i.getBoundingClientRect().width}))")
            seen["leaderboard_rows"] = page.locator("#leaderboard ~ table").first.locator("tbody tr").count()
            page.screenshot(path=str(png), full_page=full_page)
        finally:
            browser.close()
    return seen


def main(argv: list[str] | None = None) -> int:
    from speedrun.cli.program import main as speedrun
    from speedrun.records import db as db

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chromium", default=shutil.which("chromium"), help="the browser (default: chromium)")
    args = parser.parse_args(argv)
    # The committed tables judge records at the rule's own threshold (stats.RECORD_ALPHA), whatever this shell sets
    os.environ.pop("SPEEDRUN_RECORD_P", None)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "results.db"
        files = sorted((REPO / "benchmarks" / "results").rglob("*.json"))
        with contextlib.closing(db.connect(path)) as conn:
            failed = [entry for entry in db.import_files(conn, files) if entry.error]
        if failed:
            print(f"docs_report: error: {failed[0].path}: {failed[0].error}", file=sys.stderr)
            return 2
        (REPO / "docs").mkdir(exist_ok=True)
        code = speedrun(["report", "--db", str(path), "--out", str(REPO / "docs" / "report.html"),
                         "--readme", str(REPO / "README.md"), "--benchmarks", str(REPO / "BENCHMARKS.md")])
    if code or args.chromium is None:
        print("docs_report: no screenshot (no chromium; apt install chromium)" if not code else "", file=sys.stderr)
        return code or 2
    seen = screenshot(REPO / "docs" / "report.html", REPO / "docs" / "report.png", args.chromium)
    print(f"docs/report.png: {len(seen['charts'])} charts, {seen['leaderboard_rows']} leaderboard rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
