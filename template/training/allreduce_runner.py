"""The all-reduce runner of the checked all-reduce: moves the parts of one group's all-reduce between its peers.

Protocol part (one all-reduce in one group, once hivemind matchmaking has formed it): the flat vector of all
tensors is cut into parts; each reducing peer *owns* a contiguous share of parts. :class:`CheckedAllReduceRunner`
streams this peer's compressed parts of every owner's share to that owner together with its weight (tokens), and
serves its own share: each groupmate's stream of parts goes into a
:class:`~template.training.part_reducer.CheckedPartReducer` (validate, clip, weighted mean, compress once: see
:mod:`template.training.part_reducer`), and the owner sends the **same averaged bytes** back to every peer of the
group, with the bitmask of included senders and their total weight. Auxiliary peers (validators) send one empty
placeholder per part, contribute nothing, reduce nothing, and receive exactly the same bytes as the contributors.
The runner yields the averaged tensors in order and, at the end, a :meth:`~CheckedAllReduceRunner.report` (plain
types) of what this peer saw: values received, per-sender coverage, dropped and clipped parts, bytes moved.
:func:`_parse_group` reads every member's mode and announced weight from the data gathered at matchmaking.

What is guaranteed when a peer disappears mid-round (SIGKILL, network loss, stall) or misbehaves:

- Nobody waits forever: every stream is bounded by ``sender_timeout`` (``next_chunk_timeout``; a sender's
  silence) and ``reducer_timeout`` (2× that; an owner's silence, and how long an owner stays to serve
  groupmates that have not fetched its share yet).
- A sender that stops sending, or breaks the stream (a second stream, parts out of order), is banned: it is
  excluded from the parts of our share it had not delivered yet; parts that it did deliver keep its contribution.
- An owner that dies, is silent, or replies garbage (not an averaged part, undecodable, non-finite, wrong size or
  count) has the parts of its share that had not arrived registered as failed: the result is partial
  (``values_failed`` in the report), which the averager reports as a failure. A garbage part is never written
  into the result.
- The all-reduce handler serves members of this group only; anyone else gets ``PROTOCOL_VIOLATION``, and a
  request for another group id, or after the runner finished, is rejected.
- A malformed gather at matchmaking gives its peer no announced weight, so all its parts are dropped; the round
  goes on.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartContainer
from hivemind.compression import CompressionBase
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

from template.training.compression import CodecError
from template.training.part_reducer import CheckedPartReducer, Contribution, PartResult

__all__ = ["CheckedAllReduceRunner"]

logger = logging.getLogger(__name__)


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
        self.tensor_part_reducer = CheckedPartReducer(
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

    def _register_result(self, peer_index: int, part_index: int, result: PartResult) -> None:
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
                    contribution = Contribution(sender_index, part, self.weight, problem=None)
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
                self._register_result(peer_index, part_index, PartResult(message, decoded.reshape(-1)))
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

    def _decode_contribution(self, sender_index: int, message: averaging_pb2.AveragingData) -> Contribution:
        try:
            return Contribution(sender_index, self.codec.extract(message.tensor_part), message.weight, None)
        except CodecError as e:
            return Contribution(sender_index, None, message.weight, f"undecodable: {e}")

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
