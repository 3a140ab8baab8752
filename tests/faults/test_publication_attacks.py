"""Bad input on the publication RPC that tests/integration/test_publication.py does not already send.

A *lying miner* (a hivemind host bound on chain to the miner's hotkey, answering the fetch with crafted frames)
replays publications of another round, edits a signed round, re-signs with another hotkey, sends payloads whose
dtype/shape contradict the signed metadata, non-finite values, truncated or oversized frames. The validator's
``fetch_publication`` must raise a typed error for each and never return unverified data; non-finite values are
passed through (counted), because scoring them is the validator's job. A *hostile caller* sends the honest miner's
``PublicationServer`` half frames, no end-of-stream, and wrong markers: each stream is closed within the server's
timeouts and the miner keeps serving. Hosts are real hivemind DHT/libp2p nodes on 127.0.0.1; who-is-who comes from
the in-memory mock chain through the real SDK.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass

import bittensor as bt
import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from template.chain.mock import MockSubstrate
from template.chain.wallets import create_wallet
from template.p2p.dht import DHTConfig, start_dht, visible_maddrs
from template.p2p.identity import PeerDirectory, peer_directory, sign
from template.p2p.publication import (
    HANDLER_NAME,
    Publication,
    PublicationServer,
    TransportError,
    fetch_publication,
    permit_holders,
)
from template.protocol import (
    PROTOCOL_VERSION,
    FetchReply,
    FetchRequest,
    ProtocolError,
    PublicationMeta,
    ReplyStatus,
    encode_payload,
)
from tests.integration.p2p_helpers import commit_peer_id, run
from tests.integration.p2p_helpers import message_frame as frame

pytestmark = pytest.mark.timeout(90)

NETUID = 9
BASE_HASH = "5e" * 32
LAYOUT = [("embed.weight", (64, 8)), ("head.weight", (8, 64)), ("head.bias", (8,))]


@dataclass
class Network:
    loop: asyncio.AbstractEventLoop
    wallets: dict[str, bt.Wallet]
    p2p: dict
    directory: PeerDirectory

    def hotkey(self, name: str) -> str:
        return self.wallets[name].hotkey.ss58_address

    def fetch(self, round: int, *, caller: str = "validator", layout=LAYOUT, timeout: float = 10.0) -> Publication:
        miner = self.directory.by_hotkey(self.hotkey("miner"))
        coro = fetch_publication(self.p2p[caller], miner.peer_id, FetchRequest(PROTOCOL_VERSION, NETUID, round),
                                 expected_hotkey=miner.hotkey, expected_layout=layout, timeout=timeout)
        return run(self.loop, coro, timeout=timeout + 15)


@pytest.fixture(scope="module")
def network(tmp_path_factory) -> Iterator[Network]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="attack-loop", daemon=True)
    thread.start()
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("BTCLI_TOKEN_SYMBOLS_CACHE", str(tmp_path_factory.mktemp("cache") / "token_symbols.json"))
    wallet_dir = tmp_path_factory.mktemp("wallets")
    names = ("miner", "validator", "other")
    wallets = {name: create_wallet(name, "default", wallet_dir) for name in names}
    mock = MockSubstrate()
    mock.create_subnet(NETUID, tempo=1000, serving_rate_limit=0)
    for name, stake in (("miner", 0.0), ("validator", 1000.0), ("other", 0.0)):
        mock.register(NETUID, wallets[name].hotkey.ss58_address, wallets[name].coldkeypub.ss58_address, stake)
    sub = bt.Subtensor("local", substrate=mock)
    dhts: dict = {}
    p2p: dict = {}
    try:
        dhts["miner"] = start_dht()
        for name in names[1:]:
            dhts[name] = start_dht(DHTConfig(initial_peers=visible_maddrs(dhts["miner"])))
        for name in names:
            commit_peer_id(sub, wallets[name], NETUID, str(dhts[name].peer_id))
            p2p[name] = run(loop, dhts[name].replicate_p2p())
        yield Network(loop, wallets, p2p, peer_directory(sub.subnets.metagraph(NETUID)))
    finally:
        for replica in p2p.values():
            run(loop, replica.shutdown(), timeout=10)
        for dht in dhts.values():
            dht.shutdown()
        sub.close()
        monkeypatch.undo()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)


def delta(seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(shape, generator=generator)) for name, shape in LAYOUT]


@dataclass(frozen=True)
class Crafted:
    """What the lying miner sends: a reply's metadata and payload, and optionally raw frames instead."""

    meta: PublicationMeta | None
    payload: bytes
    payload_bytes: int | None = None  # announced size (default: the payload's)
    raw: bytes | None = None  # sent verbatim after the request, instead of a reply


def signed(network: Network, round: int, tensors, *, codec: str = "fp32", signer: str = "miner",
           hotkey: str = "miner", send: bytes | None = None, **overrides) -> Crafted:
    """Metadata describing ``tensors`` (names, shapes, codec), signed by ``signer``; the payload sent is their
    encoding, or ``send`` — whose sha256 the metadata then carries, so only its content contradicts the metadata."""
    described = encode_payload(tensors, codec)
    data = described.data if send is None else send
    fields = dict(version=PROTOCOL_VERSION, netuid=NETUID, round=round, base_theta_hash=BASE_HASH, tokens=1024,
                  inner_steps=8, loss=4.0, hotkey=network.hotkey(hotkey),
                  payload_sha256=hashlib.sha256(data).hexdigest(), names=described.names,
                  shapes=described.shapes, dtype="float32", codec=codec, published_at_block=50 + round)
    fields.update(overrides)
    meta = PublicationMeta(**fields)
    return Crafted(meta.with_signature(sign(network.wallets[signer].hotkey, meta.signing_bytes())), data)


@contextmanager
def lying_miner(network: Network, answer: Callable[[], Crafted]) -> Iterator[None]:
    """The miner's host answers every fetch with ``answer()``, whatever was asked."""

    async def handler(_info, reader, writer):
        with closing(writer):
            await P2P.receive_protobuf(runtime_pb2.ExpertRequest, reader)  # the request ...
            await P2P.receive_protobuf(runtime_pb2.ExpertRequest, reader)  # ... and its end-of-stream frame
            crafted = answer()
            if crafted.raw is not None:
                writer.write(crafted.raw)
            else:
                size = len(crafted.payload) if crafted.payload_bytes is None else crafted.payload_bytes
                reply = FetchReply(PROTOCOL_VERSION, ReplyStatus.OK, meta=crafted.meta, payload_bytes=size)
                writer.write(frame(runtime_pb2.ExpertResponse(metadata=reply.encode())))
                if crafted.payload:
                    tensor = runtime_pb2.Tensor(buffer=crafted.payload, size=[len(crafted.payload)], dtype="uint8")
                    writer.write(frame(runtime_pb2.ExpertResponse(tensors=[tensor])))
            await writer.drain()

    run(network.loop, network.p2p["miner"].add_binary_stream_handler(HANDLER_NAME, handler))
    try:
        yield
    finally:
        run(network.loop, network.p2p["miner"].remove_binary_stream_handler(HANDLER_NAME))


def test_an_honest_answer_through_the_lying_miners_plumbing_verifies(network):
    """The control: the same crafting, done honestly, is accepted (so every rejection below is for its reason)."""
    with lying_miner(network, lambda: signed(network, 4, delta(1))):
        publication = network.fetch(4)
    assert publication.meta.round == 4 and publication.nonfinite == {}
    assert all(torch.equal(publication.tensors[name], t) for name, t in delta(1))


def test_a_replayed_publication_of_another_round_is_refused(network):
    with lying_miner(network, lambda: signed(network, 3, delta(1))):  # a genuine, signed round-3 publication
        with pytest.raises(ProtocolError, match=f"asked for netuid {NETUID} round 4, got {NETUID}/3"):
            network.fetch(4)


def test_a_signed_publication_edited_to_another_round_is_refused(network):
    genuine = signed(network, 3, delta(1))
    edited = dataclasses.replace(genuine, meta=dataclasses.replace(genuine.meta, round=4, published_at_block=54))
    with lying_miner(network, lambda: edited):
        with pytest.raises(ProtocolError, match="signature does not verify"):
            network.fetch(4)


def test_a_publication_signed_by_another_hotkey_is_refused(network):
    # the miner's hotkey named, another hotkey's signature
    with lying_miner(network, lambda: signed(network, 4, delta(1), signer="other")):
        with pytest.raises(ProtocolError, match="signature does not verify"):
            network.fetch(4)
    # another registered hotkey's genuine publication, served from the miner's PeerID
    with lying_miner(network, lambda: signed(network, 4, delta(1), signer="other", hotkey="other")):
        with pytest.raises(ProtocolError, match="names hotkey"):
            network.fetch(4)


def test_payloads_that_contradict_their_signed_metadata_are_refused(network):
    small = [(name, torch.zeros(2)) for name, _ in LAYOUT]
    small_layout = [(name, (2,)) for name, _ in LAYOUT]
    cases = [
        # fp32 bytes under a signed fp16 codec: more than an fp16 payload of that layout can take, refused unread
        (signed(network, 4, delta(2), codec="fp16", send=encode_payload(delta(2), "fp32").data), LAYOUT,
         "exceeds the limit"),
        # the same lie with tensors so small that the size slack admits it: the dtype check catches it
        (signed(network, 4, small, codec="fp16", send=encode_payload(small, "fp32").data), small_layout,
         "codec fp16 means"),
        # the payload's shapes are not the signed ones
        (signed(network, 4, delta(2), send=encode_payload(small, "fp32").data), LAYOUT, "has shape"),
        # the signed shapes are not the model's
        (signed(network, 4, small), LAYOUT, "differ from the expected model"),
        # bytes swapped after signing
        (dataclasses.replace(signed(network, 4, delta(2)), payload=encode_payload(delta(3), "fp32").data), LAYOUT,
         "sha256"),
    ]
    for crafted, layout, message in cases:
        with lying_miner(network, lambda crafted=crafted: crafted):
            with pytest.raises(ProtocolError, match=message):
                network.fetch(4, layout=layout)


def test_non_finite_values_are_delivered_counted_for_the_validator_to_score(network):
    poisoned = delta(4)
    poisoned[0][1][0, :3] = float("nan")
    poisoned[2][1][5] = float("inf")
    with lying_miner(network, lambda: signed(network, 4, poisoned)):
        publication = network.fetch(4)
    assert publication.nonfinite == {"embed.weight": 3, "head.bias": 1}


def test_truncated_and_oversized_answers_are_refused(network):
    honest = signed(network, 4, delta(5))
    with lying_miner(network, lambda: dataclasses.replace(honest, payload_bytes=len(honest.payload) + 100)):
        with pytest.raises(TransportError):  # the stream ends before the announced payload
            network.fetch(4)
    oversized_frame = P2P.MESSAGE_MARKER + (1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
    with lying_miner(network, lambda: Crafted(None, b"", raw=oversized_frame)):
        with pytest.raises(ProtocolError, match="exceeds the limit"):
            network.fetch(4)
    with lying_miner(network, lambda: Crafted(None, b"", raw=frame(runtime_pb2.ExpertResponse(metadata=b"\xff{")))):
        with pytest.raises(ProtocolError, match="JSON"):
            network.fetch(4)
    with lying_miner(network, lambda: Crafted(None, b"", raw=b"\x07" + b"\x00" * 8)):
        with pytest.raises(ProtocolError, match="unknown frame marker"):
            network.fetch(4)


# --- a hostile caller against the honest miner's server -----------------------------------------------------------


def test_half_frames_silence_and_junk_close_the_stream_and_the_miner_keeps_serving(network):
    server = PublicationServer(network.p2p["miner"], netuid=NETUID, wallet=network.wallets["miner"],
                               authorize=permit_holders(lambda: network.directory), request_timeout=1.0)
    run(network.loop, server.start())
    try:
        server.publish(4, BASE_HASH, tokens=1024, inner_steps=8, loss=4.0, named_tensors=delta(6), codec="fp32",
                       block=54)

        async def hostile(data: bytes, close_after: bool) -> tuple[bytes, float]:
            started = time.monotonic()
            _, reader, writer = await network.p2p["validator"].call_binary_stream_handler(
                network.p2p["miner"].peer_id, HANDLER_NAME)
            with closing(writer):
                try:
                    writer.write(data)
                    await writer.drain()
                    if close_after:
                        writer.write_eof()
                    answer = await asyncio.wait_for(reader.read(), timeout=15)
                except ConnectionError:  # the miner closed the stream before we were done: a refusal too
                    answer = b""
            return answer, time.monotonic() - started

        request = frame(runtime_pb2.ExpertRequest(metadata=FetchRequest(PROTOCOL_VERSION, NETUID, 4).encode()))
        for data, close_after in (
            (request[:5], False),  # half a frame header, then silence: request_timeout closes the stream
            (request, False),  # a request but no end-of-stream frame, then silence
            (b"", False),  # nothing at all
            (b"\x05" + request, True),  # a wrong marker
            (request[:-3], True),  # a truncated body, then EOF
        ):
            answer, took = run(network.loop, hostile(data, close_after), timeout=30)
            assert took < 10, f"the server held a hostile stream for {took:.1f}s"
            # the stream is closed (timed out or refused, and logged); if a reply got out, it is a refusal
            assert len(answer) < 1024, "a hostile stream must never get the payload"
            if answer:
                status, error = asyncio.run(_parse_reply(answer))
                assert error or status in (ReplyStatus.BAD_REQUEST, ReplyStatus.RATE_LIMITED), status
        # the miner still serves a legitimate fetch
        assert network.fetch(4).meta.round == 4
    finally:
        run(network.loop, server.stop())


async def _parse_reply(data: bytes) -> tuple[str | None, bool]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    response, error = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader)
    return (None, True) if error is not None else (FetchReply.decode(response.metadata).status, False)
