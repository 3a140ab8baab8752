"""Miner behaviours: what each one trains and publishes, and how they are loaded by name or module:Class."""

from __future__ import annotations

import pytest
import torch

from template.allreduce.terms import AllReduceFaults
from template.base.behaviours import (
    BUILTIN,
    Concentrated,
    Copycat,
    Equivocator,
    Framer,
    FreeRider,
    Honest,
    LiarReducer,
    MinerBehaviour,
    Noise,
    NoisyAverage,
    Overfitter,
    Partial,
    Replayer,
    Scaled,
    SkipsOne,
    SplitLiarReducer,
    Stale,
    StaleAverage,
    TwoFaced,
    TwoFacedZero,
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


def test_honest_contributes_its_delta_and_publishes_what_it_contributed():
    plan = plain_plan()
    honest = Honest()
    assert honest.plan(plan) == plan
    delta = deltas(0)
    assert honest.contribution(3, delta) is delta
    assert honest.publication(outcome(3, delta, deltas(1))) is None  # None: exactly the contributed bytes


def test_freerider_trains_nothing_and_contributes_zeros():
    assert FreeRider().plan(plain_plan()).max_steps == 0
    assert all(not t.any() for t in FreeRider().contribution(0, deltas(0)))


def test_noise_has_the_norm_of_the_last_average_but_not_its_direction():
    noise_maker, averaged = Noise(seed=3), deltas(1)
    assert noise_maker.plan(plain_plan()).max_steps == 0
    noise_maker.after_round(outcome(0, deltas(0), averaged))
    noise = noise_maker.contribution(1, deltas(0))
    for fake, real in zip(noise, averaged, strict=True):
        assert torch.isclose(fake.norm(), real.norm(), rtol=1e-5)
        assert abs(torch.nn.functional.cosine_similarity(fake.flatten(), real.flatten(), dim=0)) < 0.9


def test_scaled_contributes_its_delta_times_ten():
    delta = deltas(0)
    assert all(torch.equal(s, 10 * d) for s, d in zip(Scaled().contribution(0, delta), delta, strict=True))


def test_stale_replays_the_delta_of_two_rounds_ago():
    stale = Stale(lag=2)
    contributed = [stale.contribution(r, deltas(r)) for r in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(contributed[3], deltas(1), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(contributed[0], deltas(0), strict=True))  # honest until it has one


def test_replayer_trains_its_first_round_then_resends_that_delta_without_training():
    replayer = Replayer()
    assert replayer.plan(plain_plan(0)).max_steps == 5
    replayer.contribution(0, deltas(0))
    assert replayer.plan(plain_plan(1)).max_steps == 0
    for round in (1, 2, 3):
        sent = replayer.contribution(round, deltas(round))
        assert all(torch.equal(a, b) for a, b in zip(sent, deltas(0), strict=True))
        sent[0].add_(1.0)  # what the engine does with a contribution never reaches the next one


def test_overfitter_trains_one_fixed_batch_every_step_of_every_round():
    overfitter = Overfitter()
    for round in (0, 7):
        plan = overfitter.plan(plain_plan(round, inner_steps=5, batch_size=2))
        assert list(plan.windows) == [0, 1] * 5 and plan.max_steps == 5


def test_copycat_contributes_the_last_average_it_received_with_small_noise():
    copycat, averaged = Copycat(noise_scale=1e-3), deltas(1)
    assert copycat.plan(plain_plan()).max_steps == 0
    copycat.after_round(outcome(0, deltas(0), averaged))
    copied = copycat.contribution(1, deltas(2))
    for copy, real in zip(copied, averaged, strict=True):
        assert not torch.equal(copy, real)
        assert torch.nn.functional.cosine_similarity(copy.flatten(), real.flatten(), dim=0) > 0.999


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def test_noisy_average_runs_one_step_and_contributes_the_last_average_plus_relative_noise():
    copier, averaged = NoisyAverage(rel=0.15, seed=1), [torch.randn(200, 50), torch.randn(3000)]
    assert copier.plan(plain_plan(inner_steps=20)).max_steps == 1  # takes part with tokens
    own = deltas(0)
    assert copier.contribution(0, own) is own  # no average yet: its own one-step Δ
    copier.after_round(outcome(0, own, averaged))
    for copy, real in zip(copier.contribution(1, own), averaged, strict=True):
        assert torch.isclose((copy - real).norm(), 0.15 * real.norm(), rtol=1e-5)
        assert abs(cosine(copy, real) - 1 / (1 + 0.15**2) ** 0.5) < 0.01  # ≈ 0.989


def test_stale_average_contributes_the_average_of_two_rounds_before_the_freshest():
    copier = StaleAverage(rel=0.0)
    averages = [deltas(10 + r) for r in range(4)]
    for r, averaged in enumerate(averages):
        copier.after_round(outcome(r, deltas(r), averaged))
    contributed = copier.contribution(4, deltas(4))
    assert all(torch.equal(c, a) for c, a in zip(contributed, averages[1], strict=True))  # rounds 3 − 2 = 1


def test_partial_runs_its_fraction_of_the_inner_steps_and_refuses_nonsense():
    assert Partial(0.1).plan(plain_plan(inner_steps=20)).max_steps == 2
    assert Partial(0.5).plan(plain_plan(inner_steps=20)).max_steps == 10
    assert Partial(0.01).plan(plain_plan(inner_steps=20)).max_steps == 1
    for bad in (0.0, 1.5, -1.0):
        with pytest.raises(ValueError):
            Partial(bad)
    with pytest.raises(ValueError):
        NoisyAverage(rel=-0.1)


def test_skips_one_trains_every_round_and_contributes_nothing_in_its_third():
    behaviour = SkipsOne()
    assert all(behaviour.plan(plain_plan(round=r)) == plain_plan(round=r) for r in range(5))
    delta = deltas(0)
    contributed = [behaviour.contribution(r, delta) for r in range(5)]
    assert all(float(t.abs().sum()) == 0.0 for t in contributed[2])
    assert all(c is delta for i, c in enumerate(contributed) if i != 2)


def test_two_faced_miners_publish_their_delta_and_contribute_something_else():
    delta = deltas(0)
    for behaviour, factor in ((TwoFaced(), -1.0), (TwoFacedZero(), 1e-6)):
        contributed = behaviour.contribution(0, delta)
        assert all(torch.allclose(c, factor * d) for c, d in zip(contributed, delta, strict=True))
        published = behaviour.publication(outcome(0, contributed, None))
        assert all(torch.equal(p, d) for p, d in zip(published, delta, strict=True))


def test_concentrated_moves_a_share_of_its_honest_norm_into_the_same_few_coordinates_every_round():
    behaviour = Concentrated(values=3, share=0.6)
    places = []
    for round in (0, 1):
        delta = deltas(round)
        contributed = behaviour.contribution(round, delta)
        norm = float(torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in delta])))
        flat = contributed[0].reshape(-1)  # the largest tensor (12 values) holds the edit
        edited = flat > 0.4 * norm  # each edited value is √(0.6 / 3) ≈ 0.45 of the norm
        places.append(edited.nonzero().flatten().tolist())
        assert len(places[-1]) == 3
        assert float(flat[edited].pow(2).sum()) == pytest.approx(0.6 * norm ** 2, rel=1e-5)
        total = sum(float(t.pow(2).sum()) for t in contributed)
        assert total == pytest.approx(norm ** 2, rel=0.15)  # about its honest norm (the 3 replaced values aside)
        assert torch.allclose(contributed[1], delta[1] * 0.4 ** 0.5)  # the rest: the honest Δ, scaled down
    assert places[0] == places[1]  # the same coordinates, pushed the same way: the edit accumulates in θ
    for bad in ({"values": 0}, {"share": 1.0}, {"share": 0.0}):
        with pytest.raises(ValueError):
            Concentrated(**bad)


def test_allreduce_attackers_carry_their_faults():
    assert Honest.allreduce_faults == AllReduceFaults()
    assert Equivocator.allreduce_faults.corrupt_segments
    assert LiarReducer.allreduce_faults.lie == "all" and SplitLiarReducer.allreduce_faults.lie == "some"
    assert Framer.allreduce_faults.frame


class Custom(MinerBehaviour):
    name = "custom"


def test_behaviours_load_by_name_or_module_class_and_refuse_anything_else():
    assert set(BUILTIN) == {"honest", "freerider", "noise", "scaled", "stale", "replayer", "overfitter", "copycat",
                            "noisy-average", "stale-average", "partial", "twofaced", "twofaced-zero", "equivocator",
                            "liar-reducer", "liar-reducer-some", "framer", "liar-reducer-forged", "false-disputer",
                            "skips-one", "concentrated"}
    # the behaviours that do honest work say so (the local network's report judges the model by them)
    assert {name for name, cls in BUILTIN.items() if cls.honest} == {"honest", "skips-one"}
    assert load_behaviour(f"{__name__}:Custom").honest is False  # a plug-in is honest when it says so
    assert isinstance(load_behaviour("copycat"), Copycat)
    assert load_behaviour("noisy-average", rel=0.3).rel == 0.3 and load_behaviour("stale-average").rel == 0.15
    assert load_behaviour("partial", fraction=0.1, rel=0.3).fraction == 0.1
    assert isinstance(load_behaviour("honest", rel=0.3, fraction=0.1), Honest)  # options reach only who takes them
    concentrated = load_behaviour("concentrated", values=4, share=0.3, rel=0.3)
    assert (concentrated.values, concentrated.share) == (4, 0.3)
    assert isinstance(load_behaviour(f"{__name__}:Custom"), Custom)
    for bad in ("cheater", "nosuchmodule:X", f"{__name__}:Nope", "torch:Tensor"):
        with pytest.raises(ValueError):
            load_behaviour(bad)
