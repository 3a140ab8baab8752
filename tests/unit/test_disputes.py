"""A sender's check of what an owner states of the sender's own input (template/allreduce/disputes.py), the rule that
leaves an owner's own input out of its segments, and how a validator judges a dispute (template/base/audit.py)."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from template.allreduce.disputes import OwnInputCheck, counted_disputes, mismatch
from template.allreduce.evidence import AllReduceEvidence, SegmentRecord
from template.allreduce.messages import AveragedSegment, InputStatement, MessageError
from template.allreduce.reduction import OwnerRule, SegmentInput, reduce_segment, weight_cap
from template.allreduce.verification import SegmentCheck, segment_context
from template.base.audit import AuditResult, _judge_dispute
from tests.unit.test_verification import CONTEXT, codec_of, values

SEGMENT = 3
NUMEL = 1000


def stated_average(codec, inputs: list[torch.Tensor], weights: list[float]):
    """What an owner sends for segment 3 (claims and statements) and the encoded inputs it averaged."""
    encoded = [SegmentInput(i, codec.encode(x), w) for i, (x, w) in enumerate(zip(inputs, weights, strict=True))]
    reduced = reduce_segment(encoded, inputs[0].numel(), codec, weights, OwnerRule(), weight_cap(weights),
                             segment_context(CONTEXT, SEGMENT))
    message = AveragedSegment(reduced.data, reduced.included, reduced.weight, (), reduced.claims, reduced.norms,
                              reduced.peaks, reduced.plain, reduced.masked)
    return message, encoded, reduced


def dispute(codec, message: AveragedSegment, encoded: list[SegmentInput], sender: int) -> str:
    """What sender ``sender`` (not the owner) makes of the owner's statement of its input in ``message``."""
    contribution = [b""] * SEGMENT + [encoded[sender].data]
    check = OwnInputCheck(codec, OwnerRule(), sender, contribution, own_range=(0, 0))
    drawn = SegmentCheck(codec, CONTEXT, []).directions(SEGMENT, message.data, NUMEL)
    return check.disputed(SEGMENT, message, codec.decode_average(message.data, NUMEL), drawn)


@pytest.mark.parametrize("codec_name", ["none", "fp16", "int8", "sparse-all", "sparse-kept"])
def test_every_sender_finds_an_honest_owners_statement_of_its_input_true(codec_name):
    """Ordinary and spread inputs, and one sender 50 × the others with a few values 100 × more: its norm is clipped
    and its values bounded, and each sender, redoing the rule for its own input, finds the owner's statement true."""
    codec, generator = codec_of(codec_name, 4096), torch.Generator().manual_seed(11)
    for kind in ("normal", "spread", "outlier"):
        inputs = [values("spread" if kind == "spread" else "normal", NUMEL, generator) for _ in range(3)]
        if kind == "outlier":
            inputs[2] = inputs[2] * 50
            inputs[2][:8] *= 100
        message, encoded, reduced = stated_average(codec, inputs, [1.0, 2.0, 3.0])
        assert bool(reduced.clipped) == (kind == "outlier"), (codec_name, kind)
        assert [dispute(codec, message, encoded, s) for s in range(3)] == ["", "", ""], (codec_name, kind)


def test_a_false_claim_norm_or_peak_is_disputed_by_its_sender_alone():
    codec, generator = codec_of("fp16", 4096), torch.Generator().manual_seed(12)
    inputs = [values("normal", NUMEL, generator) for _ in range(3)]
    message, encoded, _ = stated_average(codec, inputs, [1.0, 1.0, 1.0])
    claims = [list(c) for c in message.claims]
    claims[1][0] = -claims[1][0]
    forged = dataclasses.replace(message, claims=tuple(map(tuple, claims)))
    assert [bool(dispute(codec, forged, encoded, s)) for s in range(3)] == [False, True, False]
    assert "projections" in dispute(codec, forged, encoded, 1)
    norms = list(message.norms)
    norms[0] *= 1.001  # changes nobody's clip factor; still false
    assert "norm" in dispute(codec, dataclasses.replace(message, norms=tuple(norms)), encoded, 0)
    peaks = list(message.peaks)
    peaks[2] = peaks[2] * (1 + 2**-40)
    assert "largest magnitude" in dispute(codec, dataclasses.replace(message, peaks=tuple(peaks)), encoded, 2)
    # an owner that understates the others' norms (to clip ours): they dispute their norms, and we our claim, which
    # no longer follows from what it stated (its stated rule clips us; its claim of our input did not)
    norms = tuple(n / 10 if s != 0 else n for s, n in enumerate(message.norms))
    understated = dataclasses.replace(message, norms=norms)
    assert "norm" in dispute(codec, understated, encoded, 1)
    assert "projections" in dispute(codec, understated, encoded, 0)
    assert "without the owner's statement" in dispute(codec, dataclasses.replace(message, norms=()), encoded, 0)


def test_over_the_kept_values_each_sender_checks_its_plain_claim_its_kept_values_and_whom_the_average_names():
    """A mean over the kept values: the scaled claims are the owner's word (no sender knows the weights they use),
    but the plain claims, the projections of the average at a sender's kept values and the values the average names
    a sender for are each checked by that sender — a lie in any of them is disputed by the one it is about."""
    codec, generator = codec_of("sparse-kept", 4096), torch.Generator().manual_seed(13)
    inputs = [values("normal", NUMEL, generator) for _ in range(3)]
    message, encoded, _ = stated_average(codec, inputs, [1.0, 2.0, 1.0])
    assert message.statement(0).masked and message.statement(0).claims == message.plain[0]
    scaled = dataclasses.replace(message, claims=tuple((0.0,) * len(c) for c in message.claims))
    assert [dispute(codec, scaled, encoded, s) for s in range(3)] == ["", "", ""]
    plain = dataclasses.replace(message, plain=(message.plain[0], tuple(-c for c in message.plain[1]),
                                                message.plain[2]))
    assert [bool(dispute(codec, plain, encoded, s)) for s in range(3)] == [False, True, False]
    masked = dataclasses.replace(message, masked=(tuple(-m for m in message.masked[0]), *message.masked[1:]))
    assert "kept values" in dispute(codec, masked, encoded, 0) and dispute(codec, masked, encoded, 1) == ""
    # an average that names sender 2 for a value only sender 0 kept (and moves it): sender 2 disputes it
    decoded = codec.decode_attributed_average(message.data, NUMEL)
    average, keepers, groups = decoded.values.clone(), decoded.keepers_per_value(), decoded.groups
    kept_by = [codec.decode(e.data, NUMEL) != 0 for e in encoded]
    only_first = int(torch.nonzero(kept_by[0] & ~kept_by[1] & ~kept_by[2])[0])
    keepers[only_first], average[only_first] = 2, average[only_first] * 2
    renamed = dataclasses.replace(message, data=codec.encode_attributed_average(
        average, [keepers == s for s in range(groups)]))
    assert "names us for 1 values we did not keep" in dispute(codec, renamed, encoded, 2)
    assert "without the owner's statement" in dispute(codec, dataclasses.replace(message, masked=()), encoded, 0)


def test_a_sender_never_disputes_itself_nor_an_average_it_is_not_in():
    codec, generator = codec_of("fp16", 4096), torch.Generator().manual_seed(14)
    inputs = [values("normal", NUMEL, generator) for _ in range(2)]
    message, encoded, _ = stated_average(codec, inputs, [1.0, 1.0])
    forged = dataclasses.replace(message, claims=tuple((0.0,) * len(c) for c in message.claims))
    contribution = [b""] * SEGMENT + [encoded[0].data]
    drawn = SegmentCheck(codec, CONTEXT, []).directions(SEGMENT, message.data, NUMEL)
    average = codec.decode_average(message.data, NUMEL)
    assert OwnInputCheck(codec, OwnerRule(), 0, contribution, (SEGMENT, SEGMENT + 1)).disputed(
        SEGMENT, forged, average, drawn) == ""  # the owner's own segment
    assert OwnInputCheck(codec, OwnerRule(), 0, contribution, (0, 0)).disputed(
        SEGMENT, dataclasses.replace(forged, included=(1,), claims=forged.claims[1:], norms=forged.norms[1:],
                                     peaks=forged.peaks[1:]), average, drawn) == ""
    assert "false dispute" in OwnInputCheck(codec, OwnerRule(), 0, contribution, (0, 0), false=True).disputed(
        SEGMENT, message, average, drawn)


def test_from_enough_senders_an_owner_averages_without_its_own_input_and_members_hold_it_to_that():
    assert not OwnerRule(own_input_min_senders=3).leaves_out_owner(2)
    assert OwnerRule(own_input_min_senders=3).leaves_out_owner(3)
    assert not OwnerRule(own_input_min_senders=0).leaves_out_owner(64)
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="own_input_min_senders"):
            OwnerRule(own_input_min_senders=bad)
    members, senders = ["a", "validator", "b", "c"], ["a", "b", "c"]
    assert OwnerRule(own_input_min_senders=3).left_out(members, senders) == (0, None, 1, 2)
    assert OwnerRule().left_out(members, senders) is None
    codec, generator = codec_of("fp16", 4096), torch.Generator().manual_seed(15)
    inputs = [values("normal", NUMEL, generator) for _ in range(3)]
    weights = [1.0, 1.0, 1.0]
    left_out = (0, None, 1, 2)
    check = SegmentCheck(codec, CONTEXT, weights, left_out=left_out)
    # member 2 (sender 1) owns the segment: averaged with its own input, it is refuted; without it, it passes
    with_own, _, _ = stated_average(codec, inputs, weights)
    without, _, _ = stated_average(codec, [inputs[0], inputs[2]], [1.0, 1.0])
    without = dataclasses.replace(without, included=(0, 2))
    assert "its owner's own input" in check.admit(2, SEGMENT, with_own, NUMEL).refuted
    assert check.admit(2, SEGMENT, without, NUMEL).refuted == ""


def test_statements_travel_in_the_averaged_segment_and_malformed_ones_are_refused():
    message = AveragedSegment(b"\x00" * 8, (0, 2), 3.0, (), ((1.5, -2.0), (3.0, 4.0)), (0.5, 2.0), (0.1, 0.3))
    assert AveragedSegment.unpack(message.pack(3), 8, 3) == message
    assert message.statement(1) == InputStatement(2.0, 0.3, (3.0, 4.0))
    document = msgpack.unpackb(message.pack(3))
    for field, value in (("norms", [1, 2]), ("peaks", ["x", 1.0]), ("norms", [1.0] * 4), ("peaks", 1.0)):
        with pytest.raises(MessageError, match="norms and peaks"):
            AveragedSegment.unpack(msgpack.packb({**document, field: value}), 8, 3)


def test_a_validator_convicts_the_sender_of_a_false_dispute_and_the_owner_of_a_false_statement():
    codec, generator = codec_of("fp16", 4096), torch.Generator().manual_seed(16)
    inputs = [values("normal", NUMEL, generator) for _ in range(2)]
    message, _, reduced = stated_average(codec, inputs, [1.0, 1.0])
    senders = ("alice", "bob")
    true = tuple(message.statement(k) for k in range(2))
    record = SegmentRecord(0, (0, 1), b"", statements=true)
    outcome = AuditResult()
    _judge_dispute(outcome, SEGMENT, record, 1, senders, "alice", reduced, NUMEL)
    assert set(outcome.accused) == {"bob"} and "it was true" in outcome.accused["bob"]
    false = (true[0], dataclasses.replace(true[1], claims=tuple(-c for c in true[1].claims)))
    outcome = AuditResult()
    _judge_dispute(outcome, SEGMENT, dataclasses.replace(record, statements=false), 1, senders, "alice", reduced,
                   NUMEL)
    assert set(outcome.accused) == {"alice"} and "misstated bob's input" in outcome.accused["alice"]
    assert mismatch(true[1], true[1], NUMEL) == "" and mismatch(false[1], true[1], NUMEL) != ""


def test_an_owner_whose_input_the_rule_left_out_of_its_segments_is_still_covered_by_them():
    segments = {0: SegmentRecord(0, (1,), b""), 1: SegmentRecord(1, (0,), b""), 2: SegmentRecord(1, (), b"")}
    evidence = AllReduceEvidence(senders=("a", "b"), ranges=((0, 1), (1, 3)), segments=segments)
    assert evidence.coverage() == {"a": 1 / 3, "b": 1 / 3}  # the rule did not apply: only inclusion counts
    evidence.left_out = (0, 1)
    assert evidence.coverage() == {"a": 2 / 3, "b": 1.0}


def test_a_sender_that_disputes_more_than_one_owner_counts_for_none():
    owner_of = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
    # sender 5 disputes one owner's segments: they drop; sender 7 disputes three owners: none of its disputes counts
    pairs = [(0, 5), (1, 5), (2, 7), (4, 7), (0, 7), (3, 6)]
    assert counted_disputes(pairs, owner_of) == {0: 5, 1: 5, 3: 6}
    assert counted_disputes(reversed(pairs), owner_of) == {0: 5, 1: 5, 3: 6}  # the same for every reader
    assert counted_disputes([(2, 4), (2, 3)], owner_of) == {2: 3}  # one segment, two senders: the lowest names it
    assert counted_disputes([], owner_of) == {}
