"""The owner's own share (issue 20): what leaving it out of its own segment's average costs in held-out loss.

``python -m benchmarks.own_share [--quick] [--workers 2,4] [--rounds R] [--codec fp16] [--rules R] [--seed S]``

Why: in the butterfly all-reduce each member owns a segment and averages every sender's input for it, its own
included. Its own input never crosses the wire, so no other member can check it: an owner that forges the claim of its
own input (``AllReduceFaults(lie="forged")``) can make any wrong average pass the members' in-round check
(docs/validation.md, known limits), and a witness that receives a copy costs +1/(2(N−1)) of a member's bytes (+17 %
at N = 4, against the issue's ≤ +1 %). A way that costs no bytes is to leave the owner's own input out of its
own segment's average: then every input of an average was sent by a member that holds it and can vouch for its claim.
What it costs is training: this benchmark measures it on the exact simulator of ``benchmarks.convergence`` (same data,
model, schedule and held-out windows; blocking rounds).

Arms, per N in ``--workers``, each an exact DiLoCo run with codec ``--codec`` (parts: the flat Δ split into N equal
contiguous ranges, owned by the N peers in an order drawn per round, as hivemind's leader shuffles its group):

- ``averaged``: today's rule, every part the weighted mean of all N inputs (the reference);
- ``deferred``: a part's mean leaves its owner's input out but divides by the weight of all N (so every input counts
  at its usual weight), and the owner carries its input for that part into its next round's contribution: nothing is
  lost, 1/N of each peer's Δ arrives one round late;
- ``dropped``: a part's mean is that of the other N − 1 inputs, and the owner's input for it is lost.

Prints one JSON line: each arm's final held-out loss, its ratio to ``averaged`` at the same N, and its curve (the
held-out loss on the curve windows after each round).
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from typing import Any

import torch

from benchmarks.common import benchmark_parser, data_name, emit, machine_info, parse_benchmark_args
from template.allreduce.codecs import CODEC_NAMES
from template.allreduce.reduction import weighted_mean

OWN_SHARE_RULES = ("averaged", "deferred", "dropped")
DENSE_CODECS = [name for name in CODEC_NAMES if name != "sparse"]


def owners_of_parts(workers: int, round: int) -> list[int]:
    """Who owns each of the ``workers`` parts in ``round``: a permutation drawn per round (reproducible)."""
    return torch.randperm(workers, generator=torch.Generator().manual_seed(10_007 + round)).tolist()


def part_bounds(numel: int, workers: int) -> list[int]:
    """Where each of the ``workers`` equal contiguous parts of ``numel`` values starts (and the last one ends)."""
    return torch.linspace(0, numel, workers + 1).round().long().tolist()


def own_share_mean(decoded: list[torch.Tensor], weights: list[float], round: int,
                   rule: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The round's average under ``rule`` ("deferred" or "dropped": module docstring) and what each peer carries into
    its next contribution (zeros for "dropped"). float32, like the reducer's result."""
    workers, numel = len(decoded), decoded[0].numel()
    total = sum(weights)
    mean = torch.zeros(numel, dtype=torch.float64)
    carries = [torch.zeros(numel, dtype=torch.float32) for _ in decoded]
    bounds = part_bounds(numel, workers)
    for part, owner in enumerate(owners_of_parts(workers, round)):
        start, stop = bounds[part], bounds[part + 1]
        others = [i for i in range(workers) if i != owner]
        mean[start:stop] = weighted_mean([decoded[i][start:stop] for i in others], [weights[i] for i in others])
        if rule == "deferred":  # every input at its usual weight: divide by all of them, the owner's carried on
            mean[start:stop] *= sum(weights[i] for i in others) / total
            carries[owner][start:stop] = decoded[owner][start:stop]
    return mean.to(torch.float32), carries


def main(argv: list[str] | None = None) -> int:
    from benchmarks.convergence import Arm, Setup, outer_of, run_arm

    parser = benchmark_parser("own_share", __doc__, "tiny settings for a smoke run (seconds)")
    parser.add_argument("--preset", default="tiny", help="model preset")
    parser.add_argument("--workers", default="2,4", help="N values, comma-separated: one set of arms each")
    parser.add_argument("--codec", default="fp16", choices=DENSE_CODECS,
                        help="the arms' codec (a dense one: the sparse codec averages each value over the senders that "
                             "kept it, which this rule does not model)")
    parser.add_argument("--inner-steps", type=int, default=None, help="H (default 50; --quick 4)")
    parser.add_argument("--rounds", type=int, default=None, help="outer rounds (default 30; --quick 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 64; --quick 32")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per worker step (default 8; --quick 2)")
    parser.add_argument("--eval-windows", type=int, default=None, help="held-out windows of the final loss")
    parser.add_argument("--rules", default=",".join(OWN_SHARE_RULES),
                        help=f"which arms, of {','.join(OWN_SHARE_RULES)} (averaged, the reference, always runs)")
    parser.add_argument("--seed", type=int, default=0, help="the data assignment's and θ_0's seed (a second run's)")
    parser.add_argument("--jobs", type=int, default=None, help="arms trained in parallel (default 2; --quick 1)")
    args = parse_benchmark_args(parser, argv, inner_steps=(50, 4), rounds=(30, 2), seq_len=(64, 32),
                                batch_size=(8, 2), eval_windows=(512, 16), jobs=(2, 1))
    try:
        workers = [int(n) for n in args.workers.split(",")]
    except ValueError:
        parser.error(f"--workers takes comma-separated integers, got {args.workers!r}")
    if any(n < 2 for n in workers):
        parser.error("--workers: every N must be at least 2 (a part needs another member to vouch for it)")
    asked = set(args.rules.split(","))
    if asked - set(OWN_SHARE_RULES):
        parser.error(f"--rules takes {','.join(OWN_SHARE_RULES)}, got {args.rules}")
    rules = ["averaged"] + [rule for rule in OWN_SHARE_RULES[1:] if rule in asked]
    lr, momentum = outer_of(args.codec, [])
    base = Setup(data=args.data, model=args.preset, workers=workers[0], inner_steps=args.inner_steps,
                 rounds=args.rounds, seq_len=args.seq_len, batch_size=args.batch_size,
                 eval_windows=args.eval_windows, curve_windows=8 if args.quick else 64, run_seed=args.seed,
                 init_seed=args.seed)
    runs = [(replace(base, workers=n), Arm(f"n{n}_{rule}", "diloco", args.codec, lr, momentum, own_share=rule))
            for n in workers for rule in rules]
    started = time.monotonic()
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(run_arm, *zip(*runs, strict=True)))
    losses = {arm.name: result["final_heldout_loss"] for (_, arm), result in zip(runs, results, strict=True)}
    arms: dict[str, Any] = {}
    for (setup, arm), result in zip(runs, results, strict=True):
        arms[arm.name] = dict(workers=setup.workers, rule=arm.own_share, final_heldout_loss=losses[arm.name],
                              loss_over_averaged=losses[arm.name] / losses[f"n{setup.workers}_averaged"],
                              curve=[round(point["loss"], 4) for point in result["curve"]], seconds=result["seconds"])
    emit(dict(benchmark="own_share", machine=machine_info(), quick=args.quick,
              settings=dict(preset=args.preset, data=data_name(args.data), codec=args.codec, workers=workers,
                            inner_steps=args.inner_steps, rounds=args.rounds, outer=[lr, momentum], seed=args.seed),
              arms=arms, seconds=round(time.monotonic() - started, 1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
