"""Bad input on the publication RPC that tests/integration/test_publication.py does not already send.

A *lying miner* (a hivemind host bound on chain to the miner's hotkey, answering the fetch with crafted frames)
replays publications of another round, edits a signed round, re-signs with another hotkey, sends payloads larger than
the signed layout (or the validator's run) allows, malformed, truncated or oversized frames: the validator's
``fetch_publication`` must raise a typed error for each and never return unverified data. It also publishes, under a
valid signature and hash, bytes other than the contribution it committed to, a commitment for another round, codec,
key or model, an unsigned commitment, or a commitment other than the one it gave the all-reduce group: the fetch
delivers what was signed, and ``read_publication`` (the validator's check that scored = applied) refuses each with
its reason. Non-finite values are passed through, because scoring them is the validator's job. A *hostile caller*
sends the honest miner's ``PublicationServer`` half frames, no end-of-stream, and wrong markers: each stream is
closed within the server's timeouts and the miner keeps serving. Hosts are real hivemind DHT/libp2p nodes on
127.0.0.1; who-is-who comes from the in-memory mock chain through the real SDK.
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

from template.allreduce.codecs import SegmentCodec, get_codec
from template.allreduce.contribution import Commitment, EncodedContribution, encode_contribution
from template.base.audit import ReadPublication, read_publication
from template.chain.mock import MockSubstrate
from template.chain.wallets import create_wallet
from template.p2p.dht import DHTConfig, start_dht, visible_maddrs
from template.p2p.identity import PeerDirectory, peer_directory, sign
from template.p2p.keys import KeypairSigner
from template.p2p.publication import (
    CHUNK_BYTES,
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
    payload_size_limit,
)
from tests.integration.p2p_helpers import commit_peer_id, run
from tests.integration.p2p_helpers import message_frame as frame

pytestmark = pytest.mark.timeout(90)

NETUID = 9
SCOPE = f"netuid{NETUID}"
BASE_HASH = "5e" * 32
LAYOUT = [("embed.weight", (64, 8)), ("head.weight", (8, 64)), ("head.bias", (8,))]
SHAPES = [torch.Size(shape) for _, shape in LAYOUT]
CODEC = get_codec("none", segment_values=256)  # the run's codec: 1032 values in 5 segments


@dataclass
class Network:
    loop: asyncio.AbstractEventLoop
    wallets: dict[str, bt.Wallet]
    p2p: dict
    directory: PeerDirectory

    def hotkey(self, name: str) -> str:
        return self.wallets[name].hotkey.ss58_address

    def fetch(self, round: int, *, caller: str = "validator", layout=LAYOUT, timeout: float = 10.0,
              max_bytes: int | None = None) -> Publication:
        miner = self.directory.by_hotkey(self.hotkey("miner"))
        coro = fetch_publication(self.p2p[caller], miner.peer_id, FetchRequest(PROTOCOL_VERSION, NETUID, round),
                                 expected_hotkey=miner.hotkey, expected_layout=layout, timeout=timeout,
                                 max_bytes=max_bytes)
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


def contribution_of(tensors, codec: SegmentCodec = CODEC) -> EncodedContribution:
    return encode_contribution(codec, torch.cat([t.reshape(-1) for _, t in tensors]))


def commitment_to(network: Network, contribution: EncodedContribution, round: int, *, key: str = "miner",
                  scope: str = SCOPE) -> dict:
    """``key``'s signed commitment (wire form) to ``contribution`` in ``round``."""
    return Commitment.sign(KeypairSigner(network.wallets[key].hotkey), scope, round, contribution).to_wire()


@dataclass(frozen=True)
class Crafted:
    """What the lying miner sends: a reply's metadata and payload, and optionally raw frames instead."""

    meta: PublicationMeta | None
    payload: bytes
    payload_bytes: int | None = None  # announced size (default: the payload's)
    raw: bytes | None = None  # sent verbatim after the request, instead of a reply
    contribution: EncodedContribution | None = None  # the contribution the metadata commits to


def signed(network: Network, round: int, tensors, *, codec: SegmentCodec = CODEC, signer: str = "miner",
           hotkey: str = "miner", send: bytes | None = None, commitment: dict | None = None,
           **overrides) -> Crafted:
    """Metadata describing ``tensors``' contribution (names, shapes, codec, and ``hotkey``'s signed commitment to it
    for ``round``, unless ``commitment``), signed by ``signer``; the payload sent is the contribution's segments, or
    ``send`` — whose sha256 the metadata then carries, so only its content contradicts the metadata."""
    contribution = contribution_of(tensors, codec)
    commitment = commitment_to(network, contribution, round, key=hotkey) if commitment is None else commitment
    data = b"".join(contribution.segments) if send is None else send
    fields = dict(version=PROTOCOL_VERSION, netuid=NETUID, round=round, base_theta_hash=BASE_HASH, tokens=1024,
                  inner_steps=8, loss=4.0, hotkey=network.hotkey(hotkey),
                  payload_sha256=hashlib.sha256(data).hexdigest(), names=tuple(name for name, _ in tensors),
                  shapes=tuple(tuple(t.shape) for _, t in tensors), codec=contribution.codec, commitment=commitment,
                  published_at_block=50 + round)
    fields.update(overrides)
    meta = PublicationMeta(**fields)
    return Crafted(meta.with_signature(sign(network.wallets[signer].hotkey, meta.signing_bytes())), data,
                   contribution=contribution)


def reply_frame(crafted: Crafted, payload_bytes: int | None = None) -> bytes:
    size = len(crafted.payload) if payload_bytes is None else payload_bytes
    reply = FetchReply(PROTOCOL_VERSION, ReplyStatus.OK, meta=crafted.meta, payload_bytes=size)
    return frame(runtime_pb2.ExpertResponse(metadata=reply.encode()))


def chunk_frame(data: bytes, dtype: str = "uint8") -> bytes:
    return frame(runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=data, size=[len(data)], dtype=dtype)]))


def read(publication: Publication, contributed: dict | None, codec: SegmentCodec = CODEC) -> ReadPublication:
    """What the validator makes of a fetched publication with its run's codec and model."""
    return read_publication(publication, codec, SHAPES, SCOPE, contributed)


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
                writer.write(reply_frame(crafted, crafted.payload_bytes))
                if crafted.payload:
                    writer.write(chunk_frame(crafted.payload))
            await writer.drain()

    run(network.loop, network.p2p["miner"].add_binary_stream_handler(HANDLER_NAME, handler))
    try:
        yield
    finally:
        run(network.loop, network.p2p["miner"].remove_binary_stream_handler(HANDLER_NAME))


def test_an_honest_answer_through_the_lying_miners_plumbing_verifies(network):
    """The control: the same crafting, done honestly, is accepted (so every rejection below is for its reason)."""
    honest = signed(network, 4, delta(1))
    with lying_miner(network, lambda: honest):
        publication = network.fetch(4, max_bytes=honest.contribution.nbytes)
    assert publication.meta.round == 4 and publication.payload == b"".join(honest.contribution.segments)
    result = read(publication, contributed=honest.meta.commitment)
    assert result.reason == "" and result.segments == honest.contribution.segments
    assert all(torch.equal(tensor, t) for tensor, (_, t) in zip(result.tensors, delta(1), strict=True))


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


def test_payloads_that_contradict_their_signed_metadata_are_refused_by_the_fetch(network):
    small = [(name, torch.zeros(2)) for name, _ in LAYOUT]
    fp16 = get_codec("fp16", segment_values=256)
    fp16_size = contribution_of(delta(2), fp16).nbytes
    limit = payload_size_limit([name for name, _ in LAYOUT], [shape for _, shape in LAYOUT])
    cases = [
        # more bytes than any codec's encoding of the signed layout takes: refused unread
        (signed(network, 4, delta(2), send=b"\0" * (limit + 1)), LAYOUT, None, f"exceeds the limit of {limit}"),
        # float32 bytes under a signed fp16 codec: more than the run's fp16 contribution takes, so a validator that
        # caps the download at its run's exact contribution size refuses it unread
        (signed(network, 4, delta(2), codec=fp16, send=b"".join(contribution_of(delta(2)).segments)), LAYOUT,
         fp16_size, f"exceeds the limit of {fp16_size}"),
        # the signed shapes are not the model's
        (signed(network, 4, small), LAYOUT, None, "differ from the expected model"),
        # bytes swapped after signing
        (dataclasses.replace(signed(network, 4, delta(2)), payload=b"".join(contribution_of(delta(3)).segments)),
         LAYOUT, None, "sha256"),
        # one byte changed after signing
        (dataclasses.replace(signed(network, 4, delta(2)), payload=b"\1" + b"".join(contribution_of(delta(2))
                                                                                    .segments)[1:]),
         LAYOUT, None, "sha256"),
    ]
    for crafted, layout, max_bytes, message in cases:
        with lying_miner(network, lambda crafted=crafted: crafted):
            with pytest.raises(ProtocolError, match=message):
                network.fetch(4, layout=layout, max_bytes=max_bytes)


NOT_COMMITTED = "its payload is not the contribution it committed to"
OTHER_TERMS = "its commitment is for another key, run, round, codec or model size"
NOT_SIGNED = "its commitment is not signed by its hotkey"
NOT_CONTRIBUTED = "it published other bytes than it contributed to the all-reduce"


def test_a_validly_signed_publication_of_other_than_the_committed_contribution_is_refused(network):
    """Signature, hash and layout all check out, so the fetch delivers it; ``read_publication`` finds the lie."""
    honest = contribution_of(delta(2))
    fp16 = get_codec("fp16", segment_values=256)
    unsigned = dataclasses.replace(Commitment.from_wire(commitment_to(network, honest, 4)), signature=b"")
    small = [(name, torch.zeros(2)) for name, _ in LAYOUT]
    cases = {
        # another contribution's bytes under the commitment to the honest one (the meta carries their sha256)
        "wrong payload under a valid signature": (
            signed(network, 4, delta(2), send=b"".join(contribution_of(delta(3)).segments)), None, NOT_COMMITTED),
        # float32 bytes under a commitment to the fp16 contribution (and the fp16 descriptor): within the size limit
        "float32 bytes under an fp16 commitment": (  # (the run's codec is fp16 here)
            signed(network, 4, delta(2), codec=fp16, send=b"".join(honest.segments)), None, NOT_COMMITTED, fp16),
        # a smaller model's bytes under the signed layout
        "another model's bytes": (
            signed(network, 4, delta(2), send=b"".join(contribution_of(small).segments)), None, NOT_COMMITTED),
        # the last segment dropped, the others kept
        "a truncated contribution": (
            signed(network, 4, delta(2), send=b"".join(honest.segments[:-1])), None, NOT_COMMITTED),
        # an honest fp16 contribution, but the run's codec is raw float32
        "another codec": (signed(network, 4, delta(2), codec=fp16), None, OTHER_TERMS),
        # the honest bytes, committed to by another hotkey
        "another key's commitment": (
            signed(network, 4, delta(2), commitment=commitment_to(network, honest, 4, key="other")), None,
            OTHER_TERMS),
        # the genuine round-3 commitment to these bytes, replayed in round 4
        "a commitment of another round": (
            signed(network, 4, delta(2), commitment=commitment_to(network, honest, 3)), None, OTHER_TERMS),
        "a commitment of another run": (
            signed(network, 4, delta(2), commitment=commitment_to(network, honest, 4, scope="netuid10")), None,
            OTHER_TERMS),
        "an unsigned commitment": (signed(network, 4, delta(2), commitment=unsigned.to_wire()), None, NOT_SIGNED),
        # validly committed and published, but the group got a commitment to other bytes
        "another commitment than the group got": (
            signed(network, 4, delta(2)), commitment_to(network, contribution_of(delta(5)), 4), NOT_CONTRIBUTED),
    }
    for what, (crafted, contributed, reason, *run_codec) in cases.items():
        with lying_miner(network, lambda crafted=crafted: crafted):
            publication = network.fetch(4)
        assert publication.payload == crafted.payload, what
        result = read(publication, contributed if contributed is not None else crafted.meta.commitment, *run_codec)
        assert result.tensors is None and result.reason == reason, (what, result.reason)


def test_non_finite_values_are_delivered_for_the_validator_to_score(network):
    poisoned = delta(4)
    poisoned[0][1][0, :3] = float("nan")
    poisoned[2][1][5] = float("inf")
    crafted = signed(network, 4, poisoned)
    with lying_miner(network, lambda: crafted):
        publication = network.fetch(4)
    result = read(publication, contributed=crafted.meta.commitment)
    assert result.reason == ""
    counted = {name: int((~torch.isfinite(t)).sum()) for (name, _), t in zip(LAYOUT, result.tensors, strict=True)}
    assert counted == {"embed.weight": 3, "head.weight": 0, "head.bias": 1}
    assert torch.isnan(result.tensors[0][0, :3]).all() and result.tensors[2][5] == float("inf")


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


def test_malformed_payload_frames_are_refused(network):
    """A valid signed reply, then payload frames that are not what the protocol allows."""
    honest = signed(network, 4, delta(6))
    payload, head = honest.payload, reply_frame(honest)
    oversized_chunk = P2P.MESSAGE_MARKER + (CHUNK_BYTES + 4096).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
    two_tensors = runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=payload[:8], dtype="uint8"),
                                                      runtime_pb2.Tensor(buffer=payload[8:], dtype="uint8")])
    with_metadata = runtime_pb2.ExpertResponse(metadata=b"{}", tensors=[runtime_pb2.Tensor(buffer=payload,
                                                                                           dtype="uint8")])
    cases = [
        (head + oversized_chunk, "exceeds the limit"),  # a frame announced larger than a chunk: refused unread
        (head + chunk_frame(payload + b"\0"), "do not add up to the announced size"),  # beyond the announced size
        (reply_frame(honest, len(payload) - 10) + chunk_frame(payload), "do not add up to the announced size"),
        (head + chunk_frame(b""), "do not add up to the announced size"),  # an empty chunk never ends the payload
        (head + chunk_frame(payload, dtype="float32"), "exactly one uint8 tensor"),
        (head + frame(two_tensors), "exactly one uint8 tensor"),
        (head + frame(with_metadata), "exactly one uint8 tensor"),
        (head + frame(runtime_pb2.ExpertResponse()), "exactly one uint8 tensor"),
        (head + P2P.ERROR_MARKER + (2).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\x0a\x00",
         "expected the payload chunk, got an error frame"),
        (head + P2P.MESSAGE_MARKER + (2).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\x0a\x05",
         "not a valid ExpertResponse protobuf"),
        (head + chunk_frame(payload[:100]) + chunk_frame(payload[100:][::-1]), "sha256"),  # reassembled, then hashed
    ]
    for raw, message in cases:
        with lying_miner(network, lambda raw=raw: Crafted(None, b"", raw=raw)):
            with pytest.raises(ProtocolError, match=message):
                network.fetch(4)
    # the same payload split across several frames is fine
    split = head + chunk_frame(payload[:1]) + chunk_frame(payload[1:1000]) + chunk_frame(payload[1000:])
    with lying_miner(network, lambda: Crafted(None, b"", raw=split)):
        assert network.fetch(4).payload == payload
    with lying_miner(network, lambda: Crafted(None, b"", raw=head + chunk_frame(payload[:100]))):
        with pytest.raises(TransportError):  # the stream ends mid-payload
            network.fetch(4)


# --- a hostile caller against the honest miner's server -----------------------------------------------------------


def test_half_frames_silence_and_junk_close_the_stream_and_the_miner_keeps_serving(network):
    server = PublicationServer(network.p2p["miner"], netuid=NETUID, wallet=network.wallets["miner"],
                               authorize=permit_holders(lambda: network.directory), request_timeout=1.0)
    run(network.loop, server.start())
    try:
        contribution = contribution_of(delta(6))
        server.publish(4, BASE_HASH, tokens=1024, inner_steps=8, loss=4.0, layout=LAYOUT, codec=contribution.codec,
                       commitment=commitment_to(network, contribution, 4), segments=contribution.segments, block=54)

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
        publication = network.fetch(4)
        assert publication.meta.round == 4 and publication.payload == b"".join(contribution.segments)
    finally:
        run(network.loop, server.stop())


async def _parse_reply(data: bytes) -> tuple[str | None, bool]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    response, error = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader)
    return (None, True) if error is not None else (FetchReply.decode(response.metadata).status, False)
