"""The top of the house: the `tokenstream` CLI, the local stack, operator tools (ops, chaos, keys, plan,
route).

Nothing in the roles or the shared packages imports it (tests/test_layers.py): the roles share
`schemas`, `common`, `topics` and `producers`, and talk only through topics.
"""

__version__ = "0.1.0"
