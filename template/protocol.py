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
    "FetchReply",
    "FetchRequest",
    "ProtocolError",
    "PublicationMeta",
    "ReplyStatus",
    "check_payload",
    "payload_size_limit",
]

PROTOCOL_VERSION = 2  # 2: the payload is the contribution's encoded segments, bound by a signed commitment

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
        if not isinstance(document, Mapping):
            raise ProtocolError(f"publication metadata must be an object, got {type(document).__name__}")
        _exact_fields(document, cls, "publication metadata")
        return cls(**document)

    @classmethod
    def decode(cls, data: bytes) -> PublicationMeta:
        return cls.from_dict(_load_json_object(data, MAX_META_BYTES, "publication metadata"))


@dataclass(frozen=True)
class FetchRequest:
    """A validator asks a miner for its publication of ``round`` on ``netuid``."""

    version: int
    netuid: int
    round: int

    def __post_init__(self) -> None:
        _version(self.version)
        _int("netuid", self.netuid, 0, 0xFFFF)
        _int("round", self.round, 0, U32_MAX)

    def encode(self) -> bytes:
        return _canonical_json(dataclasses.asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> FetchRequest:
        document = _load_json_object(data, MAX_REQUEST_BYTES, "fetch request")
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
class FetchReply:
    """The first frame of a miner's answer: the signed metadata and payload size, or why there is none."""

    version: int
    status: str
    reason: str = ""
    meta: PublicationMeta | None = None
    payload_bytes: int = 0

    def __post_init__(self) -> None:
        _version(self.version)
        _choice("status", self.status, ReplyStatus.ALL)
        _str("reason", self.reason, MAX_REASON_CHARS)
        _int("payload_bytes", self.payload_bytes, 0, 1 << 50)
        if (self.status == ReplyStatus.OK) != (self.meta is not None):
            raise ProtocolError("a reply carries metadata exactly when its status is 'ok'")
        if self.meta is not None and not isinstance(self.meta, PublicationMeta):
            raise ProtocolError("reply metadata must be a PublicationMeta")

    def encode(self) -> bytes:
        document = dataclasses.asdict(self)
        document["meta"] = None if self.meta is None else json.loads(self.meta.encode())
        return _canonical_json(document)

    @classmethod
    def decode(cls, data: bytes) -> FetchReply:
        document = _load_json_object(data, MAX_REPLY_BYTES, "fetch reply")
        _exact_fields(document, cls, "fetch reply")
        meta = None if document["meta"] is None else PublicationMeta.from_dict(document["meta"])
        return cls(**{**document, "meta": meta})


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
