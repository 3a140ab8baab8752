"""The averager process of the checked all-reduce: a hivemind ``DecentralizedAverager`` that runs our runner.

Protocol part: :class:`CheckedAverager` keeps hivemind's matchmaking (peers of one ``prefix`` form a group; each
member's gathered data carries its mode, the weight (tokens) it announces, the terms of the round and its signed
contribution commitment) and its state sharing, and runs each all-reduce with
:class:`~template.allreduce.runner.CheckedAllReduceRunner` (see :mod:`template.allreduce.runner`),
in the averager's own process. The host hands it this peer's encoded contribution through a shared byte buffer
(:class:`ContributionBuffer`: segments, leaves, signed statements, written once per round); the averaged vector comes
back through a shared float buffer, written only when the result is complete, together with the runner's report
(who was included where, certificates) and every member's gathered data.

What is guaranteed when a peer disappears mid-round or misbehaves:

- A peer whose result still misses *any* segment after it asked its groupmates for the shares it missed (an owner
  died or sent garbage and no groupmate holds that share: :mod:`template.allreduce.relay`) reports a failure and its
  averaging buffers are left untouched: a partial result is never returned as success. The failure is reported
  without raising, so hivemind neither logs it as a crash nor retries it (a retry in a new group could give two
  "successful" peers different averages).
- A peer that floods us with join requests, state downloads or share fetches beyond its per-minute allowance is
  turned away (logged); the all-reduce handler serves members of a running group only, the share relay members of
  our latest group only.

Note: the RPC handle names contain the averager's class name (:class:`CheckedAverager`); it is part of the
wire protocol, which also differs from stock hivemind's, so a stock ``DecentralizedAverager`` cannot join.
Do not rename the class, and keep ``typing.AsyncIterator`` in the annotations of its ``rpc_*`` handlers:
hivemind derives each handler's wire form from them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from template.allreduce.codecs import SegmentCodec
from template.allreduce.contribution import (
    DIGEST_BYTES,
    Commitment,
    ContributionError,
    EncodedContribution,
    Signer,
    Verifier,
    codec_descriptor,
    encoded_sizes,
)
from template.allreduce.evidence import AllReduceReport
from template.allreduce.reduction import OwnerRule
from template.allreduce.relay import HeldShares
from template.allreduce.runner import CheckedAllReduceRunner
from template.allreduce.terms import AllReduceFaults, OwnContribution, RoundTerms, SegmentLayout
from template.p2p.hivemind_compat import OwnAllReduceHooks
from template.p2p.ratelimit import RateLimiter

__all__ = ["CheckedAverager", "ContributionBuffer", "StateProvider", "parse_group", "renew_torch_thread_pool"]

logger = logging.getLogger(__name__)

# runs in the host process when a peer downloads our state: (metadata, tensors)
StateProvider = Callable[[], "tuple[dict, Sequence[torch.Tensor]]"]
SIGNATURE_BYTES = 64  # sr25519
HELD_SHARES_TTL_REDUCER_TIMEOUTS = 3  # how long (in reducer timeouts) a finished group's shares stay relayable
LATE_START_WARNING_S = 0.5  # hivemind's preparation (load balancing, the tensors' lock) took that much of the budget
DEADLINE_RESERVE_FRACTION = 0.1  # of the all-reduce budget, kept after the runner for the result's copy and report


@dataclass(frozen=True)
class ContributionBuffer:
    """Where in the shared byte buffer the host puts this peer's contribution: every segment (each codec is
    fixed-size for a given length), then the leaves, then the signed statements."""

    layout: SegmentLayout
    codec: SegmentCodec

    @property
    def segment_sizes(self) -> list[int]:
        return encoded_sizes(self.codec, self.layout.numel)

    @property
    def nbytes(self) -> int:
        return sum(self.segment_sizes) + self.layout.count * (DIGEST_BYTES + SIGNATURE_BYTES)

    def write(self, buffer: torch.Tensor, contribution: EncodedContribution, statements: Sequence[bytes]) -> None:
        sizes = [len(s) for s in contribution.segments]
        if sizes != self.segment_sizes or any(len(s) != SIGNATURE_BYTES for s in statements):
            raise ValueError("the contribution does not fit the buffer's layout")
        data = b"".join((*contribution.segments, *contribution.leaves, *statements))
        buffer[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def read(self, buffer: torch.Tensor) -> OwnContribution:
        data, offset, segments = buffer.numpy(), 0, []  # each piece copied once, straight out of the shared buffer
        for size in self.segment_sizes:
            segments.append(data[offset:offset + size].tobytes())
            offset += size
        count = self.layout.count
        leaves = [data[offset + i * DIGEST_BYTES:offset + (i + 1) * DIGEST_BYTES].tobytes() for i in range(count)]
        offset += count * DIGEST_BYTES
        statements = [data[offset + i * SIGNATURE_BYTES:offset + (i + 1) * SIGNATURE_BYTES].tobytes()
                      for i in range(count)]
        return OwnContribution(tuple(segments), tuple(leaves), tuple(statements))


@dataclass(frozen=True)
class Member:
    """One member of a group as its gathered data describes it."""

    mode: AveragingMode
    weight: float | None  # None: malformed announcement (its segments are dropped)
    terms: dict | None  # {scope, round, codec}: what it averages
    commitment: Commitment | None  # None for auxiliaries and for malformed/unsigned commitments


def parse_group(group_info: GroupInfo) -> list[Member]:
    """Every member's mode, announced weight, terms and commitment, from the data gathered at matchmaking."""
    members = []
    for blob in group_info.gathered:
        _bandwidth, mode_id, user_blob = MSGPackSerializer.loads(blob)
        mode = AveragingMode(mode_id)
        try:
            user = MSGPackSerializer.loads(user_blob)
            weight, terms, wire = user.get("weight"), user.get("terms"), user.get("commitment")
        except Exception:  # a malformed gather: that peer's parts get dropped, the round goes on
            weight = terms = wire = None
        if mode == AveragingMode.AUX:
            weight, wire = 0.0, None
        ok = isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight) and weight >= 0
        try:
            commitment = None if wire is None else Commitment.from_wire(wire)
        except ContributionError:
            commitment = None
        members.append(Member(mode, float(weight) if ok else None, terms if isinstance(terms, dict) else None,
                              commitment))
    return members


def renew_torch_thread_pool() -> None:
    """Re-make torch's intra-op thread pool in a freshly forked process, from its only thread, before others start.

    Why: at a fork torch marks the pool the child inherited as unusable and replaces it on its first use; when
    several new threads make that first use at once (the runner's executor threads decoding, checking and averaging
    segments), one can read the pool in the middle of its replacement and fail with "pool INTERNAL ASSERT FAILED ...
    Invalid thread pool!" (torch 2.13: 26 of 1,000 forked children whose 32 threads start at once; 0 of 1,000 after
    this call). In the averager it failed an owner's first segment, and every member of that group received 76.0 %
    of the averages and refused the round (``benchmarks.allreduce``, 4 peers, 1 run in ~20; the "first all-reduce of a
    fresh averager" stalls of docs/benchmarks.md §2 had the same message). hivemind's own guard (it serves from a
    second thread) avoids OpenMP's broken pool, not this race.
    """
    torch.set_num_threads(torch.get_num_threads())


class CheckedAverager(OwnAllReduceHooks, DecentralizedAverager):
    """A ``DecentralizedAverager`` that runs :class:`CheckedAllReduceRunner` and refuses partial results.

    Its class name is part of the RPC handle names: every peer of a run must use this class. The two handlers any
    peer may call without being in our group (join requests, state downloads) are rate-limited per peer; the
    all-reduce handler serves the members of a running group only (:meth:`CheckedAllReduceRunner.rpc_aggregate_part`),
    and so does the relay of owners' shares (:meth:`rpc_fetch_share`: the latest group's members, rate-limited too).
    """

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: hivemind.DHT,
        *,
        buffer: ContributionBuffer,
        signer: Signer | None,
        verify: Verifier,
        faults: AllReduceFaults,
        owner_rule: OwnerRule,
        state_provider: StateProvider | None,
        max_join_requests_per_minute: int,
        max_state_downloads_per_minute: int,
        **kwargs,
    ):
        self._buffer, self._signer, self._verify, self._faults = buffer, signer, verify, faults
        self._owner_rule = owner_rule
        self._state_provider = state_provider
        self._allreduce_budget = kwargs["allreduce_timeout"]  # hivemind cancels a group's all-reduce after it
        self._join_limiter = RateLimiter(max_join_requests_per_minute)  # lives in the averager process
        self._download_limiter = RateLimiter(max_state_downloads_per_minute)
        # a member fetches at most one share per owner and round: the join allowance is ample
        self._share_limiter = RateLimiter(max_join_requests_per_minute)
        self._held_shares: HeldShares | None = None  # the latest group's shares, for members that missed one
        # the runners' output, reused every round (allocated in the averager process, on its first all-reduce):
        # all-reduces run one at a time, under the averaged tensors' lock, and a runner writes it only while it runs
        self._runner_output: torch.Tensor | None = None
        self._begun_late = False  # AllReduceFaults.begin_late_s: this process sent its late "begin"
        self._join_requests_taken = 0  # AllReduceFaults.answer_late_s stalls on the second
        super().__init__(averaged_tensors, dht, **kwargs)

    def run(self) -> None:
        """The averager process (forked by ``start``): torch's thread pool is made whole before any thread starts."""
        renew_torch_thread_pool()
        super().run()

    # hivemind derives each handler's wire form from its annotations and recognizes typing's AsyncIterator only
    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's matchmaking, for peers within their allowance; others are told we are not available. A request
        that waited here longer than its sender waits for our answer is refused (``join_request``)."""
        if not self._join_limiter.allow(str(context.remote_id)):
            logger.info("refused a join request from %s: over its per-minute allowance", context.remote_id)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        with self.join_request(context.remote_id):
            self._join_requests_taken += 1
            if self._faults.answer_late_s and self._join_requests_taken == 2:
                time.sleep(self._faults.answer_late_s)  # AllReduceFaults: a leader whose process lagged (loop blocked)
            async for response in super().rpc_join_group(request, context):
                begins = response.code == averaging_pb2.BEGIN_ALLREDUCE
                if begins and self._faults.begin_late_s and not self._begun_late:
                    self._begun_late = True  # AllReduceFaults: a leader whose event loop lagged
                    await asyncio.sleep(self._faults.begin_late_s)
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

    async def rpc_fetch_share(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        """A member of our latest group that missed an owner's share gets it as we received it (certified by the owner);
        anyone else, or a member past its allowance, is told ``BAD_GROUP_ID``."""
        held = self._held_shares
        if held is None or not self._faults.relays or not self._share_limiter.allow(str(context.remote_id)):
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in held.serve(request, context):
            yield message

    async def run_group_allreduce(self, tensors, group_info: GroupInfo, group_id: bytes, *, peer_fractions,
                                  weight: float, sender_timeout: float, reducer_timeout: float,
                                  started: float) -> AllReduceReport:
        output, contribution = tensors
        members = parse_group(group_info)
        # hivemind cancels the whole all-reduce allreduce_timeout after ``started``: the runner stops waiting on
        # groupmates a little before, so a result (complete or not) is reported, never cancelled with the wait
        loop = asyncio.get_event_loop()
        if (late := loop.time() - started) > LATE_START_WARNING_S:
            logger.warning("the all-reduce starts %.2f s into its %.1f s budget (load balancing, the tensors' lock)",
                           late, self._allreduce_budget)
        deadline = started + self._allreduce_budget * (1 - DEADLINE_RESERVE_FRACTION)
        me = members[group_info.peer_ids.index(self.peer_id)]
        runner = CheckedAllReduceRunner(
            p2p=self.p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            group_id=group_id,
            weight=weight,
            ordered_peer_ids=group_info.peer_ids,
            peer_fractions=peer_fractions,
            modes=[m.mode for m in members],
            announced_weights=[m.weight for m in members],
            terms=self._terms(me, members),
            own=None if me.mode == AveragingMode.AUX else self._buffer.read(contribution),
            rule=self._owner_rule,
            sender_timeout=sender_timeout,
            reducer_timeout=reducer_timeout,
            deadline=deadline,
            output=self._runner_output,
        )
        self._runner_output = runner.output
        self.serve_runner(group_id, runner)
        self._held_shares = runner.held  # relayed from now on, until our next group (one share set in memory)
        await runner.execute()
        # a groupmate that missed a share asks within its own exchange's bounds: after that, free the memory (the
        # whole vector in its encoded form)
        ttl = HELD_SHARES_TTL_REDUCER_TIMEOUTS * reducer_timeout
        asyncio.get_event_loop().call_later(ttl, self._release, runner.held)
        report = runner.report()
        report.finished_at = time.time()
        # hivemind would call a partial result a success; we report it as a failure (without raising, so that
        # hivemind neither logs it as a crash nor retries) and leave the buffers untouched. Every registered segment
        # was checked finite when it was decoded: no second pass over the whole vector.
        if report.values_failed:
            report.failure = f"partial all-reduce: received {100.0 * report.received_fraction:.1f}% of the averaged " \
                             "values"
        if report.lost_to_absent:  # nobody completes this group: it is dropped (no relays) and the round regroups
            self._release(runner.held)
            report.failure += f" (the rest is the share of {', '.join(report.absent)}, not in this group)"
        if report.failure:
            logger.warning("all-reduce in group %s failed: %s", group_id.hex(), report.failure)
        else:
            output.copy_(runner.output)
            self.mark_averaged()
        return report

    def _release(self, held: HeldShares) -> None:
        if self._held_shares is held:
            self._held_shares = None

    def _terms(self, me: Member, members: list[Member]) -> RoundTerms:
        """What this round is about (from our own gathered data), and each sender's commitment when it is signed
        and for exactly these terms (otherwise None: that sender's segments are refused)."""
        if me.terms is None:
            raise ValueError("our own gathered data carries no terms")
        scope, round = str(me.terms.get("scope")), int(me.terms.get("round", -1))
        codec = codec_descriptor(self._buffer.codec)
        if me.terms.get("codec") != codec:
            raise ValueError(f"our terms name codec {me.terms.get('codec')!r}, the averager runs {codec!r}")
        commitments = []
        for member in members:
            if member.mode == AveragingMode.AUX:
                continue
            c = member.commitment
            fits = c is not None and (c.scope, c.round, c.codec, c.numel) == (scope, round, codec,
                                                                               self._buffer.layout.numel)
            commitments.append(c if fits and c.verify(self._verify) else None)
        return RoundTerms(scope, round, self._buffer.codec, self._buffer.layout, tuple(commitments), self._verify,
                          self._signer, self._faults)

    def get_current_state(self):
        """Runs in the host process when a peer downloads our state (only when a provider was given)."""
        if self._state_provider is None:
            raise RuntimeError("this averager shares no state")
        metadata, tensors = self._state_provider()
        return metadata, [tensor.detach().cpu() for tensor in tensors], None
