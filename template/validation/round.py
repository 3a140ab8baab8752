"""One round of scoring: from the miners' fetched pseudo-gradients to one round score per miner, with reasons.

Order of the checks (each failing miner gets a round score of 0 and the first reason that applies):

1. fetched at all (a miner that publishes nothing earns nothing);
2. started from the validator's θ_r (base-θ hash), signed within the round's publication window;
3. the model's shapes, finite values (:func:`~template.validation.integrity.check_tensors`);
4. a plausible norm relative to the round (:func:`~template.validation.integrity.check_norm`);
5. not a replay of an earlier round's Δ or Δ̄, and not the round's own Δ̄ re-published (when the miner did not
   contribute most of Δ̄ itself);
6. the loss measure (:mod:`~template.validation.scoring`): every miner's credit beyond the best free update, all on the
   same windows, at the update's share of the step, and its own end-of-round model not significantly worse than θ_r on
   other data (an overfitter's is); then copies between miners of this round (a paired
   test on a sample of each one's assigned windows says which of two near-copies was trained on its own data; the
   earlier signature decides when it cannot);
7. quality = credit × significance × coverage × share: significance is 1 for a credit at least 2 standard errors
   above 0, 0 up to 1 standard error, linear between (:func:`~template.validation.scoring.significant_credit`);
   coverage is the fraction of the round's averaged segments that include the miner's contribution (as the validator
   saw the all-reduce) — a Δ that did not reach the shared model earned nothing for it, whatever it would have been
   worth; share is the tokens it announced to the group relative to the lower median of the group's announcements
   (a full assignment when most miners train theirs; at most 1), so a miner that trained a fraction f of its steps,
   and said so, is paid for the fraction of the step its update took in the average. The score book
   (:mod:`~template.validation.rewards`) turns qualities into weights.

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
from template.validation.scoring import (
    FreeUpdate,
    LossProbe,
    ScoringConfig,
    UpdateGains,
    WindowSampler,
    free_update,
    mean_update,
    overfit,
    own_model_unclear,
    paired_edge_z,
    significant_credit,
    update_gains,
    update_losses,
)

Tensors = Sequence[torch.Tensor]
# A miner's own share of Δ̄ above which Δ̄ is mostly its own Δ (then similarity to Δ̄ proves nothing).
OWN_SHARE_OF_AVERAGE = 0.5
# Near-copies are told apart on this many times a round's scoring sample (per miner of the pair), in full step.
COPY_SAMPLE_FACTOR = 2
COPY_STEP = 1.0


@dataclass(frozen=True)
class Candidate:
    """One miner's submission for the round, as fetched (or why it could not be)."""

    hotkey: str
    uid: int
    tensors: list[torch.Tensor] | None
    base_theta_hash: str = ""
    published_at_block: int = 0
    fetch_error: str = ""  # non-empty when nothing usable was fetched
    refused: str = ""  # non-empty when what was fetched convicts the miner (not its contribution, or the audit)
    coverage: float | None = None  # share of the round's averaged segments that include it; None when unknown
    share_of_average: float = 0.0  # its token weight / the group's total weight
    token_share: float | None = None  # its tokens / the lower median of the group's, at most 1; None when unknown


@dataclass(frozen=True)
class Verdict:
    hotkey: str
    uid: int
    quality: float  # ≥ 0: significant credit × coverage × share, 0 on a failed check
    reason: str  # "" when every check passed
    gains: UpdateGains | None = None
    norm: float = 0.0
    coverage: float | None = None
    share: float | None = None  # its tokens relative to a full assignment's, at most 1 (None: unknown)
    forfeits: bool = False  # its own model was significantly worse than θ_r: what it earned before is forfeit


@dataclass(frozen=True)
class RoundContext:
    """What the validator knows of round r: θ_r, the hash of the θ its publications must name, Δ̄_r (None if its
    all-reduce failed), the block window, and Δ̄_{r−1}, the freshest average every miner held for free when it
    committed (None when the validator did not apply it). With overlap θ is the θ Δ̄_r was applied to (G_r) and the
    hash names the θ round r trained from (G_{r−1}); blocking, both are θ_r."""

    round: int
    theta: list[torch.Tensor]
    theta_hash: str
    averaged: list[torch.Tensor] | None
    first_block: int  # a publication of round r cannot be signed before the round began
    last_block: int  # ... or after the validator fetched it
    previous_average: list[torch.Tensor] | None = None
    contributors: int = 0  # N: members of the round's all-reduce with a positive weight (0: unknown)

    def step(self, candidates: Sequence[Candidate], scale: float) -> float:
        """η: ``scale`` × an equal share of the round's step (1/N; N = the probed candidates when unknown)."""
        return scale / max(1, self.contributors or len(candidates))


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
        self.last_free_scale: float | None = None  # c of the last scored round's best free update (None: none)

    def score(self, context: RoundContext, candidates: Sequence[Candidate],
              out_of_time: Callable[[], bool] = lambda: False) -> list[Verdict]:
        """A verdict per candidate, in the candidates' order. ``out_of_time`` is polled before each loss probe;
        candidates not probed in time get the reason "not evaluated in time" and score 0 (rotation retries them)."""
        reasons: dict[str, str] = {}
        for c in candidates:
            if reason := self._basic_problem(context, c):
                reasons[c.hotkey] = reason
        valid = [c for c in candidates if c.hotkey not in reasons]
        norms = {c.hotkey: total_norm(c.tensors) for c in valid}
        # The reference is set by the miners that announced a full assignment: a partial miner's update is shorter by
        # design, and two of them beside a miner whose contribution was lost pulled it below a third of the two honest
        # miners' norms (fairness benchmark), which were then refused as "over 3x"
        full = [norms[c.hotkey] for c in valid if c.token_share is None or c.token_share >= 1.0]
        reference = reference_norm(full) or reference_norm(list(norms.values()))
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

        probed = [c for c in valid if c.hotkey not in reasons]
        gains, helpful, free = self._probe(context, probed, reasons, out_of_time)
        self.last_free_scale = free.scale if free else None
        submissions = [Submission(c.hotkey, sketches[c.hotkey], c.published_at_block, c.share_of_average > 0)
                       for c in probed if c.hotkey in gains]
        by_hotkey = {c.hotkey: c for c in probed}

        def paired(a: Submission, b: Submission) -> float:
            if out_of_time():
                return 0.0  # no time left for the paired test: the signatures' blocks decide
            others = [by_hotkey[h].tensors for h in helpful
                      if h not in (a.hotkey, b.hotkey) and cosine(sketches[h], a.sketch) < self.integrity.copy_cosine]
            return self._paired_z(context, by_hotkey[a.hotkey].tensors, others, a.hotkey, b.hotkey)

        for copier, original in find_copies(submissions, self.integrity.copy_cosine, paired).items():
            reasons[copier] = f"copy of {original}'s Δ"

        self._remember(context, sketches, average_sketch)
        verdicts = []
        for c in candidates:
            g = gains.get(c.hotkey)
            quality = 0.0
            if c.hotkey not in reasons and g is not None:
                share = 1.0 if c.token_share is None else c.token_share
                quality = significant_credit(g, self.scoring) * (1.0 if c.coverage is None else c.coverage) * share
            verdicts.append(Verdict(c.hotkey, c.uid, quality, reasons.get(c.hotkey, ""), g,
                                    norms.get(c.hotkey, 0.0), c.coverage, c.token_share,
                                    forfeits=g is not None and overfit(g, self.scoring)))
        return verdicts

    def _basic_problem(self, context: RoundContext, c: Candidate) -> str | None:
        if c.refused:
            return c.refused
        if c.fetch_error or c.tensors is None:
            return f"not fetched: {c.fetch_error or 'nothing published'}"
        if c.base_theta_hash != context.theta_hash:
            return (f"trained from θ {c.base_theta_hash[:12]}, "
                    f"round {context.round} started from {context.theta_hash[:12]}")
        if not context.first_block <= c.published_at_block <= context.last_block:
            return (f"signed at block {c.published_at_block}, outside the round's window "
                    f"[{context.first_block}, {context.last_block}]")
        return check_tensors(c.tensors, self.shapes)

    def _probe(self, context: RoundContext, candidates: Sequence[Candidate], reasons: dict[str, str],
               out_of_time: Callable[[], bool]) -> tuple[dict[str, UpdateGains], list[str], FreeUpdate | None]:
        """The credit of every candidate (:mod:`~template.validation.scoring`), all on the same scoring windows, and the
        hotkeys of the helpful ones (gain > 0); a candidate whose own model θ_r − Δ is significantly worse than θ_r gets
        a reason. The free updates are loaded once each, then each candidate's Δ twice (at η and at the full step): up
        to 2 + len(free_scales) + 2N model loads (a load of a large model costs seconds)."""
        if not candidates:
            return {}, [], None
        config = self.scoring
        assigned: set[int] = set()
        for c in candidates:
            assigned |= self.sampler.assigned(c.hotkey, context.round, 0)[1]
        drawn = self.sampler.unassigned(context.round, config.eval_windows + config.pick_windows, assigned)
        scoring, pick = drawn[:config.eval_windows], drawn[config.eval_windows:]
        step = context.step(candidates, config.step_scale)
        free = free_update(self.probe, context.theta, context.previous_average, pick, scoring, step, config)
        gains = {}
        for c in candidates:
            if out_of_time():
                reasons[c.hotkey] = "not evaluated in time"
                continue
            after = update_losses(self.probe, context.theta, c.tensors, scoring, step)
            own_model = update_losses(self.probe, context.theta, c.tensors, scoring[:config.own_model_windows], 1.0)
            g = update_gains(after, own_model, free, scoring)
            if own_model_unclear(g, config):  # a larger sample decides
                more = [*scoring[config.own_model_windows:], *pick][:config.own_model_recheck_windows]
                own_model |= update_losses(self.probe, context.theta, c.tensors, more, 1.0)
                g = update_gains(after, own_model, free, scoring)
            gains[c.hotkey] = g
            if overfit(g, config):
                reasons[c.hotkey] = (f"its own model θ_r − Δ is worse than θ_r on other data by "
                                     f"{-g.own_model_gain:.3g} ± {g.own_model_se:.2g} nats: overfit or badly trained "
                                     f"(its earlier credit is forfeit)")
        return gains, [hotkey for hotkey, g in gains.items() if g.gain > 0], free

    def _paired_z(self, context: RoundContext, update: Tensors, others: Sequence[Tensors], a: str, b: str) -> float:
        """Which of two near-identical submissions was trained, and which copied: ``update`` (either of them — they
        are the same model) against the mean of the round's other helpful updates, per window, on a fresh sample of
        ``COPY_SAMPLE_FACTOR`` × ``eval_windows`` of a's assigned windows and as many of b's. The update was trained
        on one of the two assignments, so its edge is larger there: the result is the significance of
        (mean edge on a's windows − mean edge on b's), positive when a is the original. Paired on one model and one
        reference, it tells them apart where two separate measurements (each ± its own noise) often cannot; it
        costs two model loads per pair found, at the full step (a model trained on its windows fits them)."""
        count, eta = COPY_SAMPLE_FACTOR * self.scoring.eval_windows, COPY_STEP
        windows_a = self.sampler.assigned(a, context.round, count, salt="copy")[0]
        windows_b = self.sampler.assigned(b, context.round, count, salt="copy")[0]
        every = [*windows_a, *windows_b]
        after = update_losses(self.probe, context.theta, update, every, eta)
        reference = update_losses(self.probe, context.theta, mean_update(others), every, eta)
        return paired_edge_z(after, reference, windows_a, windows_b, self.scoring)

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
