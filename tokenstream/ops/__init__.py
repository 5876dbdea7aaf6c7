"""Operator tools built on the topic registry: consumer-group lag (`tokenstream ops lag`)."""
