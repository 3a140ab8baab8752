"""The all-reduce runner of the accountable all-reduce: moves one group's segments between its members.

Protocol part (one all-reduce in one group, once hivemind matchmaking has formed it and every member's gathered data
carries its signed :class:`~template.allreduce.contribution.Commitment`): the flat vector is cut into segments
(:class:`SegmentLayout`); each reducing member *owns* a contiguous range of them, in proportion to hivemind's peer
fractions. :class:`CheckedAllReduceRunner`

- streams, to every owner, a :class:`~template.allreduce.messages.RangeHeader` (the leaves of the owner's range
  and their Merkle proof) and then each segment of the range with the sender's signed statement of its digest — the
  exact bytes the sender encoded once and committed to; auxiliary members (validators) send one empty placeholder per
  message;
- serves its own range: checks each sender's header against the sender's signed root, then each segment against its
  leaf *before* it reaches the :class:`~template.allreduce.segment_reducer.SegmentReducer`; a segment whose bytes do
  not match is left out of that segment's average and refused — with the sender's own signature as proof when the
  sender signed those bytes, silently otherwise; every member receives the same averaged segments (their bytes, the
  senders included, the proven refusals, its claims), and finally a :class:`~template.allreduce.messages.
  ShareCertificate` in which the owner signs the digest of everything it sent;
- decodes what every owner returns into the output vector — as zeros where the average misses the owner's own
  claims (:mod:`template.allreduce.verification`: every member reaches the same verdict from the same bytes) and,
  as a sender, checks what each owner states of its own input (:mod:`template.allreduce.disputes`); a share counts
  only once the owner's certificate over exactly its bytes verifies; keeps each verified share as received
  (:mod:`template.allreduce.relay`) to relay it to a groupmate that missed it, and fetches any share it
  missed itself from a groupmate that holds it (the certificate proves the relayed bytes are the owner's); keeps an
  audit of the round (:meth:`CheckedAllReduceRunner.report`): who was included in which segment, the proven
  refusals, which segments were dropped and why, the digest of every averaged segment and every owner's signed
  certificate, for the confirmation between members and for validators.

What is guaranteed when a peer disappears mid-round (SIGKILL, network loss, stall) or misbehaves:

- Nobody waits forever: every stream is bounded by ``sender_timeout`` (a sender's silence) and ``reducer_timeout``
  (2× that; an owner's silence, and how long an owner stays to serve groupmates that have not fetched its share),
  and never past ``deadline``: a groupmate that never comes cannot get a complete result cancelled with the wait.
- A sender that starts late, stops sending, or breaks the stream (a bad header, segments out of order), is banned:
  excluded from the segments of our range it had not delivered yet (those it did keep it); one that starts up to
  ``sender_timeout`` after its ban still gets our averages.
- An owner that dies, is silent, replies garbage (not an averaged segment, undecodable, non-finite, wrong count) or
  signs its certificate wrongly does not cost the round: its share is fetched, whole and certified, from any groupmate
  that received it, and last from the owner itself (asked one after the other, each bounded by ``reducer_timeout``).
  Only a share that no groupmate holds leaves its segments failed: the result is partial (``values_failed`` in the
  report), which the averager reports as a failure. Nothing uncertified ever counts.
- A member that answers "not in this group" (hivemind's leader counted it in after it had stopped waiting for the
  leader's word) is neither waited for nor asked for shares; when the result misses only the ranges of such members
  (no groupmate held their shares), no member can complete the group and the report says so (``lost_to_absent``):
  the averager looks for a group again.
- The all-reduce handler serves members of this group only; anyone else gets ``PROTOCOL_VIOLATION``, and a request
  for another group id, or after the runner finished, is rejected.
- A member whose gathered data is malformed has no announced weight or commitment: its segments are dropped.

Misbehaviours for the adversarial tests (:class:`AllReduceFaults`) are applied here, plainly marked; a peer with the
default faults (none) runs the honest protocol.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, aiter_with_timeout, anext, as_aiter, attach_event_on_finished

from template.allreduce.codecs import CodecError
from template.allreduce.contribution import (
    ContributionError,
    leaf_digest,
    merkle_levels,
    range_proof,
    root_from_range,
    statement_bytes,
)
from template.allreduce.disputes import OwnInputCheck
from template.allreduce.evidence import AllReduceEvidence, AllReduceReport, OwnerCertificate, SegmentRecord
from template.allreduce.messages import (
    AveragedSegment,
    MessageError,
    RangeHeader,
    Refusal,
    SenderSegment,
    ShareCertificate,
    ShareRequest,
    certificate_bytes,
    segments_digest,
)
from template.allreduce.owner_inputs import InputKeeper
from template.allreduce.reduction import OwnerRule, SegmentInput
from template.allreduce.relay import HeldShares, share_message
from template.allreduce.roster import GroupRoster
from template.allreduce.segment_reducer import Contribution, SegmentReducer
from template.allreduce.terms import OwnContribution, RoundTerms
from template.allreduce.verification import Admitted, SegmentCheck, round_context, segment_context

__all__ = ["CheckedAllReduceRunner", "NotInGroupError"]

T = TypeVar("T")

logger = logging.getLogger(__name__)


class NotInGroupError(AllreduceException):
    """An owner answered our segments that our group is not one of its groups."""


class CheckedAllReduceRunner:
    """Butterfly all-reduce of committed segments; each owner sends the same averages to all (module docstring).

    It replaces hivemind's ``AllReduceRunner`` inside hivemind's averager: the averager routes the groupmates'
    ``rpc_aggregate_part`` calls for this group to :meth:`rpc_aggregate_part` (by duck typing; nothing is inherited).
    """

    def __init__(
        self,
        *,
        p2p,
        servicer_type,
        prefix: str | None,
        group_id: bytes,
        weight: float,
        ordered_peer_ids: Sequence[PeerID],
        peer_fractions: tuple[float, ...],
        modes: Sequence[AveragingMode],
        announced_weights: Sequence[float | None],
        terms: RoundTerms,
        own: OwnContribution | None,
        rule: OwnerRule,
        sender_timeout: float,
        reducer_timeout: float,
        deadline: float | None = None,
        output: torch.Tensor | None = None,
    ):
        self._p2p, self.peer_id = p2p, p2p.peer_id
        self._servicer_type, self._prefix = servicer_type, prefix
        self.group_id, self.ordered_peer_ids = group_id, tuple(ordered_peer_ids)
        self.modes, self.peer_fractions = tuple(modes), tuple(peer_fractions)
        assert self.peer_id in self.ordered_peer_ids, "peer_id is not a part of the group"
        assert len(self.modes) == len(self.ordered_peer_ids) == len(self.peer_fractions) == len(announced_weights)
        self.weight, self.terms, self.own = weight, terms, own
        self.sender_timeout, self.reducer_timeout = sender_timeout, reducer_timeout
        self.deadline = deadline  # event-loop time: stop waiting on groupmates before hivemind cancels the all-reduce
        self._future = asyncio.Future()

        self.sender_peer_ids = [p for p, mode in zip(self.ordered_peer_ids, self.modes, strict=True)
                                if mode != AveragingMode.AUX]
        assert len(terms.commitments) == len(self.sender_peer_ids)
        self.is_sender = self.peer_id in self.sender_peer_ids
        assert not self.is_sender or own is not None, "a sender needs its encoded contribution"
        layout = terms.layout
        self.ranges = layout.ranges(self.peer_fractions)
        self.my_index = self.ordered_peer_ids.index(self.peer_id)
        self.my_range = self.ranges[self.my_index]
        weight_by_peer = dict(zip(self.ordered_peer_ids, announced_weights, strict=True))
        context = round_context(terms.scope, terms.round, group_id)
        left_out = rule.left_out(self.ordered_peer_ids, self.sender_peer_ids)  # disputes.py: every claim checked
        self.reducer = SegmentReducer([layout.numel_of(k) for k in range(*self.my_range)],
                                      [str(p) for p in self.sender_peer_ids],
                                      [weight_by_peer[p] for p in self.sender_peer_ids], terms.codec, rule,
                                      [segment_context(context, k) for k in range(*self.my_range)],
                                      None if left_out is None else left_out[self.my_index])
        own_check = OwnInputCheck(terms.codec, rule, self.sender_peer_ids.index(self.peer_id), own.segments,
                                  self.my_range, terms.faults.dispute) if self.is_sender else None
        self.check = SegmentCheck(terms.codec, context, [None if w is None else min(w, self.reducer.weight_cap)
                                                         for w in self.reducer.announced_weights], own_check, left_out)
        # ``output``: where the averages go (the averager lends the same buffer every round: a fresh 40 MB block for
        # 10M values costs ~17 ms of page faults). Never zeroed: only a registered segment is ever read, and the
        # averager copies the output only when every segment is.
        if output is None:
            output = torch.empty(layout.numel, dtype=torch.float32)
        assert output.dtype == torch.float32 and output.shape == (layout.numel,), "output must fit the layout"
        self.output = output
        self.registered = [False] * layout.count  # which segments of the output hold a verified average
        self.evidence = AllReduceEvidence(senders=tuple(str(p) for p in self.sender_peer_ids),
                                          ranges=tuple(tuple(r) for r in self.ranges), left_out=left_out or ())
        self.owns_segments = self.my_range[1] > self.my_range[0]
        self.roster = GroupRoster(self.peer_id, self.ordered_peer_ids, self.sender_peer_ids,
                                  owns_segments=self.owns_segments, on_banned=self.reducer.on_sender_failed)
        keys = [c.key if c is not None else None for c in terms.commitments]
        self.kept = InputKeeper(*self.my_range, layout.count, keys)  # what we accept as an owner, for validators
        self._levels = merkle_levels(own.leaves) if self.is_sender else None  # our tree, for the range proofs
        self.bytes_sent = self.bytes_received = 0
        # a relay request waits at most half the requester's patience for a share still arriving
        self.held = HeldShares(group_id, self.ordered_peer_ids, wait_s=reducer_timeout / 2)

    # ------------------------------------------------------------------------------------------------ run

    async def execute(self) -> None:
        """Send segments to owners, serve our range, collect every owner's averages; returns when all arrived or
        failed (see :meth:`report`)."""
        pending_tasks = set()
        if self.owns_segments:
            pending_tasks.add(asyncio.create_task(self.roster.ban_missing_senders(self.sender_timeout)))
        try:
            owners = [(i, p) for i, p in enumerate(self.ordered_peer_ids) if self.ranges[i][1] > self.ranges[i][0]]
            results = await asyncio.gather(*(self._communicate_with_owner(i, p) for i, p in owners),
                                           return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException) and not isinstance(result, Exception):
                    raise result
            self.held.settled = True
            await self._recover_missing_shares()
            # stay alive (bounded) until groupmates, auxiliaries included, have fetched this peer's share
            try:
                await asyncio.wait_for(self.roster.all_served.wait(), timeout=self._patience())
            except asyncio.TimeoutError:
                logger.warning("%s: peers %s did not fetch this peer's share", self,
                               sorted(map(str, self.roster.unserved)))
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

    def _time_left(self) -> float | None:  # seconds until ``deadline`` (None: no deadline)
        return None if self.deadline is None else max(0.0, self.deadline - asyncio.get_event_loop().time())

    def _patience(self) -> float:
        """How long one more wait on a groupmate may take: ``reducer_timeout``, cut to what is left of ``deadline``."""
        return self.reducer_timeout if (left := self._time_left()) is None else min(self.reducer_timeout, left)

    def finalize(self, *, cancel: bool = False, exception: BaseException | None = None) -> None:
        self.held.settled = True
        if not self._future.done():
            if cancel:
                self._future.cancel()
            elif exception:
                self._future.set_exception(exception)
            else:
                self._future.set_result(None)
            self.reducer.finalize()

    # --------------------------------------------------------------------------------- receiving averages

    def _write(self, segment: int, decoded: torch.Tensor) -> None:
        start, stop = self.terms.layout.values(segment, segment + 1)
        if decoded.numel() != stop - start:
            raise AllreduceException(f"{decoded.numel()} values for segment {segment} of {stop - start}")
        self.output[start:stop] = decoded

    def _register(self, owner: int, segment: int, averaged: AveragedSegment, admitted: Admitted) -> None:
        """A segment whose average is written and certified: it counts, and is recorded as evidence."""
        self.registered[segment] = True
        # what the owner stated of each input: an auxiliary (validator) judges disputes by it (base/audit.py)
        statements = () if self.is_sender else tuple(map(averaged.statement, range(len(averaged.included))))
        self.evidence.segments[segment] = SegmentRecord(owner, tuple(averaged.included), admitted.digest,
                                                        averaged.refusals, admitted.refuted, admitted.disputed,
                                                        statements)

    def _check_certificate(self, owner: int, certificate: ShareCertificate, received: list[bytes]) -> None:
        """The owner's signature must cover exactly the packed segments we received, and our commitments."""
        owner_sender = self.sender_peer_ids.index(self.ordered_peer_ids[owner])
        commitment = self.terms.commitments[owner_sender]
        start, stop = self.ranges[owner]
        digest = segments_digest(received)
        message = certificate_bytes(self.terms.scope, self.terms.round, self.group_id, owner, start, stop,
                                    certificate.digest, certificate.commitments)
        if certificate.digest != digest or commitment is None \
                or not self.terms.verify(commitment.key, message, certificate.signature):
            raise AllreduceException(f"owner {owner}'s certificate does not match what it sent")
        if certificate.commitments != self.terms.commitments_digest:
            raise AllreduceException(f"owner {owner} averaged against other commitments than ours")
        self.evidence.certificates[owner] = OwnerCertificate(certificate.digest, certificate.commitments,
                                                             certificate.signature, start, stop)

    def _stub(self, peer_id: PeerID):
        return self._servicer_type.get_stub(self._p2p, peer_id, namespace=self._prefix)

    async def _receive_share(self, owner: int, stream: AsyncIterator[averaging_pb2.AveragingData]) -> None:
        """Read ``owner``'s share — its averaged segments in order, then its certificate — from the owner or relayed
        by a member. Each segment is decoded and checked finite as it arrives, but none counts (is registered) until
        the owner's certificate over exactly these bytes verifies."""
        start, stop = self.ranges[owner]
        codec, received, pending = self.terms.codec, [], []
        max_bytes = codec.max_average_size(self.terms.layout.segment_values)
        async for message in aiter_with_timeout(stream, self.reducer_timeout):
            self.bytes_received += message.ByteSize()
            if message.code == averaging_pb2.BAD_GROUP_ID and not received:
                raise NotInGroupError(f"owner {owner} is not in group {self.group_id.hex()}")
            if message.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"replied {averaging_pb2.MessageCode.Name(message.code)}")
            if len(received) == stop - start:
                self._check_certificate(owner, ShareCertificate.unpack(message.tensor_part.buffer), received)
                for segment, averaged, admitted in pending:
                    self._register(owner, segment, averaged, admitted)
                self.held.shares[owner] = (tuple(received), message.tensor_part.buffer)
                return
            segment = start + len(received)
            averaged = AveragedSegment.unpack(message.tensor_part.buffer, max_bytes, len(self.sender_peer_ids))
            admitted = await asyncio.get_event_loop().run_in_executor(
                None, self.check.admit, owner, segment, averaged, self.terms.layout.numel_of(segment))
            self._write(segment, admitted.values)
            pending.append((segment, averaged, admitted))
            received.append(message.tensor_part.buffer)  # the certificate covers exactly these bytes
        raise AllreduceException(f"{len(received)} of {stop - start} segments of owner {owner} and no certificate")

    async def _recover_missing_shares(self) -> None:
        """Fetch every share we miss (its owner died, stalled or broke its stream to us) from groupmates that hold it
        whole; only a share that no member holds stays failed. Bounded: ``reducer_timeout`` per groupmate asked."""
        missing = [owner for owner, (start, stop) in enumerate(self.ranges)
                   if start < stop and not all(self.registered[start:stop])]
        await asyncio.gather(*(self._recover_share(owner) for owner in missing))

    async def _recover_share(self, owner: int) -> None:
        holders = [p for i, p in enumerate(self.ordered_peer_ids)
                   if i not in (owner, self.my_index) and p not in self.roster.absent]
        random.shuffle(holders)  # spread the relaying over the members that have it
        # the owner last: its reply to us was lost or late, yet it holds its share (in a group of two, or when every
        # other member is gone or frozen, it is the only one that can still give it)
        holders.append(self.ordered_peer_ids[owner])
        request = share_message(ShareRequest(owner).pack(), code=averaging_pb2.PART_FOR_AVERAGING)
        request.group_id = self.group_id
        for holder in holders:
            if (patience := self._patience()) <= 0:
                logger.info("no time left to fetch owner %d's share", owner)
                return
            try:
                await asyncio.wait_for(self._fetch_share(holder, owner, request), patience)
            except Exception as e:  # this holder cannot help (it misses the share too, left, or lied): next one
                logger.info("could not fetch owner %d's share from %s: %r", owner, holder, e)
                continue
            logger.info("fetched owner %d's share from groupmate %s", owner, holder)
            self.evidence.recovered[owner] = str(holder)
            return

    async def _fetch_share(self, holder: PeerID, owner: int, request: averaging_pb2.AveragingData) -> None:
        await self._receive_share(owner, await self._stub(holder).rpc_fetch_share(request))

    async def _communicate_with_owner(self, owner: int, peer_id: PeerID) -> None:
        """Send our segments of ``owner``'s range and register the averages it returns (or serve our own range), by our
        deadline: a frozen owner keeps its connection open, and a stream to it may never open (seen under load:
        hivemind then cancelled the whole all-reduce, with no report)."""
        try:
            if peer_id == self.peer_id:  # owners are always senders: auxiliaries own nothing
                await _bounded(self._average_own_range(), self._time_left(), "own range not averaged by deadline")
                return
            await _bounded(self._exchange_with_owner(owner, peer_id), self._time_left(),
                           f"no share of owner {owner} by deadline")
        except BaseException as e:
            if isinstance(e, NotInGroupError):  # hivemind's leader counted it in after it had left (roster)
                self.roster.not_in_group(peer_id)
            if isinstance(e, (AllreduceException, MessageError, CodecError, ContributionError)):
                logger.warning("owner %s failed: %s", peer_id, e)
            elif isinstance(e, Exception):
                logger.debug("failed to get averaged segments from %s: %r", peer_id, e, exc_info=True)
            self.evidence.failed_owners[str(peer_id)] = f"{type(e).__name__}: {e}"
            raise

    async def _exchange_with_owner(self, owner: int, peer_id: PeerID) -> None:
        if self.terms.faults.start_late_s:  # AllReduceFaults: a process that stalled as its group formed
            await asyncio.sleep(self.terms.faults.start_late_s)
        done_sending = asyncio.Event()
        inputs = attach_event_on_finished(self._generate_input_for_owner(owner), done_sending)
        # opened within our patience, so that a share the owner never sends can still be fetched from a groupmate
        stream = await _bounded(self._stub(peer_id).rpc_aggregate_part(inputs), self._patience(),
                                f"owner {owner} did not open our stream in time")
        if self.should_delay_results(self.peer_id):
            await done_sending.wait()
        await self._receive_share(owner, stream)

    async def _average_own_range(self) -> None:
        """Our own segments go to our reducer directly; the results are registered like any owner's."""
        start, stop = self.my_range
        sender = self.sender_peer_ids.index(self.peer_id)
        self.kept.header(sender, self.own.leaves[start:stop], range_proof(self._levels, start, stop))
        sent = []
        for offset, segment in enumerate(range(start, stop)):
            self.kept.keep(sender, segment, self.own.segments[segment])
            contribution = Contribution(sender, SegmentInput(sender, self.own.segments[segment], self.weight))
            result = await self.reducer.accumulate(contribution, offset)
            averaged = self.terms.told(self.my_index, segment, result, self.check, self.kept)
            honest = averaged is result.averaged  # else AllReduceFaults told a lie: check it as every member does
            drawn, result.drawn = result.drawn, None  # needed once, here; the reducer keeps its results all round
            admitted = await asyncio.get_event_loop().run_in_executor(
                None, self.check.admit, self.my_index, segment, averaged, result.decoded.numel(),
                result.decoded if honest else None, drawn if honest else None)
            self._write(segment, admitted.values)
            self._register(self.my_index, segment, averaged, admitted)
            sent.append(averaged.pack(len(self.sender_peer_ids)))
        certificate = self._certificate(sent)
        self.evidence.certificates[self.my_index] = OwnerCertificate(certificate.digest, certificate.commitments,
                                                                     certificate.signature, start, stop)
        self.held.shares[self.my_index] = (tuple(sent), certificate.pack())

    def _certificate(self, sent: list[bytes]) -> ShareCertificate:
        """The owner's signature over the packed averaged segments it sent one member, and the commitments used."""
        start, stop = self.my_range
        digest, commitments = segments_digest(sent), self.terms.commitments_digest
        message = certificate_bytes(self.terms.scope, self.terms.round, self.group_id, self.my_index, start, stop,
                                    digest, commitments)
        signature = self.terms.signer.sign(message) if self.terms.signer is not None else b""
        return ShareCertificate(digest, commitments, signature)

    # --------------------------------------------------------------------------------------- sending ours

    async def _generate_input_for_owner(self, owner: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Senders stream a header and their committed segments; auxiliaries one placeholder per message."""
        start, stop = self.ranges[owner]
        if self.is_sender:
            payloads = [RangeHeader(self.own.leaves[start:stop], tuple(range_proof(self._levels, start, stop))).pack()]
            for segment in range(start, stop):
                data, statement = self.own.segments[segment], self.own.statements[segment]
                if self.terms.faults.corrupt_segments:
                    data, statement = self.terms.corrupted(self.own, segment)
                payloads.append(SenderSegment(data, statement).pack())
            messages = [share_message(p, code=averaging_pb2.PART_FOR_AVERAGING, weight=self.weight) for p in payloads]
        else:
            messages = [averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, weight=0.0)
                        for _ in range(stop - start + 1)]
        for index, message in enumerate(messages):
            if index == 0:
                message.group_id = self.group_id
            self.bytes_sent += message.ByteSize()
            yield message

    # ------------------------------------------------------------------------------------- serving our range

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A groupmate streams its segments of our range (or placeholders); we reply with the averaged segments."""
        remote = context.remote_id
        if remote not in self.ordered_peer_ids:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        sender_index = self.sender_peer_ids.index(remote) if remote in self.sender_peer_ids else None
        self.roster.start(remote)
        try:
            request = await asyncio.wait_for(anext(stream), self.sender_timeout)
            reason_to_reject = self._check_reasons_to_reject(request, context)
            if reason_to_reject is not None:
                yield reason_to_reject
                return
            if request.code != averaging_pb2.PART_FOR_AVERAGING:
                raise AllreduceException(f"{remote} sent {averaging_pb2.MessageCode.Name(request.code)}")
            receiver = self.ordered_peer_ids.index(remote)
            stream = self._counted(aiter_with_timeout(achain(as_aiter(request), stream), self.sender_timeout))
            async for reply in self._reply_stream(stream, sender_index, receiver,
                                                  delay=self.should_delay_results(remote)):
                self.bytes_sent += reply.ByteSize()
                yield reply
        except BaseException as e:
            self.roster.ban(remote)
            if not isinstance(e, Exception):
                raise  # CancelledError and the like
            logger.warning("serving %s failed (it loses our range): %r", remote, e, exc_info=True)
            yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
        finally:
            self.roster.served(remote)

    async def _counted(self, stream: AsyncIterator[averaging_pb2.AveragingData]):
        async for message in stream:
            self.bytes_received += message.ByteSize()
            yield message

    async def _reply_stream(self, stream, sender_index: int | None, receiver: int, delay: bool):
        """hivemind's flow control: peers with no share of their own get replies only after they finish sending."""
        if not delay:
            async for reply in self._serve(stream, sender_index, receiver):
                yield reply
            return
        done_receiving, queue = asyncio.Event(), asyncio.Queue()

        async def _collect():
            try:
                stream_with_event = attach_event_on_finished(stream, done_receiving)
                async for reply in self._serve(stream_with_event, sender_index, receiver):
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

    async def _serve(self, stream, sender_index: int | None, receiver: int):
        """One member's stream: its header and segments in, the averages and our certificate out."""
        reducer, (start, stop) = self.reducer, self.my_range
        sent: list[bytes] = []
        withheld = str(self.ordered_peer_ids[receiver]) == self.terms.faults.withhold_from  # AllReduceFaults
        offset, excluded = 0, sender_index is None
        try:
            header = await anext(stream)
            if sender_index is not None:
                self._verify_header(sender_index, header)
            async for message in stream:
                if offset >= stop - start:
                    raise AllreduceException("more segments than the range holds")
                if not excluded:
                    contribution = await asyncio.get_event_loop().run_in_executor(
                        None, self._check_segment, sender_index, start + offset, message)
                    try:
                        result = await reducer.accumulate(contribution, offset)
                    except BannedException:  # it came late: it gets the averages, without its part
                        excluded = True
                if excluded:  # an auxiliary's messages are placeholders; so are a banned sender's from now on
                    result = await reducer.result(offset)
                averaged = self.terms.told(receiver, start + offset, result, self.check, self.kept)
                packed = averaged.pack(len(self.sender_peer_ids))
                sent.append(packed)
                offset += 1
                if not withheld:
                    yield share_message(packed, weight=averaged.weight)
            if offset == stop - start and not withheld:
                yield share_message(self._certificate(sent).pack())
        finally:
            if sender_index is not None and offset != reducer.num_segments:
                self.roster.ban(self.sender_peer_ids[sender_index])

    def _verify_header(self, sender: int, message: averaging_pb2.AveragingData) -> None:
        """The sender's leaves of our range must hash up to the root it signed at matchmaking."""
        commitment = self.terms.commitments[sender]
        start, stop = self.my_range
        if commitment is None:
            raise AllreduceException(f"sender {sender} has no valid commitment")
        header = RangeHeader.unpack(message.tensor_part.buffer, stop - start)
        root = root_from_range(header.leaves, start, stop, self.terms.layout.count, header.proof)
        if root != commitment.root:
            raise AllreduceException(f"sender {sender}'s leaves do not hash to the root it signed")
        self.kept.header(sender, header.leaves, header.proof)

    def _check_segment(self, sender: int, segment: int, message: averaging_pb2.AveragingData) -> Contribution:
        """Runs in a worker thread: hash the bytes and compare with the committed leaf before they count."""
        try:
            parsed = SenderSegment.unpack(message.tensor_part.buffer,
                                          self.terms.codec.encoded_size(self.terms.layout.segment_values))
        except MessageError as err:
            logger.warning("sender %d's segment %d is malformed: %s", sender, segment, err)
            return Contribution(sender, None)
        leaf = leaf_digest(parsed.data)
        victim = self.terms.faults.framed(sender, self.sender_peer_ids, self.peer_id)
        if leaf == self.kept.leaf(sender, segment) and not victim:
            self.kept.keep(sender, segment, parsed.data)
            return Contribution(sender, SegmentInput(sender, parsed.data, message.weight))
        if victim:  # AllReduceFaults.frame: claim a mismatch with a "proof" that cannot verify
            return Contribution(sender, None, Refusal(sender, hashlib.sha256(b"forged").digest(), bytes(64)))
        commitment = self.terms.commitments[sender]
        signed = statement_bytes(self.terms.scope, self.terms.round, segment, leaf)
        proven = commitment is not None and self.terms.verify(commitment.key, signed, parsed.signature)
        logger.warning("sender %d's segment %d does not match its committed leaf (%s)", sender, segment,
                       "signed by the sender" if proven else "unsigned")
        return Contribution(sender, None, Refusal(sender, leaf, parsed.signature) if proven else None)

    def _check_reasons_to_reject(self, request, context) -> averaging_pb2.AveragingData | None:
        if request.group_id != self.group_id:
            return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
        if self._future.cancelled():
            return averaging_pb2.AveragingData(code=averaging_pb2.CANCELLED)
        if self._future.done():
            return averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
        return None

    def should_delay_results(self, peer_id: PeerID) -> bool:
        """A member that owns nothing gets its averages only after it finished sending (hivemind's flow control)."""
        return self.peer_fractions[self.ordered_peer_ids.index(peer_id)] == 0

    # ----------------------------------------------------------------------------------------------- report

    def report(self) -> AllReduceReport:
        """What this peer can say about the round (its evidence and counters)."""
        layout, reducer = self.terms.layout, self.reducer
        failed = [k for k in range(layout.count) if not self.registered[k]]
        absent_ranges = [self.ranges[i] for i, p in enumerate(self.ordered_peer_ids) if p in self.roster.absent]
        return AllReduceReport(
            group_id=self.group_id, evidence=self.evidence, values_total=layout.numel,
            values_failed=sum(layout.numel_of(k) for k in failed),
            segments_expected=reducer.num_segments * reducer.num_senders,
            segments_received=reducer.segments_received,
            dropped=list(reducer.dropped), clipped=list(reducer.clipped),
            bytes_sent=self.bytes_sent, bytes_received=self.bytes_received,
            inputs=self.kept.snapshot() if self.owns_segments else None,
            absent=tuple(str(p) for p in self.ordered_peer_ids if p in self.roster.absent),
            lost_to_absent=bool(failed) and all(any(a <= k < b for a, b in absent_ranges) for k in failed),
        )


async def _bounded(step: Awaitable[T], timeout: float | None, failure: str) -> T:
    """``step``'s result within ``timeout`` s (None: no bound), else an ``AllreduceException`` saying ``failure``."""
    try:
        return await asyncio.wait_for(step, timeout)
    except asyncio.TimeoutError:
        raise AllreduceException(failure) from None
