"""The local stack (Kafka, Redis, Weaviate) on loopback, without Docker.

stack = Stack.default()        # persistent data, standard ports: `tokenstream stack up`
stack = Stack.ephemeral(tmp)   # throwaway data, free ports: the test suite
"""

from tokenstream.stack.stack import Stack

__all__ = ["Stack"]
