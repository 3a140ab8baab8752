"""Loss-based scoring of one pseudo-gradient: does applying it help the data the miner was assigned?

For miner i in round r, from the validator's copy of θ_r (the same θ_r the miner started from):

    L_A(x) = mean loss of parameters x on a sample of the windows assigned to i in round r
    L_U(x) = mean loss of x on a sample of training windows *not* assigned to i
    g_A = L_A(θ_r) − L_A(θ_r − η·Δ_i)          improvement on the assigned data
    g_U = L_U(θ_r) − L_U(θ_r − η·Δ_i)          improvement on other data
    quality = max(0, g_A + γ·(g_A − g_U))

η = 1 evaluates the miner's own end-of-round model. ``g_A`` rewards an update that helps (a random or scaled Δ makes
it negative); the second term adds the part of the help that is *specific to the assigned windows* — the trace of
having trained on them, which a copier, a replayer of an old round or a miner training on other data does not
have. Samples are drawn from the validator's private seed, so a miner cannot know which of its windows will be
checked and must train on all of them.

Why a sample of windows and not all: cost. A sample of ``eval_windows`` windows from each side costs
3 × ``eval_windows`` forward passes per miner (the unassigned baseline is shared by the round); see
docs/validation.md for the noise this leaves and docs/benchmarks.md for the cost.
"""

from __future__ import annotations

import hashlib
import random
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
    assigned_bonus: float = 1.0  # γ
    absent_factor: float = 0.5  # round score multiplier for a miner missing from the round's all-reduce

    def __post_init__(self) -> None:
        if self.eval_windows < 1 or self.step_scale <= 0 or self.assigned_bonus < 0:
            raise ValueError(f"invalid scoring settings: {self}")
        if not 0 <= self.absent_factor <= 1:
            raise ValueError("absent_factor must be within [0, 1]")


@dataclass(frozen=True)
class LossGains:
    assigned: float  # g_A
    unassigned: float  # g_U

    @property
    def evidence(self) -> float:
        """g_A − g_U: how much more the update helps the assigned data than other data."""
        return self.assigned - self.unassigned

    def quality(self, assigned_bonus: float) -> float:
        return max(0.0, self.assigned + assigned_bonus * self.evidence)


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "little")


class WindowSampler:
    """Which windows the validator evaluates; every draw depends on the validator's secret ``seed``."""

    def __init__(self, assignment: DataAssignment, windows_per_round: int, seed: int) -> None:
        self.assignment = assignment
        self.windows_per_round = windows_per_round  # H × batch size: what a miner is assigned per round
        self.seed = seed

    def assigned(self, hotkey: str, round: int, count: int) -> tuple[list[int], set[int]]:
        """``count`` of the windows assigned to ``hotkey`` in ``round`` (a private draw), and all of them."""
        windows = self.assignment.assigned_windows(hotkey, round, self.windows_per_round)
        sample = random.Random(_seed(self.seed, "assigned", hotkey, round)).sample(windows, min(count, len(windows)))
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


def loss_gains(probe: LossProbe, theta: Tensors, delta: Tensors, assigned: Sequence[int],
               unassigned: Sequence[int], baseline: dict[int, float], step_scale: float) -> LossGains:
    """g_A and g_U of ``delta``; ``baseline`` holds θ_r's losses of ``unassigned`` (shared by the round)."""
    probe.load(theta)
    before_assigned = mean_over(probe.window_losses(assigned), assigned)
    probe.load(theta, delta, step_scale)
    after = probe.window_losses([*assigned, *unassigned])
    return LossGains(assigned=before_assigned - mean_over(after, assigned),
                     unassigned=mean_over(baseline, unassigned) - mean_over(after, unassigned))
