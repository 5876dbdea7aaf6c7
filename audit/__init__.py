"""Auditing from the log: the timeline of a request, a conversation or a time range across every
topic the registry lets an auditor read, the text the client saw, and a gap check.

    sources.py  which topics and partitions to read (from topics/registry.py, not copied knowledge)
    scan.py     a time-ordered merge of many partitions, each between two offsets, with progress
    fold.py     one request's events: timeline rows, the client's text, the gap check
    hops.py     the time a request spent in each hop (shared with `bench pipeline`)
    report.py   rich tables and JSON Lines export
    run.py      the three scans (request, conversation, range)
    cli.py      `tokenstream audit ...`
"""
