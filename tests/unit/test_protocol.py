"""Messages (template.protocol), PeerID bindings and hotkey signatures (template.p2p.identity), and the pure parts of
the publication RPC (authorization, rate limiting).

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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
from template.p2p.publication import _RateLimiter, permit_holders
from template.protocol import (
    MAX_META_BYTES,
    MAX_REQUEST_BYTES,
    PROTOCOL_VERSION,
    FetchReply,
    FetchRequest,
    ProtocolError,
    PublicationMeta,
    ReplyStatus,
    decode_payload,
    encode_payload,
    payload_size_limit,
)
from tests.integration.p2p_helpers import commit_peer_id

NETUID = 7
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def peer_id_for(seed: str) -> str:
    """A well-formed PeerID (sha2-256 multihash, the RSA-key form ``Qm...``) derived from a seed."""
    return base58.b58encode(multihash.encode(hashlib.sha256(seed.encode()).digest(), "sha2-256")).decode()


@pytest.fixture(scope="module")
def wallets(tmp_path_factory):
    path = tmp_path_factory.mktemp("wallets")
    names = ("validator", "miner", "a", "b", "c", "d", "outsider")
    return {name: create_wallet(name, "default", path) for name in names}


def make_meta(wallets, **overrides) -> PublicationMeta:
    fields = dict(
        version=PROTOCOL_VERSION, netuid=NETUID, round=3, base_theta_hash="ab" * 32, tokens=4096, inner_steps=20,
        loss=3.25, hotkey=wallets["miner"].hotkey.ss58_address, payload_sha256="cd" * 32,
        names=("embed.weight", "layers.0.mlp.weight"), shapes=((256, 16), (16, 16)), dtype="float32", codec="fp32",
        published_at_block=123,
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


# Another valid value for every signed field: changing any one must break the signature.
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
    "dtype": "float16",
    "codec": "fp16",
    "published_at_block": 124,
}


def test_every_field_is_covered_by_the_signature(wallets):
    signed_fields = {f.name for f in dataclasses.fields(PublicationMeta)} - {"signature", "version", "hotkey"}
    assert set(TAMPERED) == signed_fields  # the table below covers every field (version/hotkey: next test)


@pytest.mark.parametrize("field", sorted(TAMPERED))
def test_tampering_with_any_field_breaks_the_signature(wallets, field):
    meta = signed_meta(wallets)
    tampered = PublicationMeta.decode(json.dumps({**meta.to_dict(), field: TAMPERED[field]}).encode())
    assert tampered.signature == meta.signature
    assert not verify(meta.hotkey, tampered.signing_bytes(), tampered.signature)


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


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("version", PROTOCOL_VERSION + 1, "not supported"),
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
        ("dtype", "float64", "dtype must be one of"),
        ("codec", "int8", "codec must be one of"),
        ("signature", "00" * 63, "signature"),
    ],
)
def test_decode_rejects_bad_fields_with_a_clear_error(wallets, field, value, message):
    document = {**signed_meta(wallets).to_dict(), field: value}
    with pytest.raises(ProtocolError, match=message):
        PublicationMeta.decode(json.dumps(document).encode())


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


# --- tensor payloads --------------------------------------------------------------------------------------------


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(256, 16, generator=generator),
        "layers.0.mlp.weight": torch.randn(16, 16, generator=generator),
        "norm.bias": torch.randn(16, generator=generator) * 1e-3,
    }


def meta_for(wallets, payload, codec: str, **overrides) -> PublicationMeta:
    fields = dict(payload_sha256=payload.sha256, names=payload.names, shapes=payload.shapes, codec=codec)
    return make_meta(wallets, **{**fields, **overrides})


def test_fp32_payload_round_trips_exactly(wallets):
    original = tensors()
    payload = encode_payload(original.items(), "fp32")
    assert payload.names == tuple(original) and payload.shapes == tuple(tuple(t.shape) for t in original.values())
    decoded = decode_payload(payload.data, meta_for(wallets, payload, "fp32"))
    assert list(decoded.tensors) == list(original) and decoded.all_finite
    assert all(torch.equal(decoded.tensors[name], original[name]) for name in original)


def test_fp16_payload_round_trips_within_half_precision(wallets):
    original = tensors()
    payload = encode_payload(original, "fp16")
    assert len(payload.data) < len(encode_payload(original, "fp32").data) * 0.55
    decoded = decode_payload(payload.data, meta_for(wallets, payload, "fp16"))
    for name, tensor in original.items():
        assert decoded.tensors[name].dtype == torch.float32
        torch.testing.assert_close(decoded.tensors[name], tensor, rtol=1e-3, atol=1e-6)


def test_shared_storage_and_views_are_encoded_as_values(wallets):
    base = torch.randn(8, 8)
    payload = encode_payload([("a", base), ("b", base.t()), ("c", base[2:4])], "fp32")
    decoded = decode_payload(payload.data, meta_for(wallets, payload, "fp32"))
    assert torch.equal(decoded.tensors["b"], base.t()) and torch.equal(decoded.tensors["c"], base[2:4])


def test_payload_hash_mismatch_is_detected(wallets):
    payload = encode_payload(tensors(), "fp32")
    other = encode_payload(tensors(seed=1), "fp32")
    with pytest.raises(ProtocolError, match="sha256"):
        decode_payload(other.data, meta_for(wallets, payload, "fp32"))


def test_shape_name_and_dtype_mismatches_are_detected_even_with_a_matching_hash(wallets):
    payload = encode_payload(tensors(), "fp32")
    wrong_shape = meta_for(wallets, payload, "fp32", shapes=((256, 16), (16, 16), (15,)))
    with pytest.raises(ProtocolError, match="has shape"):
        decode_payload(payload.data, wrong_shape, max_bytes=len(payload.data))
    wrong_names = meta_for(wallets, payload, "fp32", names=("embed.weight", "layers.0.mlp.weight", "norm.weight"))
    with pytest.raises(ProtocolError, match="missing \\['norm.weight'\\], extra \\['norm.bias'\\]"):
        decode_payload(payload.data, wrong_names)
    half = encode_payload(tensors(), "fp16")
    with pytest.raises(ProtocolError, match="codec fp32"):
        decode_payload(half.data, meta_for(wallets, half, "fp32"))


def test_oversized_payload_is_refused_before_hashing_or_parsing(wallets):
    payload = encode_payload(tensors(), "fp32")
    meta = meta_for(wallets, payload, "fp32")
    with pytest.raises(ProtocolError, match="over the limit"):
        decode_payload(payload.data, meta, max_bytes=len(payload.data) - 1)
    junk = b"\0" * (payload_size_limit(meta.names, meta.shapes, meta.codec) + 1)
    with pytest.raises(ProtocolError, match="over the limit"):
        decode_payload(junk, meta)  # the default limit comes from the metadata's own shapes


def test_bytes_that_are_not_safetensors_are_refused(wallets):
    payload = encode_payload(tensors(), "fp32")
    for junk in (b"", b"\xff" * 64, payload.data[:-7], (10**9).to_bytes(8, "little") + b"{}"):
        digest = hashlib.sha256(junk).hexdigest()
        with pytest.raises(ProtocolError, match="safetensors"):
            decode_payload(junk, meta_for(wallets, payload, "fp32", payload_sha256=digest))


def test_non_finite_values_pass_through_and_are_counted(wallets):
    original = tensors()
    original["norm.bias"][3] = float("nan")
    original["embed.weight"][0, :2] = float("inf")
    original["layers.0.mlp.weight"][0, 0] = 1e6  # finite in fp32, inf once encoded as fp16
    payload = encode_payload(original, "fp16")
    decoded = decode_payload(payload.data, meta_for(wallets, payload, "fp16"))
    assert decoded.nonfinite == {"embed.weight": 2, "layers.0.mlp.weight": 1, "norm.bias": 1}
    assert not decoded.all_finite and math.isnan(decoded.tensors["norm.bias"][3])


@FUZZ
@given(
    layout=st.lists(
        st.tuples(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 6), max_size=4)),
        min_size=1, max_size=6, unique_by=lambda item: item[0],
    ),
    codec=st.sampled_from(["fp32", "fp16"]),
)
def test_default_size_limit_admits_every_honest_payload(layout, codec):
    layout = [(name, shape) for name, shape in layout if name != "__metadata__"]
    if not layout:
        return
    payload = encode_payload([(name, torch.zeros(shape)) for name, shape in layout], codec)
    limit = payload_size_limit(payload.names, payload.shapes, codec)
    assert len(payload.data) <= limit <= len(payload.data) + 1024 + 400 * len(layout)


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
    assert directory.bootstrap_maddrs(exclude_peer_id=miner_peer) == []


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
