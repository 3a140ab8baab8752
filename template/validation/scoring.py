"""Loss-based measure of one pseudo-gradient: what it adds to the shared model beyond what any miner has for free.

What every miner holds without training: θ_r and the past averages Δ̄ (the freshest, Δ̄_{r−1}, is what a copier
re-publishes). For round r the validator picks, among the *free updates* F_c = c·Δ̄_{r−1} for c in
``ScoringConfig.free_scales`` (c = 0 is θ_r itself), the one that lowers the loss most on its private *pick*
windows, F*; then every miner of the round is measured on the *same* private *scoring* windows W (training windows
assigned to none of the round's scored miners, drawn from the validator's secret seed)::

    η        = step_scale / N                         the update's share of the step (N: the round's contributors)
    d_i(w)   = ℓ_w(θ_r − η·F*) − ℓ_w(θ_r − η·Δ_i)      per window: Δ_i's edge over the best free update
    credit_i = mean_W d_i       (± its standard error from the spread of d_i over W)
    gain_i   = L_W(θ_r) − L_W(θ_r − η·Δ_i)           the raw improvement, reported (it includes the free part)

Why this shape (docs/validation.md, measured): a raw improvement pays for the free part too — Δ̄_{r−1} plus noise
lowers the loss by 19–62 % of an honest update's gain — while beyond the best free update such a copy earns ~0 or
less. Every miner on the same windows makes the comparison *paired*: the window-to-window spread of difficulty, which
is larger than the differences between honest miners, cancels out of the comparison between them. Judged at its
share of the step (η = 1/N) an honest update keeps helping late in training; judged in full (η = 1) a single
miner's end-of-round model overfits its own windows by round 6–7 and its credit turns to noise.

One check at the full step: the miner's own end-of-round model θ_r − Δ_i must not be *significantly worse* than θ_r on
other data (``own_model_gain`` on the first ``own_model_windows`` scoring windows, refused at ``own_model_z`` standard
errors below 0 — an own model that the first sample leaves unclear is measured on ``own_model_recheck_windows`` more
and decided on all; :mod:`template.validation.rewards` then forfeits the miner's accumulated score). A miner that trains
on one batch over and over (``overfitter``) makes a Δ whose small step still helps early in training — at η = 1/N it
earned 17–85 % of an honest miner's credit in its first paid rounds on the adversarial network — but whose own model,
once it has memorized that batch, is 0.07–1.4 nats worse than θ_r elsewhere (2.2–16 standard errors). Honest miners' own
models were 0.16–0.24 nats better early; later in training their full step stops generalizing (down to −0.009 ± 0.1
nats on the local network: an own model overfits its own windows), which is why the check asks only for *not
significantly worse*, and why credit itself is measured at η = 1/N.

Samples are drawn from the validator's private seed, so a miner cannot know which windows will be scored. Cost per
miner: two model loads and ``eval_windows`` + ``own_model_windows`` forward passes (a third load and
``own_model_recheck_windows`` more for an unclear own model); per round, the free updates on
``pick_windows`` and F* and θ_r on the scoring windows (docs/benchmarks.md). The per-window edge over a *reference*
(:func:`edge_difference`) is also how :mod:`template.validation.round` tells a copy from its original.
"""

from __future__ import annotations

import hashlib
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from template.training.data import DataAssignment, TokenCorpus
from template.training.model import autocast_context

Tensors = Sequence[torch.Tensor]


@dataclass(frozen=True)
class ScoringConfig:
    eval_windows: int = 32  # scoring windows: every miner of a round is measured on the same ones
    pick_windows: int = 32  # other windows, on which the best free update is chosen
    step_scale: float = 1.0  # η × N: 1 judges each update at its share of the step
    free_scales: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0)  # c of the free updates c·Δ̄_{r−1}
    own_model_windows: int = 16  # of the scoring windows, those on which the miner's own model θ_r − Δ is checked
    # an own model worse than θ_r by this many standard errors did not train as claimed (overfit, or trained badly)
    own_model_z: float = 2.0
    # an own model between own_model_sure_z standard errors below θ_r and own_model_clear_z above it on that first
    # sample is measured again on this many more windows (the other scoring windows, then the pick windows), and
    # the whole sample decides at own_model_z: a stale or overfit update near the line cannot slip through on a
    # lucky draw of 16 windows, at the price of one more model load for the few updates that land there
    own_model_recheck_windows: int = 48
    own_model_sure_z: float = 3.0
    own_model_clear_z: float = 1.0
    # credit counts in full from credit_z_full standard errors above 0, not at all up to credit_z_zero, linearly between
    credit_z_zero: float = 1.0
    credit_z_full: float = 2.0
    # nats: the standard error of a paired edge (copy detection) is never taken as smaller than this, so that two
    # near-identical models (a copy of the reference) cannot look significant through a vanishing spread
    edge_floor: float = 0.002

    def __post_init__(self) -> None:
        unused = self.eval_windows - self.own_model_windows + self.pick_windows  # what a recheck may measure on
        if self.eval_windows < 2 or self.pick_windows < 1 or self.step_scale <= 0 or self.edge_floor <= 0 or \
                not 2 <= self.own_model_windows <= self.eval_windows or \
                not 0 <= self.own_model_recheck_windows <= unused or \
                not -self.own_model_clear_z <= self.own_model_z <= self.own_model_sure_z or \
                not 0 <= self.credit_z_zero < self.credit_z_full:
            raise ValueError(f"invalid scoring settings: {self}")
        if 0.0 not in self.free_scales:
            raise ValueError(f"free_scales must include 0 (θ_r itself), not {self.free_scales}")


@dataclass(frozen=True)
class UpdateGains:
    """One update's measures (nats; see the module docstring)."""

    gain: float  # L_W(θ_r) − L_W(θ_r − ηΔ): what it lowers the loss, the free part included
    credit: float  # mean_W of ℓ(θ_r − ηF*) − ℓ(θ_r − ηΔ): what it adds beyond the best free update
    credit_se: float  # standard error of ``credit`` over the scoring windows
    own_model_gain: float  # L(θ_r) − L(θ_r − Δ) on the first ``own_model_windows``: the miner's own model
    own_model_se: float  # ... and its standard error (reported)
    own_model_windows: int = 0  # how many windows that took (more when the first sample was not clear)


@dataclass(frozen=True)
class FreeUpdate:
    """The round's best free update F* = ``scale``·Δ̄_{r−1}, and the losses against which every miner is measured."""

    scale: float
    losses: dict[int, float]  # per scoring window, of θ_r − η·F*
    baseline: dict[int, float]  # per scoring and pick window, of θ_r


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "little")


class WindowSampler:
    """Which windows the validator evaluates; every draw depends on the validator's secret ``seed``."""

    def __init__(self, assignment: DataAssignment, windows_per_round: int, seed: int) -> None:
        self.assignment = assignment
        self.windows_per_round = windows_per_round  # H × batch size: what a miner is assigned per round
        self.seed = seed

    def assigned(self, hotkey: str, round: int, count: int, salt: str = "") -> tuple[list[int], set[int]]:
        """``count`` of the windows assigned to ``hotkey`` in ``round`` (a private draw; another ``salt``, another
        draw), and all of them."""
        windows = self.assignment.assigned_windows(hotkey, round, self.windows_per_round)
        sample = random.Random(_seed(self.seed, "assigned", hotkey, round, salt)).sample(windows,
                                                                                         min(count, len(windows)))
        return sample, set(windows)

    def unassigned(self, round: int, count: int, exclude: set[int]) -> list[int]:
        """``count`` training windows not in ``exclude`` (the windows assigned to the round's miners), a private
        draw per round; fewer only when the corpus has no more."""
        key = f"validator-{self.seed}-{round}"
        draw = self.assignment.assigned_windows(key, round, min(count + len(exclude), self.assignment.num_train))
        return [w for w in draw if w not in exclude][:count]


class LossProbe:
    """Per-window losses of θ_r and of θ_r − η·Δ on the validator's scratch model."""

    def __init__(self, model: torch.nn.Module, corpus: TokenCorpus, batch_size: int, device: str | torch.device):
        self.model = model
        self.corpus = corpus
        self.batch_size = batch_size
        self.device = torch.device(device)

    @torch.no_grad()
    def load(self, theta: Tensors, delta: Tensors | None = None, step_scale: float = 1.0) -> None:
        """Put θ (or θ − η·Δ) into the scratch model."""
        for index, parameter in enumerate(self.model.parameters()):
            value = theta[index] if delta is None else theta[index] - step_scale * delta[index].float()
            parameter.copy_(value.to(parameter.device, parameter.dtype))

    @torch.no_grad()
    def window_losses(self, windows: Sequence[int]) -> dict[int, float]:
        """Mean next-token loss of each window under the loaded parameters."""
        self.model.eval()
        losses: dict[int, float] = {}
        for start in range(0, len(windows), self.batch_size):
            chunk = list(windows[start:start + self.batch_size])
            input_ids, labels = next(self.corpus.batches(chunk, len(chunk)))
            with autocast_context(self.device):
                logits = self.model(input_ids=input_ids.to(self.device)).logits
            per_token = F.cross_entropy(logits.float().transpose(1, 2), labels.to(self.device), reduction="none")
            losses.update(zip(chunk, per_token.mean(dim=1).tolist(), strict=True))
        return losses


def mean_over(losses: dict[int, float], windows: Sequence[int]) -> float:
    return sum(losses[w] for w in windows) / len(windows)


def update_losses(probe: LossProbe, theta: Tensors, delta: Tensors | None, windows: Sequence[int],
                  step_scale: float) -> dict[int, float]:
    """Per-window losses of θ_r − η·``delta`` (θ_r itself when ``delta`` is None)."""
    probe.load(theta, delta, step_scale)
    return probe.window_losses(list(dict.fromkeys(windows)))


def mean_update(updates: Sequence[Tensors]) -> list[torch.Tensor] | None:
    """The element-wise mean of some updates (float32), or None when there are none (then the reference is θ_r)."""
    if not updates:
        return None
    return [torch.stack([u[i].float() for u in updates]).mean(0) for i in range(len(updates[0]))]


def edge_difference(after: dict[int, float], reference: dict[int, float], windows_a: Sequence[int],
                    windows_b: Sequence[int], config: ScoringConfig) -> tuple[float, float]:
    """(mean edge of ``after`` over ``reference`` on ``windows_a``) − (the same on ``windows_b``), and its standard
    error from the per-window spread on each side (floored at ``edge_floor``)."""
    edge_a = [reference[w] - after[w] for w in windows_a]
    edge_b = [reference[w] - after[w] for w in windows_b]
    spread = statistics.variance(edge_a) / len(edge_a) + statistics.variance(edge_b) / len(edge_b)
    return statistics.fmean(edge_a) - statistics.fmean(edge_b), math.sqrt(spread + config.edge_floor ** 2)


def paired_edge_z(after: dict[int, float], reference: dict[int, float], windows_a: Sequence[int],
                  windows_b: Sequence[int], config: ScoringConfig) -> float:
    """Significance of :func:`edge_difference`: how much more ``after`` helps ``windows_a`` than ``windows_b``."""
    difference, se = edge_difference(after, reference, windows_a, windows_b, config)
    return difference / se


def free_update(probe: LossProbe, theta: Tensors, previous_average: Tensors | None, pick: Sequence[int],
                scoring: Sequence[int], step: float, config: ScoringConfig) -> FreeUpdate:
    """The best free update F* = c·Δ̄_{r−1} (c in ``config.free_scales``; only c = 0, θ_r itself, without a previous
    average), chosen on the ``pick`` windows, with its losses and θ_r's on the ``scoring`` windows. Each update is
    applied at ``step`` (η), like the miners' updates it is compared with."""
    theta_losses = update_losses(probe, theta, None, [*pick, *scoring], step)
    pick_loss = {0.0: mean_over(theta_losses, pick)}
    if previous_average is not None:
        for scale in config.free_scales:
            if scale != 0.0:
                pick_loss[scale] = mean_over(update_losses(probe, theta, previous_average, pick, scale * step), pick)
    best = min(pick_loss, key=lambda scale: (pick_loss[scale], scale))
    if best == 0.0:
        losses = {w: theta_losses[w] for w in scoring}
    else:
        losses = update_losses(probe, theta, previous_average, scoring, best * step)
    return FreeUpdate(best, losses, theta_losses)


def update_gains(after: dict[int, float], own_model: dict[int, float], free: FreeUpdate,
                 windows: Sequence[int]) -> UpdateGains:
    """The measures of an update from its per-window losses on the scoring ``windows``: ``after`` of θ_r − η·Δ, and
    ``own_model`` of θ_r − Δ (on the scoring or pick windows it was measured on)."""
    edges = [free.losses[w] - after[w] for w in windows]
    own = [free.baseline[w] - loss for w, loss in own_model.items()]
    return UpdateGains(gain=mean_over(free.baseline, windows) - mean_over(after, windows),
                       credit=statistics.fmean(edges), credit_se=standard_error(edges),
                       own_model_gain=statistics.fmean(own), own_model_se=standard_error(own),
                       own_model_windows=len(own))


def overfit(gains: UpdateGains, config: ScoringConfig) -> bool:
    """Whether the miner's own model θ_r − Δ was significantly worse than θ_r (``own_model_z`` standard errors)."""
    return gains.own_model_gain < -config.own_model_z * gains.own_model_se


def own_model_unclear(gains: UpdateGains, config: ScoringConfig) -> bool:
    """Whether the first sample leaves the own-model check open: between ``own_model_sure_z`` standard errors below θ_r
    and ``own_model_clear_z`` above it (then a larger sample decides; ``ScoringConfig``). Measured on the adversarial
    network: honest own models were 1.6–9 standard errors above θ_r, a stale update's (its own Δ of two rounds before)
    2.3–10 below — but once above −2 on 16 windows, and that round paid it 13 % of the best honest credit."""
    if config.own_model_recheck_windows == 0 or gains.own_model_se <= 0:
        return False
    z = gains.own_model_gain / gains.own_model_se
    return -config.own_model_sure_z < z < config.own_model_clear_z


def significant_credit(gains: UpdateGains, config: ScoringConfig) -> float:
    """The part of the credit that is paid: in full when it is at least ``credit_z_full`` standard errors above 0,
    nothing up to ``credit_z_zero``, a linear ramp between (so no cliff between two honest miners near the line).

    Why: a credit within noise of 0 is what an update that adds nothing scores half the time. The adversarial network's
    stale miner (its own Δ of two rounds before) earned 0.0029 ± 0.0043 nats, 5 % of the best honest credit, in a round
    where honest credits were 10–11 standard errors above 0; honest credits were 4–11 standard errors above 0 in every
    paid round of that network (docs/validation.md)."""
    if gains.credit <= 0:
        return 0.0
    if gains.credit_se <= 0:
        return gains.credit
    z = gains.credit / gains.credit_se
    weight = (z - config.credit_z_zero) / (config.credit_z_full - config.credit_z_zero)
    return gains.credit * min(1.0, max(0.0, weight))


def standard_error(values: Sequence[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values))
