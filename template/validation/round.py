"""One round of scoring: from the miners' fetched pseudo-gradients to one round score per miner, with reasons.

Order of the checks (each failing miner gets a round score of 0 and the first reason that applies):

1. fetched at all (a miner that publishes nothing earns nothing);
2. started from the validator's θ_r (base-θ hash), signed within the round's publication window;
3. the model's shapes, finite values (:func:`~template.validation.integrity.check_tensors`);
4. a plausible norm relative to the round (:func:`~template.validation.integrity.check_norm`);
5. not a replay of an earlier round's Δ or Δ̄, and not the round's own Δ̄ re-published (when the miner did not
   contribute most of Δ̄ itself);
6. the loss measures (:mod:`~template.validation.scoring`): the general improvement and the evidence of training on
   the assigned data, against the mean of the round's other helpful submissions as the reference update;
   then copies between miners of this round (the later publisher is the copier);
7. quality = general improvement × coverage, the fraction of the round's averaged segments that include the
   miner's contribution (as the validator saw the all-reduce): a Δ that did not reach the shared model earned nothing
   for it, whatever it would have been worth. The evidence goes with the quality to the score book
   (:mod:`~template.validation.rewards`), which turns both into the round's credit.

The scorer keeps the sketches of the last ``history_rounds`` rounds for replay detection, and can persist them
(safetensors, atomic) so a restarted validator still recognizes replays.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from template.validation.integrity import (
    IntegrityConfig,
    Sketch,
    Submission,
    check_norm,
    check_tensors,
    cosine,
    find_copies,
    find_replays,
    reference_norm,
    total_norm,
)
from template.validation.rewards import RoundScore
from template.validation.scoring import (
    LossGains,
    LossProbe,
    ScoringConfig,
    WindowSampler,
    loss_gains,
    mean_over,
    update_losses,
)

Tensors = Sequence[torch.Tensor]
# A miner's own share of Δ̄ above which Δ̄ is mostly its own Δ (then similarity to Δ̄ proves nothing).
OWN_SHARE_OF_AVERAGE = 0.5


@dataclass(frozen=True)
class Candidate:
    """One miner's submission for the round, as fetched (or why it could not be)."""

    hotkey: str
    uid: int
    tensors: list[torch.Tensor] | None
    base_theta_hash: str = ""
    published_at_block: int = 0
    fetch_error: str = ""  # non-empty when nothing usable was fetched
    coverage: float | None = None  # share of the round's averaged segments that include it; None when unknown
    share_of_average: float = 0.0  # its token weight / the group's total weight


@dataclass(frozen=True)
class Verdict:
    hotkey: str
    uid: int
    quality: float  # ≥ 0: the general improvement × coverage, 0 on a failed check
    reason: str  # "" when every check passed
    gains: LossGains | None = None
    norm: float = 0.0
    coverage: float | None = None

    def round_score(self) -> RoundScore:
        """What the score book needs: the quality, and the evidence when every check passed (else none)."""
        if self.reason or self.gains is None:
            return RoundScore(0.0, None, self.reason)
        return RoundScore(self.quality, (self.gains.evidence, self.gains.evidence_se), self.reason)


@dataclass(frozen=True)
class RoundContext:
    """What the validator knows of round r: θ_r, its hash, Δ̄ (None if its all-reduce failed), the block window."""

    round: int
    theta: list[torch.Tensor]
    theta_hash: str
    averaged: list[torch.Tensor] | None
    first_block: int  # a publication of round r cannot be signed before the round began
    last_block: int  # ... or after the validator fetched it


class RoundScorer:
    def __init__(self, probe: LossProbe, sampler: WindowSampler, shapes: Sequence[torch.Size], *,
                 integrity: IntegrityConfig, scoring: ScoringConfig, sketch_seed: int, history_rounds: int = 3):
        self.probe = probe
        self.sampler = sampler
        self.shapes = [torch.Size(s) for s in shapes]
        self.integrity = integrity
        self.scoring = scoring
        self.sketch = Sketch(self.shapes, integrity.sketch_size, sketch_seed)
        self.history_rounds = history_rounds
        self.history: dict[str, torch.Tensor] = {}  # "round|label" -> sketch

    def score(self, context: RoundContext, candidates: Sequence[Candidate],
              out_of_time: Callable[[], bool] = lambda: False,
              standing: Callable[[str, float, float], float] | None = None) -> list[Verdict]:
        """A verdict per candidate, in the candidates' order. ``out_of_time`` is polled before each loss probe;
        candidates not probed in time get the reason "not evaluated in time" and score 0 (rotation retries them).
        ``standing(hotkey, evidence, se)`` is a miner's evidence over the rounds (the score book's); near-copies
        signed at the same block are told apart by it (this round's significance alone when it is None)."""
        reasons: dict[str, str] = {}
        for c in candidates:
            if reason := self._basic_problem(context, c):
                reasons[c.hotkey] = reason
        valid = [c for c in candidates if c.hotkey not in reasons]
        norms = {c.hotkey: total_norm(c.tensors) for c in valid}
        reference = reference_norm(list(norms.values()))
        sketches = {c.hotkey: self.sketch.of(c.tensors) for c in valid}
        average_sketch = self.sketch.of(context.averaged) if context.averaged is not None else None
        earlier = [(label.split("|", 1)[1] + f" of round {label.split('|', 1)[0]}", sketch)
                   for label, sketch in self.history.items() if int(label.split("|", 1)[0]) < context.round]
        for c in valid:
            sketch = sketches[c.hotkey]
            if reason := check_norm(norms[c.hotkey], reference, self.integrity):
                reasons[c.hotkey] = reason
            elif replayed := find_replays(sketch, earlier, self.integrity.copy_cosine):
                reasons[c.hotkey] = f"replays the Δ of {replayed}"
            elif (average_sketch is not None and c.share_of_average < OWN_SHARE_OF_AVERAGE
                  and cosine(sketch, average_sketch) >= self.integrity.copy_cosine):
                reasons[c.hotkey] = "re-publishes the group's average Δ̄"

        gains = self._probe(context, [c for c in valid if c.hotkey not in reasons], sketches, reasons, out_of_time)
        def evidence(hotkey: str) -> float:
            g = gains[hotkey]
            return standing(hotkey, g.evidence, g.evidence_se) if standing is not None else g.z

        probed = [Submission(c.hotkey, sketches[c.hotkey], c.published_at_block, evidence(c.hotkey))
                  for c in valid if c.hotkey in gains]
        for copier, original in find_copies(probed, self.integrity.copy_cosine).items():
            reasons[copier] = f"copy of {original}'s Δ"

        self._remember(context, sketches, average_sketch)
        verdicts = []
        for c in candidates:
            g = gains.get(c.hotkey)
            quality = 0.0
            if c.hotkey not in reasons and g is not None:
                quality = max(0.0, g.general) * (1.0 if c.coverage is None else c.coverage)
            verdicts.append(Verdict(c.hotkey, c.uid, quality, reasons.get(c.hotkey, ""), g,
                                    norms.get(c.hotkey, 0.0), c.coverage))
        return verdicts

    def _basic_problem(self, context: RoundContext, c: Candidate) -> str | None:
        if c.fetch_error or c.tensors is None:
            return f"not fetched: {c.fetch_error or 'nothing published'}"
        if c.base_theta_hash != context.theta_hash:
            return (f"trained from θ {c.base_theta_hash[:12]}, "
                    f"round {context.round} started from {context.theta_hash[:12]}")
        if not context.first_block <= c.published_at_block <= context.last_block:
            return (f"signed at block {c.published_at_block}, outside the round's window "
                    f"[{context.first_block}, {context.last_block}]")
        return check_tensors(c.tensors, self.shapes)

    def _probe(self, context: RoundContext, candidates: Sequence[Candidate], sketches: Mapping[str, torch.Tensor],
               reasons: dict[str, str], out_of_time: Callable[[], bool]) -> dict[str, LossGains]:
        """The loss measures of every candidate (:mod:`~template.validation.scoring`). First each update on its
        windows (its general improvement decides whether it may serve in others' references), then each
        candidate's reference on the same windows: 1 + 2N model loads, 4 × ``eval_windows`` windows per miner."""
        if not candidates:
            return {}
        n, eta = self.scoring.eval_windows, self.scoring.step_scale
        pool = self.sampler.unassigned(context.round, n)
        baseline = update_losses(self.probe, context.theta, None, pool, eta)
        windows: dict[str, tuple[list[int], list[int]]] = {}
        after: dict[str, dict[int, float]] = {}
        for c in candidates:
            if out_of_time():
                reasons[c.hotkey] = "not evaluated in time"
                continue
            assigned, excluded = self.sampler.assigned(c.hotkey, context.round, n)
            windows[c.hotkey] = assigned, [w for w in pool if w not in excluded][:n]
            after[c.hotkey] = update_losses(self.probe, context.theta, c.tensors, [*assigned, *windows[c.hotkey][1]],
                                            eta)
        helpful = [c for c in candidates if c.hotkey in after
                   and mean_over(baseline, windows[c.hotkey][1]) > mean_over(after[c.hotkey], windows[c.hotkey][1])]
        gains = {}
        for c in candidates:
            if c.hotkey not in after:
                continue
            if out_of_time():
                reasons[c.hotkey] = "not evaluated in time"
                continue
            others = [o.tensors for o in helpful if o.hotkey != c.hotkey
                      and cosine(sketches[o.hotkey], sketches[c.hotkey]) < self.integrity.copy_cosine]
            mean = [torch.stack([t[i].float() for t in others]).mean(0) for i in range(len(c.tensors))] if others \
                else None
            assigned, unassigned = windows[c.hotkey]
            reference = update_losses(self.probe, context.theta, mean, [*assigned, *unassigned], eta)
            gains[c.hotkey] = loss_gains(after[c.hotkey], reference, baseline, assigned, unassigned, self.scoring)
        return gains

    def _remember(self, context: RoundContext, sketches: Mapping[str, torch.Tensor],
                  average_sketch: torch.Tensor | None) -> None:
        for hotkey, sketch in sketches.items():
            self.history[f"{context.round}|{hotkey}"] = sketch
        if average_sketch is not None:
            self.history[f"{context.round}|the group's average"] = average_sketch
        oldest = context.round - self.history_rounds + 1
        self.history = {k: v for k, v in self.history.items() if int(k.split("|", 1)[0]) >= oldest}

    def save_history(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        save_file({k: v.contiguous() for k, v in self.history.items()}, str(tmp), metadata={"saved": str(time.time())})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load_history(self, path: str | Path) -> None:
        """Load saved sketches (own file, safetensors: no code runs); a missing file is an empty history."""
        path = Path(path)
        if path.exists():
            self.history = {k: v for k, v in load_file(str(path)).items() if v.numel() == self.sketch.size}
