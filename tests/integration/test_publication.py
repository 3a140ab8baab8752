"""The publication RPC between real hivemind hosts on 127.0.0.1, with who-is-who read from the mock chain.

Four neurons, each with its own DHT/libp2p host (``start_dht``): a miner, a validator (staked: validator permit), a
registered hotkey without a permit, and an outsider that is not registered. The mock chain runs in this process
behind the real bittensor SDK; every PeerID binding is a real commitment and the miner's hivemind address is its
served axon, from which the other hosts bootstrap. One event loop thread drives all hivemind calls; every wait is
bounded (``run(..., timeout)``, fetch timeouts, pytest timeouts).

A publication is protocol v2: the miner's contribution to the round's all-reduce (encoded once into segments by the
run's codec), with its signed commitment; the validator checks it with ``read_publication`` (template.base.audit).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass

import bittensor as bt
import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from template.allreduce.codecs import SegmentCodec, get_codec
from template.allreduce.contribution import (
    Commitment,
    codec_descriptor,
    encode_contribution,
    merkle_levels,
    range_proof,
)
from template.allreduce.owner_inputs import InputKeeper, verified_inputs
from template.base.audit import read_publication
from template.chain.mock import MockSubstrate
from template.chain.wallets import create_wallet
from template.p2p.dht import DHTConfig, start_dht, visible_maddrs
from template.p2p.identity import PeerDirectory, peer_directory, verify
from template.p2p.keys import KeypairSigner
from template.p2p.publication import (
    HANDLER_NAME,
    FetchTimeoutError,
    NotFoundError,
    Publication,
    PublicationServer,
    RateLimitedError,
    RefusedError,
    TransportError,
    fetch_owner_inputs,
    fetch_publication,
    permit_holders,
)
from template.protocol import (
    PROTOCOL_VERSION,
    FetchKind,
    FetchReply,
    FetchRequest,
    ProtocolError,
    ReplyStatus,
    payload_size_limit,
)
from tests.integration.p2p_helpers import commit_peer_id, message_frame, run

pytestmark = pytest.mark.timeout(90)

NETUID = 5
SCOPE = f"netuid{NETUID}"
BASE_HASH = "3f" * 32
NAMES = ("miner", "validator", "permitless", "outsider")


@dataclass
class Network:
    loop: asyncio.AbstractEventLoop
    mock: MockSubstrate
    sub: bt.Subtensor
    wallets: dict[str, bt.Wallet]
    p2p: dict  # name -> hivemind P2P replica
    directory: PeerDirectory

    def hotkey(self, name: str) -> str:
        return self.wallets[name].hotkey.ss58_address

    def fetch(self, caller: str, round: int, *, expected_hotkey: str | None = None, **kwargs) -> Publication:
        """``caller`` fetches the miner's publication of ``round``, finding the miner's PeerID in the directory."""
        miner = self.directory.by_hotkey(self.hotkey("miner"))
        request = FetchRequest(PROTOCOL_VERSION, NETUID, round)
        kwargs.setdefault("timeout", 15.0)
        coro = fetch_publication(
            self.p2p[caller], miner.peer_id, request, expected_hotkey=expected_hotkey or miner.hotkey, **kwargs
        )
        return run(self.loop, coro, timeout=30.0)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="hivemind-loop", daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


@pytest.fixture(scope="module")
def network(tmp_path_factory, loop) -> Iterator[Network]:
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("BTCLI_TOKEN_SYMBOLS_CACHE", str(tmp_path_factory.mktemp("cache") / "token_symbols.json"))
    wallet_dir = tmp_path_factory.mktemp("wallets")
    wallets = {name: create_wallet(name, "default", wallet_dir) for name in NAMES}
    mock = MockSubstrate()
    mock.create_subnet(NETUID, tempo=1000, serving_rate_limit=0)  # no epoch during the test: permits stay put
    for name, stake in (("miner", 0.0), ("validator", 1000.0), ("permitless", 0.0)):
        mock.register(NETUID, wallets[name].hotkey.ss58_address, wallets[name].coldkeypub.ss58_address, stake)
    sub = bt.Subtensor("local", substrate=mock)

    dhts = {"miner": start_dht()}
    p2p: dict = {}
    try:
        # The miner binds its PeerID to its hotkey and serves its hivemind address as its axon ...
        miner_maddr = visible_maddrs(dhts["miner"])[0]
        port = int(miner_maddr.split("/tcp/")[1].split("/")[0])
        commit_peer_id(sub, wallets["miner"], NETUID, str(dhts["miner"].peer_id))
        assert sub.execute(bt.ServeAxon(netuid=NETUID, ip="127.0.0.1", port=port), wallets["miner"]).success
        # ... so everyone else bootstraps from the chain alone.
        bootstrap = peer_directory(sub.subnets.metagraph(NETUID)).bootstrap_maddrs()
        assert bootstrap == [miner_maddr]
        for name in NAMES[1:]:
            dhts[name] = start_dht(DHTConfig(initial_peers=bootstrap))
        for name in ("validator", "permitless"):
            commit_peer_id(sub, wallets[name], NETUID, str(dhts[name].peer_id))
        for name, dht in dhts.items():
            p2p[name] = run(loop, dht.replicate_p2p())
        directory = peer_directory(sub.subnets.metagraph(NETUID))
        yield Network(loop, mock, sub, wallets, p2p, directory)
    finally:
        for replica in p2p.values():
            run(loop, replica.shutdown(), timeout=10)
        for dht in dhts.values():
            dht.shutdown()
        sub.close()
        monkeypatch.undo()


@contextmanager
def serving(network: Network, **options) -> Iterator[PublicationServer]:
    """The miner's publication server, authorizing permit holders from the network's directory."""
    server = PublicationServer(
        network.p2p["miner"], netuid=NETUID, wallet=network.wallets["miner"],
        authorize=permit_holders(lambda: network.directory), **options,
    )
    run(network.loop, server.start())
    try:
        yield server
    finally:
        run(network.loop, server.stop())


def pseudo_gradient(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Δ for a small model, named as ``model.named_parameters()`` names it; ~3 MiB in raw float32 (codec none), so
    it spans payload frames and the codecs' segments."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 1500), torch.nn.Linear(1500, 512))
    return [(name, torch.randn_like(param)) for name, param in model.named_parameters()]


def publish(server: PublicationServer, round: int, delta, codec: SegmentCodec | None = None):
    """Publish Δ's contribution to ``round`` (raw float32 segments unless ``codec``); return (meta, contribution,
    commitment)."""
    codec = codec or get_codec("none")
    signer = KeypairSigner(server.wallet.hotkey)
    contribution = encode_contribution(codec, torch.cat([t.reshape(-1) for _, t in delta]))
    commitment = Commitment.sign(signer, SCOPE, round, contribution).to_wire()
    meta = server.publish(round, BASE_HASH, tokens=8192, inner_steps=20, loss=4.5,
                          layout=[(name, t.shape) for name, t in delta], codec=contribution.codec,
                          commitment=commitment, segments=contribution.segments, block=100 + round)
    return meta, contribution, commitment


def test_the_directory_binds_every_registered_host(network):
    assert {record.hotkey for record in network.directory} == {network.hotkey(n) for n in NAMES[:3]}
    assert network.directory.by_hotkey(network.hotkey("validator")).validator_permit
    assert not network.directory.by_hotkey(network.hotkey("permitless")).validator_permit
    with pytest.raises(bt.ChainError):  # an unregistered hotkey cannot bind its PeerID
        commit_peer_id(network.sub, network.wallets["outsider"], NETUID, str(network.p2p["outsider"].peer_id))


@pytest.mark.parametrize("codec_name", ["none", "fp16"])
def test_a_validator_fetches_a_verified_publication(network, codec_name):
    delta = pseudo_gradient(seed=3)
    codec = get_codec(codec_name)
    with serving(network) as server:
        published, contribution, commitment = publish(server, 3, delta, codec)
        publication = network.fetch("validator", 3, expected_layout=[(n, t.shape) for n, t in delta])
    meta = publication.meta
    assert meta == published and meta.round == 3 and meta.codec == codec_descriptor(codec) == contribution.codec
    assert meta.hotkey == network.hotkey("miner") and meta.base_theta_hash == BASE_HASH
    assert meta.commitment == commitment and meta.numel == contribution.numel
    assert verify(network.hotkey("miner"), meta.signing_bytes(), meta.signature)
    assert publication.peer_id == str(network.p2p["miner"].peer_id)
    # the payload is exactly the segments the miner contributed (several, and larger than one 2 MiB frame for none)
    assert len(contribution.segments) > 1
    assert publication.payload == b"".join(contribution.segments)
    assert meta.payload_sha256 == hashlib.sha256(publication.payload).hexdigest()
    assert len(publication.payload) <= payload_size_limit(meta.names, meta.shapes)
    # ... and it reads back as what the group decoded from it, bit for bit
    shapes = [t.shape for _, t in delta]
    read = read_publication(publication, codec, shapes, SCOPE, commitment)
    assert read.reason == "" and read.segments == contribution.segments
    assert read.commitment == Commitment.from_wire(commitment)
    flat = torch.cat([t.reshape(-1) for t in read.tensors])
    assert torch.equal(flat.view(torch.int32), contribution.decoded.view(torch.int32))
    assert [t.shape for t in read.tensors] == shapes
    for tensor, (_, expected) in zip(read.tensors, delta, strict=True):
        if codec_name == "none":
            assert torch.equal(tensor, expected)
        else:
            torch.testing.assert_close(tensor, expected, rtol=1e-3, atol=1e-4)


def test_a_registered_hotkey_without_a_permit_is_refused(network):
    with serving(network) as server:
        publish(server, 3, pseudo_gradient(seed=1))
        with pytest.raises(RefusedError, match="no validator permit"):
            network.fetch("permitless", 3)


def test_an_unregistered_caller_is_refused(network):
    with serving(network) as server:
        publish(server, 3, pseudo_gradient(seed=1))
        with pytest.raises(RefusedError, match="unknown peer"):
            network.fetch("outsider", 3)


def test_an_unknown_round_is_not_found(network):
    with serving(network) as server:
        publish(server, 3, pseudo_gradient(seed=1))
        with pytest.raises(NotFoundError, match=r"round 4 is not published here \(available: \[3\]\)"):
            network.fetch("validator", 4)


def test_the_rate_limit_is_per_peer(network):
    with serving(network, max_requests_per_minute=2) as server:
        publish(server, 3, pseudo_gradient(seed=1))
        network.fetch("validator", 3)
        with pytest.raises(NotFoundError):
            network.fetch("validator", 5)  # counts too
        with pytest.raises(RateLimitedError):
            network.fetch("validator", 3)
        with pytest.raises(RefusedError, match="no validator permit"):  # another peer has its own allowance
            network.fetch("permitless", 3)


def test_old_rounds_are_evicted_after_keep_rounds(network):
    with serving(network, keep_rounds=2) as server:
        contributions = {round: publish(server, round, pseudo_gradient(seed=round))[1] for round in (1, 2, 3)}
        assert server.rounds == [2, 3]
        with pytest.raises(NotFoundError):
            network.fetch("validator", 1)
        second = network.fetch("validator", 2)
        assert second.meta.published_at_block == 102 and second.meta.round == 2
        assert second.payload == b"".join(contributions[2].segments)  # each round serves its own contribution
        with pytest.raises(ValueError, match="not after the newest"):
            publish(server, 3, pseudo_gradient(seed=9))  # a publication is final


def test_the_validator_never_accepts_what_it_cannot_verify(network):
    delta = pseudo_gradient(seed=4)
    with serving(network) as server:
        _, contribution, _ = publish(server, 3, delta)
        # The miner's peer is bound to the miner's hotkey; a caller expecting anyone else gets no data.
        with pytest.raises(ProtocolError, match="names hotkey"):
            network.fetch("validator", 3, expected_hotkey=network.hotkey("permitless"))
        with pytest.raises(ProtocolError, match="exceeds the limit"):
            network.fetch("validator", 3, max_bytes=1 << 20)  # ~3 MiB announced: refused before downloading
        size = contribution.nbytes
        with pytest.raises(ProtocolError, match=f"announced payload of {size} bytes exceeds the limit of {size - 1}"):
            network.fetch("validator", 3, max_bytes=size - 1)
        assert network.fetch("validator", 3, max_bytes=size).payload == b"".join(contribution.segments)
        with pytest.raises(ProtocolError, match="differ from the expected model"):
            network.fetch("validator", 3, expected_layout=[(n, t.shape) for n, t in delta[:-1]])


def raw_exchange(network: Network, frame: bytes) -> FetchReply:
    """Send raw bytes to the miner's handler from the validator's host; read the first answer with hivemind's reader."""

    async def exchange() -> FetchReply:
        _, reader, writer = await network.p2p["validator"].call_binary_stream_handler(
            network.p2p["miner"].peer_id, HANDLER_NAME
        )
        with closing(writer):
            writer.write(frame)
            await writer.drain()
            response, error = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader)
        assert error is None
        return FetchReply.decode(response.metadata)

    return run(network.loop, exchange(), timeout=15)


class _CutWriter:
    """A stream writer that passes the first ``budget`` bytes and drops the rest: the caller sees the stream end
    mid-answer, as when a libp2p stream breaks."""

    def __init__(self, writer: asyncio.StreamWriter, budget: int):
        self.writer, self.budget = writer, budget

    def write(self, data: bytes) -> None:
        kept = bytes(data[: max(self.budget, 0)])
        self.budget -= len(data)
        if kept:
            self.writer.write(kept)

    async def drain(self) -> None:
        await self.writer.drain()

    def close(self) -> None:
        self.writer.close()


@pytest.mark.parametrize("cuts, attempts", [(2, 3), (1, 1)])
def test_a_stream_cut_mid_answer_is_fetched_again(network, cuts, attempts):
    """The miner's first ``cuts`` answers end mid-payload: the fetch tries again within its timeout and returns the
    whole verified publication, or raises TransportError when its attempts run out."""
    delta = pseudo_gradient(seed=4)
    answers = []
    with serving(network) as server:
        _, contribution, _ = publish(server, 4, delta)

        async def cut_first_answers(info, reader, writer):
            answers.append(len(answers) < cuts)
            await server._handle(info, reader, _CutWriter(writer, 300_000) if answers[-1] else writer)

        miner = network.p2p["miner"]
        run(network.loop, miner.remove_binary_stream_handler(HANDLER_NAME))
        run(network.loop, miner.add_binary_stream_handler(HANDLER_NAME, cut_first_answers))
        if attempts > cuts:
            assert network.fetch("validator", 4, attempts=attempts).payload == b"".join(contribution.segments)
            assert answers == [True] * cuts + [False]
        else:
            with pytest.raises(TransportError, match=f"attempt {attempts} of {attempts}.*IncompleteReadError"):
                network.fetch("validator", 4, attempts=attempts)
            assert answers == [True] * attempts


def test_malformed_requests_get_a_clear_bad_request(network):
    end_of_stream = P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
    with serving(network, max_request_bytes=256) as server:
        publish(server, 3, pseudo_gradient(seed=1))
        huge = P2P.MESSAGE_MARKER + (10 << 20).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)  # announced, never sent
        reply = raw_exchange(network, huge)
        assert reply.status == ReplyStatus.BAD_REQUEST and "exceeds the limit of 256" in reply.reason
        future = json.dumps({"version": PROTOCOL_VERSION + 1, "netuid": NETUID, "round": 3}).encode()
        reply = raw_exchange(network, message_frame(runtime_pb2.ExpertRequest(metadata=future)) + end_of_stream)
        assert reply.status == ReplyStatus.BAD_REQUEST and "not supported" in reply.reason
        reply = raw_exchange(network, message_frame(runtime_pb2.ExpertRequest(metadata=b"{")) + end_of_stream)
        assert reply.status == ReplyStatus.BAD_REQUEST and "JSON" in reply.reason
        other_subnet = FetchRequest(PROTOCOL_VERSION, NETUID + 1, 3)
        with pytest.raises(ProtocolError, match=f"serves netuid {NETUID}, not {NETUID + 1}"):
            run(network.loop, fetch_publication(network.p2p["validator"], network.p2p["miner"].peer_id,
                                                other_subnet, expected_hotkey=network.hotkey("miner"), timeout=10))
        assert network.fetch("validator", 3).meta.round == 3  # the handler is still serving


def test_a_silent_peer_times_out(network):
    """A miner that accepts the stream but never answers: the fetch ends at its timeout, not later."""
    release = asyncio.Event()

    async def silent(_info, _reader, writer):
        try:
            await asyncio.wait_for(release.wait(), timeout=20)
        finally:
            writer.close()

    silent_p2p, caller = network.p2p["permitless"], network.p2p["validator"]
    run(network.loop, silent_p2p.add_binary_stream_handler(HANDLER_NAME, silent))
    try:
        request = FetchRequest(PROTOCOL_VERSION, NETUID, 3)
        coro = fetch_publication(caller, str(silent_p2p.peer_id), request,
                                 expected_hotkey=network.hotkey("permitless"), timeout=1.5)
        with pytest.raises(FetchTimeoutError, match="longer than 1.5s"):
            run(network.loop, coro, timeout=10)
    finally:
        network.loop.call_soon_threadsafe(release.set)
        run(network.loop, silent_p2p.remove_binary_stream_handler(HANDLER_NAME))


def test_an_owner_serves_the_inputs_it_averaged_and_they_verify_against_the_senders_roots(network):
    """The inputs an owner kept (OwnerInputs, as the runner fills them) travel over the same RPC (kind inputs) to a
    permit holder only; the validator checks each sender's bytes against the root the sender signed, so a byte the
    owner changed drops that segment, and a round it kept nothing for is not found."""
    codec = get_codec("fp16")
    signer = KeypairSigner(network.wallets["miner"].hotkey)
    contribution = encode_contribution(codec, torch.cat([t.reshape(-1) for _, t in pseudo_gradient(seed=4)]))
    commitment = Commitment.sign(signer, SCOPE, 3, contribution)
    count, (start, stop) = len(contribution.segments), (1, 3)
    keeper = InputKeeper(start, stop, count, [commitment.key])
    keeper.header(0, contribution.leaves[start:stop], range_proof(merkle_levels(contribution.leaves), start, stop))
    for k in range(start, stop):
        keeper.keep(0, k, contribution.segments[k])
    meta, payload = keeper.snapshot().to_wire(NETUID, 3)
    miner = network.directory.by_hotkey(network.hotkey("miner"))
    request = FetchRequest(PROTOCOL_VERSION, NETUID, 3, FetchKind.INPUTS)
    with serving(network) as server:
        publish(server, 3, pseudo_gradient(seed=1))
        server.keep_inputs(3, meta, payload)
        fetched, served = run(network.loop, fetch_owner_inputs(network.p2p["validator"], miner.peer_id, request,
                                                               max_bytes=len(payload), timeout=15))
        with pytest.raises(RefusedError):
            run(network.loop, fetch_owner_inputs(network.p2p["permitless"], miner.peer_id, request,
                                                 max_bytes=len(payload), timeout=15))
        with pytest.raises(NotFoundError, match=r"round 4 is not averaged"):
            later = FetchRequest(PROTOCOL_VERSION, NETUID, 4, FetchKind.INPUTS)
            run(network.loop, fetch_owner_inputs(network.p2p["validator"], miner.peer_id, later,
                                                 max_bytes=len(payload), timeout=15))
        with pytest.raises(ProtocolError, match="exceed the limit"):
            run(network.loop, fetch_owner_inputs(network.p2p["validator"], miner.peer_id, request,
                                                 max_bytes=len(payload) - 1, timeout=15))
        assert network.fetch("validator", 3).meta.round == 3  # publications are served as before
    assert fetched == meta and served == payload
    commitments = {commitment.key: commitment}
    assert verified_inputs(fetched, served, commitments, len(payload)) == {
        commitment.key: {k: contribution.segments[k] for k in range(start, stop)}}
    forged = bytes([served[0] ^ 1]) + served[1:]
    assert verified_inputs(fetched, forged, commitments, len(payload)) == {
        commitment.key: {stop - 1: contribution.segments[stop - 1]}}
    other = Commitment.sign(signer, SCOPE, 4, encode_contribution(codec, torch.ones(contribution.numel)))
    assert verified_inputs(fetched, served, {commitment.key: other}, len(payload)) == {}
