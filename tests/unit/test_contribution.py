"""A contribution's commitment: Merkle roots and range proofs, the signed commitment and statements, the owner's rule.

These are the pieces that make "scored = applied" checkable: an owner verifies the leaves of its range against the
sender's signed root, a validator recomputes an owner's averaged segment bit for bit from the senders' publications.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from template.allreduce.codecs import get_codec
from template.allreduce.contribution import (
    Commitment,
    ContributionError,
    decode_segments,
    encode_contribution,
    leaf_digest,
    merkle_levels,
    merkle_root,
    range_proof,
    root_from_range,
    sign_statements,
    statement_bytes,
)
from template.allreduce.reduction import OwnerRule, SegmentInput, reduce_segment, weight_cap
from template.p2p.keys import ephemeral_signer, verify_signature


def leaves(n: int) -> list[bytes]:
    return [leaf_digest(bytes([i % 256]) * (i + 1)) for i in range(n)]


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 13])
def test_every_range_of_every_tree_proves_the_root(count):
    tree = leaves(count)
    levels = merkle_levels(tree)
    root = merkle_root(tree)
    for start, stop in itertools.combinations(range(count + 1), 2):
        proof = range_proof(levels, start, stop)
        assert len(proof) <= 2 * len(levels)
        assert root_from_range(tree[start:stop], start, stop, count, proof) == root


def test_a_forged_leaf_or_a_wrong_proof_gives_another_root():
    tree = leaves(7)
    levels, root = merkle_levels(tree), merkle_root(tree)
    proof = range_proof(levels, 2, 5)
    forged = list(tree[2:5])
    forged[1] = leaf_digest(b"other bytes")
    assert root_from_range(forged, 2, 5, 7, proof) != root
    assert root_from_range(tree[2:5], 2, 5, 7, [bytes(32)] * len(proof)) != root
    with pytest.raises(ContributionError):
        root_from_range(tree[2:5], 2, 5, 7, proof[:-1])  # too short
    with pytest.raises(ContributionError):
        root_from_range(tree[2:5], 2, 5, 7, [*proof, bytes(32)])  # too long
    with pytest.raises(ContributionError):
        root_from_range(tree[2:4], 2, 5, 7, proof)  # the leaves do not fill the range


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.data())
def test_range_proofs_hold_for_random_trees_and_ranges(count, data):
    tree = leaves(count)
    start = data.draw(st.integers(0, count - 1))
    stop = data.draw(st.integers(start + 1, count))
    assert root_from_range(tree[start:stop], start, stop, count, range_proof(merkle_levels(tree), start, stop)) == \
        merkle_root(tree)


@pytest.mark.parametrize("codec_name", ["none", "fp16", "int8"])
def test_a_contribution_is_encoded_once_and_its_commitment_signed(codec_name):
    codec = get_codec(codec_name)
    flat = torch.randn(3 * codec.segment_values + 17)
    contribution = encode_contribution(codec, flat)
    assert len(contribution.segments) == 4 and contribution.root == merkle_root(contribution.leaves)
    assert torch.equal(decode_segments(codec, contribution.segments, flat.numel()), contribution.decoded)
    signer = ephemeral_signer()
    commitment = Commitment.sign(signer, "netuid1/run", 7, contribution)
    assert commitment.verify(verify_signature)
    assert Commitment.from_wire(commitment.to_wire()) == commitment
    for field, value in (("round", 8), ("scope", "netuid2/run"), ("root", bytes(32)), ("numel", 5)):
        forged = Commitment(**{**commitment.__dict__, field: value})
        assert not forged.verify(verify_signature), field
    statements = sign_statements(signer, "netuid1/run", 7, contribution)
    assert all(verify_signature(signer.key, statement_bytes("netuid1/run", 7, k, leaf), sig)
               for k, (leaf, sig) in enumerate(zip(contribution.leaves, statements, strict=True)))
    for bad in ({}, {**commitment.to_wire(), "root": "zz"}, {**commitment.to_wire(), "round": -1}, [1, 2]):
        with pytest.raises(ContributionError):
            Commitment.from_wire(bad)


def test_the_owners_rule_is_deterministic_and_checks_what_it_is_given():
    codec = get_codec("fp16")
    segments = [encode_contribution(codec, torch.randn(100) * (i + 1)).segments[0] for i in range(3)]
    inputs = [SegmentInput(i, data, 10.0) for i, data in enumerate(segments)]
    announced = [10.0, 10.0, 10.0]
    first = reduce_segment(inputs, 100, codec, announced, OwnerRule(), weight_cap(announced))
    again = reduce_segment(list(reversed(inputs)), 100, codec, announced, OwnerRule(), weight_cap(announced))
    assert first == again and first.included == (0, 1, 2)
    lying = [SegmentInput(0, segments[0], 99.0), *inputs[1:]]  # another weight than announced: dropped
    dropped = reduce_segment(lying, 100, codec, announced, OwnerRule(), weight_cap(announced))
    assert dropped.included == (1, 2) and "announced" in dropped.dropped[0][1]
    garbage = [SegmentInput(0, b"junk", 10.0), *inputs[1:]]
    assert reduce_segment(garbage, 100, codec, announced, OwnerRule(), weight_cap(announced)).included == (1, 2)


@pytest.mark.parametrize("mean_of", ["kept", "all"])
def test_a_sparse_owner_averages_each_value_over_the_senders_that_kept_it(mean_of):
    """``kept``: a value one sender of four kept arrives whole, one that two kept is their weighted mean; ``all``: every
    sender's weight counts, so a lone value arrives at its weight's share (docs/benchmarks.md §7)."""
    codec = get_codec("sparse", chunk=8, k=1, bits=8, segment_values=16, mean_of=mean_of)
    rows = torch.zeros(4, 16)
    rows[0, 1], rows[1, 1] = 2.0, 4.0  # chunk 0: senders 0 and 1 keep value 1
    rows[2, 3] = 8.0  # chunk 0: sender 2 keeps value 3
    rows[3, 0] = -1.0  # chunk 0: sender 3 keeps value 0
    rows[:, 8 + torch.arange(4)] = torch.eye(4) * 5.0  # chunk 1: each sender keeps another value
    weights = [1.0, 3.0, 2.0, 2.0]
    inputs = [SegmentInput(i, codec.encode(row), w) for i, (row, w) in enumerate(zip(rows, weights, strict=True))]
    reduced = reduce_segment(inputs, 16, codec, weights, OwnerRule(None), weight_cap(weights))
    averaged = codec.decode_average(reduced.data, 16)
    if mean_of == "kept":
        expected = {1: (1 * 2.0 + 3 * 4.0) / 4, 3: 8.0, 0: -1.0, 8: 5.0, 9: 5.0, 10: 5.0, 11: 5.0}
    else:
        expected = {1: (1 * 2.0 + 3 * 4.0) / 8, 3: 2 * 8.0 / 8, 0: -2 * 1.0 / 8, 8: 5.0 / 8, 9: 15.0 / 8, 10: 10.0 / 8,
                    11: 10.0 / 8}
    assert {i: float(v) for i, v in enumerate(averaged) if v != 0} == pytest.approx(expected, rel=1e-3)
    again = reduce_segment(list(reversed(inputs)), 16, codec, weights, OwnerRule(None), weight_cap(weights))
    assert again.data == reduced.data  # deterministic: the senders' order, whatever order the inputs came in


def test_the_owners_rule_bounds_each_value_to_the_groups_scale_and_leaves_honest_values_untouched():
    """No value may exceed value_bound_multiple × the lower median of the senders' largest magnitudes: a sender that
    put 80 % of its (honest-sized) norm into 2 values is clamped there and named; the others enter bit for bit as
    without the bound, and a sender that sent nothing does not pull the bound to 0."""
    codec = get_codec("fp16")
    generator = torch.Generator().manual_seed(0)
    honest = [torch.randn(256, generator=generator) for _ in range(3)]
    edit = honest[2] * 0.2 ** 0.5
    edit[:2] = float(torch.linalg.vector_norm(honest[2])) * (0.8 / 2) ** 0.5  # ~10, where honest values reach 3.4–4.1
    rows = [honest[0], honest[1], edit, torch.zeros(256)]
    inputs = [SegmentInput(i, encode_contribution(codec, row).segments[0], 1.0) for i, row in enumerate(rows)]
    announced = [1.0] * 4
    decoded = [codec.decode(item.data, 256) for item in inputs]
    largest = sorted(float(d.abs().max()) for d in decoded[:3])
    bound = 3.0 * largest[1]  # the lower median of the positive largest values (the zero sender left out)
    rule = OwnerRule(norm_clip_multiple=None, value_bound_multiple=3.0)
    strict = OwnerRule(norm_clip_multiple=None, value_bound_multiple=1.5)
    loose = OwnerRule(norm_clip_multiple=None, value_bound_multiple=None)
    assert reduce_segment(inputs, 256, codec, announced, rule, 4.0).bounded == ()  # within 3 ×: nothing bounded
    reduced = reduce_segment(inputs, 256, codec, announced, strict, 4.0)
    assert reduced.bounded == ((2, 2),) and reduced.included == (0, 1, 2, 3)
    limit = 1.5 * largest[1]
    expected = (decoded[0] + decoded[1] + decoded[2].clamp(-limit, limit) + decoded[3]).double() / 4
    assert torch.equal(codec.decode_average(reduced.data, 256), codec.decode_average(
        codec.encode_average(expected.float()), 256))
    unbounded = reduce_segment(inputs, 256, codec, announced, loose, 4.0)
    assert unbounded.bounded == () and unbounded.data != reduced.data
    assert bound > float(edit[:2].max()) > limit  # the test's numbers say what they claim
    with pytest.raises(ValueError):
        OwnerRule(value_bound_multiple=-1.0)
