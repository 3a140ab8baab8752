"""Loss-based measures of one pseudo-gradient: does it help, and is there evidence it was trained on the miner's data?

For miner i in round r, from the validator's copy of θ_r (the same θ_r the miner started from), with R a reference
update that was not trained (mostly) on i's data — the round's Δ̄, which i's own share moves by its token share;
R = 0, i.e. θ_r itself, when the validator holds no Δ̄ because its all-reduce failed:

    L_X(x)  = mean loss of parameters x on the windows X
    A       = a private sample of the windows assigned to i in round r;  U = training windows *not* assigned to i
    general = L_U(θ_r) − L_U(θ_r − η·Δ_i)                                  improvement on other data
    d(w)    = ℓ_w(θ_r − η·R) − ℓ_w(θ_r − η·Δ_i)                            per window: Δ_i's edge over the reference
    evidence = mean_A d − mean_U d,   with its standard error from the per-window spread of d on A and on U

η = 1 evaluates the miner's own end-of-round model. ``general`` is what the update is worth to the shared model; a
random, scaled, stale or badly trained update makes it negative. ``evidence`` is the trace of having trained on
*those* windows: a model trained on them fits them better, relative to a model trained as much on other data, than it
fits other text. Differencing against the reference per window removes most of the window-to-window spread of
difficulty, which a comparison with θ_r itself (``g_A − g_U`` of earlier versions) left in: that spread made honest
miners' scores swing by a factor of three from round to round. A copy of someone else's Δ, of Δ̄ or of an old round,
or an update trained on other data, has no evidence (its mean is ~0 and its significance low whatever its size);
training only part of the assignment leaves evidence on only that part of the sample. How evidence becomes credit
(significance accumulated over rounds, gating the general improvement) is :mod:`template.validation.rewards`.

Samples are drawn from the validator's private seed, so a miner cannot know which of its windows will be checked and
must train on all of them. Cost per miner: 2 × ``eval_windows`` forward passes (Δ_i on A and U); θ_r and Δ̄ are
evaluated once per round on every window any miner needs (docs/benchmarks.md).

A reference of the same kind and size as Δ_i (the mean of the round's *other* helpful updates) measured the evidence
with ~5× smaller standard errors on the local network, but costs a model load and 2 × ``eval_windows`` more windows
per miner, which starved a validator sharing two cores with ten miners ("not evaluated in time"); it is used where
precision matters most and the cost is rare: telling a copy from its original (:mod:`template.validation.round`).
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
    eval_windows: int = 16  # windows sampled from the assigned data, and from other data, per miner
    step_scale: float = 1.0  # η
    # nats: the standard error of the evidence is never taken as smaller than this, so that two near-identical
    # models (a copy of the reference) cannot look significant through a vanishing spread
    evidence_floor: float = 0.002

    def __post_init__(self) -> None:
        if self.eval_windows < 2 or self.step_scale <= 0 or self.evidence_floor <= 0:
            raise ValueError(f"invalid scoring settings: {self}")


@dataclass(frozen=True)
class LossGains:
    """One update's measures (nats; see the module docstring)."""

    general: float  # L_U(θ_r) − L_U(θ_r − ηΔ): what it is worth on other data
    evidence: float  # mean_A d − mean_U d: how much more it helps its assigned windows than the reference does
    evidence_se: float  # standard error of ``evidence`` (floored)

    @property
    def z(self) -> float:
        """This round's significance of the evidence."""
        return self.evidence / self.evidence_se


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

    def unassigned(self, round: int, count: int) -> list[int]:
        """Training windows for the round's baseline; callers drop those a given miner was assigned."""
        key = f"validator-{self.seed}-{round}"
        return self.assignment.assigned_windows(key, round, min(2 * count, self.assignment.num_train))


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
    error from the per-window spread on each side (floored at ``evidence_floor``)."""
    edge_a = [reference[w] - after[w] for w in windows_a]
    edge_b = [reference[w] - after[w] for w in windows_b]
    spread = statistics.variance(edge_a) / len(edge_a) + statistics.variance(edge_b) / len(edge_b)
    return statistics.fmean(edge_a) - statistics.fmean(edge_b), math.sqrt(spread + config.evidence_floor ** 2)


def paired_edge_z(after: dict[int, float], reference: dict[int, float], windows_a: Sequence[int],
                  windows_b: Sequence[int], config: ScoringConfig) -> float:
    """Significance of :func:`edge_difference`: how much more ``after`` helps ``windows_a`` than ``windows_b``."""
    difference, se = edge_difference(after, reference, windows_a, windows_b, config)
    return difference / se


def loss_gains(after: dict[int, float], reference: dict[int, float], baseline: dict[int, float],
               assigned: Sequence[int], unassigned: Sequence[int], config: ScoringConfig) -> LossGains:
    """The measures of an update from the losses (per window) of θ_r − η·Δ (``after``), of the reference θ_r − η·R
    and of θ_r (``baseline``), on the miner's assigned sample and on other windows."""
    evidence, se = edge_difference(after, reference, assigned, unassigned, config)
    return LossGains(general=mean_over(baseline, unassigned) - mean_over(after, unassigned), evidence=evidence,
                     evidence_se=se)
