"""Calls on the averager's handlers from peers that should not get far: floods and outsiders.

Join requests and state downloads — which any peer reaching our host may send — are rate-limited per peer
(``AveragingConfig.max_join_requests_per_minute`` / ``max_state_downloads_per_minute``): a caller over its allowance
is refused, another peer keeps its own allowance. The all-reduce handler serves running groups and their members only,
and the relay of a missed share the latest group's members only, within an allowance.
Real hivemind hosts on 127.0.0.1; the unwelcome caller speaks hivemind's own RPC stub, as a modified peer would (the
group-membership check is exercised on the runner directly, which needs no group to be formed in time).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter

from template.allreduce.averager import AveragingConfig, PseudoGradientAverager
from template.allreduce.averager_process import CheckedAverager
from template.allreduce.codecs import get_codec
from template.allreduce.contribution import encode_contribution
from template.allreduce.messages import ShareCertificate, ShareRequest, segments_digest
from template.allreduce.reduction import OwnerRule
from template.allreduce.runner import CheckedAllReduceRunner
from template.allreduce.terms import OwnContribution, RoundTerms, SegmentLayout
from template.p2p.dht import DHTConfig, start_dht, visible_maddrs
from template.p2p.keys import verify_signature
from tests.integration.p2p_helpers import run

SHAPES = [torch.Size([64]), torch.Size([8, 8])]


@pytest.fixture(scope="module")
def hosts():
    """Three DHT nodes and an event loop for the flooding callers' p2p replicas."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="flood-loop", daemon=True)
    thread.start()
    first = start_dht()
    nodes = [first] + [start_dht(DHTConfig(initial_peers=visible_maddrs(first))) for _ in range(2)]
    yield loop, nodes
    for node in nodes:
        node.shutdown()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)


def config(**overrides) -> AveragingConfig:
    return AveragingConfig(prefix=f"flood{uuid.uuid4().hex[:10]}", matchmaking_time=2.0, request_timeout=1.0,
                           compression="none", **overrides)


async def replies_of(call) -> list:
    """Every reply of a streamed RPC. hivemind's client writes the request stream and its end-of-stream mark in a task
    of its own and re-raises that task's error after the last reply: when the handler answered and closed before
    reading all of it (a refusal), the write fails (BrokenPipeError in 1 run of 5) although the answer arrived."""
    replies = []
    try:
        async for reply in await call:
            replies.append(reply)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return replies


@pytest.mark.timeout(120)
def test_state_downloads_beyond_the_allowance_are_refused(hosts):
    _, (sharer_node, joiner_node, other_node) = hosts
    state = ({"round": 7}, [torch.full(s, 7.0) for s in SHAPES])
    limited = config(max_state_downloads_per_minute=2)
    with PseudoGradientAverager(sharer_node, SHAPES, limited, state_provider=lambda: state) as sharer, \
            PseudoGradientAverager(joiner_node, SHAPES, limited) as joiner, \
            PseudoGradientAverager(other_node, SHAPES, limited) as other:
        sharer.set_state_priority(7)
        for _ in range(2):
            loaded = joiner.load_state_from_peers(timeout=30)
            assert loaded is not None and loaded[0] == {"round": 7}
        started = time.monotonic()
        assert joiner.load_state_from_peers(timeout=3) is None  # the third in a minute: refused, bounded wait
        assert time.monotonic() - started < 8
        assert other.load_state_from_peers(timeout=30) is not None  # another peer has its own allowance


@pytest.mark.timeout(120)
def test_join_requests_beyond_the_allowance_are_refused(hosts):
    loop, (leader_node, flooder_node, _) = hosts
    limited = config(max_join_requests_per_minute=3, min_group_size=2, target_group_size=2)
    with PseudoGradientAverager(leader_node, SHAPES, limited) as leader:
        scheduled = time.time() + 30  # looking for a group for a while: it answers join requests on their merits
        handle = leader.begin([torch.zeros(s) for s in SHAPES], 1.0, {}, scheduled, deadline=scheduled + 10)
        deadline = time.monotonic() + 20
        while handle.control.stage.name != "LOOKING_FOR_GROUP" and time.monotonic() < deadline:
            time.sleep(0.05)
        flooder = run(loop, flooder_node.replicate_p2p())
        stub = CheckedAverager.get_stub(flooder, leader_node.peer_id, namespace=limited.prefix)

        async def join() -> int:
            request = averaging_pb2.JoinRequest(schema_hash=b"not our tensors", expiration=get_dht_time() + 30,
                                                group_key=f"{limited.prefix}.0b")
            replies = await replies_of(stub.rpc_join_group(request))
            return replies[0].code

        codes = [run(loop, join()) for _ in range(5)]
        handle.control.cancel()
        run(loop, flooder.shutdown())
    # within the allowance each request is judged (and refused: wrong tensors); past it, turned away unread
    assert codes[:3] == [averaging_pb2.BAD_SCHEMA_HASH] * 3, codes
    assert codes[3:] == [averaging_pb2.NOT_LOOKING_FOR_GROUP] * 2, codes


@pytest.mark.timeout(60)
def test_parts_for_no_running_group_are_refused(hosts):
    loop, (owner_node, outsider_node, _) = hosts
    averaging = config()
    with PseudoGradientAverager(owner_node, SHAPES, averaging):
        outsider = run(loop, outsider_node.replicate_p2p())
        stub = CheckedAverager.get_stub(outsider, owner_node.peer_id, namespace=averaging.prefix)

        async def send_parts() -> list[int]:
            part = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"no such group",
                                               weight=1.0)
            return [reply.code for reply in await replies_of(stub.rpc_aggregate_part(as_aiter(part, part)))]

        for _ in range(3):  # the stream closed before the refusal's reply was read in 1 CI run: ask again
            codes = run(loop, send_parts(), timeout=20)
            if codes:
                break
        run(loop, outsider.shutdown())
    assert codes == [averaging_pb2.BAD_GROUP_ID]


class _Host:
    """The one attribute of a p2p host that a runner reads when it is built: who we are."""

    def __init__(self, peer_id: PeerID) -> None:
        self.peer_id = peer_id


def test_an_outsiders_parts_are_refused_by_the_group():
    me, member, outsider = (PeerID(bytes([i]) * 34) for i in (1, 2, 3))

    async def outsider_sends() -> list[int]:
        codec = get_codec("none", segment_values=1024)
        layout = SegmentLayout(sum(s.numel() for s in SHAPES), codec.segment_values)
        contribution = encode_contribution(codec, torch.zeros(layout.numel))
        own = OwnContribution(contribution.segments, contribution.leaves, (bytes(64),) * layout.count)
        terms = RoundTerms("run", 0, codec, layout, (None, None), verify_signature, None)
        runner = CheckedAllReduceRunner(
            p2p=_Host(me), servicer_type=CheckedAverager, prefix="run", group_id=b"group", weight=1.0,
            ordered_peer_ids=[me, member], peer_fractions=(0.5, 0.5), modes=[AveragingMode.NODE] * 2,
            announced_weights=[1.0, 1.0], terms=terms, own=own, rule=OwnerRule(), sender_timeout=1.0,
            reducer_timeout=1.0,
        )
        part = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"group", weight=1.0)
        context = P2PContext(handle_name="CheckedAverager.rpc_aggregate_part", local_id=me, remote_id=outsider)
        codes = [reply.code async for reply in runner.rpc_aggregate_part(as_aiter(part), context)]
        assert runner.reducer.segments_received == 0  # nothing of the outsider's reached the reducer
        return codes

    assert asyncio.run(asyncio.wait_for(outsider_sends(), timeout=10)) == [averaging_pb2.PROTOCOL_VIOLATION]


@pytest.mark.timeout(120)
def test_share_fetches_serve_the_groups_members_only_within_their_allowance(hosts):
    """The relay of an owner's share (for a member that missed it) answers the members of the sharer's latest group,
    with exactly the owner's certified bytes, up to a per-peer allowance; an outsider gets nothing."""
    loop, (sharer_node, member_node, outsider_node) = hosts
    limited = config(max_join_requests_per_minute=3, min_group_size=2, target_group_size=2)
    with PseudoGradientAverager(sharer_node, SHAPES, limited) as sharer, \
            PseudoGradientAverager(member_node, SHAPES, limited) as member:
        deadline = time.time() + 30
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(peer.average, [torch.full(s, float(i)) for s in SHAPES], 1.0, {}, deadline)
                       for i, peer in enumerate((sharer, member))]
            results = [future.result(timeout=45) for future in futures]
        assert all(r.ok for r in results), [r.reason for r in results]
        group_id = bytes.fromhex(results[0].group_id)
        owner = next(i for i, (start, stop) in enumerate(results[0].evidence.ranges) if stop > start)  # 1 segment
        request = averaging_pb2.AveragingData(group_id=group_id,
                                              tensor_part=runtime_pb2.Tensor(buffer=ShareRequest(owner).pack()))

        async def fetch(node) -> list[averaging_pb2.AveragingData]:
            p2p = await node.replicate_p2p()
            try:
                stub = CheckedAverager.get_stub(p2p, sharer_node.peer_id, namespace=limited.prefix)
                return await replies_of(stub.rpc_fetch_share(request))
            finally:
                await p2p.shutdown()

        outsider = run(loop, fetch(outsider_node))
        fetched = [run(loop, fetch(member_node)) for _ in range(4)]
    assert [m.code for m in outsider] == [averaging_pb2.PROTOCOL_VIOLATION]
    for replies in fetched[:3]:  # the member's allowance: the owner's segments, then its certificate over them
        assert {m.code for m in replies} == {averaging_pb2.AVERAGED_PART} and len(replies) >= 2
        certificate = ShareCertificate.unpack(replies[-1].tensor_part.buffer)
        assert segments_digest([m.tensor_part.buffer for m in replies[:-1]]) == certificate.digest
    assert [m.code for m in fetched[3]] == [averaging_pb2.BAD_GROUP_ID]
