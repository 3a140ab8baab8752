"""The values a DiLoCo round takes and gives: :class:`RoundPlan` in, :class:`RoundOutcome` out.

A round is a value: :meth:`DiLoCoPeer.run_round(plan) <template.training.diloco.DiLoCoPeer.run_round>` reads
everything it is to do from the plan (which round, which windows, how many steps, until when, whether it
contributes) and hands back everything that happened in the outcome. Roles and attacks are functions of plans and
outcomes — a miner's behaviour rewrites its plan and chooses what to publish from the outcome, a validator runs
auxiliary plans and scores the outcome's θ_r and Δ̄ — so nothing reaches into the peer between rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from template.allreduce.averager import AveragingResult
from template.allreduce.contribution import Commitment, EncodedContribution

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class RoundPlan:
    """What one peer does in one round.

    ``windows`` are trained in order, ``batch_size`` at a time, for at most ``max_steps`` steps (fewer when they
    run out or ``train_until`` passes). A plan that does not ``contribute`` trains nothing and joins the all-reduce
    with no pseudo-gradient: an auxiliary peer (a validator) receives the group's Δ̄ and takes the outer step like
    everyone else.
    """

    round: int
    windows: tuple[int, ...]
    max_steps: int
    train_until: float | None = None  # time.time(): stop inner training then (None: run max_steps)
    finish_by: float | None = None  # time.time(): the all-reduce must end by then (None: its own timeouts)
    contributes: bool = True

    def __post_init__(self) -> None:
        if self.round < 0 or self.max_steps < 0:
            raise ValueError(f"invalid plan: round {self.round}, max_steps {self.max_steps}")
        if not self.contributes and (self.max_steps or self.windows):
            raise ValueError("a plan that does not contribute trains nothing")

    def auxiliary(self) -> RoundPlan:
        """The same round, joined without training or contributing (a validator's role)."""
        return replace(self, windows=(), max_steps=0, contributes=False)


@dataclass(frozen=True)
class RoundReport:
    """What one round did, for logs, progress lines and benchmarks."""

    round: int
    base_theta_hash: str  # θ_r the round started from
    inner_steps: int
    tokens: int
    train_loss: float | None
    heldout_loss: float | None  # of θ_{r+1} (θ_r when the round failed), on held-out windows
    allreduce_ok: bool
    reason: str
    group_size: int
    allreduce_s: float  # from handing Δ over to having Δ̄
    round_s: float
    inner_s: float
    bytes_sent: int
    theta_hash: str  # of θ after the round: equal on every peer that took the step
    allreduce_wait_s: float = 0.0  # of allreduce_s, how long training stood still for it (overlap: the rest ran
    # while the next round trained)
    segments_refuted: int = 0  # averaged segments that missed their owner's claims: no step there, on every member
    landed_after_steps: int | None = None  # overlap: the next round's inner steps trained before this round's average
    # landed (when its step was taken, they train on from the corrected θ); None: after their training, or blocking
    paced_s: float = 0.0  # overlap, free-running: how long the peer waited after this round's training for its group
    # to form before it trained the next round


@dataclass(frozen=True)
class RoundOutcome:
    """Everything that happened in one round, as this peer saw it.

    ``base`` is θ_r itself (a copy) for plans that do not contribute — a validator scores round r's pseudo-gradients
    against it after the peer has moved on — and None for contributors, which need not pay a copy of the model. With
    overlap it is the θ round r's average was applied to (G_r: θ_r with round r−1's step taken), and
    ``report.base_theta_hash`` still names the θ round r trained from (G_{r−1}), which publications name too.
    ``delta`` is this peer's Δ = θ_r − θ_local (None on ranks other than the node's leader and for plans that do not
    contribute); ``averaged`` the group's Δ̄ when this peer took the outer step with it, else None; ``averaging`` the
    all-reduce as this peer saw it (the group, every member's announced weight, who made it into the average).
    ``contribution`` is what this peer fed into the all-reduce — encoded once, these exact bytes — and
    ``commitment`` its signed promise of them (both None when it contributed nothing).
    """

    report: RoundReport
    base: Tensors | None
    delta: Tensors | None
    averaged: Tensors | None
    averaging: AveragingResult | None
    contribution: EncodedContribution | None = None
    commitment: Commitment | None = None

    @property
    def round(self) -> int:
        return self.report.round


@dataclass(frozen=True)
class Progress:
    """A live progress sample during inner training."""

    round: int
    step: int
    of_steps: int
    loss: float | None
    tokens_per_s: float
