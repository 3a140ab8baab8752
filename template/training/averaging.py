"""Butterfly all-reduce of DiLoCo pseudo-gradients over hivemind, with checked contributions and identical results.

Protocol (one all-reduce in one group, built on hivemind ``DecentralizedAverager`` matchmaking): the flat
vector of all tensors is cut into parts; each reducing peer *owns* a contiguous share of parts. Every
contributing peer streams its compressed parts to each owner together with its weight (tokens). For each part,
the owner waits for all live senders, then

1. drops contributions that are undecodable, of the wrong size/dtype, non-finite, or whose weight differs
   from the weight the sender announced at matchmaking (logged with the sender's peer id);
2. clips each remaining contribution's L2 norm to ``norm_clip_multiple`` × the *lower* median of their norms
   (the lower median, so that in a group of two an inflated Δ is clipped to the honest one's scale), and caps each
   sender's weight at :data:`WEIGHT_CAP_MULTIPLE` × the lower median of the weights announced at matchmaking (a
   peer announcing 1e300 tokens would otherwise set the direction of the average alone);
3. takes the weighted mean (float64 accumulation), checks it is finite, compresses it **once**, and sends
   those same bytes to every peer of the group; the owner replaces its own part with the decoded bytes too.

Because every part is computed once and every peer decodes the same bytes with a deterministic decoder,
all peers that succeed hold **bit-identical** Δ̄ for every codec (hivemind's stock runner sends per-peer
deltas ``average - local`` instead, so peers differ by ~1e-8 in fp32 and ~1e-3 with lossy codecs). Each
reply also carries the set of senders that were included in that part (a bitmask in the otherwise unused
``peer_id`` field of ``AveragingData``) and their total weight, so every peer can report which senders made
it into which fraction of the average. Auxiliary peers (validators) send one empty placeholder per part,
contribute nothing, reduce nothing, and receive exactly the same bytes as the contributors.

What is guaranteed when a peer disappears mid-round (SIGKILL, network loss, stall):

- Nobody waits past the caller's deadline: matchmaking is bounded by the step timeout, every stream by
  ``next_chunk_timeout`` (senders) / 2× that (reducers), the whole all-reduce by ``allreduce_timeout``, and
  :meth:`PseudoGradientAverager.finish` returns at its deadline at the latest (``ok=False``).
- A sender that stops sending is excluded from the parts it had not delivered yet; parts that it did deliver
  keep its contribution. Either way, the owner's bytes are the same for everyone.
- A peer whose result is missing *any* part (an owner died or sent garbage, hivemind's "received X%
  results") reports ``ok=False`` and its averaging buffers are left untouched: a partial result is never
  returned as success, and no all-reduce is retried after it has started (a retry in a new group could give
  two "successful" peers different averages).
- Every peer that reports ``ok=True`` for the same ``group_id`` holds byte-identical Δ̄. Peers of one group
  can still differ in ``ok`` (an owner died after serving some peers but not others): a peer with ``ok=False``
  must skip the outer step and re-sync its state (:meth:`PseudoGradientAverager.load_state_from_peers`).
- A peer that floods us with join requests or state downloads beyond its per-minute allowance is turned away
  (logged); the all-reduce handler serves members of a running group only.

Note: the RPC handle names contain the averager's class name (:class:`CheckedAverager`); it is part of the
wire protocol, which also differs from stock hivemind's, so a stock ``DecentralizedAverager`` cannot join.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import typing
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartContainer
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import (
    achain,
    aiter_with_timeout,
    amap_in_executor,
    anext,
    as_aiter,
    attach_event_on_finished,
)
from hivemind.utils.serializer import MSGPackSerializer

from template.p2p.ratelimit import RateLimiter
from template.training.compression import CODEC_NAMES, CodecError, get_compression

__all__ = ["AveragingConfig", "AveragingHandle", "AveragingResult", "CheckedAverager", "PseudoGradientAverager"]

logger = logging.getLogger(__name__)

StateProvider = Callable[[], "tuple[dict, Sequence[torch.Tensor]]"]
# A sender's weight (tokens) counts at most this many times the lower median of the group's announced weights.
WEIGHT_CAP_MULTIPLE = 4.0


@dataclass
class AveragingConfig:
    """How peers find a group and how long each stage of the all-reduce may take (seconds, bytes)."""

    prefix: str = "diloco"  # peers average only with peers of the same prefix (one run = one prefix)
    # DiLoCo needs ONE group per round (every peer must apply the same average): keep target_group_size >= the
    # number of peers; hivemind splits larger populations into groups that would average separately.
    target_group_size: int = 64
    min_group_size: int = 2
    matchmaking_time: float = 5.0  # hivemind's min_matchmaking_time: how long a leader gathers followers
    request_timeout: float = 3.0  # one matchmaking request; must be < matchmaking_time
    allreduce_timeout: float = 60.0  # the whole all-reduce after the group is formed
    next_chunk_timeout: float = 10.0  # max silence of a sender (reducers get 2x) before it is dropped
    part_size_bytes: int = 2**19
    compression: str = "fp16"  # one of compression.CODEC_NAMES
    norm_clip_multiple: float | None = 3.0  # None or 0: no norm clipping (validation still applies)
    auxiliary: bool = False  # validators: contribute nothing, receive the average
    # per-peer allowances of the handlers anyone who reaches our host may call (a peer sends a few join requests
    # per round and downloads our state when it (re)joins; a flood beyond these is refused)
    max_join_requests_per_minute: int = 120
    max_state_downloads_per_minute: int = 30
    start_timeout: float = 30.0
    shutdown_timeout: float = 5.0

    def __post_init__(self) -> None:
        if "." in self.prefix or not self.prefix:
            raise ValueError("prefix must be a non-empty string without '.'")
        if self.compression not in CODEC_NAMES:
            raise ValueError(f"unknown compression {self.compression!r}: expected one of {', '.join(CODEC_NAMES)}")
        if self.min_group_size < 1 or self.target_group_size < self.min_group_size:
            raise ValueError("need 1 <= min_group_size <= target_group_size")
        for name in ("matchmaking_time", "request_timeout", "allreduce_timeout", "next_chunk_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0: an unset timeout lets a dead peer hang the round")
        if self.request_timeout >= self.matchmaking_time:
            raise ValueError("request_timeout must be < matchmaking_time (hivemind matchmaking can deadlock otherwise)")
        if self.norm_clip_multiple is not None and self.norm_clip_multiple < 0:
            raise ValueError("norm_clip_multiple must be None or >= 0")
        if self.part_size_bytes < 1024:
            raise ValueError("part_size_bytes must be >= 1024")
        if self.max_join_requests_per_minute < 1 or self.max_state_downloads_per_minute < 1:
            raise ValueError("the per-peer allowances must be >= 1 per minute")


@dataclass
class AveragingResult:
    """What one peer saw of one all-reduce. ``averaged`` is set iff ``ok``; peers are base58 peer id strings."""

    ok: bool
    averaged: list[torch.Tensor] | None
    group: dict[str, Any]  # peer id -> the ``gather`` object that peer passed (validators included)
    group_size: int
    seconds: float
    bytes_sent: int  # payload bytes this peer sent during the all-reduce (parts + averaged parts it served)
    reason: str  # "" when ok, else why not
    bytes_received: int = 0
    weights: dict[str, float] = field(default_factory=dict)  # peer id -> announced weight (0 for auxiliaries)
    coverage: dict[str, float] = field(default_factory=dict)  # sender -> fraction of parts that included it
    group_id: str = ""  # hex; peers with ok=True and the same group_id hold identical bytes


@dataclass
class AveragingHandle:
    """A step whose matchmaking runs in the background until :meth:`PseudoGradientAverager.finish`."""

    control: StepControl
    weight: float
    gather: Any
    deadline: float


# ----------------------------------------------------------------------------------------------------------------
# inside the averager process: the reducer, the all-reduce runner, and the averager that uses them
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _PartResult:
    reply: averaging_pb2.AveragingData  # the same message (same bytes) for every peer of the group
    decoded: torch.Tensor  # what every peer writes into its result for this part


@dataclass
class _Contribution:
    sender: int
    tensor: torch.Tensor | None
    weight: float
    problem: str | None  # set when the sender's message could not even be decoded


class _CheckedPartReducer:
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
        self.results: list[asyncio.Future[_PartResult]] = [loop.create_future() for _ in range(self.num_parts)]
        self.current_part_index = 0
        self.num_parts_received = [0] * self.num_senders
        self.sender_failed_after = [math.inf] * self.num_senders
        self.finished = asyncio.Event()
        self.dropped: list[tuple[str, int, str]] = []  # (sender, part, reason)
        self.clipped: list[tuple[str, int, float]] = []  # (sender, part, factor)
        self._pending: dict[int, _Contribution] = {}
        self._reducing: asyncio.Task | None = None
        if self.num_parts == 0:
            self.finished.set()

    async def accumulate_part(self, contribution: _Contribution, part_index: int) -> _PartResult:
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

    async def result(self, part_index: int) -> _PartResult:
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

    async def _reduce_in_background(self, part_index: int, contributions: list[_Contribution]) -> None:
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

    def _problem(self, part_index: int, c: _Contribution) -> str | None:
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

    def _reduce(self, part_index: int, contributions: list[_Contribution]) -> _PartResult:
        """Runs in a worker thread: torch releases the GIL, the event loop keeps streaming."""
        valid: list[_Contribution] = []
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
        return _PartResult(reply=reply, decoded=self.codec.extract(serialized))

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


class _OutputContainer(TensorPartContainer):
    """hivemind's part container, returning averages (not deltas) and remembering each part's size."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, return_deltas=False, **kwargs)
        self.part_numels_by_peer = tuple(
            tuple(part.numel() for part, _ in parts) for parts in self._input_parts_by_peer
        )


class CheckedAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce where each part's owner sends the same averaged bytes to all (module docstring)."""

    def __init__(
        self,
        *,
        p2p,
        servicer_type,
        prefix: str | None,
        group_id: bytes,
        tensors: Sequence[torch.Tensor],
        weight: float,
        ordered_peer_ids: Sequence[PeerID],
        peer_fractions: tuple[float, ...],
        modes: Sequence[AveragingMode],
        announced_weights: Sequence[float | None],
        compression: CompressionBase,
        clip_multiple: float | None,
        sender_timeout: float,
        reducer_timeout: float,
        part_size_bytes: int,
        tensor_infos=None,
    ):
        # deliberately not calling AllReduceRunner.__init__: it builds a delta-returning container and a
        # reducer that we replace; the attributes below are the ones its inherited methods use.
        self._p2p, self.peer_id = p2p, p2p.peer_id
        self._servicer_type, self._prefix = servicer_type, prefix
        self.group_id, self.ordered_peer_ids = group_id, tuple(ordered_peer_ids)
        self.modes, self.peer_fractions = tuple(modes), tuple(peer_fractions)
        assert self.peer_id in self.ordered_peer_ids, "peer_id is not a part of the group"
        assert len(self.modes) == len(self.ordered_peer_ids) == len(self.peer_fractions) == len(announced_weights)
        self.weight, self.codec = weight, compression
        self.sender_timeout, self.reducer_timeout = sender_timeout, reducer_timeout
        self._future = asyncio.Future()

        self.sender_peer_ids = [
            p for p, mode in zip(self.ordered_peer_ids, self.modes, strict=True) if mode != AveragingMode.AUX
        ]
        self.is_sender = self.peer_id in self.sender_peer_ids
        self.all_senders_started = asyncio.Event()
        self.banned_senders: set[PeerID] = set()
        self.banlock = asyncio.Lock()
        self.active_senders: set[PeerID] = {self.peer_id} if self.is_sender else set()
        if len(self.active_senders) == len(self.sender_peer_ids):
            self.all_senders_started.set()

        my_index = self.ordered_peer_ids.index(self.peer_id)
        self.tensor_part_container = _OutputContainer(
            tensors, peer_fractions, compression=compression, part_size_bytes=part_size_bytes, tensor_infos=tensor_infos
        )
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(my_index)
        weight_by_peer = dict(zip(self.ordered_peer_ids, announced_weights, strict=True))
        self.tensor_part_reducer = _CheckedPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            [str(p) for p in self.sender_peer_ids],
            [weight_by_peer[p] for p in self.sender_peer_ids],
            compression,
            clip_multiple,
        )
        self.owns_parts = self.tensor_part_container.num_parts_by_peer[my_index] > 0
        # peers that still have to fetch (and send) this peer's share before it may finish
        self._unserved = {p for p in self.ordered_peer_ids if p != self.peer_id} if self.owns_parts else set()
        self._all_served = asyncio.Event()
        if not self._unserved:
            self._all_served.set()
        self.included_parts = [0] * len(self.sender_peer_ids)
        self.bytes_sent = self.bytes_received = 0

    async def run(self) -> AsyncIterator[torch.Tensor]:
        """Send parts to owners, collect averaged parts from all owners, yield the averaged tensors in order."""
        pending_tasks = set()
        if self.owns_parts:
            pending_tasks.add(asyncio.create_task(self._handle_missing_senders()))
        try:
            for peer_id, num_parts in zip(
                self.ordered_peer_ids, self.tensor_part_container.num_parts_by_peer, strict=True
            ):
                if num_parts != 0:
                    pending_tasks.add(asyncio.create_task(self._communicate_with_peer(peer_id)))
            async for averaged_tensor in self.tensor_part_container.iterate_output_tensors():
                yield averaged_tensor
            # stay alive (bounded) until groupmates, auxiliaries included, have fetched this peer's share
            try:
                await asyncio.wait_for(self._all_served.wait(), timeout=self.reducer_timeout)
            except asyncio.TimeoutError:
                logger.warning("%s: peers %s did not fetch this peer's share", self, sorted(map(str, self._unserved)))
            self.finalize()
        except BaseException as e:
            self.finalize(exception=e)
            for task in pending_tasks:
                task.cancel()
            raise
        finally:
            for task in pending_tasks:
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                except Exception as inner_exc:
                    logger.debug("task %s failed with %r", task, inner_exc, exc_info=True)

    def _register_result(self, peer_index: int, part_index: int, result: _PartResult) -> None:
        self.tensor_part_container.register_processed_part(peer_index, part_index, result.decoded)
        included = int.from_bytes(result.reply.peer_id, "little")
        for sender in range(len(self.sender_peer_ids)):
            self.included_parts[sender] += (included >> sender) & 1

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        """Send our parts to the owner ``peer_id`` and register the averaged parts it returns."""
        peer_index = self.ordered_peer_ids.index(peer_id)
        try:
            if peer_id == self.peer_id:  # owners are always senders: auxiliaries get a zero share
                sender_index = self.sender_peer_ids.index(self.peer_id)
                for part_index, part in enumerate(self.parts_for_local_averaging):
                    contribution = _Contribution(sender_index, part, self.weight, problem=None)
                    result = await self.tensor_part_reducer.accumulate_part(contribution, part_index)
                    self._register_result(peer_index, part_index, result)
                return

            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            expected_numels = self.tensor_part_container.part_numels_by_peer[peer_index]
            part_index = 0
            async for message, decoded in amap_in_executor(
                self._decode_reply,
                aiter_with_timeout(stream, self.reducer_timeout),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                if part_index >= len(expected_numels) or decoded.numel() != expected_numels[part_index]:
                    raise AllreduceException(f"{peer_id} sent a part of the wrong size or too many parts")
                self.bytes_received += message.ByteSize()
                self._register_result(peer_index, part_index, _PartResult(message, decoded.reshape(-1)))
                part_index += 1
            if part_index != len(expected_numels):
                raise AllreduceException(f"{peer_id} sent {part_index} of {len(expected_numels)} parts")
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug("failed to get averaged parts from %s: %r", peer_id, e, exc_info=True)
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    def _decode_reply(self, message: averaging_pb2.AveragingData) -> tuple[averaging_pb2.AveragingData, torch.Tensor]:
        if message.code != averaging_pb2.AVERAGED_PART:
            raise AllreduceException(f"owner replied {averaging_pb2.MessageCode.Name(message.code)}")
        decoded = self.codec.extract(message.tensor_part)  # CodecError on garbage
        if decoded.dtype != torch.float32 or not bool(torch.isfinite(decoded).all()):
            raise AllreduceException("owner sent a non-finite or non-float32 average")
        return message, decoded

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Senders stream their compressed parts; auxiliaries stream one empty placeholder per part."""
        if self.is_sender:
            parts = self.tensor_part_container.iterate_input_parts_for(peer_index)
            messages = (averaging_pb2.AveragingData(tensor_part=part, weight=self.weight) async for part in parts)
        else:
            count = self.tensor_part_container.num_parts_by_peer[peer_index]
            messages = as_aiter(*(averaging_pb2.AveragingData(weight=0.0) for _ in range(count)))
        first = True
        async for message in messages:
            if first:
                message.code, message.group_id, first = averaging_pb2.PART_FOR_AVERAGING, self.group_id, False
            self.bytes_sent += message.ByteSize()
            yield message

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A groupmate streams its parts of our share (or placeholders); we reply with the averaged parts."""
        remote = context.remote_id
        if remote not in self.ordered_peer_ids:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        sender_index = self.sender_peer_ids.index(remote) if remote in self.sender_peer_ids else None
        if sender_index is not None:
            self.active_senders.add(remote)
            if len(self.active_senders) == len(self.sender_peer_ids):
                self.all_senders_started.set()
        try:
            request = await asyncio.wait_for(anext(stream), self.sender_timeout)
            reason_to_reject = self._check_reasons_to_reject(request, context)
            if reason_to_reject is not None:
                yield reason_to_reject
                return
            if request.code != averaging_pb2.PART_FOR_AVERAGING:
                raise AllreduceException(f"{remote} sent {averaging_pb2.MessageCode.Name(request.code)}")
            stream = self._counted(aiter_with_timeout(achain(as_aiter(request), stream), self.sender_timeout))
            async for reply in self._reply_stream(stream, sender_index, delay=self.should_delay_results(remote)):
                self.bytes_sent += reply.ByteSize()
                yield reply
        except BaseException as e:
            if sender_index is not None:
                await self._ban_sender(remote)
            if not isinstance(e, Exception):
                raise  # CancelledError and the like
            logger.debug("caught %r when serving %s", e, remote, exc_info=True)
            yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
        finally:
            self._mark_served(remote)

    async def _counted(self, stream: AsyncIterator[averaging_pb2.AveragingData]):
        async for message in stream:
            self.bytes_received += message.ByteSize()
            yield message

    async def _reply_stream(self, stream, sender_index: int | None, delay: bool):
        """hivemind's flow control: peers with no share of their own get replies only after they finish sending."""
        if not delay:
            async for reply in self._accumulate_parts_streaming(stream, sender_index):
                yield reply
            return
        done_receiving, queue = asyncio.Event(), asyncio.Queue()

        async def _collect():
            try:
                stream_with_event = attach_event_on_finished(stream, done_receiving)
                async for reply in self._accumulate_parts_streaming(stream_with_event, sender_index):
                    queue.put_nowait(reply)
            finally:
                done_receiving.set()
                queue.put_nowait(None)

        collector = asyncio.create_task(_collect())
        try:
            await done_receiving.wait()
            while (reply := await queue.get()) is not None:
                yield reply
            await collector  # re-raises what went wrong while collecting
        finally:
            collector.cancel()

    async def _accumulate_parts_streaming(self, stream, sender_index: int | None):
        reducer = self.tensor_part_reducer
        part_index = 0
        try:
            if sender_index is None:  # an auxiliary: its messages are placeholders, one per part
                async for _ in stream:
                    result = await reducer.result(part_index)
                    part_index += 1
                    yield result.reply
                return
            async for contribution in amap_in_executor(
                lambda msg: self._decode_contribution(sender_index, msg),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    result = await reducer.accumulate_part(contribution, part_index)
                except BannedException:
                    break
                part_index += 1
                yield result.reply
        finally:
            if sender_index is not None and part_index != reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    def _decode_contribution(self, sender_index: int, message: averaging_pb2.AveragingData) -> _Contribution:
        try:
            return _Contribution(sender_index, self.codec.extract(message.tensor_part), message.weight, None)
        except CodecError as e:
            return _Contribution(sender_index, None, message.weight, f"undecodable: {e}")

    def _check_reasons_to_reject(self, request, context) -> averaging_pb2.AveragingData | None:
        if request.group_id != self.group_id:
            return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
        if self._future.cancelled():
            return averaging_pb2.AveragingData(code=averaging_pb2.CANCELLED)
        if self._future.done():
            return averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
        return None

    async def _ban_sender(self, peer_id: PeerID) -> None:
        await super()._ban_sender(peer_id)
        self._mark_served(peer_id)

    def _mark_served(self, peer_id: PeerID) -> None:
        self._unserved.discard(peer_id)
        if not self._unserved:
            self._all_served.set()

    def report(self) -> dict:
        """What this peer can say about the round; plain types, it crosses the process boundary."""
        container, reducer = self.tensor_part_container, self.tensor_part_reducer
        total_parts = sum(container.num_parts_by_peer)
        return dict(
            values_total=container.total_size,
            values_failed=container.failed_size,
            coverage={
                str(peer): included / total_parts if total_parts else 1.0
                for peer, included in zip(self.sender_peer_ids, self.included_parts, strict=True)
            },
            share_parts_expected=reducer.num_parts * reducer.num_senders,
            share_parts_received=reducer.parts_received,
            dropped=list(reducer.dropped),
            clipped=list(reducer.clipped),
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
        )


def _parse_group(group_info: GroupInfo) -> tuple[list[AveragingMode], list[float | None]]:
    """Modes and announced weights of the group, from the data gathered at matchmaking."""
    modes, weights = [], []
    for blob in group_info.gathered:
        _bandwidth, mode_id, user_blob = MSGPackSerializer.loads(blob)
        mode = AveragingMode(mode_id)
        modes.append(mode)
        try:
            weight = MSGPackSerializer.loads(user_blob).get("weight")
        except Exception:  # a malformed gather: that peer's parts get dropped, the round goes on
            weight = None
        if mode == AveragingMode.AUX:
            weight = 0.0
        ok = isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight) and weight >= 0
        weights.append(float(weight) if ok else None)
    return modes, weights


class CheckedAverager(DecentralizedAverager):
    """A ``DecentralizedAverager`` that runs :class:`CheckedAllReduceRunner` and refuses partial results.

    Its class name is part of the RPC handle names: every peer of a run must use this class. The two handlers any
    peer may call without being in our group (join requests, state downloads) are rate-limited per peer; the
    all-reduce handler serves the members of a running group only (:meth:`CheckedAllReduceRunner.rpc_aggregate_part`).
    """

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: hivemind.DHT,
        *,
        norm_clip_multiple: float | None,
        state_provider: StateProvider | None,
        max_join_requests_per_minute: int,
        max_state_downloads_per_minute: int,
        **kwargs,
    ):
        self._norm_clip_multiple = norm_clip_multiple
        self._state_provider = state_provider
        self._reports: dict[bytes, dict] = {}
        self._join_limiter = RateLimiter(max_join_requests_per_minute)  # lives in the averager process
        self._download_limiter = RateLimiter(max_state_downloads_per_minute)
        super().__init__(averaged_tensors, dht, **kwargs)

    # hivemind derives each handler's wire form from its annotations and recognizes typing's AsyncIterator only
    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's matchmaking, for peers within their allowance; others are told we are not available."""
        if not self._join_limiter.allow(str(context.remote_id)):
            logger.info("refused a join request from %s: over its per-minute allowance", context.remote_id)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """Our state, for peers within their allowance; others get an empty answer and ask the next peer."""
        if not self._download_limiter.allow(str(context.remote_id)):
            logger.info("refused a state download by %s: over its per-minute allowance", context.remote_id)
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs) -> dict:
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        return dict(
            gathered={str(peer): data for peer, data in gathered.items()},
            report=self._reports.pop(group_info.group_id),
        )

    async def _run_allreduce_inplace_(self, tensors, group_info: GroupInfo, group_id: bytes | None = None, **kwargs):
        group_id = group_info.group_id if group_id is None else group_id
        modes, weights = _parse_group(group_info)
        runner = CheckedAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            group_id=group_id,
            tensors=tensors,
            ordered_peer_ids=group_info.peer_ids,
            modes=modes,
            announced_weights=weights,
            clip_multiple=self._norm_clip_multiple,
            **kwargs,
        )
        assert group_id in self._running_groups, f"group {group_id} was not registered"
        self._running_groups[group_id].set_result(runner)

        averaged = [tensor async for tensor in runner]
        report = runner.report()
        # hivemind would call a partial result a success; we report it as a failure (without raising, so that
        # hivemind neither logs it as a crash nor retries) and leave the buffers untouched
        failure = ""
        if report["values_failed"]:
            received = 100.0 * (1 - report["values_failed"] / report["values_total"])
            failure = f"partial all-reduce: received {received:.1f}% of the averaged values"
        elif not all(bool(torch.isfinite(tensor).all()) for tensor in averaged):
            failure = "the averaged result is not finite"
        else:
            for tensor, result in zip(tensors, averaged, strict=True):
                tensor.copy_(result)
            self.last_updated = time.time()
            self._state_updated.set()
        if failure:
            logger.warning("all-reduce in group %s failed: %s", group_id.hex(), failure)
        self._reports[group_id] = dict(report, group_id=group_id.hex(), failure=failure)

    def get_current_state(self):
        """Runs in the host process when a peer downloads our state (only when a provider was given)."""
        if self._state_provider is None:
            raise RuntimeError("this averager shares no state")
        metadata, tensors = self._state_provider()
        return metadata, [tensor.detach().cpu() for tensor in tensors], None


# ----------------------------------------------------------------------------------------------------------------
# the host-process facade
# ----------------------------------------------------------------------------------------------------------------


class PseudoGradientAverager:
    """Average lists of CPU float32 tensors (pseudo-gradients) with a group of peers, weighted by tokens.

    One step at a time: call :meth:`average`, or :meth:`begin` early (matchmaking runs during the last inner
    steps) and :meth:`finish` with the tensors. Nothing here knows about models, chains or validators.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        shapes: Sequence[torch.Size],
        config: AveragingConfig,
        state_provider: StateProvider | None = None,
    ):
        self.config = config
        self.shapes = [torch.Size(shape) for shape in shapes]
        if not self.shapes or any(shape.numel() == 0 for shape in self.shapes):
            raise ValueError("shapes must be a non-empty list of non-empty shapes")
        self._buffers = [torch.zeros(shape, dtype=torch.float32) for shape in self.shapes]
        self._closed = False
        self._averager = CheckedAverager(
            self._buffers,  # hivemind moves them to shared memory in place: the child process writes here
            dht,
            start=False,
            prefix=config.prefix,
            target_group_size=config.target_group_size,
            min_group_size=config.min_group_size,
            min_matchmaking_time=config.matchmaking_time,
            request_timeout=config.request_timeout,
            allreduce_timeout=config.allreduce_timeout,
            next_chunk_timeout=config.next_chunk_timeout,
            part_size_bytes=config.part_size_bytes,
            compression=get_compression(config.compression),
            auxiliary=config.auxiliary,
            bandwidth=0.0 if config.auxiliary else None,  # auxiliaries own no share of the vector
            allow_state_sharing=state_provider is not None,
            shutdown_timeout=config.shutdown_timeout,
            norm_clip_multiple=config.norm_clip_multiple,
            state_provider=state_provider,
            max_join_requests_per_minute=config.max_join_requests_per_minute,
            max_state_downloads_per_minute=config.max_state_downloads_per_minute,
        )
        try:
            self._averager.run_in_background(await_ready=True, timeout=config.start_timeout)
        except BaseException:
            self.shutdown()
            raise

    @property
    def peer_id(self) -> str:
        return str(self._averager.peer_id)

    def begin(
        self, weight: float, gather: Any, scheduled_time: float, deadline: float | None = None
    ) -> AveragingHandle:
        """Start matchmaking now for an all-reduce at ``scheduled_time`` (time.time()); tensors come in finish().

        ``weight`` (tokens) is announced to the group now and cannot change; auxiliaries' weight is ignored.
        ``gather`` must be msgpack-able; everyone in the group receives it. ``deadline`` (time.time()) bounds
        matchmaking; it defaults to ``scheduled_time + allreduce_timeout``.
        """
        self._check_open()
        weight = 0.0 if self.config.auxiliary else float(weight)
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be finite and >= 0, got {weight}")
        if deadline is None:
            deadline = scheduled_time + self.config.allreduce_timeout
        if not scheduled_time < deadline:
            raise ValueError("scheduled_time must be before the deadline")
        control = self._step(weight, gather, scheduled_time, deadline, require_trigger=True)
        return AveragingHandle(control, weight, gather, deadline)

    def _step(self, weight: float, gather: Any, scheduled_time: float, deadline: float, require_trigger: bool):
        return self._averager.step(
            gather=dict(weight=weight, data=gather),
            weight=None if self.config.auxiliary else weight,
            scheduled_time=scheduled_time,
            timeout=max(deadline - time.time(), 1e-3),
            allow_retries=False,  # an all-reduce that started is never silently redone (module docstring)
            require_trigger=require_trigger,
            wait=False,
        )

    def finish(
        self, handle: AveragingHandle, deltas: Sequence[torch.Tensor] | None, deadline: float
    ) -> AveragingResult:
        """Hand over this peer's tensors (None for auxiliaries), run the all-reduce, return by ``deadline``.

        ``seconds`` of the result is the time spent in this call (waiting for the group, then the all-reduce).
        """
        self._check_open()
        started = time.monotonic()
        deadline = min(deadline, handle.deadline)
        if not self.config.auxiliary:
            self._check_deltas(deltas)
        if not self._with_buffers(deadline, self._load, deltas):
            handle.control.cancel()
            return self._failure(started, "the averaging buffers stayed locked by an earlier all-reduce")
        control = handle.control
        control.allow_allreduce()
        while True:
            try:
                outcome = control.result(timeout=max(deadline - time.time(), 0.0))
                break
            except TimeoutError:
                control.cancel()
                return self._failure(started, f"deadline passed (stage {control.stage.name})")
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # whatever the averager process set, CancelledError included
                # a failure before any data moved (no group, leader left) can be retried within the deadline
                retry_at = time.time() + self.config.matchmaking_time
                if control.began_allreduce or retry_at >= deadline - self.config.request_timeout:
                    return self._failure(started, f"{type(e).__name__}: {e}")
                logger.info("averaging step failed before the all-reduce (%r); looking for a group again", e)
                control = self._step(handle.weight, handle.gather, retry_at, deadline, require_trigger=False)

        report, gathered = outcome["report"], outcome["gathered"]
        reason = report["failure"]
        averaged: list[torch.Tensor] | None = None
        if not reason:
            averaged = []
            if not self._with_buffers(deadline, lambda: averaged.extend(b.clone() for b in self._buffers)):
                averaged, reason = None, "the averaged result could not be read before the deadline"
        return AveragingResult(
            ok=not reason,
            averaged=averaged,
            group={peer: data.get("data") if isinstance(data, dict) else None for peer, data in gathered.items()},
            group_size=len(gathered),
            seconds=time.monotonic() - started,
            bytes_sent=report["bytes_sent"],
            reason=reason,
            bytes_received=report["bytes_received"],
            weights={peer: _weight_of(data) for peer, data in gathered.items()},
            coverage=report["coverage"],
            group_id=report["group_id"],
        )

    def average(
        self, deltas: Sequence[torch.Tensor] | None, weight: float, gather: Any, deadline: float
    ) -> AveragingResult:
        """Find a group now and all-reduce ``deltas`` weighted by ``weight``; return by ``deadline`` (time.time())."""
        scheduled_time = time.time() + self.config.matchmaking_time
        if scheduled_time >= deadline:
            return AveragingResult(False, None, {}, 0, 0.0, 0, "deadline is shorter than matchmaking_time")
        return self.finish(self.begin(weight, gather, scheduled_time, deadline), deltas, deadline)

    def set_state_priority(self, priority: float) -> None:
        """Peers loading state pick the sharing peer with the highest priority: pass e.g. the round number."""
        self._averager.state_sharing_priority = float(priority)

    def load_state_from_peers(self, timeout: float) -> tuple[dict, list[torch.Tensor]] | None:
        """Download (metadata, tensors) that a live peer's ``state_provider`` returns; None if none in time."""
        self._check_open()
        deadline = time.time() + timeout
        while (remaining := deadline - time.time()) > 0:
            try:
                state = self._averager.load_state_from_peers(wait=True, timeout=remaining)
            except TimeoutError:
                return None
            if state is not None:
                metadata, tensors = state
                if isinstance(metadata, dict) and all(isinstance(t, torch.Tensor) for t in tensors):
                    return metadata, list(tensors)
                logger.warning("a peer sent a malformed state; trying again")
            # no peer has declared its state yet (DHT records take a moment to appear): poll, bounded
            time.sleep(min(0.5, max(deadline - time.time(), 0.0)))
        return None

    def shutdown(self) -> None:
        """Stop the averager process; idempotent; bounded: ~``shutdown_timeout``, then SIGTERM, then SIGKILL."""
        if self._closed:
            return
        self._closed = True
        if self._averager.is_alive():
            self._averager.shutdown()  # asks politely, joins for shutdown_timeout, then terminates
        if self._averager.is_alive():
            self._averager.join(1.0)
        if self._averager.is_alive():
            self._averager.kill()
            self._averager.join(1.0)

    def __enter__(self) -> PseudoGradientAverager:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- helpers ---------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the averager was shut down")

    def _check_deltas(self, deltas: Sequence[torch.Tensor] | None) -> None:
        if deltas is None or len(deltas) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} tensors")
        for delta, shape in zip(deltas, self.shapes, strict=True):
            if delta.shape != shape or delta.device.type != "cpu":
                raise ValueError(
                    f"expected a CPU tensor of shape {tuple(shape)}, got {tuple(delta.shape)} on {delta.device}"
                )

    def _load(self, deltas: Sequence[torch.Tensor] | None) -> None:
        for buffer, delta in zip(
            self._buffers, deltas if deltas is not None else [None] * len(self._buffers), strict=True
        ):
            if delta is None:
                buffer.zero_()
            else:
                buffer.copy_(delta.detach())

    def _with_buffers(self, deadline: float, function: Callable, *args) -> bool:
        """Run ``function`` while holding the averager's tensor lock; False if the lock stays taken past deadline."""
        lock = self._averager.lock_averaged_tensors
        if not lock.acquire(timeout=max(deadline - time.time(), 0.0)):
            return False
        try:
            function(*args)
            return True
        finally:
            lock.release()

    def _failure(self, started: float, reason: str) -> AveragingResult:
        logger.warning("averaging failed: %s", reason)
        return AveragingResult(False, None, {}, 0, time.monotonic() - started, 0, reason)


def _weight_of(gathered: Any) -> float:
    weight = gathered.get("weight") if isinstance(gathered, dict) else None
    return float(weight) if isinstance(weight, (int, float)) else 0.0
