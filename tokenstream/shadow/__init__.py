"""`tokenstream shadow`: a candidate model tried on recorded traffic (replay.py, compare.py, gate.py,
cli.py)."""
