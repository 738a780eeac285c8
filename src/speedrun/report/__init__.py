"""The report from the results database: queries.py reads it (leaderboards, curves, instruments' reports),
html.py and markdown.py render it, charts.py draws it (matplotlib, imported only when drawing), publish.py checks
the files and writes them."""
