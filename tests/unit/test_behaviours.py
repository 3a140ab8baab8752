"""Miner behaviours: what each one trains and publishes, and how they are loaded by name or module:Class."""

from __future__ import annotations

import pytest
import torch

from template.base.behaviours import (
    BUILTIN,
    Copycat,
    FreeRider,
    Honest,
    MinerBehaviour,
    Noise,
    Overfitter,
    Scaled,
    Stale,
    load_behaviour,
)
from template.training.round import RoundOutcome, RoundPlan, RoundReport


def plain_plan(round: int = 0, inner_steps: int = 5, batch_size: int = 2) -> RoundPlan:
    """The engine's plain DiLoCo plan: H steps on the round's assigned windows."""
    return RoundPlan(round, tuple(range(100 * round, 100 * round + inner_steps * batch_size)), inner_steps)


def deltas(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=generator), torch.randn(7, generator=generator)]


def outcome(round: int, delta: list[torch.Tensor] | None, averaged: list[torch.Tensor] | None) -> RoundOutcome:
    report = RoundReport(round, "0" * 64, 5, 640, 1.0, 1.0, averaged is not None, "", 2, 0.1, 1.0, 0.9, 0, "0" * 64)
    return RoundOutcome(report, None, delta, averaged, None)


def test_honest_publishes_exactly_its_delta_and_trains_normally():
    plan = plain_plan()
    assert Honest().plan(plan) == plan
    delta = deltas(0)
    assert Honest().publication(outcome(3, delta, deltas(1))) is delta


def test_freerider_trains_nothing_and_publishes_zeros():
    assert FreeRider().plan(plain_plan()).max_steps == 0
    assert all(not t.any() for t in FreeRider().publication(outcome(0, deltas(0), deltas(1))))


def test_noise_has_the_norm_of_the_group_average_but_not_its_direction():
    averaged = deltas(1)
    noise = Noise(seed=3).publication(outcome(0, deltas(0), averaged))
    for fake, real in zip(noise, averaged, strict=True):
        assert torch.isclose(fake.norm(), real.norm(), rtol=1e-5)
        assert abs(torch.nn.functional.cosine_similarity(fake.flatten(), real.flatten(), dim=0)) < 0.9


def test_scaled_multiplies_its_delta():
    delta = deltas(0)
    published = Scaled().publication(outcome(0, delta, None))
    assert all(torch.equal(s, 10 * d) for s, d in zip(published, delta, strict=True))


def test_stale_replays_the_delta_of_two_rounds_ago():
    stale = Stale(lag=2)
    published = [stale.publication(outcome(r, deltas(r), None)) for r in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(published[3], deltas(1), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(published[0], deltas(0), strict=True))  # honest until it has one


def test_overfitter_trains_one_fixed_batch_every_step_of_every_round():
    overfitter = Overfitter()
    for round in (0, 7):
        plan = overfitter.plan(plain_plan(round, inner_steps=5, batch_size=2))
        assert list(plan.windows) == [0, 1] * 5 and plan.max_steps == 5


def test_copycat_publishes_the_group_average_with_small_noise():
    averaged = deltas(1)
    assert Copycat().plan(plain_plan()).max_steps == 0
    copied = Copycat(noise_scale=1e-3).publication(outcome(0, deltas(0), averaged))
    for copy, real in zip(copied, averaged, strict=True):
        assert not torch.equal(copy, real)
        assert torch.nn.functional.cosine_similarity(copy.flatten(), real.flatten(), dim=0) > 0.999


class Custom(MinerBehaviour):
    name = "custom"


def test_behaviours_load_by_name_or_module_class_and_refuse_anything_else():
    assert set(BUILTIN) == {"honest", "freerider", "noise", "scaled", "stale", "overfitter", "copycat"}
    assert isinstance(load_behaviour("copycat"), Copycat)
    assert isinstance(load_behaviour(f"{__name__}:Custom"), Custom)
    for bad in ("cheater", "nosuchmodule:X", f"{__name__}:Nope", "torch:Tensor"):
        with pytest.raises(ValueError):
            load_behaviour(bad)
