"""The relay of owners' shares between members: what makes a transfer lost on the way cost no round.

A member keeps every owner's share it received whole — the averaged segments and the owner's certificate over them,
byte for byte — in :class:`HeldShares`, and serves it to a groupmate of the same group that missed it
(``CheckedAverager.rpc_fetch_share``). The owner's signature covers the bytes, so a relay can withhold a share but
not alter it: the requester checks the certificate exactly as it checks the owner's own reply
(:meth:`template.allreduce.runner.CheckedAllReduceRunner._receive_share`).

What happens when a peer disappears: a request for a share still arriving waits at most ``wait_s``, and only while
our own exchange with the owners runs (never on our own fetching of missed shares, so two members that miss the same
share cannot wait on each other); a share we do not hold is answered ``INTERNAL_ERROR`` at once and the requester
asks the next member.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2

from template.allreduce.messages import MessageError, ShareRequest

__all__ = ["HeldShares", "share_message"]

RELAY_POLL_S = 0.05  # how often a relay request for a share still arriving looks again


def share_message(payload: bytes, *, code: int = averaging_pb2.AVERAGED_PART,
                  weight: float = 0.0) -> averaging_pb2.AveragingData:
    """One message of the all-reduce's streams: ``payload`` (a packed message of :mod:`template.allreduce.messages`)
    in hivemind's ``AveragingData``."""
    return averaging_pb2.AveragingData(code=code, tensor_part=runtime_pb2.Tensor(buffer=payload), weight=weight)


@dataclass
class HeldShares:
    """The owners' shares a member received whole (certificate verified), byte for byte as it received them, for the
    groupmates that missed one (module docstring)."""

    group_id: bytes
    members: tuple[PeerID, ...]
    wait_s: float
    shares: dict[int, tuple[tuple[bytes, ...], bytes]] = field(default_factory=dict)  # owner -> (segments, certificate)
    settled: bool = False  # our exchange with the owners ended: what is not here now will not arrive

    async def serve(self, request: averaging_pb2.AveragingData,
                    context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Members of the group only; a share we do not hold whole is answered ``INTERNAL_ERROR`` (ask another)."""
        if context.remote_id not in self.members or request.group_id != self.group_id:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        try:
            owner = ShareRequest.unpack(request.tensor_part.buffer, len(self.members)).owner
        except MessageError:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        give_up = time.monotonic() + self.wait_s
        while owner not in self.shares and not self.settled and time.monotonic() < give_up:
            await asyncio.sleep(RELAY_POLL_S)
        share = self.shares.get(owner)
        if share is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
            return
        segments, certificate = share
        for packed in (*segments, certificate):
            yield share_message(packed)
