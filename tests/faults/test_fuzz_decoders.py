"""Property-based fuzz of every decoder of ours that reads bytes another process sent, not fuzzed elsewhere.

Already fuzzed: the message decoders (``PublicationMeta``/``FetchRequest``/``FetchReply``, tests/unit/test_protocol.py),
the segment codecs' decoders alone (tests/unit/test_codecs.py) and the all-reduce codecs' ``extract``
(tests/unit/test_compression.py). Here:

- a publication's payload: ``check_payload`` on arbitrary bytes whose sha256 matches the signed metadata, and
  ``read_publication`` (the validator's check that the payload is the committed contribution, then its decoding by
  the run's codec) on arbitrary and corrupted payloads and commitments under validly signed metadata, including
  garbage that the miner itself committed to: it returns tensors or a reason, and never raises;
- the publication RPC's readers on both ends: whatever bytes a miner answers, ``fetch_publication`` raises one of its
  typed errors (it can only return a verified publication); whatever bytes a caller sends, the miner's handler never
  raises, never answers more than one refusal, and never sends the payload for a malformed request;
- the mock chain server's request handler and its client's reply unwrapping;
- the all-reduce's reading of what each groupmate announced at matchmaking (its weight, terms and commitment);
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

from template.allreduce.averager_process import parse_group
from template.allreduce.codecs import SegmentCodec, get_codec
from template.allreduce.contribution import (
    Commitment,
    EncodedContribution,
    codec_descriptor,
    encode_contribution,
    leaf_digest,
    merkle_root,
)
from template.base.audit import ReadPublication, read_publication
from template.chain.mock import MockSubstrate
from template.chain.mock_server import MockChainServer, MockServerError
from template.chain.mock_wire import unwrap_reply
from template.chain.wallets import create_wallet
from template.p2p.identity import PeerDirectory, PeerRecord, is_peer_id, parse_commitment, sign
from template.p2p.keys import KeypairSigner
from template.p2p.publication import FetchError, Publication, PublicationServer, fetch_publication, permit_holders
from template.protocol import (
    PROTOCOL_VERSION,
    FetchReply,
    FetchRequest,
    ProtocolError,
    PublicationMeta,
    ReplyStatus,
    check_payload,
    payload_size_limit,
)

FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
NETUID = 11
SCOPE = f"netuid{NETUID}"
CALLER = PeerID.from_base58("12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA")
MINER = PeerID.from_base58("QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN")
LAYOUT = [("a", (4, 3)), ("b", (5,))]
SHAPES = [torch.Size(shape) for _, shape in LAYOUT]
NUMEL = 17
CODEC = get_codec("none", segment_values=5)  # the run's codec: 17 values in 4 segments (the last one shorter)
# one codec of each kind, with small segments, for the committed-garbage fuzz
CODECS = {"none": CODEC, "fp16": get_codec("fp16", segment_values=5), "int8": get_codec("int8", segment_values=256),
          "sparse": get_codec("sparse", chunk=4, k=2, bits=3, segment_values=8),
          "sparse-uniform": get_codec("sparse", chunk=8, k=3, bits=2, quantizer="uniform", segment_values=8),
          "sparse-1bit": get_codec("sparse", chunk=8, k=3, bits=1, segment_values=8)}
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


def meta_for(wallet, data: bytes, names=("a", "b"), shapes=((4, 3), (5,)), codec: str | None = None,
             commitment: dict | None = None) -> PublicationMeta:
    """Validly signed metadata for ``data`` (its sha256), committing to ``commitment`` (by default: a well-formed
    commitment of the wallet's to some other contribution)."""
    if commitment is None:
        commitment = dict(scope=SCOPE, round=1, codec=codec_descriptor(CODEC), numel=NUMEL, root="00" * 32,
                          key=wallet.hotkey.ss58_address, signature="")
    meta = PublicationMeta(
        version=PROTOCOL_VERSION, netuid=NETUID, round=1, base_theta_hash="ab" * 32, tokens=1, inner_steps=1, loss=1.0,
        hotkey=wallet.hotkey.ss58_address, payload_sha256=hashlib.sha256(data).hexdigest(), names=names,
        shapes=shapes, codec=codec_descriptor(CODEC) if codec is None else codec, commitment=commitment,
        published_at_block=1,
    )
    return meta.with_signature(sign(wallet.hotkey, meta.signing_bytes()))


def honest_contribution(codec: SegmentCodec = CODEC, seed: int = 0) -> EncodedContribution:
    return encode_contribution(codec, torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)))


_SIGNED: dict[tuple[str, str], dict] = {}


def commitment_of(wallet, contribution: EncodedContribution) -> dict:
    """The wallet's signed round-1 commitment to ``contribution`` (wire form), signed once per root (sr25519
    signatures are randomized, and signing is the slow part of these fuzz examples)."""
    key = (wallet.hotkey.ss58_address, contribution.root.hex())
    if key not in _SIGNED:
        _SIGNED[key] = Commitment.sign(KeypairSigner(wallet.hotkey), SCOPE, 1, contribution).to_wire()
    return dict(_SIGNED[key])


def committed_garbage(codec: SegmentCodec, data: bytes) -> EncodedContribution:
    """``data`` cut into the codec's segments for NUMEL values, as a contribution (root and all) a miner could sign
    — whether or not the bytes decode. ``decoded`` is left empty: nobody knows what they are worth."""
    segments, offset = [], 0
    for start in range(0, NUMEL, codec.segment_values):
        size = codec.encoded_size(min(codec.segment_values, NUMEL - start))
        segments.append(data[offset:offset + size])
        offset += size
    leaves = tuple(leaf_digest(s) for s in segments)
    return EncodedContribution(codec_descriptor(codec), NUMEL, tuple(segments), leaves, merkle_root(leaves),
                               torch.empty(0))


def committed_size(codec: SegmentCodec) -> int:
    return sum(codec.encoded_size(min(codec.segment_values, NUMEL - start))
               for start in range(0, NUMEL, codec.segment_values))


def _read(payload: bytes, meta: PublicationMeta, codec: SegmentCodec = CODEC,
          contributed: dict | None = None) -> ReadPublication:
    """``read_publication`` of a fetched publication: it returns (tensors or a reason), whatever the bytes."""
    result = read_publication(Publication(MINER.to_base58(), meta, check_payload(payload, meta)), codec, SHAPES,
                              SCOPE, contributed)
    assert isinstance(result, ReadPublication)
    assert (result.tensors is None) == bool(result.reason), result
    if result.tensors is not None:
        assert [t.shape for t in result.tensors] == SHAPES and all(t.dtype == torch.float32 for t in result.tensors)
        assert b"".join(result.segments) == payload and result.commitment is not None
    return result


# --- check_payload --------------------------------------------------------------------------------------------------


@FUZZ
@given(data=st.binary(max_size=600) | st.integers(4160, 4170).map(lambda n: b"\xa5" * n),
       max_bytes=st.none() | st.integers(0, 700))
def test_fuzz_check_payload_arbitrary_bytes_with_a_matching_hash(miner_wallet, data, max_bytes):
    """Bytes whose sha256 the metadata signs are returned exactly when within the limit, whatever they are."""
    meta = meta_for(miner_wallet, data)
    limit = payload_size_limit(meta.names, meta.shapes)
    assert limit == 4 * NUMEL + 4096
    limit = limit if max_bytes is None else min(limit, max_bytes)
    try:
        checked = check_payload(data, meta, max_bytes=max_bytes)
    except ProtocolError as err:
        assert len(data) > limit and "over the limit" in str(err)
        return
    assert len(data) <= limit and checked == data
    with pytest.raises(ProtocolError, match="sha256"):
        check_payload(data[:-1] if data else b"\0", meta)  # other bytes within the limit: their hash is not signed


# --- read_publication -------------------------------------------------------------------------------------------------


@FUZZ
@given(data=st.binary(max_size=200), honest_commitment=st.booleans(), contributed=st.booleans())
def test_fuzz_read_publication_arbitrary_bytes(miner_wallet, data, honest_commitment, contributed):
    """Arbitrary bytes under validly signed metadata and a commitment (the miner's valid one to an honest contribution,
    or a well-formed unsigned one): refused with a reason — they are not the committed contribution."""
    commitment = commitment_of(miner_wallet, honest_contribution()) if honest_commitment else None
    meta = meta_for(miner_wallet, data, commitment=commitment)
    result = _read(data, meta, contributed=meta.commitment if contributed else None)
    assert result.tensors is None or data == b"".join(honest_contribution().segments)


@FUZZ
@given(
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
    truncate=st.integers(-3, 40),
    seed=st.integers(0, 3),
)
def test_fuzz_read_publication_corrupted_contribution(miner_wallet, flips, truncate, seed):
    """The honest contribution's payload, bytes changed, truncated (or extended): read back bit for bit exactly when
    it is unchanged, refused as not the committed contribution otherwise."""
    contribution = honest_contribution(seed=seed)
    honest = b"".join(contribution.segments)
    data = bytearray(honest)
    for position, value in flips:
        data[position % len(data)] = value
    corrupted = bytes(data[: len(data) - truncate]) if truncate >= 0 else bytes(data) + b"\0" * -truncate
    commitment = commitment_of(miner_wallet, contribution)
    result = _read(corrupted, meta_for(miner_wallet, corrupted, commitment=commitment), contributed=commitment)
    if corrupted == honest:
        flat = torch.cat([t.reshape(-1) for t in result.tensors])
        assert torch.equal(flat.view(torch.int32), contribution.decoded.view(torch.int32))
    else:
        assert result.reason == "its payload is not the contribution it committed to"


COMMITMENT_VALUES = st.text(max_size=70) | st.integers(0, 1 << 36) | st.sampled_from(
    ["", "00" * 32, "AB" * 32, "ab" * 31, "zz" * 32, "ab" * 64, "ab" * 65, SCOPE, "netuid12", "none/5", "fp16/5"])


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(["scope", "round", "codec", "numel", "root", "key", "signature"]),
                               COMMITMENT_VALUES, max_size=3),
       contributed=st.booleans())
def test_fuzz_read_publication_commitment_fields(miner_wallet, changes, contributed):
    """The honest payload under a commitment with fields replaced by other well-typed values (they pass the protocol's
    shape check): read back as committed exactly when the commitment still means the same thing and verifies."""
    contribution = honest_contribution()
    payload = b"".join(contribution.segments)
    honest = commitment_of(miner_wallet, contribution)
    commitment = {**honest, **changes}
    try:
        meta = meta_for(miner_wallet, payload, commitment=commitment)
    except ProtocolError:
        return  # the protocol refuses it already (a string over 400 characters, a number out of range, ...)
    result = _read(payload, meta, contributed=honest if contributed else None)
    try:
        same = Commitment.from_wire(commitment) == Commitment.from_wire(honest)  # e.g. the root in upper case
    except ValueError:
        same = False
    assert (result.tensors is not None) == (same and (not contributed or commitment == honest)), result.reason


@FUZZ
@given(codec_name=st.sampled_from(sorted(CODECS)), from_honest=st.booleans(),
       flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=3), data=st.data())
def test_fuzz_read_publication_committed_garbage(miner_wallet, codec_name, from_honest, flips, data):
    """A miner commits to (signs the root of) arbitrary bytes of the right size — random, or an honest encoding with
    bytes changed: reading them decodes them with the run's codec or refuses them with a reason; a CodecError never
    escapes, nor anything else. Unchanged honest bytes read back as the values every receiver decodes."""
    codec = CODECS[codec_name]
    size = committed_size(codec)
    honest = honest_contribution(codec)
    if from_honest:
        payload = bytearray(b"".join(honest.segments))
        for position, value in flips:
            payload[position % size] = value
        payload = bytes(payload)
    else:
        payload = data.draw(st.binary(min_size=size, max_size=size))
    contribution = committed_garbage(codec, payload)
    commitment = Commitment.sign(KeypairSigner(miner_wallet.hotkey), SCOPE, 1, contribution).to_wire()
    meta = meta_for(miner_wallet, payload, codec=contribution.codec, commitment=commitment)
    result = _read(payload, meta, codec, contributed=commitment)
    if codec_name in ("none", "fp16", "int8"):
        assert result.reason == ""  # every bit pattern of these is a value (NaN included: the scorer's to refuse)
    else:
        assert result.reason == "" or result.reason.startswith("its committed contribution does not decode: ")
    if payload == b"".join(honest.segments):
        flat = torch.cat([t.reshape(-1) for t in result.tensors])
        assert torch.equal(flat.view(torch.int32), honest.decoded.view(torch.int32))


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
    contribution = honest_contribution()
    payload = b"".join(contribution.segments)
    meta = meta_for(miner_wallet, payload, commitment=commitment_of(miner_wallet, contribution))
    reply = FetchReply(PROTOCOL_VERSION, ReplyStatus.OK, meta=meta, payload_bytes=len(payload))
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
        contribution = honest_contribution()
        server.publish(1, "ab" * 32, 1, 1, 1.0, LAYOUT, contribution.codec, commitment_of(miner_wallet, contribution),
                       contribution.segments, 1)
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


GROUP_COMMITMENT = Commitment(SCOPE, 1, "none/5", NUMEL, b"\x11" * 32,
                              "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY", b"\x22" * 64).to_wire()
WIRE_COMMITMENTS = (
    st.just(GROUP_COMMITMENT)
    | st.builds(lambda key, value: {**GROUP_COMMITMENT, key: value}, st.sampled_from(sorted(GROUP_COMMITMENT)),
                MSGPACK_VALUES)
    | st.builds(lambda key: {k: v for k, v in GROUP_COMMITMENT.items() if k != key},
                st.sampled_from(sorted(GROUP_COMMITMENT)))
    | MSGPACK_VALUES
)


@FUZZ
@given(announced=st.lists(
    st.binary(max_size=30)
    | st.builds(MSGPackSerializer.dumps, st.fixed_dictionaries({"weight": MSGPACK_VALUES}))
    | st.builds(MSGPackSerializer.dumps, st.fixed_dictionaries(
        {"weight": MSGPACK_VALUES | st.floats(0, 1e6), "terms": MSGPACK_VALUES | st.fixed_dictionaries(
            {"scope": st.just(SCOPE), "round": st.integers(0, 3), "codec": st.just("none/5")}),
         "commitment": WIRE_COMMITMENTS}))
    | st.builds(MSGPackSerializer.dumps, MSGPACK_VALUES),
    min_size=1, max_size=5,
), auxiliary=st.lists(st.booleans(), min_size=5, max_size=5))
def test_fuzz_announced_weights_terms_and_commitments(announced, auxiliary):
    modes = [AveragingMode.AUX if aux else AveragingMode.NODE for aux in auxiliary[: len(announced)]]
    pairs = zip(modes, announced, strict=True)
    gathered = tuple(MSGPackSerializer.dumps((1.0, mode.value, blob)) for mode, blob in pairs)
    group = GroupInfo(b"g", tuple(PeerID(bytes([i]) * 8) for i in range(len(announced))), gathered)
    members = parse_group(group)  # never raises, whatever the groupmates announced
    assert [member.mode for member in members] == modes
    for member, blob in zip(members, announced, strict=True):
        weight = member.weight
        assert weight is None or (isinstance(weight, float) and math.isfinite(weight) and weight >= 0)
        assert member.terms is None or isinstance(member.terms, dict)
        assert member.commitment is None or isinstance(member.commitment, Commitment)
        if member.mode == AveragingMode.AUX:
            assert weight == 0.0 and member.commitment is None  # an auxiliary contributes nothing
            continue
        try:
            user = MSGPackSerializer.loads(blob)
        except Exception:
            user = None
        wire = user.get("commitment") if isinstance(user, dict) else None
        if wire == GROUP_COMMITMENT:
            assert member.commitment == Commitment.from_wire(GROUP_COMMITMENT)  # a well-formed one is kept
        elif member.commitment is not None:
            assert member.commitment.to_wire() == Commitment.from_wire(wire).to_wire()


# --- PeerID commitments written on chain by other hotkeys ------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(value=st.text(max_size=140) | st.builds(lambda s: "dl1:" + s, st.text(max_size=80)) | JSON_VALUES)
def test_fuzz_peer_id_commitments(value):
    peer_id = parse_commitment(value)
    assert peer_id is None or (is_peer_id(peer_id) and value == "dl1:" + peer_id)
