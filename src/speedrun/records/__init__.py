"""What a run leaves behind and how it is judged: result_file.py (the JSON result, its environment), db.py (the
SQLite results database), stats.py (the statistics), cost.py (cost per run)."""
