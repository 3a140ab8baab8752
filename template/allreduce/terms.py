"""The terms of one all-reduce: how the vector is cut and shared out, what each sender committed, who signs.

Members of a group compute these alike from the gathered data (:mod:`template.allreduce.averager_process`), so every
owner, sender and auxiliary agrees on which member owns which segments and against which commitments a segment is
checked. :class:`AllReduceFaults` holds the misbehaviours of the adversarial tests, plainly marked, off by default.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from template.allreduce.codecs import SegmentCodec
from template.allreduce.contribution import (
    Commitment,
    Signer,
    Verifier,
    leaf_digest,
    segment_bounds,
    segment_count,
    statement_bytes,
)
from template.allreduce.disputes import true_statement
from template.allreduce.messages import AveragedSegment
from template.allreduce.owner_inputs import InputKeeper
from template.allreduce.segment_reducer import SegmentResult
from template.allreduce.verification import Directions, SegmentCheck, factored, kept_projections, projections

__all__ = ["AllReduceFaults", "OwnContribution", "RoundTerms", "SegmentLayout"]


@dataclass(frozen=True)
class SegmentLayout:
    """How the flat vector is cut into segments, and which member owns which segments."""

    numel: int
    segment_values: int

    @property
    def count(self) -> int:
        return segment_count(self.numel, self.segment_values)

    def numel_of(self, index: int) -> int:
        start, stop = segment_bounds(self.numel, self.segment_values, index)
        return stop - start

    def values(self, start: int, stop: int) -> tuple[int, int]:
        """The flat values [first, last) of segments [start, stop)."""
        return start * self.segment_values, min(stop * self.segment_values, self.numel)

    def ranges(self, peer_fractions: Sequence[float]) -> list[tuple[int, int]]:
        """Contiguous segment ranges in proportion to the fractions (members with fraction 0 own nothing)."""
        total = sum(peer_fractions)
        bounds, acc = [0], 0.0
        for fraction in peer_fractions:
            acc += fraction
            bounds.append(round(self.count * acc / total) if total > 0 else 0)
        bounds[-1] = self.count
        return [(bounds[i], bounds[i + 1]) for i in range(len(peer_fractions))]


@dataclass(frozen=True)
class OwnContribution:
    """This sender's encoded segments, their leaves and its signed statements (from the host, via shared memory)."""

    segments: tuple[bytes, ...]
    leaves: tuple[bytes, ...]
    statements: tuple[bytes, ...]


@dataclass(frozen=True)
class AllReduceFaults:
    """Misbehaviours of an adversarial peer (tests and research only; every field off is the honest protocol).

    ``corrupt_segments``: send segment bytes other than the committed ones, with signed statements of them (an
    equivocator: its refusals carry proof). ``lie``: as an owner, return a wrong average (the negated one) to
    ``"all"`` members or to ``"some"`` (every other member), signing what it sends; ``"forged"``: to all, with claims
    forged to fit it (each input claimed to project like the average itself: each sender disputes its own);
    ``"forged-own"``: to all, with only the claim of its own input forged to fit (the one no other member can
    check: it passes the round below ``OwnerRule.own_input_min_senders``; from there the owner's input is not in the
    average and the first sender's claim takes the lie, which that sender disputes). ``frame``: as an owner,
    refuse the first other sender's segments claiming a mismatch, with a forged "proof". ``dispute``: as a sender,
    dispute every other owner's (true) statement of our input. ``withhold_from``: as an
    owner, send the member with that peer id nothing back (a transfer lost on the way: the member must fetch the
    share elsewhere, the owner's relay included). ``relays=False``: serve no share to a groupmate that missed one,
    not even our own (with ``withhold_from``: an owner that withholds its share both ways). ``start_late_s``: open
    our streams to the other owners this many seconds late (a process that stalled right after its group formed).
    ``begin_late_s``: as a leader, send the first "begin" of this process this many seconds late (a leader whose
    event loop lagged: a follower whose wait for the word ran out has left, yet the leader counts it in; one
    follower, once). ``answer_late_s``: as a leader, stall this process (its event loop blocked) for this many seconds
    when its second join request comes, before answering it (a leader that lagged past the follower's wait for its
    answer, on the request that fills its group of 3: the follower has left, and must not be counted in). Once.
    """

    corrupt_segments: bool = False
    lie: str | None = None
    frame: bool = False
    dispute: bool = False
    withhold_from: str | None = None  # a member's peer id (base58)
    relays: bool = True
    start_late_s: float = 0.0
    begin_late_s: float = 0.0
    answer_late_s: float = 0.0

    def framed(self, sender: int, senders: Sequence, me: object) -> bool:
        """``frame``: whether to refuse ``sender``'s segments, the first of ``senders`` other than ``me``."""
        others = [s for s, peer in enumerate(senders) if peer != me]
        return self.frame and bool(others) and sender == others[0]

    def __post_init__(self) -> None:
        if self.lie not in (None, "all", "some", "forged", "forged-own"):
            raise ValueError("lie must be None, 'all', 'some', 'forged' or 'forged-own'")
        if min(self.start_late_s, self.begin_late_s, self.answer_late_s) < 0:
            raise ValueError("start_late_s, begin_late_s and answer_late_s must be >= 0")


@dataclass(frozen=True)
class RoundTerms:
    """What the members of one all-reduce agree on, besides the group itself."""

    scope: str
    round: int
    codec: SegmentCodec
    layout: SegmentLayout
    commitments: tuple[Commitment | None, ...]  # per sender (group order); None: malformed or unsigned
    verify: Verifier
    signer: Signer | None  # signs this member's certificates as an owner (None: auxiliary members own nothing)
    faults: AllReduceFaults = field(default_factory=AllReduceFaults)

    def corrupted(self, own: OwnContribution, segment: int) -> tuple[bytes, bytes]:
        """AllReduceFaults.corrupt_segments: other bytes than committed, with a (truthful) signed statement of them."""
        data = bytes(b ^ 0x01 for b in own.segments[segment][:64]) + own.segments[segment][64:]
        statement = statement_bytes(self.scope, self.round, segment, leaf_digest(data))
        return data, self.signer.sign(statement) if self.signer is not None else b""

    def told(self, receiver: int, segment: int, result: SegmentResult, check: SegmentCheck,
             kept: InputKeeper) -> AveragedSegment:
        """What an owner sends ``receiver`` of ``segment`` (``result``: its reduction; AllReduceFaults.lie: the
        negated average, with the claims of the true one, to all members — itself too, a consistent liar — or to
        every other one; forged and forged-own: with claims on the directions ``check`` draws for the wrong bytes,
        as every member's check will; ``kept``: the inputs it accepted, which forged-own projects on them)."""
        lie, averaged, decoded = self.faults.lie, result.averaged, result.decoded
        if lie is None or (lie == "some" and receiver % 2 == 0):
            return averaged
        data = negated_average(self.codec, averaged.data, decoded)
        if lie not in ("forged", "forged-own"):
            return dataclasses.replace(averaged, data=data)
        numel = decoded.numel()
        wrong = self.codec.decode_average(data, numel)
        drawn = check.directions(segment, data, numel)
        fitted = tuple(float(p) for p in projections([wrong], drawn)[0])  # what every claim must sum to
        inputs = [self.codec.decode(kept.accepted(s, segment), numel) for s in averaged.included]
        if not self.codec.mean_of_kept:
            return dataclasses.replace(averaged, data=data,
                                       claims=self._forged(lie, averaged, check, inputs, wrong, drawn, fitted))
        # a mean over the kept values: the scaled claims (no sender checks them) fit the wrong average; the plain
        # ones are forged to fit the average's projections at the kept values, which are true for the wrong bytes
        masked = factored(kept_projections(inputs, wrong, drawn)[1])
        total = sum(check.weights[s] for s in averaged.included)
        target = tuple(sum(check.weights[s] / total * m[k] for s, m in zip(averaged.included, masked, strict=True))
                       for k in range(drawn.count))
        plain = self._forged(lie, averaged, check, inputs, wrong, drawn, target)
        return dataclasses.replace(averaged, data=data, claims=tuple(fitted for _ in averaged.included), plain=plain,
                                   masked=masked)

    def _forged(self, lie: str, averaged: AveragedSegment, check: SegmentCheck, inputs: Sequence[torch.Tensor],
                wrong: torch.Tensor, drawn: Directions, target: tuple[float, ...]) -> tuple[tuple[float, ...], ...]:
        """Claims (plain ones for a ``mean_of_kept`` codec) whose weighted sum is ``target``, given the ``inputs``
        averaged (decoded): forged, all equal to it; forged-own, every one true on the wrong average's directions
        but one, which takes the whole lie — our own input's, which no other member holds, when we are in the
        average; else the first sender's, which it disputes."""
        if lie == "forged":
            return tuple(target for _ in averaged.included)
        assert check.own is not None, "forged-own is an owner that sends"
        claims = [list(true_statement(self.codec, check.own.rule, averaged, i, x, drawn, wrong).claims)
                  for i, x in enumerate(inputs)]
        position = averaged.included.index(check.own.sender) if check.own.sender in averaged.included else 0
        weights = [check.weights[s] for s in averaged.included]
        total = sum(weights)
        for k, goal in enumerate(target):
            others = sum(w / total * c[k] for i, (w, c) in enumerate(zip(weights, claims, strict=True))
                         if i != position)
            claims[position][k] = (goal - others) * total / weights[position]
        return tuple(map(tuple, claims))

    @property
    def commitments_digest(self) -> bytes:
        digest = hashlib.sha256()
        for c in self.commitments:
            digest.update(b"\x00" if c is None else b"\x01" + c.signing_bytes() + c.signature)
        return digest.digest()


def negated_average(codec: SegmentCodec, data: bytes, decoded: torch.Tensor) -> bytes:
    """The bytes of the negated average ``decoded`` (encoded as ``data``; a ``mean_of_kept`` codec's naming the same
    sender for each value): a liar's (AllReduceFaults.lie)."""
    if not codec.mean_of_kept:
        return codec.encode_average(-decoded)
    attributed = codec.decode_attributed_average(data, decoded.numel())
    keepers = attributed.keepers_per_value()
    return codec.encode_attributed_average(-decoded, [keepers == sender for sender in range(attributed.groups)])
