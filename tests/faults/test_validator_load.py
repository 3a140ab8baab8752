"""Load: a validator scores the pseudo-gradients of 16 tiny-model miners within one round of the local network.

The scoring work is measured as the validator-cost benchmark does it (``benchmarks/validator_cost.py``: 16 distinct
pseudo-gradients through ``RoundScorer.score``, one torch thread), and must fit the part of the local network's
default round that a validator may spend scoring (before the round's all-reduce phase, less its safety margin).
The fetches run concurrently and are not part of this budget (tests/integration/test_validator.py measures whole
scored rounds, fetch included, on a live network).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.validator_cost import localnet_scoring_budget, measure


@pytest.mark.timeout(300)
def test_a_validator_scores_16_tiny_miners_within_one_local_network_round():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = measure("tiny", batch_size=8, miners=16, steps=20, repeats=2)
    finally:
        torch.set_num_threads(threads)
    budget = localnet_scoring_budget()
    assert result["miners"] == 16
    assert result["scoring_total_s"] <= budget["scoring_budget_s"], (result, budget)
