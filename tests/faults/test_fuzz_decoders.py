"""Property-based fuzz of every decoder of ours that reads bytes another process sent, not fuzzed elsewhere.

Already fuzzed: the message decoders (``PublicationMeta``/``FetchRequest``/``FetchReply``, tests/unit/test_protocol.py)
and the all-reduce codecs' ``extract`` (tests/unit/test_compression.py). Here:

- ``decode_payload``: arbitrary and corrupted safetensors bytes whose sha256 matches the signed metadata;
- the publication RPC's readers on both ends: whatever bytes a miner answers, ``fetch_publication`` raises one of its
  typed errors (it can only return a verified publication); whatever bytes a caller sends, the miner's handler never
  raises, never answers more than one refusal, and never sends the payload for a malformed request;
- the mock chain server's request handler and its client's reply unwrapping;
- the all-reduce's reading of what each groupmate announced at matchmaking (its weight);
- on-chain PeerID commitments written by other hotkeys.

Each runs the real decoder on bytes in memory (a fed ``asyncio.StreamReader`` stands in for the libp2p stream).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math

import bittensor as bt
import pytest
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from template.chain.mock import MockSubstrate
from template.chain.mock_server import MockChainServer, MockServerError
from template.chain.mock_wire import unwrap_reply
from template.chain.wallets import create_wallet
from template.p2p.identity import PeerDirectory, PeerRecord, is_peer_id, parse_commitment, sign
from template.p2p.publication import FetchError, PublicationServer, fetch_publication, permit_holders
from template.protocol import (
    PROTOCOL_VERSION,
    FetchReply,
    FetchRequest,
    ProtocolError,
    PublicationMeta,
    ReplyStatus,
    decode_payload,
    encode_payload,
)
from template.training.allreduce_runner import _parse_group

FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
NETUID = 11
CALLER = PeerID.from_base58("12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA")
MINER = PeerID.from_base58("QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN")
LAYOUT = [("a", (4, 3)), ("b", (5,))]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=16),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)
MSGPACK_VALUES = st.recursive(  # what msgpack can carry: 64-bit integers, bytes too
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=16)
    | st.binary(max_size=16),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)


@pytest.fixture(scope="module")
def miner_wallet(tmp_path_factory):
    return create_wallet("miner", "default", tmp_path_factory.mktemp("wallets"))


def meta_for(wallet, data: bytes, names=("a", "b"), shapes=((4, 3), (5,)), codec="fp32") -> PublicationMeta:
    return PublicationMeta(
        version=PROTOCOL_VERSION, netuid=NETUID, round=1, base_theta_hash="ab" * 32, tokens=1, inner_steps=1, loss=1.0,
        hotkey=wallet.hotkey.ss58_address, payload_sha256=hashlib.sha256(data).hexdigest(), names=names,
        shapes=shapes, dtype="float32", codec=codec, published_at_block=1,
    )


# --- decode_payload -----------------------------------------------------------------------------------------------


def _decoded_or_protocol_error(data: bytes, meta: PublicationMeta) -> None:
    try:
        decoded = decode_payload(data, meta)
    except ProtocolError:
        return
    assert list(decoded.tensors) == list(meta.names)
    assert [tuple(t.shape) for t in decoded.tensors.values()] == list(meta.shapes)


@FUZZ
@given(data=st.binary(max_size=600), codec=st.sampled_from(["fp32", "fp16"]))
def test_fuzz_payload_arbitrary_bytes_with_a_matching_hash(miner_wallet, data, codec):
    _decoded_or_protocol_error(data, meta_for(miner_wallet, data, codec=codec))


@FUZZ
@given(
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
    truncate=st.integers(0, 40),
    header_only=st.booleans(),
)
def test_fuzz_payload_corrupted_safetensors_with_a_matching_hash(miner_wallet, flips, truncate, header_only):
    data = bytearray(encode_payload([(n, torch.randn(s)) for n, s in LAYOUT], "fp32").data)
    header_end = 8 + int.from_bytes(data[:8], "little")
    for position, value in flips:
        data[position % (header_end if header_only else len(data))] = value
    corrupted = bytes(data[: len(data) - truncate])
    _decoded_or_protocol_error(corrupted, meta_for(miner_wallet, corrupted))


# --- the publication RPC's two readers ------------------------------------------------------------------------------


def frame(body: bytes, marker: bytes = P2P.MESSAGE_MARKER) -> bytes:
    return marker + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


class _Sink:
    """The writing half of a stream: what the code under test sends is collected, nothing is transmitted."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


class _StreamFrom:
    """A p2p whose stream to the miner yields ``answer``: the caller side of the publication RPC, minus libp2p."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer

    async def call_binary_stream_handler(self, peer_id, handler_name):
        return StreamInfo(peer_id, Multiaddr("/ip4/127.0.0.1/tcp/1"), handler_name), _reader(self.answer), _Sink()


def _reply_frame(document) -> bytes:
    return frame(runtime_pb2.ExpertResponse(metadata=json.dumps(document).encode()).SerializeToString())


def miner_answers():
    """Bytes a lying or broken miner may answer: raw junk, junk frames, and well-framed replies with fuzzed JSON."""
    ok_reply = st.fixed_dictionaries({
        "version": st.just(PROTOCOL_VERSION) | JSON_VALUES, "status": st.sampled_from(ReplyStatus.ALL) | JSON_VALUES,
        "reason": st.text(max_size=20), "meta": JSON_VALUES, "payload_bytes": st.integers(-5, 1 << 60),
    })
    reply = ok_reply.map(_reply_frame)
    junk_frame = st.builds(frame, st.binary(max_size=64), st.sampled_from([P2P.MESSAGE_MARKER, P2P.ERROR_MARKER]))
    chunk = st.binary(max_size=64).map(
        lambda b: frame(runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=b, dtype="uint8")])
                        .SerializeToString()))
    return st.binary(max_size=200) | st.lists(reply | junk_frame | chunk, max_size=4).map(b"".join)


@FUZZ
@given(answer=miner_answers())
def test_fuzz_what_a_miner_answers_to_a_fetch(miner_wallet, answer):
    request = FetchRequest(PROTOCOL_VERSION, NETUID, 1)
    coro = fetch_publication(_StreamFrom(answer), MINER, request, expected_hotkey=miner_wallet.hotkey.ss58_address,
                             timeout=5)
    with pytest.raises((FetchError, ProtocolError)):  # unsigned bytes can never verify
        asyncio.run(coro)


@FUZZ
@given(answer=st.binary(max_size=300))
def test_fuzz_a_signed_reply_followed_by_arbitrary_chunks(miner_wallet, answer):
    """The reply is genuine and signed; the payload frames that follow are not: still never accepted."""
    payload = encode_payload([(n, torch.randn(s)) for n, s in LAYOUT], "fp32")
    meta = meta_for(miner_wallet, payload.data)
    meta = meta.with_signature(sign(miner_wallet.hotkey, meta.signing_bytes()))
    reply = FetchReply(PROTOCOL_VERSION, ReplyStatus.OK, meta=meta, payload_bytes=len(payload.data))
    head = frame(runtime_pb2.ExpertResponse(metadata=reply.encode()).SerializeToString())
    coro = fetch_publication(_StreamFrom(head + answer), MINER, FetchRequest(PROTOCOL_VERSION, NETUID, 1),
                             expected_hotkey=miner_wallet.hotkey.ss58_address, timeout=5)
    with pytest.raises((FetchError, ProtocolError)):
        asyncio.run(coro)


def caller_requests():
    request = runtime_pb2.ExpertRequest
    documents = st.dictionaries(st.sampled_from(["version", "netuid", "round", "x"]), JSON_VALUES, max_size=4)
    fuzzed_request = documents.map(lambda d: frame(request(metadata=json.dumps(d).encode()).SerializeToString()))
    valid_request = st.just(frame(request(metadata=FetchRequest(PROTOCOL_VERSION, NETUID, 1).encode())
                                  .SerializeToString()))
    end = st.just(frame(b"", P2P.ERROR_MARKER)) | st.builds(frame, st.binary(max_size=8), st.just(P2P.ERROR_MARKER))
    framed = st.tuples(valid_request | fuzzed_request | st.binary(max_size=40), end | st.binary(max_size=10))
    return st.binary(max_size=200) | framed.map(b"".join)


@FUZZ
@given(data=caller_requests())
def test_fuzz_what_a_caller_sends_to_the_miner(miner_wallet, data):
    async def serve() -> bytes:
        directory = PeerDirectory([PeerRecord(CALLER.to_base58(), 0, "validator-hotkey", True, None)])
        server = PublicationServer(None, netuid=NETUID, wallet=miner_wallet, request_timeout=2,
                                   authorize=permit_holders(lambda: directory), max_requests_per_minute=10**6)
        server.publish(1, "ab" * 32, 1, 1, 1.0, [(n, torch.ones(s)) for n, s in LAYOUT], "fp32", 1)
        sink = _Sink()
        await server._handle(StreamInfo(CALLER, Multiaddr("/ip4/127.0.0.1/tcp/1"), "h"), _reader(data), sink)
        assert sink.closed
        return bytes(sink.data)

    answer = asyncio.run(serve())  # the handler itself must never raise, whatever it was sent
    if not answer:
        return  # closed without a word: truncated input
    response, error = asyncio.run(_first_frame(answer))
    assert error is None
    reply = FetchReply.decode(response.metadata)
    valid = data.startswith(frame(runtime_pb2.ExpertRequest(metadata=FetchRequest(PROTOCOL_VERSION, NETUID, 1)
                                                            .encode()).SerializeToString())
                            + frame(b"", P2P.ERROR_MARKER))
    if reply.status == ReplyStatus.OK:
        assert valid, "the payload went out for a malformed request"
    else:
        assert reply.status in (ReplyStatus.BAD_REQUEST, ReplyStatus.NOT_FOUND)
        assert len(answer) == len(frame(response.SerializeToString())), "a refusal is one frame"


async def _first_frame(data: bytes):
    return await P2P.receive_protobuf(runtime_pb2.ExpertResponse, _reader(data))


# --- the mock chain server and its client -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chain_server():
    mock = MockSubstrate()
    mock.create_subnet(NETUID, tempo=100)
    return MockChainServer(mock, seconds_per_block=0)  # never started: the request handler alone, no socket


METHODS = ["block_number", "query", "query_map", "runtime_call", "submit", "register", "advance_blocks", "compose",
           "constant", "nonsense", "to_json", "set_stake"]


@FUZZ
@given(
    request=st.binary(max_size=200)
    | st.builds(lambda m, p: json.dumps({"method": m, "params": p}, default=repr).encode(),
                st.sampled_from(METHODS) | JSON_VALUES, st.dictionaries(st.text(max_size=12), JSON_VALUES, max_size=4)
                | JSON_VALUES)
    | st.builds(lambda v: json.dumps({"method": "query", "params": {"module": "SubtensorModule",
                                                                     "storage_function": "Uids", "params": v}},
                                     default=repr).encode(), JSON_VALUES)
)
def test_fuzz_mock_chain_requests(chain_server, request):
    reply = json.loads(chain_server._handle(request))
    assert isinstance(reply, dict) and len(reply) == 1 and set(reply) <= {"result", "error"}
    if "error" in reply:
        assert isinstance(reply["error"]["type"], str) and isinstance(reply["error"]["message"], str)


TAGGED = st.fixed_dictionaries({"$bytes": JSON_VALUES}) | st.fixed_dictionaries({"$call": JSON_VALUES})


@FUZZ
@given(reply=JSON_VALUES | st.fixed_dictionaries({"error": JSON_VALUES}) | st.fixed_dictionaries(
    {"error": st.fixed_dictionaries({"type": st.sampled_from(["ChainError", "ValueError", "X"]) | JSON_VALUES,
                                     "message": JSON_VALUES, "code": JSON_VALUES | st.sampled_from(["rate_limited"]),
                                     "name": JSON_VALUES})})
    | st.fixed_dictionaries({"result": JSON_VALUES | TAGGED | st.lists(TAGGED, max_size=3)}))
def test_fuzz_mock_chain_replies(reply):
    """Whatever the server answers, the client returns a value or raises one of its documented errors."""
    try:
        unwrap_reply(reply)
    except (MockServerError, bt.ChainError, ValueError):
        pass


# --- what groupmates announce at matchmaking ----------------------------------------------------------------------


@FUZZ
@given(announced=st.lists(
    st.binary(max_size=30)
    | st.builds(MSGPackSerializer.dumps, st.fixed_dictionaries({"weight": MSGPACK_VALUES}))
    | st.builds(MSGPackSerializer.dumps, MSGPACK_VALUES),
    min_size=1, max_size=5,
), auxiliary=st.lists(st.booleans(), min_size=5, max_size=5))
def test_fuzz_announced_weights(announced, auxiliary):
    modes = [AveragingMode.AUX if aux else AveragingMode.NODE for aux in auxiliary[: len(announced)]]
    pairs = zip(modes, announced, strict=True)
    gathered = tuple(MSGPackSerializer.dumps((1.0, mode.value, blob)) for mode, blob in pairs)
    group = GroupInfo(b"g", tuple(PeerID(bytes([i]) * 8) for i in range(len(announced))), gathered)
    parsed_modes, weights = _parse_group(group)
    assert parsed_modes == modes
    for mode, weight in zip(modes, weights, strict=True):
        assert weight is None or (math.isfinite(weight) and weight >= 0)
        if mode == AveragingMode.AUX:
            assert weight == 0.0


# --- PeerID commitments written on chain by other hotkeys ------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(value=st.text(max_size=140) | st.builds(lambda s: "dl1:" + s, st.text(max_size=80)) | JSON_VALUES)
def test_fuzz_peer_id_commitments(value):
    peer_id = parse_commitment(value)
    assert peer_id is None or (is_peer_id(peer_id) and value == "dl1:" + peer_id)
