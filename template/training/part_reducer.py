"""The part reducer of the checked all-reduce: how one owner turns its groupmates' contributions into one average.

Protocol part: in a butterfly all-reduce the flat vector of all tensors is cut into parts, and each reducing peer
*owns* a contiguous share of them (the runner in :mod:`template.training.allreduce_runner` moves the bytes). Every
contributing peer sends each part of the owner's share together with its weight (tokens). For each part, the
owner's :class:`CheckedPartReducer` waits for all live senders, then

1. drops contributions that are undecodable, of the wrong size/dtype, non-finite, or whose weight differs
   from the weight the sender announced at matchmaking (logged with the sender's peer id);
2. clips each remaining contribution's L2 norm to ``clip_multiple`` × the *lower* median of their norms
   (the lower median, so that in a group of two an inflated Δ is clipped to the honest one's scale), and caps each
   sender's weight at :data:`WEIGHT_CAP_MULTIPLE` × the lower median of the weights announced at matchmaking (a
   peer announcing 1e300 tokens would otherwise set the direction of the average alone);
3. takes the weighted mean (float64 accumulation), checks it is finite, compresses it **once**, and hands out
   those same bytes (:class:`PartResult`) for every peer of the group; the owner replaces its own part with the
   decoded bytes too.

Because every part is computed once and every peer decodes the same bytes with a deterministic decoder, all
peers that succeed hold **bit-identical** Δ̄ for every codec (hivemind's stock runner sends per-peer deltas
``average - local`` instead, so peers differ by ~1e-8 in fp32 and ~1e-3 with lossy codecs). Each reply also
carries the set of senders that were included in that part (a bitmask in the otherwise unused ``peer_id`` field
of ``AveragingData``) and their total weight, so every peer can report which senders made it into which fraction
of the average.

What is guaranteed when a sender disappears or misbehaves:

- A sender that stops sending (the runner calls :meth:`CheckedPartReducer.on_sender_failed`) is excluded from the
  parts it had not delivered yet; parts that it did deliver keep its contribution. No part ever waits for a
  contribution that will not come. Either way, the owner's bytes are the same for everyone.
- A bad contribution (garbage, wrong size, non-finite, weight other than announced) is dropped from its part and
  logged; an inflated norm or an inflated announced weight is clipped/capped. A part with no valid contribution,
  or whose average is not finite, fails (every waiter gets an ``AllreduceException``), and so does every part
  still pending when the reducer is finalized: a failed part is never handed out as a result.
- Senders are kept in lock-step (part p only after part p-1 is reduced), so memory is one part per sender, and a
  sender sending parts out of order is refused.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.proto import averaging_pb2

__all__ = ["WEIGHT_CAP_MULTIPLE", "CheckedPartReducer", "Contribution", "PartResult"]

logger = logging.getLogger(__name__)

# A sender's weight (tokens) counts at most this many times the lower median of the group's announced weights.
WEIGHT_CAP_MULTIPLE = 4.0


@dataclass
class PartResult:
    reply: averaging_pb2.AveragingData  # the same message (same bytes) for every peer of the group
    decoded: torch.Tensor  # what every peer writes into its result for this part


@dataclass
class Contribution:
    sender: int
    tensor: torch.Tensor | None
    weight: float
    problem: str | None  # set when the sender's message could not even be decoded


class CheckedPartReducer:
    """Reduces this peer's share of parts: validate, clip, weighted-mean, compress once (module docstring).

    Like hivemind's ``TensorPartReducer`` it keeps senders in lock-step (a sender may submit part p only after
    part p-1 is reduced), so memory is one part per sender; unlike it, results of every part stay available
    until the runner finishes, so auxiliary receivers may fetch them at their own pace.
    """

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        sender_names: Sequence[str],
        announced_weights: Sequence[float | None],
        codec: CompressionBase,
        clip_multiple: float | None,
    ):
        self.part_shapes, self.num_parts = tuple(part_shapes), len(part_shapes)
        self.sender_names, self.num_senders = tuple(sender_names), len(sender_names)
        self.announced_weights, self.codec, self.clip_multiple = tuple(announced_weights), codec, clip_multiple
        positive = sorted(w for w in announced_weights if w is not None and math.isfinite(w) and w > 0)
        # the same for every owner (everyone sees the same announced weights), so every part is weighted alike
        self.weight_cap = WEIGHT_CAP_MULTIPLE * positive[(len(positive) - 1) // 2] if positive else math.inf
        loop = asyncio.get_event_loop()
        self.results: list[asyncio.Future[PartResult]] = [loop.create_future() for _ in range(self.num_parts)]
        self.current_part_index = 0
        self.num_parts_received = [0] * self.num_senders
        self.sender_failed_after = [math.inf] * self.num_senders
        self.finished = asyncio.Event()
        self.dropped: list[tuple[str, int, str]] = []  # (sender, part, reason)
        self.clipped: list[tuple[str, int, float]] = []  # (sender, part, factor)
        self._pending: dict[int, Contribution] = {}
        self._reducing: asyncio.Task | None = None
        if self.num_parts == 0:
            self.finished.set()

    async def accumulate_part(self, contribution: Contribution, part_index: int) -> PartResult:
        sender = contribution.sender
        if part_index >= self.num_parts or part_index != self.num_parts_received[sender]:
            raise AllreduceException(f"sender {self.sender_names[sender]} sent part {part_index} out of order")
        while part_index > self.current_part_index and not self.finished.is_set():  # lock-step
            await self._wait_any(self.results[self.current_part_index])
        if self.sender_failed_after[sender] != math.inf:
            raise BannedException(f"sender {self.sender_names[sender]} was banned")
        # counting and storing happen together (no await in between): a ban at any moment then excludes
        # exactly the parts whose data we do not hold, so no part can wait for a contribution that never comes
        self.num_parts_received[sender] += 1
        self._pending[sender] = contribution
        self._maybe_reduce()
        return await self.result(part_index)

    async def result(self, part_index: int) -> PartResult:
        """The reduced part (for senders and receivers alike); raises if the part failed or the runner ended."""
        if not 0 <= part_index < self.num_parts:
            raise AllreduceException(f"part {part_index} does not exist")
        await self._wait_any(self.results[part_index])
        if not self.results[part_index].done():
            raise AllreduceException("all-reduce was terminated before this part was reduced")
        return self.results[part_index].result()

    async def _wait_any(self, future: asyncio.Future) -> None:
        """Wait for ``future`` or for the reducer to finish. (``asyncio.wait`` never cancels what it waits on, so
        a cancelled waiter cannot cancel the result that other peers are waiting for.)"""
        finished = asyncio.ensure_future(self.finished.wait())
        try:
            await asyncio.wait({future, finished}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            finished.cancel()

    def on_sender_failed(self, sender: int) -> None:
        """Exclude a sender from every part it has not submitted yet (hivemind semantics)."""
        self.sender_failed_after[sender] = self.num_parts_received[sender]
        self._maybe_reduce()

    def _maybe_reduce(self) -> None:
        if self._reducing is not None or self.finished.is_set() or self.current_part_index >= self.num_parts:
            return
        part_index = self.current_part_index
        expected = [s for s in range(self.num_senders) if part_index < self.sender_failed_after[s]]
        if any(s not in self._pending for s in expected):
            return
        contributions = [self._pending[s] for s in expected]
        self._pending = {}
        self._reducing = asyncio.create_task(self._reduce_in_background(part_index, contributions))

    async def _reduce_in_background(self, part_index: int, contributions: list[Contribution]) -> None:
        future = self.results[part_index]
        try:
            result = await asyncio.get_event_loop().run_in_executor(None, self._reduce, part_index, contributions)
            if not future.done():
                future.set_result(result)
        except Exception as e:
            logger.warning("part %d of this peer's share failed: %s", part_index, e)
            _set_exception_quietly(future, AllreduceException(f"part {part_index} failed: {e}"))
        finally:
            self._reducing = None
            self.current_part_index = part_index + 1
            if self.current_part_index >= self.num_parts:
                self.finalize()
            else:
                self._maybe_reduce()

    def _problem(self, part_index: int, c: Contribution) -> str | None:
        if c.problem is not None:
            return c.problem
        expected_numel = self.part_shapes[part_index].numel()
        if c.tensor.dtype != torch.float32 or c.tensor.numel() != expected_numel:
            return f"expected {expected_numel} float32 values, got {c.tensor.numel()} {c.tensor.dtype}"
        announced = self.announced_weights[c.sender]
        if announced is None or not math.isfinite(c.weight) or c.weight != announced:
            return f"weight {c.weight} differs from the announced weight {announced}"
        if not bool(torch.isfinite(c.tensor).all()):
            return "non-finite values"
        return None

    def _reduce(self, part_index: int, contributions: list[Contribution]) -> PartResult:
        """Runs in a worker thread: torch releases the GIL, the event loop keeps streaming."""
        valid: list[Contribution] = []
        for c in contributions:
            problem = self._problem(part_index, c)
            if problem is not None:
                self.dropped.append((self.sender_names[c.sender], part_index, problem))
                logger.warning("dropped part %d from %s: %s", part_index, self.sender_names[c.sender], problem)
            elif c.weight > 0:
                valid.append(c)
        if not valid:
            raise AllreduceException("no valid contribution")

        norms = [float(torch.linalg.vector_norm(c.tensor, dtype=torch.float64)) for c in valid]
        factors = [1.0] * len(valid)
        if self.clip_multiple:
            bound = self.clip_multiple * sorted(norms)[(len(norms) - 1) // 2]
            for i, norm in enumerate(norms):
                if norm > bound:
                    factors[i] = bound / norm
                    self.clipped.append((self.sender_names[valid[i].sender], part_index, factors[i]))
                    logger.info(
                        "clipped part %d from %s by %.3g", part_index, self.sender_names[valid[i].sender], factors[i]
                    )

        weights = [min(c.weight, self.weight_cap) for c in valid]
        total_weight = sum(weights)
        accumulator = torch.zeros(self.part_shapes[part_index].numel(), dtype=torch.float64)
        for c, weight, factor in zip(valid, weights, factors, strict=True):
            accumulator.add_(c.tensor.reshape(-1).to(torch.float64), alpha=weight * factor / total_weight)
        averaged = accumulator.to(torch.float32).reshape(self.part_shapes[part_index])
        if not bool(torch.isfinite(averaged).all()):
            raise AllreduceException("the average is not finite")

        serialized = self.codec.compress(averaged, CompressionInfo.from_tensor(averaged, key=part_index))
        included = sum(1 << c.sender for c in valid)
        reply = averaging_pb2.AveragingData(
            code=averaging_pb2.AVERAGED_PART,
            tensor_part=serialized,
            weight=total_weight,
            peer_id=included.to_bytes((self.num_senders + 7) // 8, "little"),
        )
        return PartResult(reply=reply, decoded=self.codec.extract(serialized))

    def finalize(self) -> None:
        if self.finished.is_set():
            return
        self.finished.set()
        for future in self.results:
            if not future.done():
                _set_exception_quietly(future, AllreduceException("all-reduce terminated"))
        if self._reducing is not None:
            self._reducing.cancel()

    @property
    def parts_received(self) -> int:
        return sum(self.num_parts_received)


def _set_exception_quietly(future: asyncio.Future, exception: BaseException) -> None:
    """Set an exception that may have no waiter, without asyncio's 'never retrieved' warning."""
    if not future.done():
        future.set_exception(exception)
        future.exception()
