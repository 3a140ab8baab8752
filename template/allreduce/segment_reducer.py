"""The owner of segments in the accountable all-reduce: turns its groupmates' verified segments into one average each.

Protocol part: in a butterfly all-reduce each reducing peer *owns* a contiguous range of segments of the flat vector
(the runner in :mod:`template.allreduce.runner` moves the bytes and checks every sender's segment against
its signed root before handing it here). For each owned segment, :class:`SegmentReducer` waits for every live
sender, then applies the owner's rule (:func:`template.allreduce.reduction.reduce_segment`: drop what does not decode,
is not finite or carries another weight than announced; clip norms to a multiple of the lower median; cap weights;
bound single values to a multiple of the lower median of the senders' largest; float64 weighted mean; encode once;
the claims), and hands out the same :class:`~template.allreduce.messages.AveragedSegment` — with the senders it
includes, the refusals it can prove and its claims — for every member of the group.

What is guaranteed when a sender disappears or misbehaves:

- A sender that stops sending (the runner calls :meth:`SegmentReducer.on_sender_failed`) is excluded from the
  segments it had not delivered yet; segments that it did deliver keep its contribution. No segment ever waits for a
  contribution that will not come. Either way, the owner's bytes are the same for everyone.
- A refused or unusable contribution is left out of its segment and reported; a segment with no valid contribution,
  or whose average does not decode to finite values, fails (every waiter gets an ``AllreduceException``), and so does
  every segment still pending when the reducer is finalized: a failed segment is never handed out as a result.
- Senders are kept in lock-step (segment p only after segment p-1 is reduced), so memory is one segment per sender,
  and a sender sending segments out of order is refused.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hivemind.averaging.partition import AllreduceException, BannedException

from template.allreduce.codecs import SegmentCodec, all_finite
from template.allreduce.messages import AveragedSegment, Refusal
from template.allreduce.reduction import NoValidContribution, OwnerRule, SegmentInput, reduce_segment, weight_cap
from template.allreduce.verification import Directions

__all__ = ["SegmentReducer", "Contribution", "SegmentResult"]

logger = logging.getLogger(__name__)


@dataclass
class SegmentResult:
    averaged: AveragedSegment  # the same for every member of the group
    decoded: torch.Tensor  # what every member writes into its result for this segment
    drawn: Directions | None = None  # the directions of the owner's claims, for its own check of ``averaged``


@dataclass
class Contribution:
    """What one sender delivered for one segment: its verified bytes, or nothing usable (and a proof, if any)."""

    sender: int
    segment: SegmentInput | None
    refusal: Refusal | None = None


class SegmentReducer:
    """Reduces this peer's share of segments: validate, clip, weighted-mean, compress once (module docstring).

    Like hivemind's ``TensorPartReducer`` it keeps senders in lock-step (a sender may submit segment p only after
    segment p-1 is reduced), so memory is one segment per sender; unlike it, results of every segment stay available
    until the runner finishes, so auxiliary receivers may fetch them at their own pace.
    """

    def __init__(
        self,
        segment_numels: Sequence[int],
        sender_names: Sequence[str],
        announced_weights: Sequence[float | None],
        codec: SegmentCodec,
        rule: OwnerRule,
        claims_contexts: Sequence[bytes] | None = None,
        left_out: int | None = None,
    ):
        """``claims_contexts``: per segment, what its claims are drawn from (None: no claims, as in tests of the
        rule alone); ``left_out``: the sender whose input is not averaged (the owner's own, when the rule says so:
        :meth:`template.allreduce.reduction.OwnerRule.leaves_out_owner`)."""
        self.segment_numels, self.num_segments = tuple(segment_numels), len(segment_numels)
        self.claims_contexts, self.left_out = claims_contexts, left_out
        self.sender_names, self.num_senders = tuple(sender_names), len(sender_names)
        self.announced_weights, self.codec, self.rule = tuple(announced_weights), codec, rule
        # the same for every owner (everyone sees the same announced weights), so every segment is weighted alike
        self.weight_cap = weight_cap(announced_weights)
        loop = asyncio.get_event_loop()
        self.results: list[asyncio.Future[SegmentResult]] = [loop.create_future() for _ in range(self.num_segments)]
        self.current_segment = 0
        self.num_segments_received = [0] * self.num_senders
        self.sender_failed_after = [math.inf] * self.num_senders
        self.finished = asyncio.Event()
        self.dropped: list[tuple[str, int, str]] = []  # (sender, segment, reason)
        self.clipped: list[tuple[str, int, float]] = []  # (sender, segment, factor)
        self.bounded: list[tuple[str, int, int]] = []  # (sender, segment, values clamped)
        self._pending: dict[int, Contribution] = {}
        self._reducing: asyncio.Task | None = None
        if self.num_segments == 0:
            self.finished.set()

    async def accumulate(self, contribution: Contribution, segment: int) -> SegmentResult:
        sender = contribution.sender
        if segment >= self.num_segments or segment != self.num_segments_received[sender]:
            raise AllreduceException(f"sender {self.sender_names[sender]} sent segment {segment} out of order")
        while segment > self.current_segment and not self.finished.is_set():  # lock-step
            await self._wait_any(self.results[self.current_segment])
        if self.sender_failed_after[sender] != math.inf:
            raise BannedException(f"sender {self.sender_names[sender]} was banned")
        # counting and storing happen together (no await in between): a ban at any moment then excludes
        # exactly the segments whose data we do not hold, so no segment can wait for a contribution that never comes
        self.num_segments_received[sender] += 1
        self._pending[sender] = contribution
        self._maybe_reduce()
        return await self.result(segment)

    async def result(self, segment: int) -> SegmentResult:
        """The reduced segment (for senders and receivers alike); raises if the segment failed or the runner ended."""
        if not 0 <= segment < self.num_segments:
            raise AllreduceException(f"segment {segment} does not exist")
        await self._wait_any(self.results[segment])
        if not self.results[segment].done():
            raise AllreduceException("all-reduce was terminated before this segment was reduced")
        return self.results[segment].result()

    async def _wait_any(self, future: asyncio.Future) -> None:
        """Wait for ``future`` or for the reducer to finish. (``asyncio.wait`` never cancels what it waits on, so
        a cancelled waiter cannot cancel the result that other peers are waiting for.)"""
        finished = asyncio.ensure_future(self.finished.wait())
        try:
            await asyncio.wait({future, finished}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            finished.cancel()

    def on_sender_failed(self, sender: int) -> None:
        """Exclude a sender from every segment it has not submitted yet (hivemind semantics)."""
        self.sender_failed_after[sender] = self.num_segments_received[sender]
        self._maybe_reduce()

    def _maybe_reduce(self) -> None:
        if self._reducing is not None or self.finished.is_set() or self.current_segment >= self.num_segments:
            return
        segment = self.current_segment
        expected = [s for s in range(self.num_senders) if segment < self.sender_failed_after[s]]
        if any(s not in self._pending for s in expected):
            return
        contributions = [self._pending[s] for s in expected]
        self._pending = {}
        self._reducing = asyncio.create_task(self._reduce_in_background(segment, contributions))

    async def _reduce_in_background(self, segment: int, contributions: list[Contribution]) -> None:
        future = self.results[segment]
        try:
            result = await asyncio.get_event_loop().run_in_executor(None, self._reduce, segment, contributions)
            if not future.done():
                future.set_result(result)
        except Exception as e:
            logger.warning("segment %d of this peer's share failed: %s", segment, e)
            _set_exception_quietly(future, AllreduceException(f"segment {segment} failed: {e}"))
        finally:
            self._reducing = None
            self.current_segment = segment + 1
            if self.current_segment >= self.num_segments:
                self.finalize()
            else:
                self._maybe_reduce()

    def _reduce(self, segment: int, contributions: list[Contribution]) -> SegmentResult:
        """Runs in a worker thread: torch releases the GIL, the event loop keeps streaming."""
        inputs = [c.segment for c in contributions if c.segment is not None and c.sender != self.left_out]
        refusals = tuple(c.refusal for c in contributions if c.refusal is not None)
        try:
            reduced = reduce_segment(inputs, self.segment_numels[segment], self.codec, self.announced_weights,
                                     self.rule, self.weight_cap,
                                     None if self.claims_contexts is None else self.claims_contexts[segment])
        except NoValidContribution:
            raise AllreduceException("no valid contribution") from None
        for sender, reason in reduced.dropped:
            self.dropped.append((self.sender_names[sender], segment, reason))
            logger.warning("dropped segment %d from %s: %s", segment, self.sender_names[sender], reason)
        for sender, factor in reduced.clipped:
            self.clipped.append((self.sender_names[sender], segment, factor))
            logger.info("clipped segment %d from %s by %.3g", segment, self.sender_names[sender], factor)
        for sender, count in reduced.bounded:
            self.bounded.append((self.sender_names[sender], segment, count))
            logger.warning("bounded %d values of segment %d from %s", count, segment, self.sender_names[sender])
        decoded = reduced.decoded
        if decoded is None:
            decoded = self.codec.decode_average(reduced.data, self.segment_numels[segment])
        if not all_finite(decoded):
            raise AllreduceException("the average is not finite")
        return SegmentResult(AveragedSegment(reduced.data, reduced.included, reduced.weight, refusals,
                                             reduced.claims, reduced.norms if reduced.claims else (),
                                             reduced.peaks if reduced.claims else (), reduced.plain, reduced.masked),
                             decoded, reduced.drawn)

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
    def segments_received(self) -> int:
        return sum(self.num_segments_received)


def _set_exception_quietly(future: asyncio.Future, exception: BaseException) -> None:
    """Set an exception that may have no waiter, without asyncio's 'never retrieved' warning."""
    if not future.done():
        future.set_exception(exception)
        future.exception()
