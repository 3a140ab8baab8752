"""A peer's contribution to one round's all-reduce: encoded once, committed to by a Merkle root, signed.

Why: the bytes a miner feeds into the all-reduce must be exactly the bytes it publishes to validators (DESIGN.md §9),
and every mismatch must be refused before it reaches the average or attributed to its author with proof. So the
contribution is encoded once and everything else refers to those bytes:

- **Segments.** The flat vector of all parameters (Δ, plus the error-feedback residual for codecs that keep one) is
  cut into segments of ``codec.segment_values`` values (segments span tensor boundaries; the last is shorter), and
  each segment is encoded on its own. The segment is the unit of the butterfly (a reducer owns whole segments), of
  verification and of publication.
- **Root.** ``leaf_k = H("segment" | bytes_k)``; a binary Merkle tree over the leaves (``node = H("node" | l | r)``,
  an odd node at the end of a level moves up unchanged) gives ``root``, which commits to every segment and their
  number. A reducer that owns segments [a, b) checks the sender's leaves of its range against the signed root with
  :func:`range_proof` / :func:`root_from_range` (at most two hashes per tree level), then each segment's bytes against
  its leaf *before* accumulating it.
- **Commitment.** ``(scope, round, codec, numel, root)`` signed by the contributor's key (a hotkey for neurons) is
  what goes into the matchmaking gather, so every member knows every sender's root before any data moves, and what
  the publication repeats.
- **Segment statements.** Each segment is also sent with the sender's signature over ``(scope, round, k, leaf)`` of
  the bytes it actually sends: a reducer that receives bytes other than the committed leaf holds the sender's own
  signature of them, a proof anyone can check; a reducer that claims a mismatch without one proves nothing (and its
  exclusion of that sender is then its own fault).

On bad input: every parser here raises ``ValueError`` (``ContributionError``) naming what is wrong and never trusts a
length it was given; :func:`root_from_range` refuses a proof of the wrong length.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from template.allreduce.codecs import SegmentCodec, encode_segments, segment_slices

_LEAF = b"diloco/segment\x00"
_NODE = b"diloco/node\x00"
_COMMITMENT = b"diloco/contribution-commitment/v1\x00"
_STATEMENT = b"diloco/segment-statement/v1\x00"
DIGEST_BYTES = 32
MAX_SCOPE_CHARS = 200


class ContributionError(ValueError):
    """A commitment, proof or statement that is malformed or does not check out."""


class Signer(Protocol):
    """Who contributes: ``key`` is the public identity (an ss58 hotkey), ``sign`` its signature of some bytes."""

    key: str

    def sign(self, message: bytes) -> bytes: ...


Verifier = Callable[[str, bytes, bytes], bool]  # (key, message, signature) -> whether the key signed the message


# ---------------------------------------------------------------------------------------------------- the tree


def leaf_digest(segment: bytes) -> bytes:
    return hashlib.sha256(_LEAF + segment).digest()


def _parent(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(_NODE + left + right).digest()


def merkle_levels(leaves: Sequence[bytes]) -> list[list[bytes]]:
    """Every level of the tree, leaves first, the root's level last."""
    if not leaves:
        raise ContributionError("a contribution has at least one segment")
    levels = [list(leaves)]
    while len(levels[-1]) > 1:
        level = levels[-1]
        levels.append([_parent(level[i], level[i + 1]) if i + 1 < len(level) else level[i]
                       for i in range(0, len(level), 2)])
    return levels


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    return merkle_levels(leaves)[-1][0]


def range_proof(levels: list[list[bytes]], start: int, stop: int) -> list[bytes]:
    """The hashes a holder of leaves [start, stop) needs to recompute the root: ≤ 2 per level, bottom-up."""
    if not 0 <= start < stop <= len(levels[0]):
        raise ContributionError(f"range [{start}, {stop}) is not within {len(levels[0])} leaves")
    proof = []
    for level in levels[:-1]:
        if start % 2:
            proof.append(level[start - 1])
        if stop % 2 and stop < len(level):
            proof.append(level[stop])
        start, stop = start // 2, (stop + 1) // 2
    return proof


def root_from_range(leaves: Sequence[bytes], start: int, stop: int, count: int, proof: Sequence[bytes]) -> bytes:
    """The root of a tree of ``count`` leaves, from its leaves [start, stop) and their :func:`range_proof`."""
    if not 0 <= start < stop <= count or len(leaves) != stop - start:
        raise ContributionError(f"{len(leaves)} leaves do not fill range [{start}, {stop}) of {count}")
    if any(len(h) != DIGEST_BYTES for h in (*leaves, *proof)):
        raise ContributionError("a digest is not 32 bytes")
    nodes, remaining = list(leaves), list(proof)
    while count > 1:
        if start % 2:
            if not remaining:
                raise ContributionError("the proof is too short")
            nodes.insert(0, remaining.pop(0))
            start -= 1
        if stop % 2 and stop < count:
            if not remaining:
                raise ContributionError("the proof is too short")
            nodes.append(remaining.pop(0))
            stop += 1
        nodes = [_parent(nodes[i], nodes[i + 1]) if i + 1 < len(nodes) else nodes[i] for i in range(0, len(nodes), 2)]
        start, stop, count = start // 2, (stop + 1) // 2, (count + 1) // 2
    if remaining:
        raise ContributionError(f"the proof has {len(remaining)} hashes too many")
    return nodes[0]


# ----------------------------------------------------------------------------------------------- the encoding


def shaped(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """The flat vector of a contribution or an average, as views of the model's tensor shapes."""
    return [part.view(shape) for part, shape in zip(flat.split([s.numel() for s in shapes]), shapes, strict=True)]


def segment_count(numel: int, segment_values: int) -> int:
    return -(-numel // segment_values)


def segment_bounds(numel: int, segment_values: int, index: int) -> tuple[int, int]:
    """Values [start, stop) of the flat vector that segment ``index`` holds."""
    start = index * segment_values
    return start, min(start + segment_values, numel)


def encoded_sizes(codec: SegmentCodec, numel: int) -> list[int]:
    """The byte size of each encoded segment of a ``numel``-value contribution (every codec is fixed-size)."""
    return [codec.encoded_size(values.stop - values.start) for values in segment_slices(numel, codec.segment_values)]


@dataclass(frozen=True)
class EncodedContribution:
    """One peer's contribution, encoded once: these exact bytes are hashed, signed, sent and published."""

    codec: str  # the codec's descriptor (name and every setting that changes the bytes)
    numel: int
    segments: tuple[bytes, ...]
    leaves: tuple[bytes, ...]
    root: bytes
    decoded: torch.Tensor  # flat float32: what the receivers will decode, i.e. what the contribution is worth

    @property
    def nbytes(self) -> int:
        return sum(len(s) for s in self.segments)


def codec_descriptor(codec: SegmentCodec) -> str:
    """A string that differs whenever two codecs would produce different bytes (name, segment size, settings)."""
    settings = getattr(codec, "settings", None)
    return f"{codec.name}/{codec.segment_values}" + (f"/{settings}" if settings is not None else "")


def encode_contribution(codec: SegmentCodec, flat: torch.Tensor) -> EncodedContribution:
    """Encode a flat float32 vector segment by segment; ``decoded`` is what every receiver will decode."""
    segments, decoded = encode_segments(codec, flat.detach().reshape(-1).to(torch.float32))
    leaves = tuple(leaf_digest(s) for s in segments)
    return EncodedContribution(codec_descriptor(codec), decoded.numel(), tuple(segments), leaves, merkle_root(leaves),
                               decoded)


def decode_segments(codec: SegmentCodec, segments: Sequence[bytes], numel: int) -> torch.Tensor:
    """The flat vector a list of encoded segments stands for (CodecError from the codec on malformed bytes)."""
    if len(segments) != segment_count(numel, codec.segment_values):
        raise ContributionError(f"{len(segments)} segments cannot hold {numel} values")
    flat = torch.empty(numel, dtype=torch.float32)
    for index, data in enumerate(segments):
        start, stop = segment_bounds(numel, codec.segment_values, index)
        flat[start:stop] = codec.decode(data, stop - start)
    return flat


# ------------------------------------------------------------------------------ what is signed, and by whom


@dataclass(frozen=True)
class Commitment:
    """A contributor's signed promise: in round ``round`` of ``scope`` it contributes the segments under ``root``."""

    scope: str  # the run (and, for neurons, the subnet): a commitment never counts elsewhere
    round: int
    codec: str
    numel: int
    root: bytes
    key: str
    signature: bytes = b""

    def signing_bytes(self) -> bytes:
        scope = self.scope.encode()
        codec = self.codec.encode()
        return b"".join((_COMMITMENT, struct.pack("<H", len(scope)), scope, struct.pack("<QQ", self.round, self.numel),
                         struct.pack("<H", len(codec)), codec, self.root, self.key.encode()))

    @classmethod
    def sign(cls, signer: Signer, scope: str, round: int, contribution: EncodedContribution) -> Commitment:
        unsigned = cls(scope, round, contribution.codec, contribution.numel, contribution.root, signer.key)
        return cls(**{**unsigned.__dict__, "signature": signer.sign(unsigned.signing_bytes())})

    def verify(self, verify: Verifier) -> bool:
        return verify(self.key, self.signing_bytes(), self.signature)

    def to_wire(self) -> dict[str, Any]:
        """Plain msgpack/JSON-able values (bytes as hex)."""
        return dict(scope=self.scope, round=self.round, codec=self.codec, numel=self.numel, root=self.root.hex(),
                    key=self.key, signature=self.signature.hex())

    @classmethod
    def from_wire(cls, document: Any) -> Commitment:
        """Parse what :meth:`to_wire` made; ContributionError for anything else."""
        fields = ("scope", "round", "codec", "numel", "root", "key", "signature")
        if not isinstance(document, dict) or set(document) != set(fields):
            raise ContributionError("a commitment is an object with exactly the fields " + ", ".join(fields))
        scope, round, codec, numel, root, key, signature = (document[f] for f in fields)
        if not (isinstance(scope, str) and len(scope) <= MAX_SCOPE_CHARS and isinstance(codec, str)
                and len(codec) <= MAX_SCOPE_CHARS and isinstance(key, str) and len(key) <= 64):
            raise ContributionError("a commitment's scope, codec or key is not a short string")
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 48 for v in (round, numel)):
            raise ContributionError("a commitment's round and numel are non-negative integers")
        try:
            root_bytes, signature_bytes = bytes.fromhex(root), bytes.fromhex(signature)
        except (TypeError, ValueError):
            raise ContributionError("a commitment's root and signature are hex") from None
        if len(root_bytes) != DIGEST_BYTES or len(signature_bytes) > 128:
            raise ContributionError("a commitment's root is 32 bytes and its signature short")
        return cls(scope, round, codec, numel, root_bytes, key, signature_bytes)


def statement_bytes(scope: str, round: int, index: int, leaf: bytes) -> bytes:
    """What a sender signs for each segment it sends: "in round r of scope, my segment k has this digest"."""
    encoded = scope.encode()
    return b"".join((_STATEMENT, struct.pack("<H", len(encoded)), encoded, struct.pack("<QQ", round, index), leaf))


def sign_statements(signer: Signer, scope: str, round: int, contribution: EncodedContribution) -> tuple[bytes, ...]:
    return tuple(signer.sign(statement_bytes(scope, round, k, leaf)) for k, leaf in enumerate(contribution.leaves))
