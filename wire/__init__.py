"""Sans-IO protocol core of meshd: framing, streams, secure channel, messages.

Nothing in this package touches sockets, threads or trio; every piece is a
state machine fed bytes (and, where timing matters, the current time).
"""
