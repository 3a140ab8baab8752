"""Small helpers the tests that talk to hivemind hosts share: running a coroutine on the thread that owns a hivemind
event loop, framing a protobuf message the way hivemind's stream handlers read it, binding a PeerID to a hotkey on
chain the way a neuron does, and the start of an averaging peer run as a child process."""

from __future__ import annotations

import asyncio
import textwrap

import bittensor as bt
from hivemind.p2p import P2P

from template.chain.client import ChainClient
from template.p2p.identity import commitment_value

# The start of a child script (``python -c SCRIPT ARGS_JSON``) that runs one averaging peer: it reads its arguments
# (``initial_peers``, ``shapes``, the ``AveragingConfig`` fields under ``config``, optionally ``segment_values``)
# from argv[1], starts a DHT and a PseudoGradientAverager, and prints READY. The rest of the script uses ``args``,
# ``dht``, ``shapes``, ``averager`` and the modules imported here.
AVERAGER_CHILD_PREAMBLE = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import torch
    from template.p2p.dht import DHTConfig, start_dht
    from template.allreduce.averager import AveragingConfig, PseudoGradientAverager
    from template.allreduce.codecs import get_codec

    args = json.loads(sys.argv[1])
    dht = start_dht(DHTConfig(initial_peers=args["initial_peers"]))
    shapes = [torch.Size(s) for s in args["shapes"]]
    config = AveragingConfig(**args["config"])
    codec = get_codec(config.compression, **{k: args[k] for k in ("segment_values",) if k in args})
    averager = PseudoGradientAverager(dht, shapes, config, codec=codec)
    print("READY", flush=True)
    """
)


def run(loop: asyncio.AbstractEventLoop, coro, timeout: float = 30.0):
    """Run a coroutine on the hivemind loop thread and wait for it, at most ``timeout`` seconds."""
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def message_frame(message) -> bytes:
    """A message frame of hivemind's protobuf streams: marker, 8-byte big-endian length, body."""
    body = message.SerializeToString()
    return P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


def commit_peer_id(subtensor: bt.Subtensor, wallet: bt.Wallet, netuid: int, peer_id: str) -> None:
    """Commit ``peer_id`` as the wallet hotkey's PeerID on ``netuid``, through the chain facade as a neuron does
    (a no-op when the chain holds it already; ValueError for a non-PeerID, bt.ChainError when the chain refuses)."""
    ChainClient(subtensor, netuid).set_commitment(wallet, commitment_value(peer_id))
