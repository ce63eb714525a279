"""The study tools' shared code: the runner of run folders (runner.py) and the report engine (report.py)."""
