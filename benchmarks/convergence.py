"""Convergence: DiLoCo vs synchronous data-parallel vs one worker, on the same tokens, from the same θ_0; codecs
(dense and sparse) and overlapped communication, on an exact in-process simulator.

``python -m benchmarks.convergence [--quick] [--engine exact|hivemind|both] [--codecs none,fp16,int8,sparse]
[--sparse-k K --sparse-chunk C --sparse-bits B --sparse-quantizer Q --no-error-feedback]
[--sweep --sweep-k 16,64,256 --sweep-bits 1,2,4 --sweep-decay off,0.9,0.95,1.0]
[--overlap fp16,sparse [--overlap-modes eager,corrected --arrival-steps 10,25]]``

Arms (tiny preset, byte-level data, the engine's default inner AdamW settings for every arm):

- ``dp``: synchronous data-parallel with N workers that average gradients every step, computed exactly in one
  process: one model, global batch = the N workers' batches of that step concatenated (the mean loss over the
  global batch has exactly the mean of the N workers' gradients), S steps. Same tokens as DiLoCo.
- ``single``: one worker, S steps on worker 0's batches (its batch = the per-worker batch): 1/N of the tokens.
- ``diloco_<codec>``: N replicas, S/H rounds of H inner steps each on the data the engine assigns to
  ``peer0..peerN-1``, with the segment codecs of ``template.allreduce.codecs`` applied exactly as the engine applies
  them: each peer's flat Δ (plus its residual, kept across rounds, for ``sparse``) goes through
  ``encode_with_feedback``; the token-weighted mean of the *decoded* contributions (float64 accumulation, float32
  result — the reducer's arithmetic) goes through ``encode_average``/``decode_average`` per segment; the outer step
  is the engine's ``OuterOptimizer``. ``sparse`` takes its settings from ``--sparse-*``; ``--sweep`` runs k ∈ {16,
  64, 256} of 4096 × bits ∈ {1, 2, 4} × error-feedback β ∈ {off, 0.9, 0.95, 1.0} (36 arms; ``--sweep-*`` pick a
  part) at the outer step of ``--outer``, beside ``diloco_none`` (and skips ``dp``/``single``).
- ``diloco_<codec>_delayed`` / ``_eager`` / ``_eager_full`` / ``_eager_mixed`` (``--overlap``): round r's all-reduce
  runs while round r+1 trains. Notation: G_r is the global θ after the outer steps of Δ̄_0 … Δ̄_{r−1}, identical on
  every peer (G_0 = θ_0, G_{r+1} = outer(G_r, Δ̄_r), with the outer optimizer's momentum); Δ̄_r arrives during round
  r+1, so at the start of round r+1 a peer knows G_r but not G_{r+1}. Every peer contributes its *own progress* in
  the round: Δ_{i,r} = S_{i,r} − θ_local_{i,r}, where S_{i,r} is the θ its inner training of round r started from.

  - blocking (``diloco_<codec>``): S_{i,r+1} = G_{r+1} (wait for Δ̄_r).
  - delayed: S_{i,r+1} = G_r, the same on every peer: the outer step lags one round (the start-point track
    B_{r+1} = outer(B_r, Δ̄_{r−1})), and Δ̄_r, measured from B_r = G_{r−1}, is applied to G_r (one round stale).
  - eager (the engine's): S_{i,r+1} = outer(G_r, s_{i,r}·D_{i,r}) computed on a local copy of G_r and its momentum,
    where D_{i,r} is the peer's own *decoded* contribution (exactly the bytes it published) standing in for Δ̄_r,
    shrunk by s_{i,r} = ⟨Δ̄_{r−1}, D_{i,r−1}⟩ / ⟨D_{i,r−1}, D_{i,r−1}⟩ in [0, 1] (``outer.stand_in_scale``: how far
    the last average followed the peer's own last contribution; 1 in round 0). The global track still applies the
    true Δ̄_r once it arrives, so every peer's G stays identical. Using decoded contributions and averages keeps
    S_{i,r+1} a function of public data.
  - eager_full: as eager with s = 1 (the engine's overlap before 2026-12-04): the mean of the peers' start points is
    then G_{r+1} up to the average's rounding (the outer step is affine in Δ).
  - eager_mixed: as eager_full, but the stand-in is the last average that did arrive with the peer's own share of it
    replaced by its fresh contribution, Δ̄_{r−1} + (w_i/W)·(D_{i,r} − D_{i,r−1}) (Δ̄_{−1} = D_{i,−1} = 0): the
    mixture of Kale et al., "Eager updates for overlapped communication and computation in DiLoCo" (2025) — the
    others' part is one round stale, but it is a mean of N, not one peer's noisy progress.
  - corrected_at<K> (``--arrival-steps K``, default H/2): as eager, and once Δ̄_{r−1} lands, after K of the round's
    H inner steps, each peer shifts θ_local by the stand-in's error G_r − S_{i,r}, trains the other H − K steps from
    there (its AdamW state kept) and measures its Δ from G_r, the θ the round's average is applied to. Not the
    engine's: it would need the average's arrival checked between inner steps (docs/benchmarks.md §1a).

  Every arm is evaluated at equal inner steps on the global θ once every all-reduce it started has landed (after
  round r: G_{r+1}); the final loss is that of G_R.
- ``hivemind_<codec>`` (``--engine hivemind``/``both``): the real engine — N ``template.training.peer`` processes
  on 127.0.0.1 with the same data, H and seeds; peer 0's final checkpoint is evaluated on the same held-out windows.

Bytes: a peer's contribution is the sum of its encoded segments; the averaged bytes are those of every averaged
segment. In a butterfly a peer sends (N−1)/N of its contribution and (N−1)/N × the averaged bytes (it serves its
1/N share of them to N−1 peers), and receives as much. All arms are deterministic (one torch thread each), so
``--jobs`` only changes the wall time. Every loss is the mean next-token loss on the same fixed held-out windows,
which no worker trains on.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
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
    run_peers,
)
from benchmarks.convergence_summary import summarize
from benchmarks.own_share import own_share_mean
from template.allreduce.codecs import (
    SPARSE_MEANS,
    SegmentCodec,
    SparseCodec,
    SparseSettings,
    encode_segments,
    encode_with_feedback,
)
from template.allreduce.reduction import kept_weight, weighted_mean

log = logging.getLogger("benchmarks.convergence")

SWEEP_K = "16,64,256"  # of 4096: density 0.39 %, 1.56 %, 6.25 %
SWEEP_BITS = "1,2,4"
SWEEP_DECAY = "off,0.9,0.95,1.0"  # error-feedback β; off = no residual at all
OVERLAP_MODES = ("blocking", "delayed", "eager", "eager_full", "eager_mixed", "corrected")


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
    sparse: SparseSettings | None = None  # the settings of a "sparse" arm
    overlap: str = "blocking"  # one of OVERLAP_MODES (module docstring)
    arrival: int = 0  # corrected: the inner step of a round at which the round before's average lands
    own_share: str = "averaged"  # the owner's input in its own part's mean (benchmarks.own_share's rules)

    def outer_config(self):
        """The outer step of this arm (plain SGD when its momentum is 0)."""
        from template.training.outer import outer_step

        return outer_step(self.outer_lr, self.outer_momentum)

    def build_codec(self) -> SegmentCodec:
        from template.allreduce.codecs import get_codec

        return SparseCodec(self.sparse) if self.codec == "sparse" else get_codec(self.codec)


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


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [part.view_as(t) for part, t in zip(torch.split(flat, [t.numel() for t in like]), like, strict=True)]


@dataclass
class _Peers:
    """The simulated peers of a DiLoCo arm: replicas, their inner optimizers, residuals and start points."""

    models: list[torch.nn.Module]
    trainers: list[Any]
    residuals: list[torch.Tensor | None]
    starts: list[torch.Tensor]  # flat θ each peer's next round starts from


def _stepped(outer, delta: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """Flat θ of ``outer.step(delta)`` taken on a copy of ``outer`` (θ and momentum): ``outer`` is not changed."""
    from template.training.outer import OuterOptimizer

    scratch = OuterOptimizer(model, outer.config)
    scratch.load_state_dict(outer.state_dict())
    scratch.step(unflatten(delta, scratch.params()))
    return flatten(scratch.params())


def run_diloco(setup: Setup, arm: Arm, data: _Data) -> dict[str, Any]:
    """One DiLoCo arm (module docstring): returns the final model, its curve and the bytes it sent."""
    from template.training.inner import InnerConfig, InnerTrainer
    from template.training.outer import OuterOptimizer, stand_in_scale

    codec = arm.build_codec()
    models = [data.build_model() for _ in range(setup.workers)]
    outer = OuterOptimizer(models[0], arm.outer_config())
    theta_0 = flatten(outer.params())
    peers = _Peers(models, [InnerTrainer(model, InnerConfig(), "cpu") for model in models],
                   [None] * setup.workers, [theta_0] * setup.workers)
    in_flight: torch.Tensor | None = None  # Δ̄ of the previous round, still being all-reduced (overlap arms)
    previous = [torch.zeros_like(theta_0)] * setup.workers  # each peer's decoded contribution of the last round
    curve, contribution_bytes, averaged_bytes = [], 0, []
    landed: torch.Tensor | None = None  # Δ̄_{r−1}, once it has landed (overlap arms)
    carries: list[torch.Tensor] | None = None  # what owners left out of their own parts carry on (own_share arms)
    for r in range(setup.rounds):
        decoded, weights = [], []
        if arm.overlap == "corrected" and in_flight is not None:  # Δ̄_{r−1} lands during round r: G_{r−1} → G_r
            outer.step(unflatten(in_flight, outer.params()))
            landed, in_flight = in_flight, None
        for worker, (model, trainer) in enumerate(zip(peers.models, peers.trainers, strict=True)):
            _load_flat(model, peers.starts[worker], outer.params())
            if arm.overlap == "corrected":
                stats = _train_corrected(trainer, model, data.worker_batches(worker, r), setup.inner_steps,
                                         arm.arrival, peers.starts[worker], flatten(outer.params()))
                peers.starts[worker] = flatten(outer.params())  # its Δ is measured from G_r
            else:
                stats = trainer.train(data.worker_batches(worker, r), setup.inner_steps)
            delta = peers.starts[worker] - flatten(list(model.parameters()))
            delta = delta if carries is None else delta + carries[worker]
            segments, contribution, peers.residuals[worker] = encode_with_feedback(
                codec, delta, peers.residuals[worker] if codec.error_feedback else None)
            contribution_bytes = sum(len(segment) for segment in segments)
            decoded.append(contribution)
            weights.append(float(stats.tokens))
        if arm.own_share == "averaged":
            kept = kept_weight(decoded, weights) if codec.mean_of_kept else None
            mean = weighted_mean(decoded, weights, kept=kept).to(torch.float32)
        else:
            mean, carries = own_share_mean(decoded, weights, r, arm.own_share)
        averaged_segments, averaged = encode_segments(codec, mean, average=True)
        averaged_bytes.append(sum(len(segment) for segment in averaged_segments))
        if arm.overlap == "blocking":
            outer.step(unflatten(averaged, outer.params()))
            peers.starts = [flatten(outer.params())] * setup.workers
        else:
            if arm.overlap != "corrected":
                landed = in_flight
                if in_flight is not None:  # Δ̄_{r−1} lands during round r: G_{r−1} → G_r
                    outer.step(unflatten(in_flight, outer.params()))
            if arm.overlap == "delayed":
                peers.starts = [flatten(outer.params())] * setup.workers
            elif arm.overlap in ("eager", "corrected"):  # the own contribution, shrunk by its fit, stands in for Δ̄_r
                average = None if landed is None else unflatten(landed, outer.params())  # Δ̄_{r−1}
                peers.starts = [_stepped(outer, stand_in_scale(old, average) * own, models[0])
                                for own, old in zip(decoded, previous, strict=True)]
            elif arm.overlap == "eager_full":  # the whole own contribution stands in for Δ̄_r
                peers.starts = [_stepped(outer, own, models[0]) for own in decoded]
            else:  # eager_mixed: Δ̄_{r−1} with the peer's own share swapped for its fresh contribution
                landed = torch.zeros_like(theta_0) if landed is None else landed
                peers.starts = [_stepped(outer, landed + (own - old) * (weight / sum(weights)), models[0])
                                for own, old, weight in zip(decoded, previous, weights, strict=True)]
            in_flight, previous = averaged, decoded
        settled = flatten(outer.params()) if in_flight is None else _stepped(outer, in_flight, models[0])
        _load_flat(models[0], settled, outer.params())
        curve.append(dict(step=(r + 1) * setup.inner_steps, loss=data.loss(models[0], data.curve_windows)))
        _progress(arm, r, setup.rounds, curve[-1]["loss"])
    if in_flight is not None:  # the last all-reduce lands: G_R
        outer.step(unflatten(in_flight, outer.params()))
    outer.load_into(models[0])
    params = theta_0.numel()
    share = (setup.workers - 1) / setup.workers
    return dict(
        model=models[0], curve=curve, theta_hash=outer.theta_hash(),
        bytes_sent_per_peer=round(share * (setup.rounds * contribution_bytes + sum(averaged_bytes))),
        contribution_bytes=contribution_bytes, averaged_bytes=averaged_bytes,
        contribution_bits_per_param=8 * contribution_bytes / params,
        averaged_bits_per_param=8 * sum(averaged_bytes) / len(averaged_bytes) / params,
    )


def _train_corrected(trainer, model: torch.nn.Module, batches: list, steps: int, arrival: int, start: torch.Tensor,
                     landed: torch.Tensor):
    """The correction on arrival: ``arrival`` inner steps from the eager ``start``, then θ_local is shifted by the
    stand-in's error (``landed`` − ``start``, ``landed`` = G_r: the θ the round before's average landed on) and
    trains the rest of the round from there, its AdamW state kept. The peer's Δ is then measured from G_r."""
    from template.training.inner import InnerStats

    first = trainer.train(batches[:arrival], arrival)
    with torch.no_grad():
        for p, shift in zip(model.parameters(), unflatten(landed - start, list(model.parameters())), strict=True):
            p.add_(shift)
    rest = trainer.train(batches[arrival:], steps - arrival)
    return InnerStats(steps=first.steps + rest.steps, tokens=first.tokens + rest.tokens, mean_loss=None,
                      last_loss=rest.last_loss, seconds=first.seconds + rest.seconds)


def _progress(arm: Arm, r: int, rounds: int, loss: float) -> None:
    """A line on stderr every tenth of the run (arms train in worker processes, where logging is not set up)."""
    if (r + 1) % max(rounds // 10, 1) == 0:
        print(f"{time.strftime('%H:%M:%S')} {arm.name}: round {r + 1}/{rounds}, held-out loss {loss:.4f}",
              file=sys.stderr, flush=True)


def _load_flat(model: torch.nn.Module, flat: torch.Tensor, like: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, value in zip(model.parameters(), unflatten(flat, like), strict=True):
            p.copy_(value)


def run_arm(setup: Setup, arm: Arm) -> dict[str, Any]:
    """Train one arm from θ_0 and return its held-out losses (runs in a worker process, one torch thread)."""
    from template.training.inner import InnerConfig, InnerTrainer

    torch.set_num_threads(1)
    started = time.monotonic()
    data = _Data(setup)
    extra: dict[str, Any] = {}
    if arm.kind == "diloco":
        extra = run_diloco(setup, arm, data)
        model, curve, theta_hash = extra.pop("model"), extra.pop("curve"), extra.pop("theta_hash")
    else:
        model = data.build_model()
        trainer = InnerTrainer(model, InnerConfig(), "cpu")
        curve = []
        for r in range(setup.rounds):
            if arm.kind == "single":
                batches = data.worker_batches(0, r)
            else:  # dp: step k takes the k-th batch of every worker, concatenated
                per_worker = [data.worker_batches(worker, r) for worker in range(setup.workers)]
                batches = [(torch.cat([b[k][0] for b in per_worker]), torch.cat([b[k][1] for b in per_worker]))
                           for k in range(setup.inner_steps)]
            trainer.train(batches, setup.inner_steps)
            curve.append(dict(step=(r + 1) * setup.inner_steps, loss=data.loss(model, data.curve_windows)))
            _progress(arm, r, setup.rounds, curve[-1]["loss"])
        theta_hash = None
    params = sum(p.numel() for p in model.parameters())
    workers = 1 if arm.kind == "single" else setup.workers
    tokens = setup.steps_per_worker * setup.batch_size * setup.seq_len * workers
    communications = {"dp": setup.steps_per_worker, "single": 0, "diloco": setup.rounds}[arm.kind]
    if arm.kind == "dp":  # float32 gradients through a ring/butterfly every step
        extra["bytes_sent_per_peer"] = round(communications * butterfly_bytes(params, setup.workers, 4.0))
    elif arm.kind == "single":
        extra["bytes_sent_per_peer"] = 0
    described = asdict(arm) if arm.kind == "diloco" else dict(name=arm.name, kind=arm.kind)
    return dict(
        described, final_heldout_loss=data.loss(model, data.eval_windows), curve=curve,
        steps_per_worker=setup.steps_per_worker, tokens=tokens, communications=communications, params=params,
        seconds=round(time.monotonic() - started, 1), theta_hash=theta_hash, **extra,
    )


def run_engine(setup: Setup, arm: Arm, timeout_s: float, matchmaking_time: float) -> dict[str, Any]:
    """The same DiLoCo run through the real engine (peer processes, hivemind all-reduce); evaluate peer 0's θ.
    An overlapped arm (:func:`engine_arm`) runs the engine overlapped, against the exact arm's blocking rounds."""
    from template.training.checkpoint import load_latest_checkpoint
    from template.training.outer import OuterOptimizer

    args = ["--run-id", f"conv{arm.codec}", "--preset", setup.model, "--data", setup.data,
            "--seq-len", str(setup.seq_len), "--batch-size", str(setup.batch_size),
            "--inner-steps", str(setup.inner_steps), "--rounds", str(setup.rounds), "--run-seed", str(setup.run_seed),
            "--init-seed", str(setup.init_seed), "--outer-lr", str(arm.outer_lr),
            "--outer-momentum", str(arm.outer_momentum), "--compression", arm.codec, "--heldout-batches", "0",
            "--matchmaking-time", str(matchmaking_time), "--join-timeout", "60",
            "--no-overlap" if arm.overlap == "blocking" else "--overlap"]  # the exact arm waits for every all-reduce
    with tempfile.TemporaryDirectory(prefix="bench-conv-") as out:
        run = run_peers(setup.workers, args, Path(out), timeout_s, threads=1)
        result: dict[str, Any] = dict(asdict(arm), seconds=round(run.seconds, 1), finished=run.finished,
                                      errors=run.errors)
        failed = [e for events in run.rounds.values() for e in events if not e["allreduce_ok"]]
        result["failed_allreduces"] = len(failed)
        result["failures"] = [dict(peer=e["peer_key"], round=e["round"], reason=e["reason"]) for e in failed]
        result["theta_identical_across_peers"] = len({e["theta_hash"] for e in run.done.values()}) == 1
        # overlap: after how many of the next round's inner steps each average landed (null: after its training)
        result["landed_after_steps"] = sorted(Counter(e.get("landed_after_steps") for events in run.rounds.values()
                                                      for e in events).items(), key=lambda kv: (kv[0] is None, kv[0]))
        checkpoint = load_latest_checkpoint(Path(out) / "peer0")
        if not run.finished or checkpoint is None or checkpoint.round != setup.rounds:
            return result
    torch.set_num_threads(1)
    data = _Data(setup)
    model = data.build_model()
    outer = OuterOptimizer(model, arm.outer_config())  # the checkpoint's momentum state has this optimizer's shape
    outer.load_state_dict({k[len("outer."):]: v for k, v in checkpoint.tensors.items() if k.startswith("outer.")})
    outer.load_into(model)
    result.update(final_heldout_loss=data.loss(model, data.eval_windows), theta_hash=outer.theta_hash(),
                  allreduce_s_median=median([e["allreduce_s"] for events in run.rounds.values() for e in events]))
    return result


def outer_of(codec: str, given: list[tuple[float, float]]) -> tuple[float, float]:
    """The outer step of a ``codec`` arm: the first ``--outer`` pair when given, else what the engine uses for that
    codec (``PLAIN_OUTER`` for sparse, ``OuterConfig()`` for the dense codecs)."""
    from template.training.outer import default_outer

    if given:
        return given[0]
    default = default_outer(codec)
    return default.lr, default.momentum


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
    parser.add_argument("--codecs", default="none,fp16,int8",
                        help="DiLoCo arms, one per codec of none,fp16,int8,sparse (first = headline)")
    parser.add_argument("--outer", default="",
                        help="outer lr:momentum pairs; the first is every arm's (default: each codec's own, 0.7:0.9 "
                             "dense, 1.0:0 sparse), the others are a sweep (codec none)")
    defaults = SparseSettings()
    parser.add_argument("--sparse-k", type=int, default=defaults.k, help="entries kept per chunk")
    parser.add_argument("--sparse-chunk", type=int, default=defaults.chunk, help="values per chunk")
    parser.add_argument("--sparse-bits", type=int, default=defaults.bits, help="bits per kept value")
    parser.add_argument("--sparse-quantizer", default=defaults.quantizer, choices=["signmag", "uniform"])
    parser.add_argument("--no-error-feedback", action="store_true", help="sparse senders keep no residual")
    parser.add_argument("--sparse-mean-of", default=defaults.mean_of, choices=SPARSE_MEANS,
                        help="an averaged value: over the senders that kept it (kept) or over all senders (all)")
    parser.add_argument("--sparse-feedback-decay", type=float, default=defaults.feedback_decay,
                        help="β of the error feedback, e ← β·e + Δ before each encoding (1.0 keeps all)")
    parser.add_argument("--sweep", action="store_true",
                        help="one sparse arm per setting of --sweep-k × --sweep-bits × --sweep-decay (chunk 4096, "
                             "outer step from --outer), beside diloco_none (replaces --codecs, skips dp and single; "
                             "--no-reference-arms skips diloco_none too)")
    parser.add_argument("--sweep-k", default=SWEEP_K, help="sweep: entries kept per 4096-value chunk, comma-separated")
    parser.add_argument("--sweep-bits", default=SWEEP_BITS, help="sweep: bits per kept value, comma-separated")
    parser.add_argument("--sweep-decay", default=SWEEP_DECAY,
                        help="sweep: error-feedback β values, comma-separated; off = no residual")
    parser.add_argument("--no-reference-arms", action="store_true",
                        help="skip dp and single (they do not depend on codecs; deterministic, so earlier runs hold)")
    parser.add_argument("--overlap", default="",
                        help="codecs that also get overlapped-all-reduce arms (--overlap-modes), e.g. fp16,sparse")
    parser.add_argument("--overlap-modes", default=",".join(OVERLAP_MODES[1:]),
                        help=f"which overlap arms --overlap adds, of {','.join(OVERLAP_MODES[1:])}")
    parser.add_argument("--arrival-steps", default="",
                        help="corrected arms: the inner steps of a round at which the round before's average lands, "
                             "comma-separated, one arm each (default H/2)")
    parser.add_argument("--engine", choices=["exact", "hivemind", "both"], default="exact")
    parser.add_argument("--engine-codec", default="fp16", help="codec of the hivemind-engine run")
    parser.add_argument("--engine-overlap", action="store_true",
                        help="the hivemind-engine run overlaps (compared with the exact arm, which blocks)")
    parser.add_argument("--engine-matchmaking-time", type=float, default=None,
                        help="seconds a hivemind-engine round waits for its group (default 5; --quick 2). Overlapped "
                             "peers run free without a chain clock: give it about a round's training, or a peer "
                             "that falls behind by more misses the group")
    parser.add_argument("--jobs", type=int, default=None, help="arms trained in parallel (default 2; --quick 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound of the hivemind-engine run, seconds")
    return parser


def engine_arm(args: argparse.Namespace, outer_lr: float, outer_momentum: float) -> Arm:
    """The hivemind engine's arm; overlapped, it is the engine's correction on arrival (landing when the machine's
    timing lets it: its result's ``landed_after_steps``), summarised against the blocking arm of its codec."""
    overlap = "corrected" if args.engine_overlap else "blocking"
    name = f"hivemind_{args.engine_codec}{'_overlap' if args.engine_overlap else ''}"
    return Arm(name, "diloco", args.engine_codec, outer_lr, outer_momentum, overlap=overlap)


def build_arms(args: argparse.Namespace) -> tuple[list[Arm], list[str]]:
    """The arms a command line asks for, and the codecs of the plain ``diloco_<codec>`` arms."""
    outer = parse_outer(args.outer) if args.outer else []
    sparse = SparseSettings(chunk=args.sparse_chunk, k=args.sparse_k, bits=args.sparse_bits,
                            quantizer=args.sparse_quantizer, error_feedback=not args.no_error_feedback,
                            feedback_decay=args.sparse_feedback_decay, mean_of=args.sparse_mean_of)

    def diloco(codec: str, name: str = "", overlap: str = "blocking", settings: SparseSettings = sparse) -> Arm:
        return Arm(name or f"diloco_{codec}", "diloco", codec, *outer_of(codec, outer),
                   settings if codec == "sparse" else None, overlap)

    if args.sweep:
        codecs = [] if args.no_reference_arms else ["none"]
        arms = [diloco(c) for c in codecs]
        arms += [diloco("sparse", f"diloco_sparse_k{k}_b{bits}_ef{decay}", settings=settings)
                 for k, bits, decay, settings in sweep_settings(args, sparse)]
    else:
        codecs = args.codecs.split(",")
        arms = [] if args.no_reference_arms else [Arm("dp", "dp"), Arm("single", "single")]
        arms += [diloco(c) for c in codecs]
        arms += [Arm(f"diloco_none_lr{lr_}_m{m}", "diloco", "none", lr_, m) for lr_, m in outer[1:]]
    for codec in filter(None, args.overlap.split(",")):
        if codec not in codecs:
            arms.append(diloco(codec))
        for mode in args.overlap_modes.split(","):
            if mode != "corrected":
                arms.append(diloco(codec, f"diloco_{codec}_{mode}", mode))
                continue
            for arrival in arrival_steps(args):
                arms.append(replace(diloco(codec, f"diloco_{codec}_corrected_at{arrival}", mode), arrival=arrival))
    return arms, codecs


def arrival_steps(args: argparse.Namespace) -> list[int]:
    """The arrival points of the corrected arms, inside the round (at 0 a corrected arm would be the blocking one, at
    H the eager one); a bad value exits with its reason."""
    try:
        steps = [int(k) for k in args.arrival_steps.split(",")] if args.arrival_steps else [args.inner_steps // 2]
    except ValueError as exc:
        raise SystemExit(f"bad --arrival-steps: {exc}") from exc
    if not all(0 < k < args.inner_steps for k in steps):
        raise SystemExit(f"bad --arrival-steps: each must lie strictly between 0 and H = {args.inner_steps}, "
                         f"got {steps}")
    return steps


def sweep_settings(args: argparse.Namespace, base: SparseSettings) -> list[tuple[int, int, str, SparseSettings]]:
    """The sweep's grid: (k, bits, β, settings) for each setting, the rest of ``base`` kept; a bad value exits with
    the setting it names."""
    grid = []
    try:
        for k in (int(v) for v in args.sweep_k.split(",")):
            for bits in (int(v) for v in args.sweep_bits.split(",")):
                for decay in args.sweep_decay.split(","):
                    feedback = (dict(error_feedback=False) if decay == "off"
                                else dict(error_feedback=True, feedback_decay=float(decay)))
                    grid.append((k, bits, decay, replace(base, chunk=4096, k=k, bits=bits, segment_values=None,
                                                         **feedback)))
    except ValueError as exc:
        raise SystemExit(f"bad sweep setting: {exc}") from exc
    return grid


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_benchmark_args(parser, argv, inner_steps=(50, 4), rounds=(6, 2), seq_len=(64, 32),
                                batch_size=(8, 2), eval_windows=(512, 16), jobs=(2, 1))
    if set(args.overlap_modes.split(",")) - set(OVERLAP_MODES[1:]):
        parser.error(f"--overlap-modes takes {','.join(OVERLAP_MODES[1:])}, got {args.overlap_modes}")
    quick = args.quick
    setup = Setup(
        data=args.data, model=args.preset, workers=args.workers, inner_steps=args.inner_steps, rounds=args.rounds,
        seq_len=args.seq_len, batch_size=args.batch_size, eval_windows=args.eval_windows,
        curve_windows=8 if quick else 128,
    )
    arms, codecs = build_arms(args)
    headline_lr, headline_momentum = outer_of(args.engine_codec, parse_outer(args.outer) if args.outer else [])
    result: dict[str, Any] = dict(benchmark="convergence", machine=machine_info(), quick=quick, engine=args.engine,
                                  settings=dict(asdict(setup), data=data_name(setup.data), codecs=codecs,
                                                outer={c: outer_of(c, parse_outer(args.outer) if args.outer else [])
                                                       for c in codecs}, sweep=args.sweep,
                                                overlap=args.overlap, steps_per_worker=setup.steps_per_worker))
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
        arm = engine_arm(args, headline_lr, headline_momentum)
        matchmaking_time = args.engine_matchmaking_time or (2.0 if quick else 5.0)
        engine = run_engine(setup, arm, args.timeout, matchmaking_time)
        exact = arm_results.get(f"diloco_{args.engine_codec}")
        if exact is not None and "final_heldout_loss" in engine:
            engine["loss_over_exact"] = engine["final_heldout_loss"] / exact["final_heldout_loss"]
            if not args.engine_overlap:  # overlapped, θ differs from blocking's by design
                engine["theta_bit_identical_to_exact"] = engine["theta_hash"] == exact["theta_hash"]
        arm_results[arm.name] = engine
    result["arms"] = arm_results
    result["summary"] = summarize(arm_results, codecs)
    result["seconds"] = round(time.monotonic() - started, 1)
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
