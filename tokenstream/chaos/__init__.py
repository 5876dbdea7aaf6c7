"""`tokenstream chaos`: a fault drill against the whole system under load (see `drill.py`)."""
