"""tokenstream: an LLM serving system built as an event-driven pipeline over Apache Kafka.

This package holds what every role shares: typed configuration (`config`), the
command line (`cli`) and the local stack manager (`stack`). Roles live in their own
top-level packages and talk only through `topics` and `schemas`.
"""

__version__ = "0.1.0"
