"""Messages between neurons: the signed metadata of a published pseudo-gradient, the fetch request and reply,
and the tensor payload they describe. Versioned by :data:`PROTOCOL_VERSION`.

Wire forms (JSON and safetensors only, never pickle):

- :class:`PublicationMeta`, :class:`FetchRequest`, :class:`FetchReply`: UTF-8 JSON objects with exactly the
  dataclass's fields. The miner's hotkey signs :meth:`PublicationMeta.signing_bytes`: a domain tag followed by the
  *canonical* JSON of every field except ``signature`` (sorted keys, no spaces, ASCII, floats as Python's shortest
  round-trip repr), so a validator re-derives the exact signed bytes from the decoded fields.
- The payload: exactly the bytes the miner fed into the round's all-reduce — its contribution's encoded segments,
  concatenated (:mod:`template.allreduce.contribution`). The signed metadata carries their sha256, the model's names
  and shapes, the codec that encoded them, and the miner's signed contribution *commitment* (whose Merkle root the
  segments must hash to): what a validator scores is what the miner contributed.
- :class:`InputsMeta` (a reply to a request of kind ``inputs``): what a miner averaged as an owner in a round — each
  sender's accepted segments of its range with the leaves and Merkle proof that tie them to the sender's signed
  root — and the payload of those segments; unsigned, since every byte is checked against its sender's root.

Guarantees on malformed input: every ``decode``/``from_dict`` and :func:`check_payload` either returns a fully
validated object or raises :class:`ProtocolError` with a message saying what was wrong — never another exception
type, whatever the bytes (wrong types, out-of-range numbers, NaN, unknown or missing fields, deep nesting, invalid
UTF-8, truncation). Sizes are checked *before* parsing: metadata above :data:`MAX_META_BYTES`, requests above
:data:`MAX_REQUEST_BYTES` and payloads above the caller's limit are refused unread. What the segments decode to
(including non-finite values, which validators must score rather than lose as a transport failure) is the
validator's business, with the run's codec.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bittensor.sp_core import ss58_decode

__all__ = [
    "MAX_META_BYTES",
    "MAX_REASON_CHARS",
    "MAX_REPLY_BYTES",
    "MAX_REQUEST_BYTES",
    "PROTOCOL_VERSION",
    "FetchKind",
    "FetchReply",
    "FetchRequest",
    "InputsMeta",
    "ProtocolError",
    "PublicationMeta",
    "ReplyStatus",
    "SenderInputs",
    "check_payload",
    "payload_size_limit",
]

# 2: the payload is the contribution's encoded segments, bound by a signed commitment; 3: a request names its kind
# (a publication, or the inputs an owner averaged)
PROTOCOL_VERSION = 3

MAX_META_BYTES = 1 << 20  # ~100x the metadata of a 1B-parameter Llama (a few hundred names)
MAX_REQUEST_BYTES = 1024
MAX_REASON_CHARS = 512
MAX_REPLY_BYTES = MAX_META_BYTES + 12 * MAX_REASON_CHARS + 256  # a reason may be \u-escaped; a few small fields
MAX_TENSORS = 16_384
MAX_NAME_CHARS = 256
MAX_NDIM = 8
MAX_NUMEL = 1 << 36  # 64 Gi values: far above any model this subnet trains, far below int overflow
U32_MAX = (1 << 32) - 1
MAX_TOKENS = (1 << 53) - 1  # exact in a JSON double
MAX_LOSS = 1e6
MAX_CODEC_CHARS = 200
MAX_SENDERS = 1024  # contributors of one group, far above any group the subnet forms
MAX_SEGMENT_BYTES = 1 << 30
_COMMITMENT_FIELDS = {"scope": str, "round": int, "codec": str, "numel": int, "root": str, "key": str,
                      "signature": str}

_SIGNING_DOMAIN = b"diloco-subnet/publication-meta/v2\n"  # a signature here can never pass as another message's
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX128 = re.compile(r"[0-9a-f]{128}")


class ProtocolError(ValueError):
    """A message or payload is malformed, oversized, inconsistent with its metadata, or from another version."""


# --- field validation -------------------------------------------------------------------------------------------


def _int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{name} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise ProtocolError(f"{name}={value} is outside [{low}, {high}]")
    return value


def _str(name: str, value: Any, max_chars: int) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{name} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise ProtocolError(f"{name} is {len(value)} characters long (limit {max_chars})")
    return value


def _hex(name: str, value: Any, pattern: re.Pattern[str]) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ProtocolError(f"{name} must be lowercase hex of the right length, got {str(value)[:80]!r}")
    return value


def _version(value: Any) -> int:
    version = _int("version", value, 0, U32_MAX)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this node speaks {PROTOCOL_VERSION})")
    return version


def _hotkey(value: Any) -> str:
    hotkey = _str("hotkey", value, 64)
    try:
        ss58_decode(hotkey)
    except Exception:  # the binding raises ValueError today; any failure means "not an address"
        raise ProtocolError(f"hotkey {hotkey[:64]!r} is not an ss58 address") from None
    return hotkey


def _names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= MAX_TENSORS:
        raise ProtocolError(f"names must be a list of 1..{MAX_TENSORS} strings")
    names = tuple(_str("tensor name", name, MAX_NAME_CHARS) for name in value)
    if any(not name or name == "__metadata__" for name in names):
        raise ProtocolError("tensor names must be non-empty and not '__metadata__'")
    if len(set(names)) != len(names):
        raise ProtocolError("tensor names must be unique")
    return names


def _shapes(value: Any, count: int) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, (list, tuple)) or len(value) != count:
        raise ProtocolError(f"shapes must be a list with one shape per name ({count})")
    shapes = []
    total = 0
    for shape in value:
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM:
            raise ProtocolError(f"each shape must be a list of at most {MAX_NDIM} dimensions")
        dims = tuple(_int("dimension", dim, 0, MAX_NUMEL) for dim in shape)
        total += math.prod(dims)
        if total > MAX_NUMEL:
            raise ProtocolError(f"the shapes hold more than {MAX_NUMEL} values")
        shapes.append(dims)
    return tuple(shapes)


def _commitment(value: Any) -> None:
    """The shape of a contribution commitment's wire form (its meaning is checked by whoever verifies it)."""
    if not isinstance(value, Mapping) or set(value) != set(_COMMITMENT_FIELDS):
        raise ProtocolError(f"commitment must be an object with exactly {sorted(_COMMITMENT_FIELDS)}")
    for key, kind in _COMMITMENT_FIELDS.items():
        item = value[key]
        if kind is int:
            _int(f"commitment {key}", item, 0, MAX_NUMEL)
        else:
            _str(f"commitment {key}", item, 2 * MAX_CODEC_CHARS)


def _choice(name: str, value: Any, allowed: Iterable[str]) -> str:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ProtocolError(f"{name} must be one of {allowed}, got {str(value)[:40]!r}")
    return value


def _loss(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"loss must be a number, got {type(value).__name__}")
    loss = float(value)
    if not (math.isfinite(loss) and 0.0 <= loss <= MAX_LOSS):
        raise ProtocolError(f"loss={loss} must be finite and within [0, {MAX_LOSS}]")
    return loss


# --- JSON framing -----------------------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"non-standard JSON constant {name}")


def _load_json_object(data: Any, limit: int, what: str) -> dict:
    """Parse bytes holding one JSON object, checking the size first; every failure becomes ProtocolError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{what} must be bytes, got {type(data).__name__}")
    if len(data) > limit:
        raise ProtocolError(f"{what} is {len(data)} bytes (limit {limit})")
    try:
        document = json.loads(bytes(data).decode("utf-8"), parse_constant=_reject_constant)
    except ProtocolError:
        raise
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, int-digit limit, nesting
        raise ProtocolError(f"{what} is not valid UTF-8 JSON: {str(err)[:200]}") from None
    if not isinstance(document, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {type(document).__name__}")
    return document


def _exact_fields(document: Mapping, cls: type, what: str) -> None:
    expected = {f.name for f in dataclasses.fields(cls)}
    keys = set(document)
    if keys != expected:
        missing, unknown = sorted(expected - keys), sorted(str(k)[:40] for k in keys - expected)
        raise ProtocolError(f"{what}: missing fields {missing}, unknown fields {unknown}")


def _from_object(cls: type, document: Any, what: str) -> Any:
    """An instance of the dataclass ``cls`` from a JSON object with exactly its fields (validated by the class)."""
    if not isinstance(document, Mapping):
        raise ProtocolError(f"{what} must be an object, got {type(document).__name__}")
    _exact_fields(document, cls, what)
    return cls(**document)


def _canonical_json(document: Mapping) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


# --- messages ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PublicationMeta:
    """What a miner says about its pseudo-gradient Δ for one round; signed by its hotkey (``signature``, hex).

    ``names``/``shapes`` list the tensors in ``model.parameters()`` order; ``codec`` names the encoding of the
    payload's segments (with its settings); ``commitment`` is the miner's signed commitment to those segments, in the
    wire form of :class:`template.allreduce.contribution.Commitment` (checked for shape here, for its signature and
    root by the validator); ``payload_sha256`` binds the payload bytes to this signature. ``signature`` is ``""``
    until signed. Construction validates every field (ProtocolError), so an instance is always well-formed.
    """

    version: int
    netuid: int
    round: int
    base_theta_hash: str
    tokens: int
    inner_steps: int
    loss: float
    hotkey: str
    payload_sha256: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    codec: str
    commitment: dict
    published_at_block: int
    signature: str = ""

    def __post_init__(self) -> None:
        _version(self.version)
        _int("netuid", self.netuid, 0, 0xFFFF)
        _int("round", self.round, 0, U32_MAX)
        _hex("base_theta_hash", self.base_theta_hash, _HEX64)
        _int("tokens", self.tokens, 0, MAX_TOKENS)
        _int("inner_steps", self.inner_steps, 0, U32_MAX)
        object.__setattr__(self, "loss", _loss(self.loss))
        _hotkey(self.hotkey)
        _hex("payload_sha256", self.payload_sha256, _HEX64)
        names = _names(self.names)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "shapes", _shapes(self.shapes, len(names)))
        _str("codec", self.codec, MAX_CODEC_CHARS)
        _commitment(self.commitment)
        _int("published_at_block", self.published_at_block, 0, U32_MAX)
        if self.signature != "":
            _hex("signature", self.signature, _HEX128)

    def to_dict(self) -> dict:
        document = dataclasses.asdict(self)
        document["names"] = list(self.names)
        document["shapes"] = [list(shape) for shape in self.shapes]
        document["commitment"] = dict(self.commitment)
        return document

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    def signing_bytes(self) -> bytes:
        """The exact bytes the hotkey signs: a domain tag + canonical JSON of every field but ``signature``."""
        document = self.to_dict()
        del document["signature"]
        return _SIGNING_DOMAIN + _canonical_json(document)

    def with_signature(self, signature_hex: str) -> PublicationMeta:
        return dataclasses.replace(self, signature=signature_hex)

    def encode(self) -> bytes:
        """Canonical JSON; ProtocolError when it would exceed :data:`MAX_META_BYTES` (no peer would accept it)."""
        data = _canonical_json(self.to_dict())
        if len(data) > MAX_META_BYTES:
            raise ProtocolError(f"publication metadata is {len(data)} bytes (limit {MAX_META_BYTES})")
        return data

    @classmethod
    def from_dict(cls, document: Any) -> PublicationMeta:
        return _from_object(cls, document, "publication metadata")

    @classmethod
    def decode(cls, data: bytes) -> PublicationMeta:
        return cls.from_dict(_load_json_object(data, MAX_META_BYTES, "publication metadata"))


class FetchKind:
    """What a :class:`FetchRequest` asks for."""

    PUBLICATION = "publication"  # the miner's own signed contribution of the round
    INPUTS = "inputs"  # the senders' segments it accepted and averaged as an owner in the round (InputsMeta)

    ALL = (PUBLICATION, INPUTS)


@dataclass(frozen=True)
class FetchRequest:
    """A validator asks a miner for its publication of ``round`` on ``netuid``, or (``kind`` inputs) for the inputs
    it averaged as an owner in that round."""

    version: int
    netuid: int
    round: int
    kind: str = FetchKind.PUBLICATION

    def __post_init__(self) -> None:
        _version(self.version)
        _int("netuid", self.netuid, 0, 0xFFFF)
        _int("round", self.round, 0, U32_MAX)
        _choice("kind", self.kind, FetchKind.ALL)

    def encode(self) -> bytes:
        return _canonical_json(dataclasses.asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> FetchRequest:
        document = _load_json_object(data, MAX_REQUEST_BYTES, "fetch request")
        _version(document.get("version"))  # first: another version's request may have other fields
        _exact_fields(document, cls, "fetch request")
        return cls(**document)


class ReplyStatus:
    """The outcomes a miner can answer a :class:`FetchRequest` with."""

    OK = "ok"
    REFUSED = "refused"  # the caller is not allowed (unknown peer, no validator permit, ...)
    RATE_LIMITED = "rate_limited"
    NOT_FOUND = "not_found"  # no publication for that round (never published, or already evicted)
    BAD_REQUEST = "bad_request"  # the request was malformed, oversized, for another netuid or version

    ALL = (OK, REFUSED, RATE_LIMITED, NOT_FOUND, BAD_REQUEST)


@dataclass(frozen=True)
class SenderInputs:
    """One sender's segments that an owner accepted in a round: what a validator needs to check them against the
    sender's signed root (its ``leaves`` of the owner's range and their Merkle ``proof``, hex) and which of them the
    payload holds (``segments``, ascending, with their byte ``sizes``)."""

    key: str  # the sender's hotkey: its commitment's key
    leaves: tuple[str, ...]
    proof: tuple[str, ...]
    segments: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class InputsMeta:
    """What an owner averaged in ``round``: for its range [start, stop) of the ``count`` segments, each sender's
    accepted segments, concatenated in the payload in the order of ``senders`` and then of ``segments``. Unsigned:
    every byte is checked against its sender's signed root, and the average against the owner's signed certificate.
    """

    version: int
    netuid: int
    round: int
    start: int
    stop: int
    count: int
    senders: tuple[SenderInputs, ...]
    payload_sha256: str

    def __post_init__(self) -> None:
        _version(self.version)
        _int("netuid", self.netuid, 0, 0xFFFF)
        _int("round", self.round, 0, U32_MAX)
        _int("count", self.count, 1, MAX_NUMEL)
        _int("start", self.start, 0, self.count - 1)
        _int("stop", self.stop, self.start + 1, self.count)
        _hex("payload_sha256", self.payload_sha256, _HEX64)
        if not isinstance(self.senders, (list, tuple)) or len(self.senders) > MAX_SENDERS:
            raise ProtocolError(f"senders must be a list of at most {MAX_SENDERS}")
        senders = tuple(_sender_inputs(s, self.start, self.stop) for s in self.senders)
        if len({s.key for s in senders}) != len(senders):
            raise ProtocolError("each sender is listed once")
        object.__setattr__(self, "senders", senders)

    @property
    def payload_bytes(self) -> int:
        return sum(sum(s.sizes) for s in self.senders)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, document: Any) -> InputsMeta:
        return _from_object(cls, document, "inputs metadata")


def _sender_inputs(value: Any, start: int, stop: int) -> SenderInputs:
    """Validate one sender's entry (a SenderInputs or its JSON object) for the range [start, stop)."""
    if not isinstance(value, SenderInputs):
        value = _from_object(SenderInputs, value, "a sender's inputs")
    _hotkey(value.key)
    leaves, proof = _hex_list("leaves", value.leaves, stop - start), _hex_list("proof", value.proof, 128)
    if len(leaves) != stop - start:
        raise ProtocolError(f"a sender's leaves must cover the range: {len(leaves)} for {stop - start} segments")
    segments = tuple(_int("segment", k, start, stop - 1) for k in _list("segments", value.segments, stop - start))
    sizes = tuple(_int("size", n, 0, MAX_SEGMENT_BYTES) for n in _list("sizes", value.sizes, stop - start))
    if list(segments) != sorted(set(segments)) or len(sizes) != len(segments):
        raise ProtocolError("a sender's segments must ascend, each once, with one size each")
    return SenderInputs(value.key, leaves, proof, segments, sizes)


def _list(name: str, value: Any, limit: int) -> tuple:
    if not isinstance(value, (list, tuple)) or len(value) > limit:
        raise ProtocolError(f"{name} must be a list of at most {limit}")
    return tuple(value)


def _hex_list(name: str, value: Any, limit: int) -> tuple[str, ...]:
    return tuple(_hex(name, item, _HEX64) for item in _list(name, value, limit))


@dataclass(frozen=True)
class FetchReply:
    """The first frame of a miner's answer: the signed metadata (``meta``, a publication; ``inputs``, what it
    averaged as an owner) and payload size, or why there is none."""

    version: int
    status: str
    reason: str = ""
    meta: PublicationMeta | None = None
    payload_bytes: int = 0
    inputs: InputsMeta | None = None

    def __post_init__(self) -> None:
        _version(self.version)
        _choice("status", self.status, ReplyStatus.ALL)
        _str("reason", self.reason, MAX_REASON_CHARS)
        _int("payload_bytes", self.payload_bytes, 0, 1 << 50)
        if (self.status == ReplyStatus.OK) != ((self.meta is None) != (self.inputs is None)):
            raise ProtocolError("a reply carries one kind of metadata exactly when its status is 'ok'")
        if self.meta is not None and not isinstance(self.meta, PublicationMeta):
            raise ProtocolError("reply metadata must be a PublicationMeta")
        if self.inputs is not None and not (isinstance(self.inputs, InputsMeta)
                                            and self.inputs.payload_bytes == self.payload_bytes):
            raise ProtocolError("reply inputs must be an InputsMeta whose sizes add up to the payload")

    def encode(self) -> bytes:
        document = dataclasses.asdict(self)
        document["meta"] = None if self.meta is None else json.loads(self.meta.encode())
        return _canonical_json(document)

    @classmethod
    def decode(cls, data: bytes) -> FetchReply:
        document = _load_json_object(data, MAX_REPLY_BYTES, "fetch reply")
        _exact_fields(document, cls, "fetch reply")
        meta = None if document["meta"] is None else PublicationMeta.from_dict(document["meta"])
        inputs = None if document["inputs"] is None else InputsMeta.from_dict(document["inputs"])
        return cls(**{**document, "meta": meta, "inputs": inputs})


# --- payload ------------------------------------------------------------------------------------------------------


def payload_size_limit(names: Sequence[str], shapes: Sequence[Sequence[int]]) -> int:
    """The most bytes an honest payload for this layout can take: every codec encodes a value in at most 4 bytes
    (``none`` is raw float32), plus a little per-segment overhead. Used as the default hard limit, so a payload is
    refused unread when it is larger than its own metadata allows."""
    numel = sum(math.prod(shape) for shape in _shapes(shapes, len(_names(names))))
    return 4 * numel + 4096


def check_payload(data: Any, meta: PublicationMeta, *, max_bytes: int | None = None) -> bytes:
    """Check the payload's size (before anything else) and its sha256 against ``meta``; return it as bytes."""
    limit = payload_size_limit(meta.names, meta.shapes)
    limit = limit if max_bytes is None else min(limit, max_bytes)
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError(f"payload must be bytes, got {type(data).__name__}")
    if len(data) > limit:
        raise ProtocolError(f"payload is {len(data)} bytes, over the limit of {limit}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != meta.payload_sha256:
        raise ProtocolError(f"payload sha256 {digest[:16]}… does not match the signed {meta.payload_sha256[:16]}…")
    return bytes(data)
