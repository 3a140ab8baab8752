"""Convergence: DiLoCo vs synchronous data-parallel vs one worker, on the same tokens, from the same θ_0.

``python -m benchmarks.convergence [--quick] [--engine exact|hivemind|both]``

Arms (tiny preset, byte-level data, the engine's default inner AdamW settings for every arm):

- ``dp``: synchronous data-parallel with N workers that average gradients every step, computed exactly in one
  process: one model, global batch = the N workers' batches of that step concatenated (the mean loss over the
  global batch has exactly the mean of the N workers' gradients), S steps. Same tokens as DiLoCo.
- ``single``: one worker, S steps on worker 0's batches (its batch = the per-worker batch): 1/N of the tokens.
- ``diloco_<codec>``: N replicas, S/H rounds of H inner steps each on the data the engine assigns to
  ``peer0..peerN-1``; Δ̄ is the exact token-weighted mean of the pseudo-gradients (float64 accumulation, float32
  result — what the engine's reducer computes), with the codec applied as the engine applies it: every Δ_i goes
  through the codec, the mean goes through it again (the engine skips the first round trip for the 1/N of Δ that a
  peer owns, so this is slightly pessimistic); the outer step is the engine's ``OuterOptimizer``.
- ``hivemind_<codec>`` (``--engine hivemind``/``both``): the real engine — N ``template.training.peer`` processes
  on 127.0.0.1 with the same data, H and seeds; peer 0's final checkpoint is evaluated on the same held-out windows.

All arms are deterministic (one torch thread each), so ``--jobs`` only changes the wall time. Every loss is the
mean next-token loss on the same fixed held-out windows, which no worker trains on.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    benchmark_parser,
    butterfly_bytes,
    data_name,
    emit,
    machine_info,
    median,
    parse_benchmark_args,
    ratio,
    run_peers,
)

log = logging.getLogger("benchmarks.convergence")

BYTES_PER_VALUE = {"none": 4.0, "fp16": 2.0, "int8": 1.0 + 4 / 256}  # int8: one float32 scale per 256 values
DILOCO_OVER_DP_GOAL = 1.02
CODEC_LOSS_GOAL = 0.01


@dataclass(frozen=True)
class Setup:
    """What every arm shares: data, model, batch, schedule and the held-out windows."""

    data: str
    model: str
    seq_len: int
    batch_size: int  # per worker
    workers: int
    inner_steps: int  # H
    rounds: int
    eval_windows: int
    curve_windows: int
    run_seed: int = 0
    init_seed: int = 0

    @property
    def steps_per_worker(self) -> int:
        return self.inner_steps * self.rounds


@dataclass(frozen=True)
class Arm:
    name: str
    kind: str  # "dp", "single" or "diloco"
    codec: str = "none"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9


class _Data:
    """The corpus, the engine's data assignment and the fixed held-out windows."""

    def __init__(self, setup: Setup) -> None:
        from template.training.data import ByteTokenizer, DataAssignment, build_corpus

        self.setup = setup
        self.corpus = build_corpus(setup.data, ByteTokenizer(), setup.seq_len)
        self.vocab_size = ByteTokenizer.vocab_size
        self.assignment = DataAssignment(self.corpus.fingerprint, self.corpus.num_windows, setup.run_seed)
        count = min(setup.eval_windows, self.assignment.num_heldout)
        self.eval_windows = self.assignment.heldout_windows(0, count, salt="benchmark")
        self.curve_windows = self.eval_windows[: setup.curve_windows]

    def worker_batches(self, worker: int, round: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Worker ``worker``'s H batches of round ``round``: exactly what engine peer ``peer<worker>`` trains on."""
        s = self.setup
        windows = self.assignment.assigned_windows(f"peer{worker}", round, s.inner_steps * s.batch_size)
        return list(self.corpus.batches(windows, s.batch_size))

    def build_model(self):
        from template.training.model import build_model

        return build_model(self.setup.model, self.vocab_size, self.setup.seq_len, init_seed=self.setup.init_seed)

    def loss(self, model, windows: list[int]) -> float:
        from template.training.inner import evaluate

        return evaluate(model, self.corpus.batches(windows, 64), "cpu")


def codec_mean(deltas: list[list[torch.Tensor]], codec_name: str) -> list[torch.Tensor]:
    """Δ̄ = codec(mean_i codec(Δ_i)), mean accumulated in float64 (equal token weights)."""
    from hivemind.compression import CompressionInfo

    from template.training.compression import get_compression

    codec = get_compression(codec_name)

    def roundtrip(tensor: torch.Tensor) -> torch.Tensor:
        if codec_name == "none":
            return tensor
        return codec.extract(codec.compress(tensor, CompressionInfo.from_tensor(tensor)))

    averaged = []
    for k in range(len(deltas[0])):
        accumulator = torch.zeros(deltas[0][k].shape, dtype=torch.float64)
        for delta in deltas:
            accumulator.add_(roundtrip(delta[k]).to(torch.float64), alpha=1.0 / len(deltas))
        averaged.append(roundtrip(accumulator.to(torch.float32)))
    return averaged


def run_arm(setup: Setup, arm: Arm) -> dict[str, Any]:
    """Train one arm from θ_0 and return its held-out losses (runs in a worker process, one torch thread)."""
    from template.training.inner import InnerConfig, InnerTrainer
    from template.training.outer import OuterConfig, OuterOptimizer

    torch.set_num_threads(1)
    started = time.monotonic()
    data = _Data(setup)
    curve = []
    if arm.kind == "diloco":
        models = [data.build_model() for _ in range(setup.workers)]
        trainers = [InnerTrainer(model, InnerConfig(), "cpu") for model in models]
        outer_config = OuterConfig(lr=arm.outer_lr, momentum=arm.outer_momentum, nesterov=arm.outer_momentum > 0)
        outer = OuterOptimizer(models[0], outer_config)
        for r in range(setup.rounds):
            deltas = []
            for worker, (model, trainer) in enumerate(zip(models, trainers, strict=True)):
                outer.load_into(model)
                trainer.train(data.worker_batches(worker, r), setup.inner_steps)
                deltas.append(outer.pseudo_gradient(model))
            outer.step(codec_mean(deltas, arm.codec))
            outer.load_into(models[0])
            curve.append(dict(step=(r + 1) * setup.inner_steps, loss=data.loss(models[0], data.curve_windows)))
        model, theta_hash = models[0], outer.theta_hash()
    else:
        model = data.build_model()
        trainer = InnerTrainer(model, InnerConfig(), "cpu")
        for r in range(setup.rounds):
            if arm.kind == "single":
                batches = data.worker_batches(0, r)
            else:  # dp: step k takes the k-th batch of every worker, concatenated
                per_worker = [data.worker_batches(worker, r) for worker in range(setup.workers)]
                batches = [(torch.cat([b[k][0] for b in per_worker]), torch.cat([b[k][1] for b in per_worker]))
                           for k in range(setup.inner_steps)]
            trainer.train(batches, setup.inner_steps)
            curve.append(dict(step=(r + 1) * setup.inner_steps, loss=data.loss(model, data.curve_windows)))
        theta_hash = None
    params = sum(p.numel() for p in model.parameters())
    workers = 1 if arm.kind == "single" else setup.workers
    tokens = setup.steps_per_worker * setup.batch_size * setup.seq_len * workers
    communications = {"dp": setup.steps_per_worker, "single": 0, "diloco": setup.rounds}[arm.kind]
    bytes_per_value = BYTES_PER_VALUE["none" if arm.kind == "dp" else arm.codec]
    per_comm = butterfly_bytes(params, setup.workers, bytes_per_value) if arm.kind != "single" else 0.0
    described = asdict(arm) if arm.kind == "diloco" else dict(name=arm.name, kind=arm.kind)
    return dict(
        described, final_heldout_loss=data.loss(model, data.eval_windows), curve=curve,
        steps_per_worker=setup.steps_per_worker, tokens=tokens, communications=communications,
        bytes_sent_per_peer=round(communications * per_comm), params=params,
        seconds=round(time.monotonic() - started, 1), theta_hash=theta_hash,
    )


def run_engine(setup: Setup, arm: Arm, timeout_s: float, matchmaking_time: float) -> dict[str, Any]:
    """The same DiLoCo run through the real engine (peer processes, hivemind all-reduce); evaluate peer 0's θ."""
    from template.training.checkpoint import load_latest_checkpoint
    from template.training.outer import OuterConfig, OuterOptimizer

    args = ["--run-id", f"conv{arm.codec}", "--preset", setup.model, "--data", setup.data,
            "--seq-len", str(setup.seq_len), "--batch-size", str(setup.batch_size),
            "--inner-steps", str(setup.inner_steps), "--rounds", str(setup.rounds), "--run-seed", str(setup.run_seed),
            "--init-seed", str(setup.init_seed), "--outer-lr", str(arm.outer_lr),
            "--outer-momentum", str(arm.outer_momentum), "--compression", arm.codec, "--heldout-batches", "0",
            "--matchmaking-time", str(matchmaking_time), "--join-timeout", "60"]
    with tempfile.TemporaryDirectory(prefix="bench-conv-") as out:
        run = run_peers(setup.workers, args, Path(out), timeout_s, threads=1)
        result: dict[str, Any] = dict(asdict(arm), seconds=round(run.seconds, 1), finished=run.finished,
                                      errors=run.errors)
        failed = [e for events in run.rounds.values() for e in events if not e["allreduce_ok"]]
        result["failed_allreduces"] = len(failed)
        result["failures"] = [dict(peer=e["peer_key"], round=e["round"], reason=e["reason"]) for e in failed]
        result["theta_identical_across_peers"] = len({e["theta_hash"] for e in run.done.values()}) == 1
        checkpoint = load_latest_checkpoint(Path(out) / "peer0")
        if not run.finished or checkpoint is None or checkpoint.round != setup.rounds:
            return result
    torch.set_num_threads(1)
    data = _Data(setup)
    model = data.build_model()
    outer = OuterOptimizer(model, OuterConfig())
    outer.load_state_dict({k[len("outer."):]: v for k, v in checkpoint.tensors.items() if k.startswith("outer.")})
    outer.load_into(model)
    result.update(final_heldout_loss=data.loss(model, data.eval_windows), theta_hash=outer.theta_hash(),
                  allreduce_s_median=median([e["allreduce_s"] for events in run.rounds.values() for e in events]))
    return result


def parse_outer(text: str) -> list[tuple[float, float]]:
    """``"0.7:0.9,1.0:0.5"`` → [(0.7, 0.9), (1.0, 0.5)] (outer lr : Nesterov momentum)."""
    pairs = []
    for item in text.split(","):
        lr, _, momentum = item.partition(":")
        pairs.append((float(lr), float(momentum or 0.9)))
    return pairs


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser("convergence", __doc__, "tiny settings for the smoke test (seconds)")
    parser.add_argument("--preset", default="tiny", help="model preset")
    parser.add_argument("--workers", type=int, default=4, help="N: DiLoCo peers = data-parallel workers")
    parser.add_argument("--inner-steps", type=int, default=None, help="H (default 50; --quick 4)")
    parser.add_argument("--rounds", type=int, default=None, help="outer rounds (default 6; --quick 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 64; --quick 32")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per worker step (default 8; --quick 2)")
    parser.add_argument("--eval-windows", type=int, default=None, help="held-out windows of the final loss")
    parser.add_argument("--codecs", default="none,fp16,int8", help="DiLoCo arms, one per codec (first = headline)")
    parser.add_argument("--outer", default="0.7:0.9",
                        help="outer lr:momentum pairs; the first is the headline, the others are a sweep (codec none)")
    parser.add_argument("--engine", choices=["exact", "hivemind", "both"], default="exact")
    parser.add_argument("--engine-codec", default="fp16", help="codec of the hivemind-engine run")
    parser.add_argument("--jobs", type=int, default=None, help="arms trained in parallel (default 2; --quick 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound of the hivemind-engine run, seconds")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_benchmark_args(build_parser(), argv, inner_steps=(50, 4), rounds=(6, 2), seq_len=(64, 32),
                                batch_size=(8, 2), eval_windows=(512, 16), jobs=(2, 1))
    quick = args.quick
    setup = Setup(
        data=args.data, model=args.preset, workers=args.workers, inner_steps=args.inner_steps, rounds=args.rounds,
        seq_len=args.seq_len, batch_size=args.batch_size, eval_windows=args.eval_windows,
        curve_windows=8 if quick else 128,
    )
    codecs = args.codecs.split(",")
    outer = parse_outer(args.outer)
    headline_lr, headline_momentum = outer[0]
    arms = [Arm("dp", "dp"), Arm("single", "single")]
    arms += [Arm(f"diloco_{c}", "diloco", c, headline_lr, headline_momentum) for c in codecs]
    arms += [Arm(f"diloco_none_lr{lr}_m{m}", "diloco", "none", lr, m) for lr, m in outer[1:]]
    result: dict[str, Any] = dict(benchmark="convergence", machine=machine_info(), quick=quick, engine=args.engine,
                                  settings=dict(asdict(setup), data=data_name(setup.data), codecs=codecs,
                                                outer=outer, steps_per_worker=setup.steps_per_worker))
    started = time.monotonic()
    arm_results: dict[str, dict] = {}
    if args.engine in ("exact", "both"):
        if args.jobs == 1:
            for arm in arms:
                arm_results[arm.name] = run_arm(setup, arm)
                log.info("%s: held-out loss %.4f", arm.name, arm_results[arm.name]["final_heldout_loss"])
        else:
            with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
                futures = {pool.submit(run_arm, setup, arm): arm.name for arm in arms}
                for future in as_completed(futures):
                    name = futures[future]
                    arm_results[name] = future.result()
                    log.info("%s: held-out loss %.4f", name, arm_results[name]["final_heldout_loss"])
            arm_results = {arm.name: arm_results[arm.name] for arm in arms}
    if args.engine in ("hivemind", "both"):
        arm = Arm(f"hivemind_{args.engine_codec}", "diloco", args.engine_codec, headline_lr, headline_momentum)
        engine = run_engine(setup, arm, args.timeout, matchmaking_time=2.0 if quick else 5.0)
        exact = arm_results.get(f"diloco_{args.engine_codec}")
        if exact is not None and "final_heldout_loss" in engine:
            engine["loss_over_exact"] = engine["final_heldout_loss"] / exact["final_heldout_loss"]
            engine["theta_bit_identical_to_exact"] = engine["theta_hash"] == exact["theta_hash"]
        arm_results[arm.name] = engine
    result["arms"] = arm_results
    result["summary"] = summarize(arm_results, codecs)
    result["seconds"] = round(time.monotonic() - started, 1)
    emit(result)
    return 0


def summarize(arms: dict[str, dict], codecs: list[str]) -> dict[str, Any]:
    """Ratios against the baselines of the same run, and whether the goals are met."""
    loss = {name: arm.get("final_heldout_loss") for name, arm in arms.items()}
    summary: dict[str, Any] = {}
    headline = next((f"diloco_{c}" for c in codecs if loss.get(f"diloco_{c}") is not None), None)
    if headline is None:
        headline = next((name for name in arms if name.startswith("hivemind_") and loss.get(name)), None)
    if headline is None or loss.get("dp") is None:
        return summary
    summary.update(
        headline_arm=headline,
        diloco_over_dp=loss[headline] / loss["dp"],
        diloco_over_dp_goal=DILOCO_OVER_DP_GOAL,
        diloco_over_dp_goal_met=loss[headline] / loss["dp"] <= DILOCO_OVER_DP_GOAL,
        single_over_dp=ratio(loss["single"], loss["dp"]),
        diloco_beats_single=loss[headline] < loss["single"],
        communications=dict(dp=arms["dp"]["communications"], diloco=arms[headline].get("communications")),
    )
    changes = {c: loss[f"diloco_{c}"] / loss["diloco_none"] - 1 for c in codecs
               if c != "none" and loss.get(f"diloco_{c}") is not None and loss.get("diloco_none") is not None}
    if changes:
        summary.update(codec_loss_change_vs_none=changes, codec_loss_goal=CODEC_LOSS_GOAL,
                       codec_loss_goal_met=all(abs(v) <= CODEC_LOSS_GOAL for v in changes.values()))
    sweep = {name: value for name, value in loss.items() if "_lr" in name and value is not None}
    if sweep:
        summary["outer_sweep_over_dp"] = {name: value / loss["dp"] for name, value in sweep.items()}
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
