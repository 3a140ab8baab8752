"""A round between its training and its outcome, as :class:`template.training.diloco.DiLoCoPeer` holds it: the inner
steps' :class:`Stats`, the :class:`Trained` round (its contribution encoded, its all-reduce not begun) and, with
overlap, the round :class:`InFlight` whose all-reduce runs while the next one trains."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

from template.allreduce.averager import AveragingHandle, AveragingResult
from template.allreduce.contribution import EncodedContribution
from template.training.round import RoundPlan, Tensors


@dataclass(frozen=True)
class Stats:
    steps: int
    tokens: int
    mean_loss: float | None
    seconds: float


@dataclass(frozen=True)
class Trained:
    """A round trained and (leader) encoded, before its all-reduce: what its outcome needs from the training."""

    plan: RoundPlan
    base_hash: str  # θ the round started from: its Δ is measured from it on every peer of the group
    base: Tensors | None  # a copy of that θ, for plans that do not contribute
    stats: Stats
    delta: Tensors | None
    contribution: EncodedContribution | None
    trained_at: float  # time.monotonic() when inner training ended


@dataclass
class InFlight:
    """Overlap: a round whose all-reduce runs in the background while the next round trains."""

    trained: Trained
    handle: AveragingHandle | None  # None on ranks other than the leader
    pending: Future[AveragingResult] | None  # PseudoGradientAverager.finish, running on the averager's thread
    begun_at: float  # time.time() when its all-reduce was handed over
    round_s: float = 0.0  # wall time of the call that trained it (set when that call returns)
    waited_s: float = 0.0  # how long the peer stood still for the result

    def result(self) -> AveragingResult | None:
        """The all-reduce's result (None on ranks other than the leader); returns by the step's deadline."""
        started = time.monotonic()
        result = self.pending.result() if self.pending is not None else None
        self.waited_s = time.monotonic() - started
        return result
