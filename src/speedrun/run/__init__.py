"""One `speedrun train`: runner.py drives N seeds of a recipe through its family, session.py keeps what finished
(result file, database, display), resume.py handles checkpoints, export.py saved models, display.py the table."""
