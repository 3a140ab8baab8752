"""The in-round check of an owner's average against its own claims (template/allreduce/verification.py): honest
averages pass on every codec whatever the values, a wrong average is dropped, and nothing about it is left to chance
beyond what the module's tolerance says."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from template.allreduce.codecs import get_codec
from template.allreduce.messages import AveragedSegment, MessageError
from template.allreduce.reduction import OwnerRule, SegmentInput, reduce_segment, weight_cap
from template.allreduce.terms import negated_average
from template.allreduce.verification import (
    Directions,
    SegmentCheck,
    kept_projections,
    projections,
    round_context,
    segment_context,
)

CONTEXT = round_context("run", 7, b"\x01" * 20)
CODECS = {"none": {}, "fp16": {}, "int8": {}, "sparse-all": {"mean_of": "all", "chunk": 64, "k": 8},
          "sparse-kept": {"mean_of": "kept", "chunk": 64, "k": 8}}


def codec_of(name: str, segment_values: int):
    if name.startswith("sparse"):
        return get_codec("sparse", **CODECS[name])
    return get_codec(name, segment_values=segment_values)


def values(kind: str, numel: int, generator: torch.Generator) -> torch.Tensor:
    """Inputs an owner may see: ordinary, tiny (subnormal fp16 averages), spread over many magnitudes, or nearly
    cancelling each other (an average far smaller than its inputs)."""
    base = torch.randn(numel, generator=generator)
    if kind == "tiny":
        return base * 1e-7
    if kind == "spread":
        return base * torch.exp(torch.randn(numel, generator=generator) * 2)  # 1e-4 … 1e4
    return base * 1e-2


def averaged(codec, numel: int, inputs: list[torch.Tensor], weights: list[float],
             segment: int = 3) -> tuple[AveragedSegment, torch.Tensor, SegmentCheck]:
    """What an owner sends for one segment (with its claims), the decoded average, and a member's check."""
    encoded = [SegmentInput(i, codec.encode(x), w) for i, (x, w) in enumerate(zip(inputs, weights, strict=True))]
    cap = weight_cap(weights)
    reduced = reduce_segment(encoded, numel, codec, weights, OwnerRule(), cap, segment_context(CONTEXT, segment))
    message = AveragedSegment(reduced.data, reduced.included, reduced.weight, (), reduced.claims,
                              plain=reduced.plain, masked=reduced.masked)
    check = SegmentCheck(codec, CONTEXT, [min(w, cap) for w in weights])
    return message, codec.decode_average(reduced.data, numel), check


def refuted(check: SegmentCheck, segment: int, message: AveragedSegment, decoded: torch.Tensor) -> str:
    """Why a member drops ``message`` ("" when it does not)."""
    return check.admit(0, segment, message, decoded.numel(), decoded).refuted


@pytest.mark.parametrize("codec_name", sorted(CODECS))
def test_honest_averages_pass_whatever_their_values(codec_name):
    generator = torch.Generator().manual_seed(1)
    checked = 0
    for trial in range(60):
        numel = [1, 7, 256, 1000, 4096][trial % 5]
        kind = ["normal", "tiny", "spread", "cancel"][trial % 4]
        codec = codec_of(codec_name, 4096)
        inputs = [values(kind, numel, generator) for _ in range(3)]
        if kind == "cancel":  # two senders nearly cancel: the average is far below its inputs
            inputs[1] = -inputs[0] * (1 + 1e-4 * torch.randn(numel, generator=generator))
        weights = [1.0, 2.0, 2.0 + trial % 3]
        message, decoded, check = averaged(codec, numel, inputs, weights, segment=trial)
        assert len(message.claims) == 3 and all(len(c) == codec.check_directions for c in message.claims)
        assert refuted(check, trial, message, decoded) == "", (codec_name, trial, kind, numel)
        checked += 1
    assert checked == 60


@pytest.mark.parametrize("codec_name", sorted(CODECS))
def test_an_owner_that_sends_the_negated_average_is_refuted(codec_name):
    generator = torch.Generator().manual_seed(2)
    for trial in range(40):
        numel = [256, 1000, 4096, 3][trial % 4]
        codec = codec_of(codec_name, 4096)
        inputs = [values("normal", numel, generator) for _ in range(3)]
        message, decoded, check = averaged(codec, numel, inputs, [1.0, 1.0, 1.0], segment=trial)
        lie = dataclasses.replace(message, data=negated_average(codec, message.data, decoded))
        why = refuted(check, trial, lie, codec.decode_average(lie.data, numel))
        assert "misses the owner's own claims" in why, (codec_name, trial)
        admitted = check.admit(0, trial, lie, numel)
        assert admitted.refuted == why and not bool(admitted.values.any())  # written as zeros: no step there


def test_one_value_moved_far_is_refuted_and_the_claims_must_match_the_inclusion():
    codec = get_codec("fp16", segment_values=4096)
    generator = torch.Generator().manual_seed(3)
    inputs = [values("normal", 4096, generator) for _ in range(2)]
    message, decoded, check = averaged(codec, 4096, inputs, [1.0, 1.0])
    edited = decoded.clone()
    edited[17] += 1.0  # ~100 × the typical value: a concentrated edit of one coordinate
    lie = dataclasses.replace(message, data=codec.encode_average(edited))
    assert refuted(check, 3, lie, codec.decode_average(lie.data, 4096)) != ""
    assert "without the owner's claims" in refuted(check, 3, dataclasses.replace(message, claims=()), decoded)
    one_short = dataclasses.replace(message, claims=message.claims[:1])
    assert "without the owner's claims" in refuted(check, 3, one_short, decoded)
    nan = dataclasses.replace(message, claims=((float("nan"),) * codec.check_directions,) * 2)
    assert refuted(check, 3, nan, decoded) != ""
    # the directions come from the averaged bytes and the segment: another segment's check of the same bytes fails
    assert refuted(check, 4, message, decoded) != ""
    # a member that counts a sender with no weight refutes (an owner never includes one)
    assert "no weight" in refuted(SegmentCheck(codec, CONTEXT, [1.0, None]), 3, message, decoded)


def test_clipped_and_bounded_inputs_are_claimed_as_the_rule_used_them():
    """A sender 50 × the others: its norm is clipped and its values bounded; the claims follow, the average passes."""
    codec = get_codec("fp16", segment_values=4096)
    generator = torch.Generator().manual_seed(4)
    inputs = [values("normal", 4096, generator) for _ in range(3)]
    inputs[2] = inputs[2] * 50
    inputs[2][:8] *= 100  # concentrated as well
    encoded = [SegmentInput(i, codec.encode(x), 1.0) for i, x in enumerate(inputs)]
    reduced = reduce_segment(encoded, 4096, codec, [1.0] * 3, OwnerRule(), 4.0, segment_context(CONTEXT, 0))
    assert reduced.clipped and reduced.bounded
    message, decoded, check = averaged(codec, 4096, inputs, [1.0] * 3, segment=0)
    assert refuted(check, 0, message, decoded) == ""


def test_an_average_beyond_the_fp16_range_is_refuted_it_is_not_the_mean():
    """The sparse codec's contributions can exceed ±65504 (float32 scales); their fp16 average is clamped there, so
    it is not the owner's mean: dropped, like any average that misses its claims (no honest Δ comes near it)."""
    codec = codec_of("sparse-all", 4096)
    inputs = [torch.full((256,), 1e5), torch.full((256,), 1e5)]
    message, decoded, check = averaged(codec, 256, inputs, [1.0, 1.0])
    assert float(decoded.abs().max()) == 65504.0
    assert "misses the owner's own claims" in refuted(check, 3, message, decoded)


def test_averages_over_the_kept_values_are_checked_with_the_same_formula():
    """The sparse codec's default averages each value over the senders that kept it; the claims scale each input per
    value by W / (the weight of the senders that kept it), so the members' Σ (w/W)·claim is the projection of that
    mean too: unequal weights, values kept by one sender, by several and by none all pass, and moving the average of
    one value that a single sender kept (its pull there is w / its own weight = 1, not w / W) is refuted."""
    codec = codec_of("sparse-kept", 4096)
    assert codec.mean_of_kept
    generator = torch.Generator().manual_seed(5)
    inputs = [values("normal", 1000, generator) for _ in range(3)]
    message, decoded, check = averaged(codec, 1000, inputs, [1.0, 3.0, 0.5])
    kept_by = (torch.stack([codec.decode(codec.encode(x), 1000) for x in inputs]) != 0).sum(dim=0)
    assert {0, 1, 2} <= set(kept_by.tolist())  # values nobody kept, and kept by one or by two
    assert len(message.claims) == 3 and refuted(check, 3, message, decoded) == ""
    edited = decoded.clone()
    edited[int(torch.nonzero(kept_by == 1)[0])] *= -1
    lie = dataclasses.replace(message, data=codec.encode_average(edited))
    assert "misses the owner's own claims" in refuted(check, 3, lie, codec.decode_average(lie.data, 1000))


def test_the_directions_are_fixed_by_their_inputs_and_the_same_on_every_machine():
    digest = hashlib.sha256(b"average").digest()
    z = Directions(segment_context(CONTEXT, 5), digest, 20, 3).bits()
    assert z.shape == (3, 20) and set(z.flatten().tolist()) == {0.0, 1.0}
    assert (z == Directions(segment_context(CONTEXT, 5), digest, 20, 3).bits()).all()
    assert not (z == Directions(segment_context(CONTEXT, 6), digest, 20, 3).bits()).all()
    assert not (z == Directions(segment_context(CONTEXT, 5), hashlib.sha256(b"averagf").digest(), 20, 3).bits()).all()
    # SHAKE-256 of a SHA-256 seed, unpacked most significant bit first: pinned so that no library update changes
    # the members' verdicts (two members drawing different directions would drop different segments)
    seed = hashlib.sha256(segment_context(CONTEXT, 5) + hashlib.sha256(b"average").digest()).digest()
    first = hashlib.shake_256(seed).digest(1)[0]
    assert [int(v > 0) for v in z[0, :8]] == [(first >> (7 - i)) & 1 for i in range(8)]


@pytest.mark.parametrize("codec_name", sorted(CODECS))
def test_an_owner_checks_its_own_average_on_the_directions_its_claims_were_made_on(codec_name):
    """The owner hands its claims' directions to its own check (no second digest and draw): the same directions, the
    same verdict and digest as a member that draws them, for an honest average and for a lie."""
    codec, generator = codec_of(codec_name, 1024), torch.Generator().manual_seed(9)
    inputs = [values("ordinary", 1024, generator) for _ in range(3)]
    weights = [1.0, 2.0, 3.0]
    encoded = [SegmentInput(i, codec.encode(x), w) for i, (x, w) in enumerate(zip(inputs, weights, strict=True))]
    reduced = reduce_segment(encoded, 1024, codec, weights, OwnerRule(), 6.0, segment_context(CONTEXT, 3))
    assert reduced.drawn is not None and reduced.drawn.digest == hashlib.sha256(reduced.data).digest()
    check = SegmentCheck(codec, CONTEXT, weights)
    honest = AveragedSegment(reduced.data, reduced.included, reduced.weight, (), reduced.claims,
                             plain=reduced.plain, masked=reduced.masked)
    lie = dataclasses.replace(honest, claims=tuple(tuple(-c for c in claim) for claim in honest.claims))
    for message in (honest, lie):
        decoded = codec.decode_average(message.data, 1024)
        own, drawn = check.admit(0, 3, message, 1024, decoded, reduced.drawn), check.admit(0, 3, message, 1024)
        assert (own.refuted, own.digest) == (drawn.refuted, drawn.digest) and bool(own.refuted) == (message is lie)
    assert reduce_segment(encoded, 1024, codec, weights, OwnerRule(), 6.0).drawn is None  # no claims asked for


def test_a_sparse_vector_is_projected_at_its_nonzeros_to_the_same_value():
    """The sparse codec's segments (~1M values, a few % nonzero) are read at their nonzeros only; the projection is
    the dense one, and so are the three projections a mean over the kept values makes of each input."""
    generator = torch.Generator().manual_seed(6)
    drawn = Directions(segment_context(CONTEXT, 1), hashlib.sha256(b"a").digest(), 10_001, 2)
    sparse = torch.randn(10_001, generator=generator) * (torch.rand(10_001, generator=generator) < 0.05)
    dense = sparse + (sparse == 0) * 1e-30  # every value nonzero: the dense path, the same projection
    assert 0 < int(sparse.count_nonzero()) < 1000 and int(dense.count_nonzero()) == 10_001
    assert drawn.bits_at(torch.nonzero(sparse)[:, 0].numpy()).tolist() == drawn.bits()[:, sparse != 0].tolist()
    at_nonzeros, whole = projections([sparse, dense], drawn)
    assert at_nonzeros == pytest.approx(whole, rel=1e-12, abs=1e-12)
    # a mean over the kept values: each input's plain projection, the average's at its nonzeros and the input's
    # scaled by W / K per value, all from one read of its nonzeros: the dense projections of the same vectors
    kept = (torch.rand(10_001, generator=generator) + 0.5).double()
    average = torch.randn(10_001, generator=generator)
    plain, masked, scaled = kept_projections([sparse], average, drawn, (kept.numpy(), 3.0))
    expected = projections([dense, torch.where(sparse != 0, average, 0.0) + (sparse == 0) * 1e-30,
                            (dense.double() * 3.0 / kept).float()], drawn)
    assert plain[0] == pytest.approx(expected[0], rel=1e-12, abs=1e-12)
    assert masked[0] == pytest.approx(expected[1], rel=1e-12, abs=1e-12)
    assert scaled[0] == pytest.approx(expected[2], rel=1e-6)  # the dense side rounds W / K · x to float32
    assert kept_projections([sparse], average, drawn)[2] is None


def test_claims_travel_in_the_averaged_segment_and_malformed_ones_are_refused():
    message = AveragedSegment(b"\x00" * 8, (0, 2), 3.0, (), ((1.5, -2.0, 0.0, 1e-9), (3.0, 4.0, 5.0, 6.0)))
    packed = message.pack(3)
    assert AveragedSegment.unpack(packed, 8, 3) == message
    assert AveragedSegment.unpack(AveragedSegment(b"\x00" * 8, (0,), 1.0, ()).pack(3), 8, 3).claims == ()
    for claims in (((1,) * 4,), (("x",) * 4,), ((1.0,) * 9,), ((1.0,),) * 4):
        bad = dataclasses.replace(message, claims=claims)
        with pytest.raises(MessageError):
            AveragedSegment.unpack(bad.pack(3), 8, 3)
