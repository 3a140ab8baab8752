"""Validator cost: seconds to score one miner's pseudo-gradient, relative to one inner training step.

``python -m benchmarks.validator_cost [--quick] [--skip-small] [--miners 16]``

For each preset (tiny; small unless skipped), on CPU with the torch threads a neuron would use:

- baseline measured in the same run: ``t_step``, the median wall time of one inner AdamW step (batch 8 × seq 64 for
  tiny; batch 1 × seq 64 for small) on the same model;
- ``t_miner``: the wall time of :meth:`RoundScorer.score` over ``--miners`` distinct pseudo-gradients (made by
  short real training runs from θ_r, then perturbed so that no two are copies), divided by the number of miners —
  everything the validator does per miner after the fetch: integrity checks, sketches, copy and replay detection and
  the loss probes: the round's free updates (Δ̄_{r−1} at three scales) on the pick and scoring windows once, then
  every miner on the same 32 scoring windows;
- ``ratio = t_miner / t_step``, and for tiny whether 16 miners fit the scoring budget of one round of the local
  network's default length (``template.localnet.LocalnetConfig``).

The fetch itself is not included (loopback RPC of the fp16 payload; see tests/integration/test_publication.py).
"""

from __future__ import annotations

import argparse
import copy
import logging
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import emit, machine_info, median, ratio, setup_logging
from template.base.config import DEFAULT_ALLREDUCE_FRACTION
from template.base.neuron import allreduce_grace
from template.base.validator import SCORING_MARGIN_S
from template.localnet import LocalnetConfig
from template.training.data import DataAssignment, build_corpus, load_tokenizer
from template.training.inner import InnerConfig, InnerTrainer
from template.training.model import build_model, count_parameters
from template.training.outer import OuterConfig, OuterOptimizer
from template.validation.integrity import IntegrityConfig
from template.validation.round import Candidate, RoundContext, RoundScorer
from template.validation.scoring import LossProbe, ScoringConfig, WindowSampler

log = logging.getLogger("benchmarks.validator_cost")

SEQ_LEN = 64


def localnet_scoring_budget() -> dict[str, float]:
    """The local network's default round, and the part of it a validator may spend scoring: everything before the
    round's all-reduce phase (matchmaking + grace before the last block), less the validator's safety margin."""
    config = LocalnetConfig(out=Path("."))
    round_s = config.blocks_per_round * config.seconds_per_block
    grace = allreduce_grace(round_s, DEFAULT_ALLREDUCE_FRACTION)
    return dict(round_s=round_s, scoring_budget_s=round_s - config.matchmaking_time - 2 * grace - SCORING_MARGIN_S)


def measure(preset: str, batch_size: int, miners: int, steps: int, repeats: int) -> dict[str, Any]:
    tokenizer = load_tokenizer("bytes")
    corpus = build_corpus("builtin", tokenizer, SEQ_LEN, max_tokens=400_000)
    assignment = DataAssignment(corpus.fingerprint, corpus.num_windows, run_seed=0)
    model = build_model(preset, tokenizer.vocab_size, SEQ_LEN, init_seed=0)
    outer = OuterOptimizer(model, OuterConfig())
    local = copy.deepcopy(model)
    trainer = InnerTrainer(local, InnerConfig(warmup_steps=1), "cpu")
    windows = assignment.assigned_windows("timing", 0, (repeats + 1) * batch_size)
    batches = corpus.batches(windows, batch_size)
    trainer.train(batches, 1)  # warm-up: allocations, AdamW state
    step_times = []
    for _ in range(repeats):
        started = time.perf_counter()
        trainer.train(batches, 1)
        step_times.append(time.perf_counter() - started)
    t_step = median(step_times)

    # distinct pseudo-gradients: a short real training run, then a per-miner perturbation (no two are copies)
    base_delta = outer.pseudo_gradient(local)
    generator = torch.Generator().manual_seed(0)
    deltas = [[d * (1 + 0.3 * torch.randn(d.shape, generator=generator)) for d in base_delta] for _ in range(miners)]
    theta = [t.clone() for t in outer.params()]
    theta_hash = "0" * 64
    scorer = RoundScorer(LossProbe(model, corpus, 8, "cpu"), WindowSampler(assignment, steps * 8, seed=1),
                         [t.shape for t in theta], integrity=IntegrityConfig(), scoring=ScoringConfig(),
                         sketch_seed=1)
    candidates = [Candidate(f"miner-{i}", i, delta, theta_hash, 5, coverage=1.0)
                  for i, delta in enumerate(deltas)]
    started = time.perf_counter()
    context = RoundContext(0, theta, theta_hash, None, 0, 10, previous_average=base_delta, contributors=miners)
    verdicts = scorer.score(context, candidates)
    total = time.perf_counter() - started
    if any(v.reason for v in verdicts):
        raise RuntimeError(f"a benchmark miner was refused: {[v.reason for v in verdicts if v.reason]}")
    t_miner = total / miners
    log.info("%s: step %.3fs, per miner %.3fs (%d miners in %.1fs)", preset, t_step, t_miner, miners, total)
    return dict(preset=preset, parameters=count_parameters(model), batch_size=batch_size, seq_len=SEQ_LEN,
                miners=miners, t_step_s=round(t_step, 4), t_miner_s=round(t_miner, 4),
                ratio_miner_to_step=round(ratio(t_miner, t_step), 2), scoring_total_s=round(total, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny only, 4 miners, fewer timing repeats")
    parser.add_argument("--skip-small", action="store_true", help="do not measure the small preset")
    parser.add_argument("--miners", type=int, default=16, help="pseudo-gradients scored per preset")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a neuron's --neuron.torch_threads)")
    args = parser.parse_args()
    setup_logging()
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    miners = 4 if args.quick else args.miners
    results = [measure("tiny", 8, miners, steps=20, repeats=3 if args.quick else 10)]
    if not (args.quick or args.skip_small):
        results.append(measure("small", 1, miners, steps=20, repeats=3))
    tiny_16_miners_s = results[0]["t_miner_s"] * 16
    localnet = localnet_scoring_budget()
    emit(dict(benchmark="validator_cost", quick=args.quick, seconds=round(time.monotonic() - started, 2),
              machine=machine_info(), threads=args.threads, results=results,
              localnet=dict(localnet, tiny_16_miners_s=round(tiny_16_miners_s, 2),
                            fits_one_round=tiny_16_miners_s <= localnet["scoring_budget_s"])))


if __name__ == "__main__":
    main()
