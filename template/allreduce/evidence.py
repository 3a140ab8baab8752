"""What one member saw of one all-reduce, as typed values: the evidence members compare and validators audit.

The runner (:mod:`template.allreduce.runner`) fills an :class:`AllReduceReport` in the averager's process; it crosses
to the host process whole (own processes only; nothing here ever comes from another peer as an object: every field was
parsed and checked from wire messages first). The host adds the members' confirmation (:attr:`AllReduceEvidence.
conflicts`) and hands :class:`AllReduceEvidence` to whoever audits the round (:mod:`template.base.audit`), which reads
it by attribute.

Indices: *members* are numbered in the group's order (hivemind's ``group_info.peer_ids``, auxiliaries included);
*senders* are the members that contribute, numbered in the same order without the auxiliaries. An owner is a member.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from template.allreduce.messages import InputStatement, Refusal
from template.allreduce.owner_inputs import OwnerInputs

__all__ = ["AllReduceEvidence", "AllReduceReport", "Dispute", "OwnerCertificate", "SegmentRecord"]


@dataclass(frozen=True)
class SegmentRecord:
    """One averaged segment as this member received it from its owner."""

    owner: int  # member index
    included: tuple[int, ...]  # sender indices whose contribution the average holds
    digest: bytes  # sha256 of the averaged segment's encoded bytes
    refusals: tuple[Refusal, ...] = ()  # senders refused with proof (their own signed statement of other bytes)
    refuted: str = ""  # why the average missed the owner's claims: dropped (zeros in θ's step), by every member alike
    disputed: str = ""  # why this member, a sender, disputes the owner's statement of its input (disputes.py)
    statements: tuple[InputStatement | None, ...] = ()  # per included sender, what the owner stated (auxiliaries)


@dataclass(frozen=True)
class Dispute:
    """A sender's valid signed dispute of what the owner of ``segment`` stated of its input (disputes.py)."""

    segment: int
    sender: int  # sender index
    signature: bytes


@dataclass(frozen=True)
class OwnerCertificate:
    """An owner's signature over every averaged segment of its range [start, stop) that it sent this member."""

    digest: bytes  # of the packed averaged segments, in order
    commitments: bytes  # digest of the senders' commitments the owner checked against
    signature: bytes
    start: int
    stop: int

    def claim(self) -> list[str]:
        """The certificate as members post it to each other (hex strings in the DHT)."""
        return [self.digest.hex(), self.commitments.hex(), self.signature.hex()]


@dataclass
class AllReduceEvidence:
    """Who was in the round, what each owner averaged and signed, and what went wrong (with proof where any)."""

    senders: tuple[str, ...] = ()  # sender index -> peer id
    ranges: tuple[tuple[int, int], ...] = ()  # member index -> its segment range [start, stop)
    segments: dict[int, SegmentRecord] = field(default_factory=dict)  # segment -> how it was averaged
    certificates: dict[int, OwnerCertificate] = field(default_factory=dict)  # owner (member index) -> certificate
    failed_owners: dict[str, str] = field(default_factory=dict)  # owner peer id -> why its share failed here
    conflicts: tuple[int, ...] = ()  # owners that signed different shares for different members (confirmation)
    # every valid signed dispute the members posted (confirmation), in order; the segments of those that count
    # (template.allreduce.disputes.counted_disputes) are dropped (zeros) by every member that read them
    disputes: tuple[Dispute, ...] = ()
    recovered: dict[int, str] = field(default_factory=dict)  # owner -> the member that relayed its share to us
    # per member, its sender index when the rule left each owner's own input out of its segments (reduction.
    # OwnerRule.own_input_min_senders), else (): such a segment still counts as covering its owner
    left_out: tuple[int | None, ...] = ()

    def coverage(self) -> dict[str, float]:
        """Sender peer id -> the fraction of the vector's segments whose average includes it."""
        count = self.segment_count
        included = [0] * len(self.senders)
        for record in self.segments.values():
            for sender in record.included:
                included[sender] += 1
            if self.left_out and (owner := self.left_out[record.owner]) is not None:
                included[owner] += 1  # its input was left out by the rule, not lost
        return {peer: (included[s] / count if count else 0.0) for s, peer in enumerate(self.senders)}

    def refuted(self) -> dict[int, str]:
        """Segment -> why its average was dropped in the round (template.allreduce.verification)."""
        return {segment: record.refuted for segment, record in self.segments.items() if record.refuted}

    @property
    def segment_count(self) -> int:
        return max((stop for _, stop in self.ranges), default=0)


@dataclass
class AllReduceReport:
    """The runner's account of one all-reduce, for the host: the evidence and the counters."""

    group_id: bytes
    evidence: AllReduceEvidence
    values_total: int
    values_failed: int  # values of segments that never arrived or failed: > 0 means a partial result
    segments_expected: int = 0  # of our own range, from every sender
    segments_received: int = 0
    dropped: list[tuple[str, int, str]] = field(default_factory=list)  # (sender, segment, reason) in our range
    clipped: list[tuple[str, int, float]] = field(default_factory=list)  # (sender, segment, factor) in our range
    bytes_sent: int = 0
    bytes_received: int = 0
    failure: str = ""  # "" when every value arrived and the result was written
    inputs: OwnerInputs | None = None  # what we accepted as an owner, kept for validators (None: we own nothing)
    finished_at: float = 0.0  # time.time() when the averager process ended the all-reduce (overlap: it ran unseen)
    absent: tuple[str, ...] = ()  # members that answered that they are not in this group (template.allreduce.roster)
    # what failed are only the ranges of absent members, whose shares no groupmate held: no member completes this
    # group, so the round may look for another (template.allreduce.roster)
    lost_to_absent: bool = False

    @property
    def received_fraction(self) -> float:
        return 1.0 - self.values_failed / self.values_total if self.values_total else 0.0
