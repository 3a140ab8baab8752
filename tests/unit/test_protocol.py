"""Messages (template.protocol), PeerID bindings and hotkey signatures (template.p2p.identity), the pure parts of
the publication RPC (authorization, rate limiting), and what a validator checks of a publication's payload: its size
and hash (``check_payload``) and that it is the contribution its miner committed to (``read_publication``).

Decoders are fuzzed with hypothesis: whatever the bytes, they return a valid object or raise ProtocolError. The
directory is built from real metagraphs: the in-memory mock chain driven through the real bittensor SDK (no sockets).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import base58
import bittensor as bt
import multihash
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import template.protocol
from template.allreduce.codecs import CODEC_NAMES, SegmentCodec, get_codec
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
from template.chain.wallets import create_wallet
from template.p2p.identity import (
    COMMITMENT_PREFIX,
    MAX_COMMITMENT_BYTES,
    PeerDirectory,
    PeerRecord,
    is_peer_id,
    parse_commitment,
    peer_directory,
    sign,
    verify,
)
from template.p2p.keys import KeypairSigner, verify_signature
from template.p2p.publication import Publication, _RateLimiter, permit_holders
from template.protocol import (
    MAX_META_BYTES,
    MAX_REQUEST_BYTES,
    PROTOCOL_VERSION,
    FetchKind,
    FetchReply,
    FetchRequest,
    InputsMeta,
    ProtocolError,
    PublicationMeta,
    ReplyStatus,
    SenderInputs,
    check_payload,
    payload_size_limit,
)
from tests.integration.p2p_helpers import commit_peer_id

NETUID = 7
SCOPE = f"netuid{NETUID}"
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def peer_id_for(seed: str) -> str:
    """A well-formed PeerID (sha2-256 multihash, the RSA-key form ``Qm...``) derived from a seed."""
    return base58.b58encode(multihash.encode(hashlib.sha256(seed.encode()).digest(), "sha2-256")).decode()


@pytest.fixture(scope="module")
def wallets(tmp_path_factory):
    path = tmp_path_factory.mktemp("wallets")
    names = ("validator", "miner", "a", "b", "c", "d", "outsider")
    return {name: create_wallet(name, "default", path) for name in names}


# The metadata tests' contribution: an fp16 encoding of the two tensors below (256·16 + 16·16 values).
META_CODEC = get_codec("fp16")
META_CONTRIBUTION = encode_contribution(META_CODEC, torch.linspace(-1, 1, 256 * 16 + 16 * 16))
_COMMITMENTS: dict[str, dict] = {}


def miner_commitment(wallets) -> dict:
    """The miner's signed commitment (wire form) to META_CONTRIBUTION in round 3; signed once (sr25519 signatures are
    randomized), so every metadata built here carries the same one."""
    hotkey = wallets["miner"].hotkey
    if hotkey.ss58_address not in _COMMITMENTS:
        signed = Commitment.sign(KeypairSigner(hotkey), SCOPE, 3, META_CONTRIBUTION)
        _COMMITMENTS[hotkey.ss58_address] = signed.to_wire()
    return dict(_COMMITMENTS[hotkey.ss58_address])


def make_meta(wallets, **overrides) -> PublicationMeta:
    fields = dict(
        version=PROTOCOL_VERSION, netuid=NETUID, round=3, base_theta_hash="ab" * 32, tokens=4096, inner_steps=20,
        loss=3.25, hotkey=wallets["miner"].hotkey.ss58_address, payload_sha256="cd" * 32,
        names=("embed.weight", "layers.0.mlp.weight"), shapes=((256, 16), (16, 16)),
        codec=codec_descriptor(META_CODEC), commitment=miner_commitment(wallets), published_at_block=123,
    )
    fields.update(overrides)
    return PublicationMeta(**fields)


def signed_meta(wallets, **overrides) -> PublicationMeta:
    meta = make_meta(wallets, **overrides)
    return meta.with_signature(sign(wallets["miner"].hotkey, meta.signing_bytes()))


# --- signatures over metadata -----------------------------------------------------------------------------------


def test_signed_metadata_round_trips_and_verifies(wallets):
    meta = signed_meta(wallets)
    decoded = PublicationMeta.decode(meta.encode())
    assert decoded == meta
    assert verify(meta.hotkey, decoded.signing_bytes(), decoded.signature)
    assert not verify(wallets["validator"].hotkey.ss58_address, decoded.signing_bytes(), decoded.signature)


# Another valid value for every signed field (a function of the original where it depends on it): changing any one
# must break the signature.
TAMPERED = {
    "netuid": 8,
    "round": 4,
    "base_theta_hash": "ac" * 32,
    "tokens": 4097,
    "inner_steps": 21,
    "loss": 3.2500001,
    "payload_sha256": "ce" * 32,
    "names": ("embed.weight", "layers.0.mlp.bias"),
    "shapes": ((256, 16), (16, 15)),
    "codec": "fp16/65536",
    "commitment": lambda commitment: {**commitment, "root": "00" * 32},
    "published_at_block": 124,
}


def test_every_field_is_covered_by_the_signature(wallets):
    signed_fields = {f.name for f in dataclasses.fields(PublicationMeta)} - {"signature", "version", "hotkey"}
    assert set(TAMPERED) == signed_fields  # the table below covers every field (version/hotkey: next test)
    assert "dtype" not in {f.name for f in dataclasses.fields(PublicationMeta)}  # v2: the codec says it all


@pytest.mark.parametrize("field", sorted(TAMPERED))
def test_tampering_with_any_field_breaks_the_signature(wallets, field):
    meta = signed_meta(wallets)
    document = meta.to_dict()
    value = TAMPERED[field](document[field]) if callable(TAMPERED[field]) else TAMPERED[field]
    tampered = PublicationMeta.decode(json.dumps({**document, field: value}).encode())
    assert tampered.signature == meta.signature and getattr(tampered, field) != getattr(meta, field)
    assert not verify(meta.hotkey, tampered.signing_bytes(), tampered.signature)


def test_a_changed_commitment_key_order_or_spacing_is_the_same_signed_message(wallets):
    """The signed bytes are canonical JSON: a relay that re-serializes the commitment (key order, spaces) breaks
    nothing, so a validator re-derives exactly what the miner signed."""
    meta = signed_meta(wallets)
    document = meta.to_dict()
    document["commitment"] = dict(reversed(list(document["commitment"].items())))
    relayed = PublicationMeta.decode(json.dumps(document, indent=2).encode())
    assert relayed == meta and relayed.signing_bytes() == meta.signing_bytes()
    assert verify(meta.hotkey, relayed.signing_bytes(), relayed.signature)


def test_a_signature_does_not_carry_over_to_another_hotkey(wallets):
    meta = signed_meta(wallets)
    claimed = dataclasses.replace(meta, hotkey=wallets["validator"].hotkey.ss58_address)
    assert not verify(claimed.hotkey, claimed.signing_bytes(), claimed.signature)
    assert not verify(meta.hotkey, claimed.signing_bytes(), meta.signature)  # hotkey is part of the signed bytes


@pytest.mark.parametrize(
    ("hotkey", "payload", "signature"),
    [
        ("not-an-address", b"x", "00" * 64),
        (None, b"x", "00" * 64),
        ("5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY", b"x", "zz"),
        ("5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY", b"x", "00" * 63),
        ("5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY", "text, not bytes", "00" * 64),
        ("5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY", b"x", None),
    ],
)
def test_verify_returns_false_on_garbage(hotkey, payload, signature):
    assert verify(hotkey, payload, signature) is False


@FUZZ
@given(payload=st.binary(max_size=64), signature=st.text(max_size=140))
def test_verify_never_raises(wallets, payload, signature):
    assert verify(wallets["miner"].hotkey.ss58_address, payload, signature) is False


# --- strict decoding --------------------------------------------------------------------------------------------


def _without(key: str):
    return lambda commitment: {k: v for k, v in commitment.items() if k != key}


def _with(key: str, value):
    return lambda commitment: {**commitment, key: value}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("version", PROTOCOL_VERSION + 1, "not supported"),
        ("version", 1, "not supported"),  # the v1 (safetensors) protocol is gone
        ("netuid", True, "must be an integer"),
        ("round", -1, "outside"),
        ("round", 1 << 32, "outside"),
        ("tokens", 1.5, "must be an integer"),
        ("base_theta_hash", "AB" * 32, "lowercase hex"),
        ("payload_sha256", "cd" * 31, "lowercase hex"),
        ("loss", -0.5, "within"),
        ("loss", "3.2", "must be a number"),
        ("hotkey", "5notanaddress", "ss58"),
        ("names", [], "1.."),
        ("names", ["a", "a"], "unique"),
        ("names", ["__metadata__", "b"], "__metadata__"),
        ("names", ["x" * 300, "b"], "characters long"),
        ("shapes", [[1]], "one shape per name"),
        ("shapes", [[1, -2], [3]], "outside"),
        ("shapes", [[1] * 9, [3]], "dimensions"),
        ("shapes", [[1 << 35, 4], [3]], "more than"),
        ("codec", 7, "codec must be a string"),
        ("codec", None, "codec must be a string"),
        ("codec", "x" * 201, "codec is 201 characters long"),
        ("commitment", None, "commitment must be an object"),
        ("commitment", [], "commitment must be an object"),
        ("commitment", "ab" * 32, "commitment must be an object"),
        ("commitment", _without("root"), "commitment must be an object with exactly"),
        ("commitment", _with("extra", 1), "commitment must be an object with exactly"),
        ("commitment", _with("round", -1), "commitment round=-1 is outside"),
        ("commitment", _with("round", "3"), "commitment round must be an integer"),
        ("commitment", _with("numel", True), "commitment numel must be an integer"),
        ("commitment", _with("numel", 1.0), "commitment numel must be an integer"),
        ("commitment", _with("numel", 1 << 40), "commitment numel=.* is outside"),
        ("commitment", _with("root", 5), "commitment root must be a string"),
        ("commitment", _with("signature", None), "commitment signature must be a string"),
        ("commitment", _with("scope", "s" * 401), "commitment scope is 401 characters long"),
        ("commitment", _with("key", ["5Grw"]), "commitment key must be a string"),
        ("signature", "00" * 63, "signature"),
    ],
)
def test_decode_rejects_bad_fields_with_a_clear_error(wallets, field, value, message):
    document = signed_meta(wallets).to_dict()
    document[field] = value(document[field]) if callable(value) else value
    with pytest.raises(ProtocolError, match=message):
        PublicationMeta.decode(json.dumps(document).encode())


def test_dtype_of_protocol_v1_is_an_unknown_field(wallets):
    document = {**signed_meta(wallets).to_dict(), "dtype": "float32"}
    with pytest.raises(ProtocolError, match="unknown fields \\['dtype'\\]"):
        PublicationMeta.decode(json.dumps(document).encode())


@pytest.mark.parametrize("codec", [get_codec(name) for name in CODEC_NAMES]
                         + [get_codec("fp16", segment_values=1000), get_codec("int8", segment_values=512),
                            get_codec("sparse", chunk=64, k=4, bits=3, quantizer="uniform", segment_values=256,
                                      error_feedback=False)],
                         ids=repr)
def test_every_codec_descriptor_is_a_valid_codec_field(wallets, codec):
    """The codec field is the run codec's free-form descriptor (name, segment size, settings), at most 200 characters:
    every codec's fits, and survives the round trip and the commitment's own limit."""
    descriptor = codec_descriptor(codec)
    assert len(descriptor) <= template.protocol.MAX_CODEC_CHARS and descriptor.startswith(codec.name + "/")
    meta = signed_meta(wallets, codec=descriptor, commitment={**miner_commitment(wallets), "codec": descriptor})
    decoded = PublicationMeta.decode(meta.encode())
    assert decoded.codec == descriptor and decoded.commitment["codec"] == descriptor
    assert Commitment.from_wire(decoded.commitment).codec == descriptor
    longest = signed_meta(wallets, codec="c" * template.protocol.MAX_CODEC_CHARS)
    assert PublicationMeta.decode(longest.encode()) == longest


def test_decode_rejects_missing_unknown_and_non_standard_input(wallets):
    document = signed_meta(wallets).to_dict()
    with pytest.raises(ProtocolError, match="missing fields \\['loss'\\]"):
        PublicationMeta.decode(json.dumps({k: v for k, v in document.items() if k != "loss"}).encode())
    with pytest.raises(ProtocolError, match="unknown fields \\['extra'\\]"):
        PublicationMeta.decode(json.dumps({**document, "extra": 1}).encode())
    with pytest.raises(ProtocolError, match="NaN"):
        PublicationMeta.decode(json.dumps({**document, "loss": float("nan")}).encode())
    with pytest.raises(ProtocolError, match="JSON object"):
        PublicationMeta.decode(b"[1, 2]")
    with pytest.raises(ProtocolError, match="UTF-8 JSON"):
        PublicationMeta.decode(b"\xff\xfe{}")
    with pytest.raises(ProtocolError, match="UTF-8 JSON"):
        PublicationMeta.decode(b"[" * 200_000 + b"]" * 200_000)  # under the size limit, too deep to parse
    with pytest.raises(ProtocolError, match="must be bytes"):
        PublicationMeta.decode("a str")  # type: ignore[arg-type]


def test_oversized_input_is_refused_before_parsing(wallets):
    padded = signed_meta(wallets).encode() + b" " * MAX_META_BYTES  # valid JSON, just too long
    with pytest.raises(ProtocolError, match="limit"):
        PublicationMeta.decode(padded)
    with pytest.raises(ProtocolError, match="limit"):
        FetchRequest.decode(b" " * (MAX_REQUEST_BYTES + 1))
    with pytest.raises(ProtocolError, match="limit"):
        signed_meta(wallets, names=[f"n{i:0>200}" for i in range(6000)], shapes=[[1]] * 6000).encode()


def test_every_truncation_of_a_valid_encoding_is_refused(wallets):
    data = signed_meta(wallets).encode()
    for end in range(len(data)):
        with pytest.raises(ProtocolError):
            PublicationMeta.decode(data[:end])


def _valid_or_protocol_error(decoder, data: bytes) -> None:
    try:
        decoded = decoder(data)
    except ProtocolError:
        return
    assert decoder(decoded.encode()) == decoded  # anything accepted is well-formed and re-encodes to itself


@FUZZ
@given(data=st.binary(max_size=2048))
def test_fuzz_arbitrary_bytes(data):
    for decoder in (PublicationMeta.decode, FetchRequest.decode, FetchReply.decode):
        _valid_or_protocol_error(decoder, data)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(field=st.sampled_from([f.name for f in dataclasses.fields(PublicationMeta)]), value=JSON_VALUES)
def test_fuzz_one_field_replaced_by_arbitrary_json(wallets, field, value):
    document = {**signed_meta(wallets).to_dict(), field: value}
    _valid_or_protocol_error(PublicationMeta.decode, json.dumps(document).encode())
    reply = {"version": PROTOCOL_VERSION, "status": "ok", "reason": "", "meta": document, "payload_bytes": 10}
    _valid_or_protocol_error(FetchReply.decode, json.dumps(reply).encode())


@FUZZ
@given(key=st.sampled_from(["scope", "round", "codec", "numel", "root", "key", "signature", "extra"]),
       value=JSON_VALUES, drop=st.booleans())
def test_fuzz_one_commitment_field_replaced_by_arbitrary_json(wallets, key, value, drop):
    document = signed_meta(wallets).to_dict()
    commitment = {**document["commitment"], key: value}
    if drop:
        del commitment[key]
    _valid_or_protocol_error(PublicationMeta.decode, json.dumps({**document, "commitment": commitment}).encode())


@FUZZ
@given(position=st.integers(min_value=0), byte=st.integers(min_value=0, max_value=255))
def test_fuzz_single_byte_corruption(wallets, position, byte):
    data = bytearray(signed_meta(wallets).encode())
    data[position % len(data)] = byte
    _valid_or_protocol_error(PublicationMeta.decode, bytes(data))


@FUZZ
@given(document=st.dictionaries(st.sampled_from(["version", "netuid", "round", "x"]), JSON_VALUES, max_size=4))
def test_fuzz_fetch_requests(document):
    _valid_or_protocol_error(FetchRequest.decode, json.dumps(document).encode())


def test_request_and_replies_round_trip(wallets):
    request = FetchRequest(PROTOCOL_VERSION, NETUID, 9)
    assert FetchRequest.decode(request.encode()) == request
    ok = FetchReply(PROTOCOL_VERSION, ReplyStatus.OK, meta=signed_meta(wallets), payload_bytes=1234)
    assert FetchReply.decode(ok.encode()) == ok
    refused = FetchReply(PROTOCOL_VERSION, ReplyStatus.REFUSED, reason="no validator permit")
    assert FetchReply.decode(refused.encode()) == refused
    with pytest.raises(ProtocolError, match="exactly when"):
        FetchReply(PROTOCOL_VERSION, ReplyStatus.NOT_FOUND, meta=signed_meta(wallets))
    with pytest.raises(ProtocolError, match="exactly when"):
        FetchReply.decode(json.dumps({**json.loads(ok.encode()), "meta": None}).encode())
    with pytest.raises(ProtocolError, match="status must be one of"):
        FetchReply.decode(json.dumps({**json.loads(refused.encode()), "status": "maybe"}).encode())


def inputs_meta(wallets, **changes) -> InputsMeta:
    """An owner's inputs of segments [2, 4) of 6: one sender, both segments served (4 and 6 bytes)."""
    sender = SenderInputs(wallets["a"].hotkey.ss58_address, ("ab" * 32, "cd" * 32), ("ef" * 32,), (2, 3), (4, 6))
    fields = dict(version=PROTOCOL_VERSION, netuid=NETUID, round=9, start=2, stop=4, count=6, senders=(sender,),
                  payload_sha256="00" * 32)
    return InputsMeta(**{**fields, **changes})


def test_an_inputs_request_and_reply_round_trip(wallets):
    request = FetchRequest(PROTOCOL_VERSION, NETUID, 9, FetchKind.INPUTS)
    assert FetchRequest.decode(request.encode()) == request
    reply = FetchReply(PROTOCOL_VERSION, ReplyStatus.OK, inputs=inputs_meta(wallets), payload_bytes=10)
    assert FetchReply.decode(reply.encode()) == reply
    with pytest.raises(ProtocolError, match="kind must be one of"):
        FetchRequest(PROTOCOL_VERSION, NETUID, 9, "everything")
    with pytest.raises(ProtocolError, match="sizes add up"):
        FetchReply(PROTOCOL_VERSION, ReplyStatus.OK, inputs=inputs_meta(wallets), payload_bytes=11)
    with pytest.raises(ProtocolError, match="one kind of metadata"):
        FetchReply(PROTOCOL_VERSION, ReplyStatus.OK, meta=signed_meta(wallets), inputs=inputs_meta(wallets),
                   payload_bytes=10)


@pytest.mark.parametrize("change, message", [
    (dict(start=4), r"stop=4 is outside"),
    (dict(stop=7), r"stop=7 is outside"),
    (dict(payload_sha256="zz"), "payload_sha256 must be lowercase hex"),
    (dict(senders="x"), "senders must be a list"),
    (dict(senders=("x",)), "a sender's inputs must be an object"),
])
def test_malformed_inputs_metadata_is_refused(wallets, change, message):
    with pytest.raises(ProtocolError, match=message):
        inputs_meta(wallets, **change)


@pytest.mark.parametrize("sender_change, message", [
    (dict(leaves=("ab" * 32,)), "leaves must cover the range"),
    (dict(leaves=("AB" * 32, "cd" * 32)), "leaves must be lowercase hex"),
    (dict(segments=(3, 2)), "must ascend"),
    (dict(segments=(2, 4)), r"segment=4 is outside"),
    (dict(sizes=(4,)), "one size each"),
    (dict(key="not-a-hotkey"), "not an ss58 address"),
])
def test_a_malformed_sender_entry_is_refused(wallets, sender_change, message):
    sender = dataclasses.replace(inputs_meta(wallets).senders[0], **sender_change)
    with pytest.raises(ProtocolError, match=message):
        inputs_meta(wallets, senders=(sender,))
    document = inputs_meta(wallets).to_dict()
    document["senders"] = [{**document["senders"][0], **{k: list(v) if isinstance(v, tuple) else v
                                                         for k, v in sender_change.items()}}]
    with pytest.raises(ProtocolError, match=message):
        InputsMeta.from_dict(json.loads(json.dumps(document)))


# --- payloads: size and hash (check_payload) ---------------------------------------------------------------------


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(256, 16, generator=generator),
        "layers.0.mlp.weight": torch.randn(16, 16, generator=generator),
        "norm.bias": torch.randn(16, generator=generator) * 1e-3,
    }


def flat(named: dict[str, torch.Tensor]) -> torch.Tensor:
    """The contribution's flat vector: every tensor, in order (as the averager's buffer holds them)."""
    return torch.cat([t.reshape(-1) for t in named.values()])


def shapes_of(named: dict[str, torch.Tensor]) -> list[torch.Size]:
    return [t.shape for t in named.values()]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def payload_meta(wallets, named: dict[str, torch.Tensor], payload: bytes, **overrides) -> PublicationMeta:
    fields = dict(payload_sha256=sha256(payload), names=tuple(named), shapes=tuple(tuple(t.shape) for t in
                                                                                   named.values()))
    return signed_meta(wallets, **{**fields, **overrides})


def test_check_payload_returns_the_bytes_whose_hash_is_signed(wallets):
    payload = b"".join(encode_contribution(get_codec("none"), flat(tensors())).segments)
    meta = payload_meta(wallets, tensors(), payload)
    assert check_payload(payload, meta) == payload
    checked = check_payload(bytearray(payload), meta)
    assert type(checked) is bytes and checked == payload
    assert check_payload(payload, meta, max_bytes=len(payload)) == payload  # the limit is inclusive


def test_payload_hash_mismatch_is_detected(wallets):
    payload = b"".join(encode_contribution(get_codec("none"), flat(tensors())).segments)
    other = b"".join(encode_contribution(get_codec("none"), flat(tensors(seed=1))).segments)
    meta = payload_meta(wallets, tensors(), payload)
    for wrong in (other, payload[:-1], payload + b"\0", b"", bytes([payload[0] ^ 1]) + payload[1:]):
        with pytest.raises(ProtocolError, match="sha256"):
            check_payload(wrong, meta)


@pytest.mark.parametrize("data", ["a str", memoryview(b"abc"), None, 42, [1, 2]])
def test_a_payload_that_is_not_bytes_is_refused(wallets, data):
    with pytest.raises(ProtocolError, match="payload must be bytes"):
        check_payload(data, payload_meta(wallets, tensors(), b"abc"))


def test_oversized_payload_is_refused_before_hashing(wallets, monkeypatch):
    payload = b"".join(encode_contribution(get_codec("none"), flat(tensors())).segments)
    meta = payload_meta(wallets, tensors(), payload)
    limit = payload_size_limit(meta.names, meta.shapes)
    assert limit == 4 * meta.numel + 4096 == 4 * flat(tensors()).numel() + 4096
    exactly = b"\1" * limit
    exactly_meta = payload_meta(wallets, tensors(), exactly)
    assert check_payload(exactly, exactly_meta) == exactly  # the default limit itself is admitted

    hashed: list[bytes] = []

    class CountingHashlib:
        @staticmethod
        def sha256(data):
            hashed.append(bytes(data[:8]))
            return hashlib.sha256(data)

    monkeypatch.setattr(template.protocol, "hashlib", CountingHashlib)
    with pytest.raises(ProtocolError, match=f"over the limit of {len(payload) - 1}"):
        check_payload(payload, meta, max_bytes=len(payload) - 1)
    junk = b"\0" * (limit + 1)
    with pytest.raises(ProtocolError, match=f"{limit + 1} bytes, over the limit of {limit}"):
        check_payload(junk, payload_meta(wallets, tensors(), junk))  # the default limit: the metadata's own shapes
    with pytest.raises(ProtocolError, match=f"over the limit of {limit}"):
        check_payload(junk, meta, max_bytes=10 * limit)  # max_bytes only ever lowers the limit
    assert hashed == []  # none of them was hashed
    assert check_payload(payload, meta) == payload and len(hashed) == 1  # (the counter counts)


@st.composite
def sparse_settings(draw) -> tuple[str, dict]:
    chunk = 2 ** draw(st.integers(1, 10))
    return "sparse", dict(chunk=chunk, k=draw(st.integers(1, chunk)), bits=draw(st.integers(2, 8)),
                          quantizer=draw(st.sampled_from(["signmag", "uniform"])),
                          segment_values=chunk * 2 ** draw(st.integers(0, 4)))


CODEC_SETTINGS = st.one_of(
    st.builds(lambda v: ("none", {"segment_values": v}), st.integers(1, 5000)),
    st.builds(lambda v: ("fp16", {"segment_values": v}), st.integers(1, 5000)),
    st.builds(lambda blocks: ("int8", {"segment_values": 256 * blocks}), st.integers(1, 20)),
    sparse_settings(),
    st.sampled_from([(name, {}) for name in CODEC_NAMES]),  # the run defaults
)


@settings(max_examples=120, deadline=None)
@given(
    layout=st.lists(
        st.tuples(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 12), max_size=3)),
        min_size=1, max_size=6, unique_by=lambda item: item[0],
    ),
    codec=CODEC_SETTINGS,
    seed=st.integers(0, 3),
)
def test_default_size_limit_admits_every_honest_payload(layout, codec, seed):
    """Whatever the layout and the codec (any settings), the contribution a miner encodes is within the default limit
    that ``fetch_publication`` and ``check_payload`` apply; for ``none`` (raw float32) it is exactly 4 bytes a value."""
    layout = [(name, shape) for name, shape in layout if name != "__metadata__"]
    numel = sum(math.prod(shape) for _, shape in layout)
    assume(layout and numel > 0)  # a contribution has at least one value
    name, options = codec
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    values[:: max(1, numel // 3)] = [0.0, 1e9, float("nan")][seed % 3]  # zeros, huge values, NaN: same sizes
    contribution = encode_contribution(get_codec(name, **options), values)
    payload = b"".join(contribution.segments)
    limit = payload_size_limit([n for n, _ in layout], [s for _, s in layout])
    assert len(payload) <= limit == 4 * numel + 4096
    if name == "none":
        assert len(payload) == 4 * numel


# --- payloads: the committed contribution (read_publication) --------------------------------------------------------


def publication_of(wallets, named: dict[str, torch.Tensor], codec: SegmentCodec, *, round: int = 3,
                   scope: str = SCOPE, signer: str = "miner", contribution: EncodedContribution | None = None,
                   commitment: dict | None = None, payload: bytes | None = None,
                   ) -> tuple[Publication, EncodedContribution]:
    """A publication as ``fetch_publication`` returns it (signed metadata, payload checked against it): ``named``
    encoded by ``codec`` and committed to by ``signer`` — or the given contribution, commitment or payload instead."""
    contribution = encode_contribution(codec, flat(named)) if contribution is None else contribution
    if commitment is None:
        commitment = Commitment.sign(KeypairSigner(wallets[signer].hotkey), scope, round, contribution).to_wire()
    payload = b"".join(contribution.segments) if payload is None else payload
    meta = payload_meta(wallets, named, payload, round=round, codec=contribution.codec, commitment=commitment)
    return Publication(peer_id_for("miner"), meta, check_payload(payload, meta)), contribution


def read(publication: Publication, codec: SegmentCodec, shapes, contributed: dict | None = None) -> ReadPublication:
    return read_publication(publication, codec, shapes, SCOPE, contributed)


def assert_reads_as(result: ReadPublication, contribution: EncodedContribution, shapes) -> None:
    """Accepted, and the tensors are the contribution's decoded values bit for bit (NaN payloads included)."""
    assert result.reason == "" and result.tensors is not None
    assert [t.shape for t in result.tensors] == list(shapes)
    assert all(t.dtype == torch.float32 for t in result.tensors)
    joined = torch.cat([t.reshape(-1) for t in result.tensors])
    assert torch.equal(joined.view(torch.int32), contribution.decoded.view(torch.int32))
    assert result.segments == contribution.segments


def test_a_none_contribution_reads_back_exactly(wallets):
    named, codec = tensors(), get_codec("none", segment_values=1000)  # 5 segments; they span tensor boundaries
    publication, contribution = publication_of(wallets, named, codec)
    assert len(contribution.segments) == 5
    result = read(publication, codec, shapes_of(named), contributed=publication.meta.commitment)
    assert_reads_as(result, contribution, shapes_of(named))
    assert all(torch.equal(t, original) for t, original in zip(result.tensors, named.values(), strict=True))
    assert result.commitment == Commitment.from_wire(publication.meta.commitment)
    assert result.commitment.key == wallets["miner"].hotkey.ss58_address and result.commitment.round == 3
    assert read(publication, codec, shapes_of(named), contributed=None).reason == ""  # not seen in the group: fine


def test_an_fp16_contribution_reads_back_as_decoded(wallets):
    named, codec = tensors(), get_codec("fp16")
    publication, contribution = publication_of(wallets, named, codec)
    none_size = sum(len(s) for s in encode_contribution(get_codec("none"), flat(named)).segments)
    assert len(publication.payload) == contribution.nbytes == none_size // 2
    result = read(publication, codec, shapes_of(named), contributed=publication.meta.commitment)
    assert_reads_as(result, contribution, shapes_of(named))
    for tensor, original in zip(result.tensors, named.values(), strict=True):
        torch.testing.assert_close(tensor, original, rtol=1e-3, atol=1e-6)


def test_views_are_published_as_their_values(wallets):
    base = torch.randn(8, 8)
    named = {"a": base, "b": base.t(), "c": base[2:4]}  # shared storage, a transposed and a sliced view
    codec = get_codec("none", segment_values=50)
    publication, contribution = publication_of(wallets, named, codec)
    result = read(publication, codec, shapes_of(named))
    assert_reads_as(result, contribution, shapes_of(named))
    assert [torch.equal(t, v) for t, v in zip(result.tensors, named.values(), strict=True)] == [True] * 3


def test_non_finite_values_pass_through_to_the_caller(wallets):
    """Non-finite values are the scorer's to refuse (and score): reading neither hides nor rejects them."""
    named = tensors()
    named["norm.bias"][3] = float("nan")
    named["embed.weight"][0, :2] = float("inf")
    named["layers.0.mlp.weight"][0, 0] = 1e6  # finite; the fp16 codec clamps it to 65504 (v1's fp16 made it +inf)
    for codec_name, big in (("none", 1e6), ("fp16", 65504.0)):
        codec = get_codec(codec_name, segment_values=2048)
        publication, contribution = publication_of(wallets, named, codec)
        result = read(publication, codec, shapes_of(named), contributed=publication.meta.commitment)
        assert_reads_as(result, contribution, shapes_of(named))
        counted = {name: int((~torch.isfinite(t)).sum()) for name, t in zip(named, result.tensors, strict=True)}
        assert counted == {"embed.weight": 2, "layers.0.mlp.weight": 0, "norm.bias": 1}, codec_name
        assert math.isnan(result.tensors[2][3]) and result.tensors[0][0, :2].tolist() == [math.inf, math.inf]
        assert result.tensors[1][0, 0] == big


NOT_COMMITTED = "its payload is not the contribution it committed to"
OTHER_TERMS = "its commitment is for another key, run, round, codec or model size"
NOT_SIGNED = "its commitment is not signed by its hotkey"
NOT_CONTRIBUTED = "it published other bytes than it contributed to the all-reduce"


def assert_refused(result: ReadPublication, reason: str, case: str = "") -> None:
    assert result.reason.startswith(reason), (case, result.reason)
    assert result.tensors is None and result.segments == () and result.commitment is None, case


def test_a_payload_that_is_not_the_committed_contribution_is_refused(wallets):
    named, codec = tensors(), get_codec("fp16", segment_values=1000)
    honest = encode_contribution(codec, flat(named))
    other = encode_contribution(codec, flat(tensors(seed=1)))
    segments = list(honest.segments)
    swapped = b"".join([segments[1], segments[0], *segments[2:]])
    flipped = bytearray(b"".join(segments))
    flipped[-1] ^= 0x80
    wrong_payloads = {
        "another contribution": b"".join(other.segments),
        "segments swapped": swapped,
        "one bit flipped": bytes(flipped),
        "truncated": b"".join(segments)[:-2],
        "one segment missing": b"".join(segments[:-1]),
        "a byte appended": b"".join(segments) + b"\0",
        "empty": b"",
        "the float32 encoding of the same values": b"".join(encode_contribution(get_codec("none"),
                                                                                flat(named)).segments),
    }
    for what, payload in wrong_payloads.items():
        # the metadata is validly signed and names the payload's sha256: only the commitment tells the lie
        publication, _ = publication_of(wallets, named, codec, contribution=honest, payload=payload)
        result = read(publication, codec, shapes_of(named), contributed=publication.meta.commitment)
        assert_refused(result, NOT_COMMITTED, what)


def test_a_commitment_for_other_terms_is_refused(wallets):
    named, codec = tensors(), get_codec("fp16", segment_values=1000)
    shapes = shapes_of(named)
    cases = {
        "another round": dict(round=3, commitment_round=4),
        "another run": dict(scope="netuid8"),
        "another key": dict(signer="validator"),  # the validator's valid signature of the miner's bytes
    }
    for what, case in cases.items():
        contribution = encode_contribution(codec, flat(named))
        signer = wallets[case.get("signer", "miner")].hotkey
        commitment = Commitment.sign(KeypairSigner(signer), case.get("scope", SCOPE),
                                     case.get("commitment_round", 3), contribution).to_wire()
        publication, _ = publication_of(wallets, named, codec, contribution=contribution, commitment=commitment)
        assert Commitment.from_wire(commitment).verify(verify_signature), what  # a valid signature, by its key
        assert_refused(read(publication, codec, shapes), OTHER_TERMS, what)
    # another codec: the run's codec differs from the one the contribution was encoded (and committed) with
    publication, _ = publication_of(wallets, named, codec)
    for run_codec in (get_codec("fp16"), get_codec("none", segment_values=1000),
                      get_codec("int8", segment_values=1024)):
        assert_refused(read(publication, run_codec, shapes), OTHER_TERMS, repr(run_codec))
    # another model size: the run's shapes hold other than the committed number of values
    assert_refused(read(publication, codec, shapes[:-1]), OTHER_TERMS)
    assert_refused(read(publication, codec, [*shapes[:-1], torch.Size([17])]), OTHER_TERMS)
    # the same commitment, published by another hotkey's metadata
    stolen = dataclasses.replace(publication, meta=dataclasses.replace(
        publication.meta, hotkey=wallets["validator"].hotkey.ss58_address))
    assert_refused(read(stolen, codec, shapes), OTHER_TERMS)


def test_an_unsigned_or_forged_commitment_is_refused(wallets):
    named, codec = tensors(), get_codec("none", segment_values=1000)
    contribution = encode_contribution(codec, flat(named))
    miner = wallets["miner"].hotkey.ss58_address
    unsigned = Commitment(SCOPE, 3, contribution.codec, contribution.numel, contribution.root, miner)
    forged = dataclasses.replace(unsigned, signature=KeypairSigner(wallets["validator"].hotkey).sign(
        unsigned.signing_bytes()))
    other_root = encode_contribution(codec, flat(tensors(seed=1))).root
    signed = Commitment.sign(KeypairSigner(wallets["miner"].hotkey), SCOPE, 3, contribution)
    for commitment in (unsigned, forged, dataclasses.replace(signed, root=other_root),
                       dataclasses.replace(signed, signature=signed.signature[:-1] + b"\0")):
        wire = commitment.to_wire()
        publication, _ = publication_of(wallets, named, codec, contribution=contribution, commitment=wire)
        assert_refused(read(publication, codec, shapes_of(named), contributed=wire), NOT_SIGNED)


def test_a_malformed_commitment_is_refused(wallets):
    """The protocol checks only the commitment's shape; what does not parse as a commitment is a reason, not an
    exception."""
    named, codec = tensors(), get_codec("none", segment_values=1000)
    contribution = encode_contribution(codec, flat(named))
    good = Commitment.sign(KeypairSigner(wallets["miner"].hotkey), SCOPE, 3, contribution).to_wire()
    for key, value in (("root", "zz" * 32), ("root", "ab" * 31), ("signature", "0"), ("signature", "ab" * 129),
                       ("scope", "s" * 201), ("codec", "c" * 201), ("key", "k" * 65)):
        publication, _ = publication_of(wallets, named, codec, contribution=contribution,
                                        commitment={**good, key: value})
        assert_refused(read(publication, codec, shapes_of(named)), "malformed commitment")


def test_a_publication_other_than_the_contribution_given_to_the_group_is_refused(wallets):
    """The miner gave the all-reduce group one commitment and publishes another, validly signed one (other bytes):
    what it would be scored on is not what it applied."""
    named, codec = tensors(), get_codec("fp16", segment_values=1000)
    signer = KeypairSigner(wallets["miner"].hotkey)
    applied = Commitment.sign(signer, SCOPE, 3, encode_contribution(codec, flat(tensors(seed=7)))).to_wire()
    publication, contribution = publication_of(wallets, named, codec)
    assert_refused(read(publication, codec, shapes_of(named), contributed=applied), NOT_CONTRIBUTED)
    # the same bytes, committed to again (a fresh, randomized signature): still not the commitment the group got
    again = Commitment.sign(signer, SCOPE, 3, contribution).to_wire()
    assert again["root"] == publication.meta.commitment["root"] and again != publication.meta.commitment
    assert_refused(read(publication, codec, shapes_of(named), contributed=again), NOT_CONTRIBUTED)
    assert_reads_as(read(publication, codec, shapes_of(named), contributed=dict(publication.meta.commitment)),
                    contribution, shapes_of(named))


def test_a_committed_contribution_that_does_not_decode_is_refused(wallets):
    """A miner may sign a root over bytes its codec cannot decode (here: sparse segments of the right size, all 0xff:
    NaN scales and repeated indices); reading it gives a reason, never an exception."""
    named = tensors()
    codec = get_codec("sparse", chunk=64, k=4, bits=2, segment_values=256)
    honest = encode_contribution(codec, flat(named))
    segments = tuple(b"\xff" * len(s) for s in honest.segments)
    leaves = tuple(leaf_digest(s) for s in segments)
    garbage = dataclasses.replace(honest, segments=segments, leaves=leaves, root=merkle_root(leaves))
    publication, _ = publication_of(wallets, named, codec, contribution=garbage)
    assert_refused(read(publication, codec, shapes_of(named), contributed=publication.meta.commitment),
                   "its committed contribution does not decode")
    honest_publication, _ = publication_of(wallets, named, codec, contribution=honest)
    assert_reads_as(read(honest_publication, codec, shapes_of(named)), honest, shapes_of(named))


# --- PeerID bindings on the chain -------------------------------------------------------------------------------


def test_peer_id_validation_and_commitment_format():
    ed25519 = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"
    rsa = peer_id_for("x")
    assert is_peer_id(ed25519) and is_peer_id(rsa)
    assert len((COMMITMENT_PREFIX + ed25519).encode()) <= MAX_COMMITMENT_BYTES
    not_a_hash = base58.b58encode(multihash.encode(b"k" * 32, "sha3-256")).decode()
    for bad in ("", "Qm0", "1" + rsa, rsa[:-1], not_a_hash, None, 42, "x" * 200):
        assert not is_peer_id(bad)
    assert parse_commitment(COMMITMENT_PREFIX + rsa) == rsa
    for bad in (rsa, "dl2:" + rsa, COMMITMENT_PREFIX + rsa + " ", COMMITMENT_PREFIX, None, "0xdead"):
        assert parse_commitment(bad) is None


@pytest.fixture
def chain(wallets):
    """Subnet NETUID: a staked validator (permit) and five unstaked hotkeys; the outsider is not registered."""
    mock = MockSubstrate()
    mock.create_subnet(NETUID, tempo=1000, serving_rate_limit=0)
    for name in ("validator", "miner", "a", "b", "c", "d"):
        wallet = wallets[name]
        stake = 1000.0 if name == "validator" else 0.0
        mock.register(NETUID, wallet.hotkey.ss58_address, wallet.coldkeypub.ss58_address, stake_tao=stake)
    with bt.Subtensor("local", substrate=mock) as sub:
        yield mock, sub


def raw_commit(sub, wallet, value: bytes) -> None:
    call = bt.calls.Commitments.set_commitment(netuid=NETUID, info={"fields": [{f"Raw{len(value)}": value}]})
    assert sub.submit_call(call, wallet, signer="hotkey").success


def test_directory_from_the_metagraph(chain, wallets):
    mock, sub = chain
    validator_peer, miner_peer, shared_peer = peer_id_for("validator"), peer_id_for("miner"), peer_id_for("shared")
    commit_peer_id(sub, wallets["validator"], NETUID, validator_peer)
    commit_peer_id(sub, wallets["miner"], NETUID, miner_peer)
    raw_commit(sub, wallets["a"], b"dl1:not-a-peer-id")  # malformed binding
    raw_commit(sub, wallets["b"], b"https://example.org/some/other/use")  # a commitment of another kind
    commit_peer_id(sub, wallets["c"], NETUID, shared_peer)  # c and d claim the same PeerID
    commit_peer_id(sub, wallets["d"], NETUID, shared_peer)
    with pytest.raises(bt.ChainError):
        commit_peer_id(sub, wallets["outsider"], NETUID, peer_id_for("outsider"))  # not registered
    assert sub.execute(bt.ServeAxon(netuid=NETUID, ip="127.0.0.1", port=40123), wallets["miner"]).success
    assert sub.execute(bt.ServeAxon(netuid=NETUID, ip="127.0.0.1", port=40124), wallets["c"]).success

    graph = sub.subnets.metagraph(NETUID)
    directory = peer_directory(graph)
    assert sorted(directory.get(p).uid for p in (validator_peer, miner_peer)) == [0, 1] and len(directory) == 2
    assert shared_peer not in directory  # contested: dropped for both claimants
    validator, miner = directory.get(validator_peer), directory.get(miner_peer)
    assert validator == PeerRecord(validator_peer, 0, wallets["validator"].hotkey.ss58_address, True, None)
    assert miner == PeerRecord(miner_peer, 1, wallets["miner"].hotkey.ss58_address, False, "127.0.0.1:40123")
    assert directory.by_hotkey(wallets["miner"].hotkey.ss58_address) == miner
    assert directory.by_hotkey(wallets["a"].hotkey.ss58_address) is None
    assert directory.bootstrap_maddrs() == [f"/ip4/127.0.0.1/tcp/40123/p2p/{miner_peer}"]
    # a neuron leaves itself out: its own previous run, whose PeerID the chain still shows, or its current PeerID
    assert directory.bootstrap_maddrs(exclude_hotkey=wallets["miner"].hotkey.ss58_address) == []
    assert directory.bootstrap_maddrs(exclude_hotkey=wallets["validator"].hotkey.ss58_address) == [
        f"/ip4/127.0.0.1/tcp/40123/p2p/{miner_peer}"]


def test_committing_the_same_peer_id_again_is_a_no_op(chain, wallets):
    mock, sub = chain
    hotkey = wallets["miner"].hotkey.ss58_address
    commit_peer_id(sub, wallets["miner"], NETUID, peer_id_for("one"))
    nonce = mock.account_next_index_sync(hotkey)
    commit_peer_id(sub, wallets["miner"], NETUID, peer_id_for("one"))
    assert mock.account_next_index_sync(hotkey) == nonce  # nothing submitted
    commit_peer_id(sub, wallets["miner"], NETUID, peer_id_for("two"))  # a new identity replaces the old one
    assert mock.account_next_index_sync(hotkey) == nonce + 1
    assert peer_directory(sub.subnets.metagraph(NETUID)).by_hotkey(hotkey).peer_id == peer_id_for("two")
    with pytest.raises(ValueError, match="not a libp2p PeerID"):
        commit_peer_id(sub, wallets["miner"], NETUID, "not-a-peer-id")


def test_bootstrap_addresses_cover_ipv6_and_skip_unusable_axons():
    records = [
        PeerRecord(peer_id_for("v6"), 3, "hk3", False, "[::1]:4000"),
        PeerRecord(peer_id_for("v4"), 1, "hk1", True, "10.0.0.7:9000"),
        PeerRecord(peer_id_for("zero"), 2, "hk2", False, "0.0.0.0:9000"),
        PeerRecord(peer_id_for("port"), 4, "hk4", False, "10.0.0.8:0"),
        PeerRecord(peer_id_for("junk"), 5, "hk5", False, "nonsense"),
    ]
    assert PeerDirectory(records).bootstrap_maddrs() == [
        f"/ip4/10.0.0.7/tcp/9000/p2p/{peer_id_for('v4')}",
        f"/ip6/::1/tcp/4000/p2p/{peer_id_for('v6')}",
    ]
    with pytest.raises(ValueError):
        PeerDirectory(records + [dataclasses.replace(records[0], uid=9, hotkey="other")])


# --- authorization and rate limiting ----------------------------------------------------------------------------


def test_permit_holders_allow_only_bound_hotkeys_with_a_permit():
    validator, miner = peer_id_for("validator"), peer_id_for("miner")
    directory = PeerDirectory(
        [PeerRecord(validator, 0, "hk-validator", True, None), PeerRecord(miner, 1, "hk-miner", False, None)]
    )
    authorize = permit_holders(lambda: directory)
    assert authorize(validator).allowed and authorize(validator).hotkey == "hk-validator"
    refused = authorize(miner)
    assert not refused.allowed and refused.hotkey == "hk-miner" and "no validator permit" in refused.reason
    unknown = authorize(peer_id_for("stranger"))
    assert not unknown.allowed and unknown.hotkey is None and "unknown peer" in unknown.reason


def test_rate_limiter_uses_a_sliding_window_per_peer():
    now = [0.0]
    limiter = _RateLimiter(3, clock=lambda: now[0])
    assert [limiter.allow("p") for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("q")  # per peer
    now[0] = 59.9
    assert not limiter.allow("p")  # refusals do not extend the window, but the window has not slid yet
    now[0] = 60.0
    assert [limiter.allow("p") for _ in range(4)] == [True, True, True, False]
    with pytest.raises(ValueError):
        _RateLimiter(0)
