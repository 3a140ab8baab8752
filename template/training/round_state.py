"""A round between its training and its outcome, as :class:`template.training.diloco.DiLoCoPeer` holds it: the inner
steps (:func:`train_in_chunks`) and their :class:`Stats`, the :class:`Trained` round (its contribution encoded, its
all-reduce not begun) and, with overlap, the round :class:`InFlight` whose all-reduce runs while the next one
trains."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from template.allreduce.averager import AveragingHandle, AveragingResult
from template.allreduce.contribution import EncodedContribution
from template.training.distributed import NodeGroup
from template.training.inner import Batch, InnerTrainer
from template.training.round import Progress, RoundPlan, Tensors


@dataclass(frozen=True)
class Stats:
    steps: int
    tokens: int
    mean_loss: float | None
    seconds: float


def train_in_chunks(inner: InnerTrainer, node: NodeGroup, batches: Iterator[Batch], steps: int,
                    deadline: float | None, on_progress: Callable[[Progress], None] | None, r: int) -> Stats:
    """Round ``r``'s inner steps in chunks of up to 10, reporting progress (leader) between chunks.

    The leader decides between chunks whether to go on (deadline) and tells the other ranks, so that all
    ranks of a node always run the same number of DDP steps.
    """
    chunk = max(1, min(10, steps))
    total_steps = total_tokens = 0
    loss_sum = seconds = 0.0
    last_loss = None
    while total_steps < steps:
        in_time = deadline is None or time.time() < deadline
        if not node.broadcast_int(int(in_time)):
            break
        stats = inner.train(batches, min(chunk, steps - total_steps))
        if stats.steps == 0:
            break
        total_steps += stats.steps
        total_tokens += stats.tokens * node.world
        seconds += stats.seconds
        loss_sum += (stats.mean_loss or 0.0) * stats.steps
        last_loss = stats.last_loss
        if on_progress and node.is_leader:
            on_progress(Progress(r, total_steps, steps, last_loss, total_tokens / max(seconds, 1e-9)))
    return Stats(total_steps, total_tokens, loss_sum / total_steps if total_steps else None, seconds)


@dataclass(frozen=True)
class Trained:
    """A round trained and (leader) encoded, before its all-reduce: what its outcome needs from the training."""

    plan: RoundPlan
    base_hash: str  # θ the round started from: its Δ is measured from it on every peer of the group
    base: Tensors | None  # for plans that do not contribute, a copy of the θ the average is applied to, taken when
    # the all-reduce begins (``DiLoCoPeer._begin``; overlap: the round before's step taken)
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
