"""The messages of the accountable all-reduce, as msgpack maps inside hivemind's ``AveragingData.tensor_part.buffer``.

Sender → owner, on one stream per owner:

- :class:`RangeHeader` first: the sender's leaf digests of the owner's segments [a, b) and the Merkle proof that ties
  them to the root the sender signed at matchmaking (:mod:`template.allreduce.contribution`);
- then one :class:`SenderSegment` per segment: its encoded bytes and the sender's signed statement of their digest.

Owner → every member (senders and auxiliary validators alike), the same bytes to all:

- one :class:`AveragedSegment` per segment: the encoded average, which senders it includes, their total weight, the
  *proven* refusals — a sender whose bytes did not match its committed leaf, with the sender's own signature of
  the digest it did send — the owner's claims, which every member holds the average against
  (:mod:`template.allreduce.verification`), and each input's norm and largest magnitude as its rule read them, from
  which each sender checks the claim of its own input (:mod:`template.allreduce.disputes`) — for a codec that averages
  over the kept values, also plain claims and the average's projections at each sender's kept values;
- a final :class:`ShareCertificate`: the owner's signature over the digest of every averaged segment it sent and of
  the commitments it checked against, so that two members who received different bytes, or an owner that averaged
  against other roots, hold conflicting signed statements (the confirmation in :mod:`template.allreduce.averager`).

Member → member, when a member misses part of an owner's share after the all-reduce (the owner died or stalled
while serving it): one :class:`ShareRequest`, answered with the owner's averaged segments and its certificate
exactly as that member received them; the owner's signature makes the relaying member unable to alter them.

Decoding never trusts the peer: sizes are bounded before use, every field is type-checked, and anything malformed
raises :class:`MessageError` (a ``ValueError``) naming the problem.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from template.allreduce.contribution import DIGEST_BYTES

MAX_SIGNATURE_BYTES = 128
MAX_CLAIMS = 8  # projections per sender in an averaged segment (verification uses 2, 4 for int8)
_CERTIFICATE = b"diloco/share-certificate/v1\x00"


class MessageError(ValueError):
    """A message of the all-reduce that is malformed or oversized."""


def _pack(document: dict[str, Any]) -> bytes:
    return msgpack.packb(document, use_bin_type=True)


def _unpack(data: bytes, fields: Sequence[str], what: str, limit: int) -> dict[str, Any]:
    if len(data) > limit:
        raise MessageError(f"{what} of {len(data)} bytes exceeds {limit}")
    try:
        document = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=limit, max_array_len=1 << 24,
                                   max_map_len=16, max_str_len=1024)
    except Exception as err:  # msgpack's own errors (ExtraData, FormatError, ValueError, ...): all mean malformed
        raise MessageError(f"{what} is not msgpack: {type(err).__name__}") from None
    if not isinstance(document, dict) or set(document) != set(fields):
        raise MessageError(f"{what} must be a map with exactly {sorted(fields)}")
    return document


def _digests(value: Any, what: str, limit: int) -> tuple[bytes, ...]:
    if not isinstance(value, list) or len(value) > limit:
        raise MessageError(f"{what} must be a list of at most {limit} digests")
    if not all(isinstance(d, bytes) and len(d) == DIGEST_BYTES for d in value):
        raise MessageError(f"{what} must hold 32-byte digests")
    return tuple(value)


def _signature(value: Any, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) > MAX_SIGNATURE_BYTES:
        raise MessageError(f"{what} must be a short byte string")
    return value


@dataclass(frozen=True)
class RangeHeader:
    leaves: tuple[bytes, ...]
    proof: tuple[bytes, ...]

    def pack(self) -> bytes:
        return _pack(dict(leaves=list(self.leaves), proof=list(self.proof)))

    @classmethod
    def unpack(cls, data: bytes, segments: int) -> RangeHeader:
        document = _unpack(data, ("leaves", "proof"), "range header", (segments + 130) * (DIGEST_BYTES + 3) + 64)
        return cls(_digests(document["leaves"], "leaves", segments), _digests(document["proof"], "proof", 128))


@dataclass(frozen=True)
class SenderSegment:
    data: bytes
    signature: bytes

    def pack(self) -> bytes:
        return _pack(dict(data=self.data, sig=self.signature))

    @classmethod
    def unpack(cls, data: bytes, max_bytes: int) -> SenderSegment:
        document = _unpack(data, ("data", "sig"), "segment", max_bytes + MAX_SIGNATURE_BYTES + 64)
        if not isinstance(document["data"], bytes):
            raise MessageError("a segment's data must be bytes")
        return cls(document["data"], _signature(document["sig"], "a segment's signature"))


@dataclass(frozen=True)
class Refusal:
    """A sender refused with proof: its signature that its segment had digest ``leaf`` (≠ its committed leaf)."""

    sender: int
    leaf: bytes
    signature: bytes


@dataclass(frozen=True)
class InputStatement:
    """What an owner says about one sender's input in one averaged segment (or what that input really gives): its
    norm and largest magnitude as the owner's rule read them, its claims (plain: unscaled) and, for a codec that
    averages over the kept values, the average's projections at the values it kept (template.allreduce.disputes)."""

    norm: float
    peak: float
    claims: tuple[float, ...]
    masked: tuple[float, ...] = ()


@dataclass(frozen=True)
class AveragedSegment:
    data: bytes
    included: tuple[int, ...]  # sender indices, increasing
    weight: float
    refusals: tuple[Refusal, ...]
    # per included sender, the owner's projections of its input (template.allreduce.verification); () for a codec
    # whose segments are not checked in the round
    claims: tuple[tuple[float, ...], ...] = ()
    # per included sender, its input's norm and largest magnitude as the owner's rule read them (each sender redoes
    # the rule for its own input from these: template.allreduce.disputes); () without claims
    norms: tuple[float, ...] = ()
    peaks: tuple[float, ...] = ()
    # per included sender, for a codec that averages over the kept values (``mean_of_kept``), whose claims are
    # scaled by weights only the owner knows: its plain (unscaled) claims and the average's projections at the values
    # it kept, which its sender can check (template.allreduce.verification); () otherwise
    plain: tuple[tuple[float, ...], ...] = ()
    masked: tuple[tuple[float, ...], ...] = ()

    def statement(self, position: int) -> InputStatement | None:
        """The owner's statement of the ``position``-th included sender's input, as that sender can check it (for a
        ``mean_of_kept`` codec: the plain claims and the projections at its kept values); None when it made none."""
        if not len(self.norms) == len(self.peaks) == len(self.claims) == len(self.included):
            return None
        if not self.plain and not self.masked:
            return InputStatement(self.norms[position], self.peaks[position], tuple(self.claims[position]))
        if not len(self.plain) == len(self.masked) == len(self.included):
            return None
        return InputStatement(self.norms[position], self.peaks[position], tuple(self.plain[position]),
                              tuple(self.masked[position]))

    def pack(self, senders: int) -> bytes:
        mask = sum(1 << s for s in self.included).to_bytes((senders + 7) // 8, "little")
        refusals = [[r.sender, r.leaf, r.signature] for r in self.refusals]
        return _pack(dict(data=self.data, included=mask, weight=float(self.weight), refusals=refusals,
                          claims=[list(c) for c in self.claims], norms=[float(n) for n in self.norms],
                          peaks=[float(p) for p in self.peaks], plain=[list(c) for c in self.plain],
                          masked=[list(m) for m in self.masked]))

    @classmethod
    def unpack(cls, data: bytes, max_bytes: int, senders: int) -> AveragedSegment:
        document = _unpack(data, ("data", "included", "weight", "refusals", "claims", "norms", "peaks", "plain",
                                  "masked"), "averaged segment",
                           max_bytes + senders * (DIGEST_BYTES + MAX_SIGNATURE_BYTES + 38 + 27 * MAX_CLAIMS) + 64)
        mask, weight, refusals = document["included"], document["weight"], document["refusals"]
        claims, norms, peaks = document["claims"], document["norms"], document["peaks"]
        plain, masked = document["plain"], document["masked"]
        for rows in (claims, plain, masked):
            if not isinstance(rows, list) or len(rows) > senders or not all(
                    isinstance(c, list) and len(c) <= MAX_CLAIMS and all(isinstance(p, float) for p in c)
                    for c in rows):
                raise MessageError(f"an averaged segment's projections are at most {MAX_CLAIMS} floats per sender")
        if not all(isinstance(v, list) and len(v) <= senders and all(isinstance(x, float) for x in v)
                   for v in (norms, peaks)):
            raise MessageError("an averaged segment's norms and peaks are at most one float per sender")
        if not isinstance(document["data"], bytes) or not isinstance(mask, bytes) or len(mask) != (senders + 7) // 8:
            raise MessageError("an averaged segment's data and inclusion mask must be bytes of the right size")
        if not isinstance(weight, float) or not isinstance(refusals, list) or len(refusals) > senders:
            raise MessageError("an averaged segment's weight is a float and its refusals a short list")
        bits = int.from_bytes(mask, "little")
        if bits >> senders:
            raise MessageError("the inclusion mask names senders that do not exist")
        parsed = []
        for item in refusals:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], int) and 0 <= item[0] < senders
                    and isinstance(item[1], bytes) and len(item[1]) == DIGEST_BYTES):
                raise MessageError("a refusal is [sender index, 32-byte leaf, signature]")
            parsed.append(Refusal(item[0], item[1], _signature(item[2], "a refusal's signature")))
        return cls(document["data"], tuple(s for s in range(senders) if bits >> s & 1), weight, tuple(parsed),
                   tuple(tuple(c) for c in claims), tuple(norms), tuple(peaks), tuple(tuple(c) for c in plain),
                   tuple(tuple(m) for m in masked))


@dataclass(frozen=True)
class ShareCertificate:
    """An owner's signed account of the share it served: digest of its averaged segments, of the roots it used."""

    digest: bytes
    commitments: bytes
    signature: bytes

    def pack(self) -> bytes:
        return _pack(dict(digest=self.digest, commitments=self.commitments, sig=self.signature))

    @classmethod
    def unpack(cls, data: bytes) -> ShareCertificate:
        document = _unpack(data, ("digest", "commitments", "sig"), "share certificate", 512)
        digest, commitments = document["digest"], document["commitments"]
        if not all(isinstance(d, bytes) and len(d) == DIGEST_BYTES for d in (digest, commitments)):
            raise MessageError("a share certificate's digests are 32 bytes")
        return cls(digest, commitments, _signature(document["sig"], "a share certificate's signature"))


@dataclass(frozen=True)
class ShareRequest:
    """Member → member, after the all-reduce: "send me owner ``owner``'s share as you received it"."""

    owner: int  # member index

    def pack(self) -> bytes:
        return _pack(dict(owner=self.owner))

    @classmethod
    def unpack(cls, data: bytes, members: int) -> ShareRequest:
        owner = _unpack(data, ("owner",), "share request", 64)["owner"]
        if not isinstance(owner, int) or isinstance(owner, bool) or not 0 <= owner < members:
            raise MessageError(f"a share request names an owner in [0, {members})")
        return cls(owner)


def certificate_bytes(scope: str, round: int, group_id: bytes, owner: int, start: int, stop: int, digest: bytes,
                      commitments: bytes) -> bytes:
    """What an owner signs about the share [start, stop) it averaged in one group."""
    encoded = scope.encode()
    return b"".join((_CERTIFICATE, struct.pack("<H", len(encoded)), encoded, struct.pack("<Q", round),
                     struct.pack("<H", len(group_id)), group_id, struct.pack("<QQQ", owner, start, stop), digest,
                     commitments))


def segments_digest(segments: Sequence[bytes]) -> bytes:
    """One digest of a share's averaged segments, in order (each length-prefixed)."""
    digest = hashlib.sha256()
    for data in segments:
        digest.update(struct.pack("<Q", len(data)))
        digest.update(data)
    return digest.digest()
