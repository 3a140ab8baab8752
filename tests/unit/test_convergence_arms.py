"""The convergence benchmark's arms as its command line builds them (no training): the sparse sweep's grid, the
corrected overlap's arrival steps, the engine's arm and how the summary reads it."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from benchmarks.convergence import build_arms, build_parser, engine_arm
from benchmarks.convergence_summary import summarize
from template.allreduce.codecs import SparseSettings


def arms_of(*flags: str):
    return build_arms(build_parser().parse_args(list(flags)))


def test_the_sweep_crosses_density_bits_and_feedback_decay_at_the_outer_step_asked():
    arms, codecs = arms_of("--sweep", "--sweep-k", "16,256", "--sweep-bits", "1,4", "--sweep-decay", "off,0.9")
    assert codecs == ["none"] and arms[0].name == "diloco_none"
    sparse = {arm.name: arm for arm in arms[1:]}
    assert len(sparse) == 8 and all(arm.codec == "sparse" for arm in sparse.values())
    assert sparse["diloco_sparse_k16_b1_efoff"].sparse == SparseSettings(k=16, bits=1, error_feedback=False)
    assert sparse["diloco_sparse_k256_b4_ef0.9"].sparse == SparseSettings(k=256, bits=4, feedback_decay=0.9)
    assert {(arm.outer_lr, arm.outer_momentum) for arm in sparse.values()} == {(1.0, 0.0)}  # the sparse default
    arms, codecs = arms_of("--sweep", "--no-reference-arms", "--outer", "0.7:0.9", "--sweep-k", "64",
                           "--sweep-bits", "2", "--sweep-decay", "0.95")
    assert codecs == [] and [(a.name, a.outer_lr, a.outer_momentum) for a in arms] == [
        ("diloco_sparse_k64_b2_ef0.95", 0.7, 0.9)]
    assert len(arms_of("--sweep")[0]) == 1 + 3 * 3 * 4


@pytest.mark.parametrize("flags", [("--sweep-bits", "0"), ("--sweep-k", "many"), ("--sweep-decay", "2.0")])
def test_a_bad_sweep_setting_exits_with_its_reason(flags):
    with pytest.raises(SystemExit, match="bad sweep setting"):
        arms_of("--sweep", *flags)


def test_the_corrected_overlap_gets_one_arm_per_arrival_step_inside_the_round():
    arms, _ = arms_of("--codecs", "fp16", "--no-reference-arms", "--overlap", "fp16", "--inner-steps", "50",
                      "--overlap-modes", "eager,corrected", "--arrival-steps", "10,25")
    assert [(arm.name, arm.overlap, arm.arrival) for arm in arms] == [
        ("diloco_fp16", "blocking", 0), ("diloco_fp16_eager", "eager", 0),
        ("diloco_fp16_corrected_at10", "corrected", 10), ("diloco_fp16_corrected_at25", "corrected", 25)]
    halfway, _ = arms_of("--codecs", "fp16", "--no-reference-arms", "--overlap", "fp16", "--inner-steps", "8",
                         "--overlap-modes", "corrected")
    assert [arm.arrival for arm in halfway if arm.overlap == "corrected"] == [4]


@pytest.mark.parametrize("steps", ["0", "50", "half"])
def test_an_arrival_step_outside_the_round_exits_with_its_reason(steps):
    with pytest.raises(SystemExit, match="bad --arrival-steps"):
        arms_of("--overlap", "fp16", "--inner-steps", "50", "--overlap-modes", "corrected", "--arrival-steps", steps)


def test_the_overlapped_engine_is_summarised_against_the_blocking_arm_of_its_codec():
    arm = engine_arm(build_parser().parse_args(["--engine", "both", "--engine-overlap"]), 1.0, 0.0)
    assert (arm.name, arm.overlap) == ("hivemind_fp16_overlap", "corrected")
    assert engine_arm(build_parser().parse_args(["--engine", "both"]), 1.0, 0.0).overlap == "blocking"
    exact = dict(kind="diloco", overlap="blocking", contribution_bits_per_param=16.0, averaged_bits_per_param=16.0)
    arms = {"diloco_none": dict(exact, codec="none", final_heldout_loss=1.5),
            "diloco_fp16": dict(exact, codec="fp16", final_heldout_loss=1.5),
            arm.name: dict(asdict(arm), final_heldout_loss=1.53)}  # an engine run counts no bits per parameter
    summary = summarize(arms, ["none", "fp16"])
    assert summary["overlap_over_blocking"] == {arm.name: pytest.approx(1.02)}
    assert summary["overlap_goal_met"] == {arm.name: False}
    assert set(summary["over_dense_fp32"]) == {"diloco_none", "diloco_fp16"}


def test_the_own_share_rules_leave_each_owner_out_of_its_part_and_deferred_keeps_every_input():
    """benchmarks.own_share: no part's mean holds its owner's input; "deferred" divides by every weight and carries
    the owner's input, so the mean (× W) plus the carries (× their weights) is exactly Σ w·x; "dropped" is the mean
    of the others."""
    from benchmarks.own_share import own_share_mean, owners_of_parts, part_bounds

    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(10, generator=generator) for _ in range(3)]
    weights = [1.0, 2.0, 3.0]
    bounds = part_bounds(10, 3)
    assert bounds[0] == 0 and bounds[-1] == 10 and len(bounds) == 4
    owners = owners_of_parts(3, round=5)
    assert sorted(owners) == [0, 1, 2] and owners == owners_of_parts(3, round=5)
    mean, carries = own_share_mean(inputs, weights, 5, "deferred")
    restored = mean.double() * sum(weights) + sum(w * c.double() for w, c in zip(weights, carries, strict=True))
    assert torch.allclose(restored, sum(w * x.double() for w, x in zip(weights, inputs, strict=True)), atol=1e-5)
    dropped, nothing = own_share_mean(inputs, weights, 5, "dropped")
    assert all(not c.any() for c in nothing)
    for part, owner in enumerate(owners):
        span = slice(bounds[part], bounds[part + 1])
        assert torch.equal(carries[owner][span], inputs[owner][span])
        assert all(not carries[i][span].any() for i in range(3) if i != owner)
        others = [i for i in range(3) if i != owner]
        expected = sum(weights[i] * inputs[i][span] for i in others) / sum(weights[i] for i in others)
        assert torch.allclose(dropped[span], expected, atol=1e-6)
