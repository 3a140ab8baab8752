"""The averager process of the checked all-reduce: a hivemind ``DecentralizedAverager`` that runs our runner.

Protocol part: :class:`CheckedAverager` keeps hivemind's matchmaking (peers of one ``prefix`` form a group; each
member's gathered data carries its mode and the weight (tokens) it announces) and its state sharing, and runs
each all-reduce with :class:`~template.training.allreduce_runner.CheckedAllReduceRunner` (see
:mod:`template.training.allreduce_runner`), in the averager's own process. After the runner, it writes the
result into the shared averaging buffers only when it is complete and finite, and hands the host process
(:mod:`template.training.averaging`) the runner's report with every member's gathered data.

What is guaranteed when a peer disappears mid-round or misbehaves:

- A peer whose result is missing *any* part (an owner died or sent garbage, hivemind's "received X%
  results") reports a failure and its averaging buffers are left untouched: a partial result is never
  returned as success. The failure is reported without raising, so hivemind neither logs it as a crash nor
  retries it (a retry in a new group could give two "successful" peers different averages).
- A peer that floods us with join requests or state downloads beyond its per-minute allowance is turned away
  (logged); the all-reduce handler serves members of a running group only.

Note: the RPC handle names contain the averager's class name (:class:`CheckedAverager`); it is part of the
wire protocol, which also differs from stock hivemind's, so a stock ``DecentralizedAverager`` cannot join.
Do not rename the class, and keep ``typing.AsyncIterator`` in the annotations of its ``rpc_*`` handlers:
hivemind derives each handler's wire form from them.
"""

from __future__ import annotations

import logging
import time
import typing
from collections.abc import Callable, Sequence

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from template.p2p.ratelimit import RateLimiter
from template.training.allreduce_runner import CheckedAllReduceRunner, _parse_group

__all__ = ["CheckedAverager", "StateProvider"]

logger = logging.getLogger(__name__)

# runs in the host process when a peer downloads our state: (metadata, tensors)
StateProvider = Callable[[], "tuple[dict, Sequence[torch.Tensor]]"]


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
