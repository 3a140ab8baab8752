"""The fairness benchmark's judge (``benchmarks/fairness.py``): the ratios its goals are stated in, from a network's
weights and scored rows (the networks themselves are too slow for the suite; their numbers are in docs)."""

from __future__ import annotations

import pytest

from benchmarks.fairness import judge
from template.base.behaviours import load_behaviour


def scored(round: int, paid: bool, credit: dict[str, float], reason: dict[str, str] | None = None) -> dict:
    return dict(round=round, paid=paid, credit=credit, quality={name: max(0.0, c) for name, c in credit.items()},
                reason={name: (reason or {}).get(name, "") for name in credit})


def test_judge_compares_honest_miners_and_counts_the_rounds_a_copier_earned_little():
    network = dict(
        behaviour={"miner1": "honest", "miner2": "honest", "miner3": "benchmarks.fairness:NoisyAverage30"},
        weights={"miner1": 0.55, "miner2": 0.44, "miner3": 0.01},
        scored=[
            scored(3, False, {"miner1": 0.5, "miner2": 0.4, "miner3": 0.3}),  # not paid: not counted
            scored(4, True, {"miner1": 0.2, "miner2": 0.25, "miner3": 0.01}),
            scored(5, True, {"miner1": 0.2, "miner2": 0.1, "miner3": 0.05}),
            scored(6, True, {"miner1": 0.1, "miner2": 0.1, "miner3": 0.0}, {"miner3": "copy of miner1's Δ"}),
        ])
    judged = judge(network)
    assert judged["honest_weights"] == [0.55, 0.44]
    assert judged["honest_max_over_min"] == pytest.approx(1.25)
    copier = judged["others"]["NoisyAverage30"]
    assert copier["rounds_paid"] == 3 and copier["rounds_at_most_10_percent"] == 2  # 0.05 > 10 % of 0.2
    assert copier["of_honest_mean"] == pytest.approx(0.01 / 0.495)
    assert copier["reasons"] == ["copy of miner1's Δ"]


def test_the_benchmarks_plug_in_behaviours_load_with_their_option_fixed():
    assert load_behaviour("benchmarks.fairness:Partial10").fraction == 0.1
    assert load_behaviour("benchmarks.fairness:NoisyAverage60").rel == 0.6
    assert load_behaviour("benchmarks.fairness:NoisyAverage15").name == "noisy-average-0.15"
