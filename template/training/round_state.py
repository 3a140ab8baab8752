"""A round between its training and its outcome, as :class:`template.training.diloco.DiLoCoPeer` holds it: the inner
steps (:func:`train_in_chunks`) and their :class:`Stats`, the :class:`Trained` round (its contribution encoded, its
all-reduce not begun) and, with overlap, the round :class:`InFlight` whose all-reduce runs while the next one
trains."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from template.allreduce.averager import AveragingConfig, AveragingHandle, AveragingResult, PseudoGradientAverager
from template.allreduce.contribution import EncodedContribution
from template.training.distributed import NodeGroup
from template.training.inner import Batch, InnerTrainer
from template.training.round import Progress, RoundPlan, Tensors

log = logging.getLogger(__name__)

SLOWEST_GROUPMATE = 4.0  # how many times slower than this peer a groupmate's round may be and still be waited for


@dataclass(frozen=True)
class Stats:
    steps: int
    tokens: int
    mean_loss: float | None
    seconds: float


@dataclass(frozen=True)
class Landing:
    """Round r−1's all-reduce, landed while round r trained (overlap)."""

    at_step: int  # round r's inner steps trained before it landed
    result: AveragingResult | None  # None on ranks other than the leader
    applied: tuple[bool, str]  # the outer step taken or not, and why not (``DiLoCoPeer._apply``)


@dataclass
class Arrival:
    """Overlap: round r−1's all-reduce, in flight while round r trains (the correction on arrival, :mod:`diloco`).

    Until it has landed, inner steps run one at a time and before each the leader asks ``ready`` (it never waits);
    once it says yes, every rank calls ``land`` with the number of steps trained so far, once, at the same step."""

    ready: Callable[[], bool]
    land: Callable[[int], Landing]
    landed: Landing | None = None


def train_in_chunks(inner: InnerTrainer, node: NodeGroup, batches: Iterator[Batch], steps: int,
                    deadline: float | None, on_progress: Callable[[Progress], None] | None, r: int,
                    arrival: Arrival | None = None) -> Stats:
    """Round ``r``'s inner steps in chunks of up to 10 (of one while ``arrival`` has not landed: the sooner a landed
    average is taken, the less of the round trains from the stand-in), reporting progress (leader) between chunks.

    The leader decides between chunks whether to go on (deadline) and whether ``arrival`` has landed, and tells the
    other ranks, so that all ranks of a node always run the same number of DDP steps and land it at the same step.
    """
    chunk = max(1, min(10, steps))
    total_steps = total_tokens = 0
    loss_sum = seconds = 0.0
    last_loss = None
    while total_steps < steps:
        in_time = deadline is None or time.time() < deadline
        landed = arrival is not None and arrival.landed is None and node.is_leader and arrival.ready()
        go, landed = node.broadcast_ints([int(in_time), int(landed)])
        if landed:
            arrival.landed = arrival.land(total_steps)
        if not go:
            break
        waiting = arrival is not None and arrival.landed is None
        stats = inner.train(batches, min(1 if waiting else chunk, steps - total_steps))
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
    landed: Landing | None = None  # overlap: round r−1's all-reduce, when it landed while this round trained


@dataclass
class InFlight:
    """Overlap: a round whose all-reduce runs in the background while the next round trains."""

    trained: Trained
    handle: AveragingHandle | None  # None on ranks other than the leader
    pending: Future[AveragingResult] | None  # PseudoGradientAverager.finish, running on the averager's thread
    begun_at: float  # time.time() when its all-reduce was handed over
    round_s: float = 0.0  # wall time of the call that trained it (set when that call returns)
    waited_s: float = 0.0  # how long the peer stood still for the result
    paced_s: float = 0.0  # how long the peer waited after training it for its group to form (free-running only)
    landed_at_step: int | None = None  # the next round's inner steps trained before it landed (None: after them)

    def result(self) -> AveragingResult | None:
        """The all-reduce's result (None on ranks other than the leader); returns by the step's deadline."""
        started = time.monotonic()
        result = self.pending.result() if self.pending is not None else None
        self.waited_s = time.monotonic() - started
        return result


def may_apply(result: AveragingResult | None, current: str, min_contributors: int) -> tuple[bool, str]:
    """Whether a peer whose θ has hash ``current`` may take the outer step with ``result``, and why not: the all-reduce
    succeeded with at least ``min_contributors`` trainers in it, and ``current`` is the θ the group's token-weighted
    majority applies the average to (``onto``)."""
    if result is None:
        return False, "no averager"
    if not result.ok:
        return False, result.reason
    contributors = sum(1 for weight in result.weights.values() if weight > 0)
    if contributors < min_contributors:
        # hivemind counts auxiliary members (validators) and zero-token members toward the group size: a
        # trainer "averaging" with a validator alone would apply its own Δ and drift away from the others
        return False, f"only {contributors} peer(s) with tokens in the group: round not applied"
    targets: Counter[str] = Counter()
    for peer, gathered in result.group.items():
        if isinstance(gathered, dict) and isinstance(gathered.get("onto"), str):
            targets[gathered["onto"]] += result.weights.get(peer, 0.0)
    majority = max(targets.items(), key=lambda item: (item[1], item[0]))[0] if targets else current
    if majority != current:
        log.warning("our θ %s differs from the group's %s (by weight: %s)", current[:12], majority[:12],
                    {k[:12]: v for k, v in targets.items()})
        return False, "our θ differs from the group's: re-syncing"
    return True, ""


def matchmaking_window(config: AveragingConfig, trained: Trained, overlapped: bool,
                       after: AveragingResult | None = None) -> float:
    """How long a peer gathers ``trained``'s group, from when it begins looking; ``after`` is the round before's
    all-reduce, whose members said how long they trained that round (``trained_s`` in their gathered data).

    ``config.matchmaking_time`` is enough where something brings the peers to the same start: a chain clock (the plan's
    ``finish_by``: every neuron starts looking at the same block) or a blocking all-reduce (a barrier every round).
    Free-running overlapped peers have no barrier but the wait, at the end of a round's training, for the round
    before's average, which needs every groupmate to have trained that round: so a groupmate can begin looking up to
    one of *its* rounds' training later than this peer. The window covers the slowest such round seen, this peer's
    own or a member's of the last group, on top of ``matchmaking_time``. With this peer's own round alone, a peer 50 %
    slower than the others (the bootstrap peer on two busy cores) fell out of every group from round 9 of 30 on; with
    ``matchmaking_time`` alone 9–11 of 120 all-reduces were lost to drift (docs/benchmarks.md §1a). It costs nothing
    when the whole group is there: a group forms as soon as ``target_group_size`` members have joined; only a round
    that misses a peer waits the longer window (in the background) before going on without it. What a member says counts
    up to :data:`SLOWEST_GROUPMATE` times this peer's own round: a peer that says more delays a round no longer."""
    if not overlapped or trained.plan.finish_by is not None:
        return config.matchmaking_time
    own = trained.stats.seconds
    said = [data.get("trained_s") for data in (after.group.values() if after is not None else ())
            if isinstance(data, dict)]
    slowest = max([own, *(s for s in said if isinstance(s, float) and math.isfinite(s))])
    return config.matchmaking_time + min(slowest, SLOWEST_GROUPMATE * own)


def allreduce_deadline(config: AveragingConfig, start: float, finish_by: float | None) -> float:
    """When a round's all-reduce that begins looking for its group at ``start`` must be over: its matchmaking and
    all-reduce time, within the plan's ``finish_by`` when a chain clock set one (and at least a second)."""
    budget = start + config.matchmaking_time + config.allreduce_timeout
    return budget if finish_by is None else max(min(budget, finish_by), start + 1.0)


def pace(averager: PseudoGradientAverager, handle: AveragingHandle, trained: Trained) -> float:
    """A free-running overlapped peer whose round r−1 average landed only after round r's training (``trained``)
    stood still for it: it waits now instead, at the start of the next round, until round r's group has formed, so
    that round r's average lands early in round r+1 instead of after it (docs/benchmarks.md §1a, design change 25).
    Only then: a peer whose averages land while it trains never waits (the wait would cost it compute); waiting past
    the window less one of its own rounds would only move its wait for the landing. Returns the seconds waited."""
    started = time.monotonic()
    averager.wait_for_group(handle, until=handle.scheduled - trained.stats.seconds)
    return time.monotonic() - started
