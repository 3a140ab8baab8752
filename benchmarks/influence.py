"""Bounded influence: how far honest DiLoCo contributions reach, and what the owner's value bound does to an attack.

``python -m benchmarks.influence [--quick] [--presets tiny,small] [--codecs fp16,sparse] [--lrs tiny=1e-3:3e-3,...]
[--workers 4] [--inner-steps 25] [--rounds 25] [--attack-values 8 --attack-share 0.5]``

Every arm trains real DiLoCo rounds in one process (the exact simulator of ``benchmarks.convergence``: the engine's
data assignment, inner AdamW, codecs with error feedback, outer optimizer) and reduces *every segment with the
owner's rule itself* (:func:`template.allreduce.reduction.reduce_segment`, the default
:class:`~template.allreduce.reduction.OwnerRule`: norm clip and value bound), as each owner of the real all-reduce
does. Per preset × codec × learning rate:

- ``honest``: N honest workers. Counted over every member-round: contributions whose norm the rule clipped and
  whose values it bounded (both must stay 0), and the largest *reach* — a contribution's largest magnitude in a
  segment over the lower median of the group's largest there, the quantity the bound caps at
  ``value_bound_multiple``. The same rounds run again with the bound off: θ must end bit-identical (the rule never
  touched honest work), so the held-out loss with the rule is that without it.
- ``attack`` (with and without the bound): worker N−1 is the ``concentrated`` miner
  (:class:`template.base.behaviours.Concentrated`: ``--attack-share`` of its honest norm in ``--attack-values``
  coordinates, the same ones every round). Reported: how far the averaged update Δ̄ moves those coordinates against
  the largest move of any coordinate in the honest arm's Δ̄ of the same round (``pull``: 1.0 = as far as honest
  training moves its most-moved coordinate), per round and summed over the run (the edit accumulates in θ: the
  targets' summed Δ̄ against the honest arm's largest summed Δ̄), and the held-out loss.
- cost: the owner's rule over the last round's segments with the bound and without, alternately (seconds, median of
  5 each); the bytes of every averaged segment with and without (the bound changes values, never sizes).

Prints one JSON object; the per-round rows go to stderr as they come.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from benchmarks.common import benchmark_parser, data_name, emit, machine_info, median, parse_benchmark_args, ratio
from benchmarks.convergence import Arm, Setup, _Data, _load_flat, flatten, unflatten
from template.allreduce.codecs import SparseSettings, encode_with_feedback, segment_slices
from template.allreduce.reduction import OwnerRule, SegmentInput, lower_median, reduce_segment, weight_cap
from template.base.behaviours import Concentrated
from template.training.cli import PRESET_COMPRESSION
from template.training.inner import InnerConfig, InnerTrainer
from template.training.outer import OuterOptimizer, default_outer

DEFAULT_LRS = {"tiny": (1e-3, 3e-3), "small": (3e-4, 1e-3)}  # the engine's default (1e-3) and one step beside it
NO_BOUND = replace(OwnerRule(), value_bound_multiple=None)


@dataclass(frozen=True)
class Case:
    preset: str
    codec: str
    lr: float


@dataclass
class RoundStats:
    norm_clipped: int = 0  # contributions of honest workers whose norm the rule clipped
    bounded: int = 0  # contributions of honest workers with a value the rule bounded
    attacker_bounded: int = 0
    reach: float = 0.0  # the largest honest reach of the round (module docstring)
    largest_move: float = 0.0  # the largest |Δ̄| of the round
    pull: float | None = None  # attack arms: the targets' largest |Δ̄| / the honest arm's largest |Δ̄| that round


def reduce_round(codec, segments: list[list[bytes]], weights: list[float], numel: int, rule: OwnerRule,
                 honest: set[int]) -> tuple[torch.Tensor, int, RoundStats]:
    """Every segment through the owner's rule, as the owners of one all-reduce do; the decoded Δ̄, its bytes and
    what the rule did to whom."""
    stats, averaged, size = RoundStats(), torch.empty(numel), 0
    cap = weight_cap(weights)
    for k, part in enumerate(segment_slices(numel, codec.segment_values)):
        inputs = [SegmentInput(j, segments[j][k], weights[j]) for j in range(len(segments))]
        reduced = reduce_segment(inputs, part.stop - part.start, codec, weights, rule, cap)
        averaged[part] = codec.decode_average(reduced.data, part.stop - part.start)
        size += len(reduced.data)
        stats.norm_clipped += sum(1 for j, _ in reduced.clipped if j in honest)
        stats.bounded += sum(1 for j, _ in reduced.bounded if j in honest)
        stats.attacker_bounded += sum(1 for j, _ in reduced.bounded if j not in honest)
    stats.largest_move = float(averaged.abs().max())
    return averaged, size, stats


def reduce_seconds(codec, segments: list[list[bytes]], weights: list[float], numel: int) -> dict[str, float]:
    """The owner's rule over one round's segments with the bound and without, alternately: median of 5 each."""
    times: dict[str, list[float]] = {"bound": [], "no_bound": []}
    cap = weight_cap(weights)
    for _ in range(5):
        for name, rule in (("bound", OwnerRule()), ("no_bound", NO_BOUND)):
            started = time.perf_counter()
            for k, part in enumerate(segment_slices(numel, codec.segment_values)):
                inputs = [SegmentInput(j, segments[j][k], weights[j]) for j in range(len(segments))]
                reduce_segment(inputs, part.stop - part.start, codec, weights, rule, cap)
            times[name].append(time.perf_counter() - started)
    return {name: round(median(values), 4) for name, values in times.items()}


def reach(codec, decoded: list[torch.Tensor], honest: set[int]) -> float:
    """The largest (honest largest magnitude in a segment) / (lower median of the group's largest there)."""
    worst = 0.0
    for part in segment_slices(decoded[0].numel(), codec.segment_values):
        largest = [float(d[part].abs().max()) for d in decoded]
        positive = [m for m in largest if m > 0]
        if positive:
            worst = max(worst, max(largest[j] for j in honest) / lower_median(positive))
    return worst


def run_arm(setup: Setup, case: Case, rule: OwnerRule, attack: Concentrated | None,
            honest_moves: dict[str, Any] | None = None) -> dict[str, Any]:
    """One arm (module docstring): per-round stats, the final θ's hash and held-out loss. Attack arms compare their
    targets' moves with ``honest_moves`` (the honest arm's ``largest_moves`` and ``largest_drift``)."""
    torch.set_num_threads(1)
    data = _Data(setup)
    outer = default_outer(case.codec)
    arm = Arm("influence", "diloco", case.codec, outer.lr, outer.momentum, SparseSettings())
    codec = arm.build_codec()
    models = [data.build_model() for _ in range(setup.workers)]
    outer = OuterOptimizer(models[0], arm.outer_config())
    like = outer.params()
    theta = flatten(like)
    trainers = [InnerTrainer(model, InnerConfig(lr=case.lr), "cpu") for model in models]
    residuals: list[torch.Tensor | None] = [None] * setup.workers
    honest = set(range(setup.workers - 1 if attack else setup.workers))
    targets: torch.Tensor | None = None
    rounds, drift = [], torch.zeros_like(theta, dtype=torch.float64)
    sizes = []
    for r in range(setup.rounds):
        segments, decoded, weights = [], [], []
        for worker, (model, trainer) in enumerate(zip(models, trainers, strict=True)):
            _load_flat(model, theta, like)
            trained = trainer.train(data.worker_batches(worker, r), setup.inner_steps)
            delta = theta - flatten(list(model.parameters()))
            if worker not in honest:
                delta = flatten(attack.contribution(r, unflatten(delta.clone(), like)))
                if targets is None:  # where the attacker's edit sits (the same coordinates every round)
                    targets = delta.abs().topk(attack.values).indices
            encoded, contribution, residuals[worker] = encode_with_feedback(
                codec, delta, residuals[worker] if codec.error_feedback else None)
            segments.append(encoded)
            decoded.append(contribution)
            weights.append(float(trained.tokens))
        averaged, size, stats = reduce_round(codec, segments, weights, theta.numel(), rule, honest)
        sizes.append(size)
        stats.reach = reach(codec, decoded, honest)
        drift += averaged.double()
        if targets is not None:
            stats.pull = float(averaged[targets].abs().max()) / honest_moves["largest_moves"][r]
        outer.step(unflatten(averaged, like))
        theta = flatten(outer.params())
        rounds.append(stats)
        print(f"{time.strftime('%H:%M:%S')} {case} bound={rule.value_bound_multiple} attack={attack is not None} "
              f"round {r + 1}: {stats}", file=sys.stderr, flush=True)
    _load_flat(models[0], theta, like)
    result: dict[str, Any] = dict(
        member_rounds=setup.rounds * len(honest),
        honest_norm_clipped=sum(s.norm_clipped for s in rounds), honest_bounded=sum(s.bounded for s in rounds),
        attacker_bounded_rounds=sum(1 for s in rounds if s.attacker_bounded),
        largest_reach=round(max(s.reach for s in rounds), 3),
        theta_hash=outer.theta_hash(), heldout_loss=round(data.loss(models[0], data.eval_windows), 4),
        averaged_bytes=sizes, largest_moves=[s.largest_move for s in rounds], largest_drift=float(drift.abs().max()))
    if targets is None:
        result["reduce_s"] = reduce_seconds(codec, segments, weights, theta.numel())
    else:
        result.update(pull_per_round=[round(s.pull, 2) for s in rounds],
                      largest_pull=round(max(s.pull for s in rounds), 2),
                      accumulated_pull=round(float(drift[targets].abs().max()) / honest_moves["largest_drift"], 2))
    return result


def _shown(arm: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in arm.items() if k not in ("theta_hash", "averaged_bytes", "largest_moves", "largest_drift")}


def parse_lrs(text: str) -> dict[str, tuple[float, ...]]:
    """``tiny=1e-3:3e-3,small=3e-4`` → {"tiny": (1e-3, 3e-3), "small": (3e-4,)}."""
    lrs = {}
    for item in filter(None, text.split(",")):
        preset, _, values = item.partition("=")
        lrs[preset.strip()] = tuple(float(v) for v in values.split(":"))
    return lrs


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("influence", __doc__.split("\n\n")[0],
                              "tiny preset, fp16 and sparse, 2 rounds of 3 workers, 2 inner steps (smoke test)")
    parser.add_argument("--presets", default="tiny,small", help="model presets (comma-separated)")
    parser.add_argument("--codecs", default="fp16,sparse", help="codecs of the all-reduce (comma-separated)")
    parser.add_argument("--lrs", default="", help="inner learning rates per preset, e.g. tiny=1e-3:3e-3,small=3e-4 "
                                                  f"(default {DEFAULT_LRS})")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=None, help="H (default 25; 2 with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per arm (default 25; 2 with --quick)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--attack-values", type=int, default=8)
    parser.add_argument("--attack-share", type=float, default=0.5)
    args = parse_benchmark_args(parser, argv, inner_steps=(25, 2), rounds=(25, 2))
    if args.quick:
        args.presets, args.workers = "tiny", 3
    lrs = {**{p: v[:1] if args.quick else v for p, v in DEFAULT_LRS.items()}, **parse_lrs(args.lrs)}
    info, began = machine_info(), time.monotonic()
    cases = [Case(preset, codec, lr) for preset in args.presets.split(",") for codec in args.codecs.split(",")
             for lr in lrs[preset]]
    results = []
    for case in cases:
        setup = Setup(args.data, case.preset, args.seq_len, args.batch_size, args.workers, args.inner_steps,
                      args.rounds, eval_windows=64 if args.quick else 256, curve_windows=0)
        attack = Concentrated(args.attack_values, args.attack_share)
        started = time.monotonic()
        honest = run_arm(setup, case, OwnerRule(), None)
        unbounded = run_arm(setup, case, NO_BOUND, None)
        attacked = run_arm(setup, case, OwnerRule(), attack, honest)
        attacked_unbounded = run_arm(setup, case, NO_BOUND, Concentrated(args.attack_values, args.attack_share),
                                     honest)
        results.append(dict(
            preset=case.preset, codec=case.codec, lr=case.lr, seconds=round(time.monotonic() - started, 1),
            honest=_shown(honest), theta_identical_without_bound=honest["theta_hash"] == unbounded["theta_hash"],
            loss_without_bound=unbounded["heldout_loss"],
            bytes_identical_without_bound=honest["averaged_bytes"] == unbounded["averaged_bytes"],
            reduce_ratio=ratio(honest["reduce_s"]["bound"], honest["reduce_s"]["no_bound"]),
            attack=_shown(attacked), attack_without_bound=_shown(attacked_unbounded)))
    summary = dict(
        honest_member_rounds=sum(r["honest"]["member_rounds"] for r in results),
        honest_norm_clipped=sum(r["honest"]["honest_norm_clipped"] + r["attack"]["honest_norm_clipped"]
                                for r in results),
        honest_bounded=sum(r["honest"]["honest_bounded"] + r["attack"]["honest_bounded"] for r in results),
        largest_honest_reach=max(max(r["honest"]["largest_reach"], r["attack"]["largest_reach"]) for r in results),
        value_bound_multiple=OwnerRule().value_bound_multiple,
        theta_identical_without_bound=all(r["theta_identical_without_bound"] for r in results),
        bytes_identical_without_bound=all(r["bytes_identical_without_bound"] for r in results),
        largest_attack_pull=max(r["attack"]["largest_pull"] for r in results),
        largest_attack_pull_without_bound=max(r["attack_without_bound"]["largest_pull"] for r in results),
        largest_accumulated_pull=max(r["attack"]["accumulated_pull"] for r in results),
        largest_reduce_ratio=max(r["reduce_ratio"] for r in results),
        attacker_bounded_in_every_round=all(r["attack"]["attacker_bounded_rounds"] == args.rounds for r in results))
    emit(dict(benchmark="influence", quick=args.quick, machine=info, seconds=round(time.monotonic() - began, 1),
              data=data_name(args.data),
              workers=args.workers, inner_steps=args.inner_steps, rounds=args.rounds,
              attack=dict(values=args.attack_values, share=args.attack_share),
              preset_codecs=PRESET_COMPRESSION, cases=results, summary=summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
