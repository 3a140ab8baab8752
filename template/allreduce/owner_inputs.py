"""What an owner averaged, kept for validators: the senders' accepted segments of its range, checkable by anyone.

Why (DESIGN.md §12): a validator recomputes every averaged segment from its inputs. From the
publications alone it cannot when one of a segment's senders did not publish what it contributed — and that shields
the segment's *owner*: a liar-reducer beside a twofaced sender went unchecked in every round (0 of 15 segments
recomputed, 26.9 % of the weight, ``docs/validation.md``). So every owner keeps the segments it accepted
(:class:`InputKeeper`, filled by the runner as it checks them) and serves them over the publication RPC (kind
``inputs``, to validator-permit holders, :mod:`template.p2p.publication`).

An owner can withhold an input but not forge one: each sender's bytes come with its leaves of the owner's range
and their Merkle proof, which must hash up to the root the sender signed at matchmaking, and each segment must hash
to its leaf (:func:`verified_inputs`). A recomputation from verified inputs that differs from what the owner signed
in its certificate convicts the owner on its own signature and its victims' (:mod:`template.base.audit`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from template.allreduce.contribution import Commitment, ContributionError, leaf_digest, root_from_range
from template.protocol import PROTOCOL_VERSION, InputsMeta, SenderInputs

__all__ = ["AcceptedInput", "InputKeeper", "OwnerInputs", "verified_inputs"]


@dataclass(frozen=True)
class AcceptedInput:
    """One sender's segments of the owner's range that the owner accepted, and what proves them the sender's."""

    key: str  # the sender's hotkey: its commitment's key
    leaves: tuple[bytes, ...]  # its leaves of the owner's range, checked against its signed root
    proof: tuple[bytes, ...]  # their Merkle range proof
    segments: dict[int, bytes]  # segment index -> the bytes the owner accepted


@dataclass(frozen=True)
class OwnerInputs:
    """Everything an owner accepted in one all-reduce, for its range [start, stop) of ``count`` segments."""

    start: int
    stop: int
    count: int
    inputs: tuple[AcceptedInput, ...]

    def to_wire(self, netuid: int, round: int) -> tuple[InputsMeta, bytes]:
        """The metadata and payload the publication server keeps and serves."""
        senders, parts = [], []
        for accepted in self.inputs:
            indices = sorted(accepted.segments)
            parts.extend(accepted.segments[k] for k in indices)
            senders.append(SenderInputs(accepted.key, tuple(h.hex() for h in accepted.leaves),
                                        tuple(h.hex() for h in accepted.proof), tuple(indices),
                                        tuple(len(accepted.segments[k]) for k in indices)))
        payload = b"".join(parts)
        meta = InputsMeta(PROTOCOL_VERSION, netuid, round, self.start, self.stop, self.count, tuple(senders),
                          hashlib.sha256(payload).hexdigest())
        return meta, payload


@dataclass
class InputKeeper:
    """What the runner accepted as an owner, as it checks it: each sender's header, then its segments."""

    start: int
    stop: int
    count: int
    keys: Sequence[str | None]  # sender index -> its commitment's key (None: no valid commitment)
    _headers: dict[int, tuple[tuple[bytes, ...], tuple[bytes, ...]]] = field(default_factory=dict)
    _segments: dict[int, dict[int, bytes]] = field(default_factory=dict)

    def header(self, sender: int, leaves: Sequence[bytes], proof: Sequence[bytes]) -> None:
        """The sender's leaves of our range and their proof, once they hashed up to its signed root."""
        self._headers[sender] = (tuple(leaves), tuple(proof))
        self._segments[sender] = {}

    def leaf(self, sender: int, segment: int) -> bytes:
        return self._headers[sender][0][segment - self.start]

    def keep(self, sender: int, segment: int, data: bytes) -> None:
        """A segment whose bytes hashed to the sender's leaf."""
        self._segments[sender][segment] = data

    def accepted(self, sender: int, segment: int) -> bytes:
        """The bytes of ``sender``'s ``segment`` that we kept."""
        return self._segments[sender][segment]

    def snapshot(self) -> OwnerInputs:
        return OwnerInputs(self.start, self.stop, self.count, tuple(
            AcceptedInput(self.keys[s], *self._headers[s], dict(self._segments[s]))
            for s in sorted(self._headers) if self.keys[s] is not None))


def verified_inputs(meta: InputsMeta, payload: bytes, commitments: Mapping[str, Commitment],
                    max_segment_bytes: int) -> dict[str, dict[int, bytes]]:
    """Sender key -> segment -> bytes, for the senders whose leaves hash up to the root they signed
    (``commitments``: key -> commitment) and for the segments that hash to their leaf; anything else is left out,
    as the owner had not served it."""
    verified: dict[str, dict[int, bytes]] = {}
    offset = 0
    for sender in meta.senders:
        chunks = []
        for size in sender.sizes:
            chunks.append(payload[offset:offset + size])
            offset += size
        commitment = commitments.get(sender.key)
        if commitment is None:
            continue
        leaves = tuple(bytes.fromhex(h) for h in sender.leaves)
        try:
            root = root_from_range(leaves, meta.start, meta.stop, meta.count, [bytes.fromhex(h) for h in sender.proof])
        except ContributionError:
            continue
        if root != commitment.root:
            continue
        verified[sender.key] = {k: data for k, data in zip(sender.segments, chunks, strict=True)
                                if len(data) <= max_segment_bytes and leaf_digest(data) == leaves[k - meta.start]}
    return verified
