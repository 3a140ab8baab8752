"""Small helpers the tests that talk to hivemind hosts share: running a coroutine on the thread that owns a hivemind
event loop, and framing a protobuf message the way hivemind's stream handlers read it."""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P


def run(loop: asyncio.AbstractEventLoop, coro, timeout: float = 30.0):
    """Run a coroutine on the hivemind loop thread and wait for it, at most ``timeout`` seconds."""
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def message_frame(message) -> bytes:
    """A message frame of hivemind's protobuf streams: marker, 8-byte big-endian length, body."""
    body = message.SerializeToString()
    return P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body
