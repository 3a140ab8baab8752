"""What a validator checks between a round's publications and the round's all-reduce: scored = applied.

A miner's publication of round r must be *exactly* what it contributed to round r's all-reduce (DESIGN.md §9):

- :func:`read_publication` checks the publication's commitment (signed by the miner's hotkey, for this subnet, run
  and round, with the run's codec and model size), that the payload's segments hash up to the committed root, and —
  when the validator saw the miner in the round's group — that it is the same commitment the miner gave the group.
  Only then are the segments decoded into the Δ that is scored.
- :func:`audit_allreduce` then checks the all-reduce itself from the validator's own view of it (as an auxiliary
  member it received every owner's averaged segments, the senders each one included, the refusals with their proofs,
  and every owner's signed certificate): a refusal must carry the sender's own signature of bytes other than it
  committed (else the owner framed it), two validly signed certificates of one owner that differ prove that it sent
  different members different bytes, and every averaged segment is recomputed bit for bit from the publications with
  the reducer's own rule (:func:`template.allreduce.reduction.reduce_segment`) — which is what checks an owner's own
  share, the one contribution that never crosses the wire. The same recomputation shows which senders' values the
  rule had to bound (a value beyond ``value_bound_multiple`` × the lower median of the senders' largest): such a
  sender is convicted on its own signed bytes — honest training stays far inside the bound (docs/benchmarks.md §8).
  A segment a sender disputed in the round (:mod:`template.allreduce.disputes`) is judged by the same recomputation,
  with the owner's claims: a wrong average or a false statement of the sender's input convicts the owner, a true
  statement the sender. An owner that averaged its own input where the rule leaves it out is convicted too.

Every accusation rests on something the accused signed (a commitment, a statement, a certificate) or on a
deterministic recomputation from bytes its victims signed; there is no accusation on anyone's word. A sender that
did not publish what it contributed does not shield the segments it went into: their owners serve the inputs they
averaged (:mod:`template.allreduce.owner_inputs`, each checked against its sender's signed root), and the audit
recomputes from those. What still cannot be checked is counted: a segment whose inputs neither the publications
nor its owner show is not recomputed (``unshown``: the owner did not show them, and earns nothing for the round); a
sender an owner left out without proof (a timeout, or a silent drop) is nobody's fault here — it just does not
count toward that sender's participation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from template.allreduce.averager import AveragingResult
from template.allreduce.codecs import CodecError, SegmentCodec
from template.allreduce.contribution import (
    Commitment,
    ContributionError,
    codec_descriptor,
    decode_segments,
    encoded_sizes,
    leaf_digest,
    merkle_root,
    segment_bounds,
    shaped,
    statement_bytes,
)
from template.allreduce.disputes import mismatch
from template.allreduce.evidence import SegmentRecord
from template.allreduce.reduction import (
    NoValidContribution,
    OwnerRule,
    ReducedSegment,
    SegmentInput,
    reduce_segment,
    weight_cap,
)
from template.allreduce.verification import round_context, segment_context
from template.p2p.keys import verify_signature
from template.p2p.publication import Publication

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class ReadPublication:
    """A publication whose bytes are the miner's committed contribution, decoded (or why it is not)."""

    tensors: Tensors | None
    segments: tuple[bytes, ...] = ()
    commitment: Commitment | None = None
    reason: str = ""


def read_publication(publication: Publication, codec: SegmentCodec, shapes: Sequence[torch.Size], scope: str,
                     contributed: Mapping | None) -> ReadPublication:
    """Check that ``publication`` is the contribution its miner committed to (module docstring), and decode it.

    ``contributed`` is the commitment (wire form) the miner gave the round's group, when the validator saw it there.
    """
    meta = publication.meta
    try:
        commitment = Commitment.from_wire(dict(meta.commitment))
    except ContributionError as err:
        return ReadPublication(None, reason=f"malformed commitment: {err}")
    numel = sum(s.numel() for s in shapes)
    expected = (meta.hotkey, scope, meta.round, codec_descriptor(codec), numel)
    if (commitment.key, commitment.scope, commitment.round, commitment.codec, commitment.numel) != expected:
        return ReadPublication(None, reason="its commitment is for another key, run, round, codec or model size")
    if not commitment.verify(verify_signature):
        return ReadPublication(None, reason="its commitment is not signed by its hotkey")
    segments, offset = [], 0
    for size in encoded_sizes(codec, numel):
        segments.append(publication.payload[offset:offset + size])
        offset += size
    if offset != len(publication.payload) or merkle_root([leaf_digest(s) for s in segments]) != commitment.root:
        return ReadPublication(None, reason="its payload is not the contribution it committed to")
    if contributed is not None and contributed != commitment.to_wire():
        return ReadPublication(None, reason="it published other bytes than it contributed to the all-reduce")
    try:
        flat = decode_segments(codec, segments, numel)
    except (CodecError, ContributionError) as err:
        return ReadPublication(None, reason=f"its committed contribution does not decode: {err}")
    return ReadPublication(shaped(flat, shapes), tuple(segments), commitment)


@dataclass
class AuditResult:
    """Who the all-reduce's own evidence convicts (peer id → why), and what could not be checked.

    ``framed`` counts, per sender, the segments an owner refused without proof: the sender did its part, so its
    participation must not suffer for the owner's lie.
    """

    accused: dict[str, str] = field(default_factory=dict)
    framed: dict[str, int] = field(default_factory=dict)
    segments_checked: int = 0
    segments_unchecked: int = 0
    unshown: dict[str, int] = field(default_factory=dict)  # owner -> its segments left unchecked: it did not show
    # the inputs it averaged (asked for them because a sender's publication was missing, it served none that verify)


def owners_to_ask(result: AveragingResult, segments_by_peer: Mapping[str, Sequence[bytes]]) -> list[str]:
    """The owners (peer ids) of the averaged segments that the publications alone cannot recompute: one of the
    senders they included did not publish what it contributed. Ask them for the inputs they averaged."""
    evidence, members = result.evidence, list(result.group)
    return sorted({members[record.owner] for record in evidence.segments.values()
                   if not all(evidence.senders[s] in segments_by_peer for s in record.included)})


def audit_allreduce(result: AveragingResult, segments_by_peer: Mapping[str, Sequence[bytes]], codec: SegmentCodec,
                    scope: str, round: int, rule: OwnerRule,
                    served: Mapping[str, Mapping[int, bytes]] | None = None) -> AuditResult:
    """Check the round's all-reduce from the validator's view of it against the verified publications
    (``segments_by_peer``: peer id → the segments it committed and published) and, for a sender that did not
    publish, the inputs its owners served (``served``: peer id → segment → bytes verified against the sender's
    signed root, :func:`template.allreduce.owner_inputs.verified_inputs`; module docstring)."""
    served = served or {}
    evidence, outcome = result.evidence, AuditResult()
    senders = evidence.senders
    if not senders:
        return outcome
    members = list(result.group)
    commitments = {peer: Commitment.from_wire(c) for peer, c in result.commitments.items()}
    announced = [result.weights.get(peer) for peer in senders]
    cap = weight_cap(announced)
    context = round_context(scope, round, bytes.fromhex(result.group_id))
    disputers: dict[int, list[int]] = {}  # segment -> the senders that disputed it (who lied, owner or sender?)
    for dispute in evidence.disputes:
        disputers.setdefault(dispute.segment, []).append(dispute.sender)
    for owner in evidence.conflicts:
        outcome.accused[members[owner]] = "signed different shares for different members of the group (its own " \
                                          "certificates)"
    for segment, record in evidence.segments.items():
        owner = members[record.owner]
        for refusal in record.refusals:
            sender = senders[refusal.sender]
            statement = statement_bytes(scope, round, segment, refusal.leaf)
            committed = segments_by_peer.get(sender)
            proven = sender in commitments and verify_signature(commitments[sender].key, statement, refusal.signature)
            if proven and (committed is None or leaf_digest(committed[segment]) != refusal.leaf):
                outcome.accused.setdefault(sender, f"sent segment {segment} other than it committed (its own "
                                                   "signed statement)")
            else:
                outcome.accused.setdefault(owner, f"refused {sender}'s segment {segment} without proof")
                outcome.framed[sender] = outcome.framed.get(sender, 0) + 1
        data = [_input(segments_by_peer, served, senders[s], segment) for s in record.included]
        if any(d is None for d in data):
            outcome.segments_unchecked += 1
            outcome.unshown[owner] = outcome.unshown.get(owner, 0) + 1
            continue
        inputs = [SegmentInput(s, d, announced[s] or 0.0) for s, d in zip(record.included, data, strict=True)]
        numel = _segment_numel(codec, commitments, segment)
        try:
            expected = reduce_segment(inputs, numel, codec, announced, rule, cap,
                                      segment_context(context, segment) if segment in disputers else None)
        except NoValidContribution:
            expected = None
        outcome.segments_checked += 1
        if rule.leaves_out_owner(len(senders)) and owner in senders and senders.index(owner) in record.included:
            outcome.accused.setdefault(owner, f"averaged its own input into segment {segment} (the rule leaves it "
                                              f"out from {rule.own_input_min_senders} senders)")
        for sender, count in expected.bounded if expected is not None else ():
            outcome.accused.setdefault(senders[sender], f"moved {count} values of segment {segment} beyond the "
                                                        f"owner's bound ({rule.value_bound_multiple} × the lower "
                                                        "median of the senders' largest; recomputed from its "
                                                        "signed inputs)")
        if expected is None or hashlib.sha256(expected.data).digest() != record.digest \
                or tuple(expected.included) != record.included:
            outcome.accused.setdefault(owner, f"returned a wrong average for segment {segment} (recomputed from its "
                                              "inputs as their senders signed them)")
        else:
            for disputer in disputers.get(segment, ()):
                _judge_dispute(outcome, segment, record, disputer, senders, owner, expected, numel)
    return outcome


def _judge_dispute(outcome: AuditResult, segment: int, record: SegmentRecord, disputer: int, senders: Sequence[str],
                   owner: str, expected: ReducedSegment, numel: int) -> None:
    """Sender ``disputer`` disputed what the owner of ``segment`` stated of its input, and the owner's average is
    right (``expected``: recomputed with its claims, on the directions of the very bytes the owner sent): the owner
    is convicted when its statement was false, the sender when it was true (template.allreduce.disputes)."""
    position = record.included.index(disputer)
    said = record.statements[position] if len(record.statements) == len(record.included) else None
    if said is None:
        outcome.accused.setdefault(owner, f"stated nothing of {senders[disputer]}'s input in segment {segment}")
        return
    if wrong := mismatch(said, expected.statement(position), numel):
        outcome.accused.setdefault(owner, f"misstated {senders[disputer]}'s input in segment {segment}: {wrong} "
                                          "(recomputed from its signed inputs)")
        return
    # the average's bytes are the recomputed ones, so whom it names for each value is right too
    outcome.accused.setdefault(senders[disputer], f"disputed {owner}'s statement of its input in segment {segment}; "
                                                  "it was true (recomputed from the signed inputs)")


def _input(published: Mapping[str, Sequence[bytes]], served: Mapping[str, Mapping[int, bytes]], sender: str,
           segment: int) -> bytes | None:
    """A sender's segment: from its publication, else as its owner served it, else None (cannot be checked)."""
    if sender in published:
        return published[sender][segment]
    return served.get(sender, {}).get(segment)


def _segment_numel(codec: SegmentCodec, commitments: Mapping[str, Commitment], segment: int) -> int:
    start, stop = segment_bounds(next(iter(commitments.values())).numel, codec.segment_values, segment)
    return stop - start
