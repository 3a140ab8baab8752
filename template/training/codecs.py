"""Segment codecs: the wire and publication format of a miner's pseudo-gradient, independent of hivemind.

Why: a miner's contribution is encoded **once**, into fixed-size *segments* of the flat vector of all parameters
(segments may span tensor boundaries; the last one is shorter), and those exact bytes are hashed, signed, sent to
the reducers and published to validators. A reducer decodes the contributions of its segments, averages them in
float64 and encodes each averaged segment once (``encode_average``), so every peer receives the same bytes. This
module is only the codec layer: bytes in, tensors out, no network, no hivemind.

Codecs (:func:`get_codec`, names in :data:`CODEC_NAMES`):

- ``none``: raw float32, little-endian. Lossless; NaN/±inf (and their bit patterns) pass through.
- ``fp16``: IEEE half, little-endian. Finite values beyond ±65504 are clamped to ±65504, ±inf stay ±inf, NaN stays
  NaN (canonical quiet NaN, so the bytes do not depend on the CPU's conversion of NaN payloads).
- ``int8``: per-block absmax int8, blocks of 256 values (the layout and bound of ``compression.BlockInt8Compression``
  without its 16-byte header, whose fields — block size, count — are fixed by the run settings and the caller's
  ``numel``): ``float32 scales[ceil(n/256)] | int8 codes[n]``. ``s = absmax/127`` rounded toward zero (so decoding
  never overflows), floored at the smallest normal float32; ``q = round(x/s)`` clamped to ±127; decoding is
  ``q·s``, so every value is within ``s/2`` of its block's scale (up to float32 rounding). A block that contains
  any NaN/±inf gets a NaN scale: all its values decode to NaN.
- ``sparse`` (SparseLoCo/DeMo family, :class:`SparseSettings`): the segment is cut into chunks of ``chunk`` values;
  each chunk keeps its ``k`` entries of largest ``|x|`` (ties: the lower index wins), stores their in-chunk indices
  in ``ceil(log2(chunk))`` bits each and their values in ``bits`` bits with one float32 scale per chunk.
  Layout: ``float32 scales[nchunks] | index bitstream | value-code bitstream`` (each bitstream little-endian by bit,
  zero-padded to a whole byte; a chunk's indices ascending). It is meant to be used with error feedback
  (:func:`encode_with_feedback`): what a round does not send stays in the sender's residual.

All four are fixed-size for a given ``numel`` (:meth:`SegmentCodec.encoded_size`). For ``none``/``fp16``/``int8``
``encode_average`` is ``encode``. For ``sparse`` the sum of N contributions has up to N·k nonzeros per chunk with
arbitrary values, so ``encode_average`` writes ``1-byte tag | payload``: tag 1 = sparse (``u16 counts[nchunks] |
index bitstream | fp16 values[nnz]``, the nonzeros of the fp16-rounded mean) or tag 0 = dense fp16, whichever is
smaller for that segment (dense on a tie). Both forms decode to the same fp16-rounded values.

Guarantees:

- **Deterministic.** The same input gives the same bytes and the same bytes decode to the same bits on every
  machine and thread count: only elementwise arithmetic, order-free reductions (max, integer sums), explicit
  little-endian layouts, canonical NaNs, and a top-k whose keys are unique (``|x|``'s bits, then the index).
- **Non-finite values are never hidden.** ``none``/``fp16`` carry NaN/±inf through; ``int8`` and ``sparse`` give a
  block/chunk that contains any NaN/±inf a NaN scale, so *every* value it keeps decodes to NaN (a sparse chunk keeps
  k ≥ 1 values, and a non-finite entry is always among them: its ``|x|`` bits sort above every finite value), and the
  receiver's finite check sees it.
- **Decoders never trust the sender.** ``decode``/``decode_average`` take the number of values the *caller*
  expects (at most ``segment_values``), check the exact byte length and every field (tags, counts, index range
  and order, code range, padding bits, scale signs) before allocating anything sized by the data, and raise
  :class:`CodecError` — never another exception type — for any bytes they cannot or must not decode. Sparse
  structure must be canonical (indices strictly rising within a chunk, zero padding bits, no explicit zeros, the
  smaller averaged form), so scattered positions are unique and their order never matters.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch

__all__ = [
    "CODEC_NAMES",
    "CodecError",
    "DenseCodec",
    "Fp16Codec",
    "Int8Codec",
    "RawCodec",
    "SegmentCodec",
    "SparseCodec",
    "SparseSettings",
    "encode_segments",
    "encode_with_feedback",
    "get_codec",
]

CODEC_NAMES: tuple[str, ...] = ("none", "fp16", "int8", "sparse")
DENSE_SEGMENT_VALUES = 1 << 17  # 512 KiB of float32, 256 KiB of fp16, 130 KiB of int8 per segment
MAX_SEGMENT_VALUES = 1 << 26  # a decode never allocates more than 256 MiB, whatever the settings say
SPARSE_TARGET_SEGMENT_BYTES = 16 * 1024  # a 32-byte digest + 64-byte signature stay < 0.6 % of a segment
INT8_BLOCK = 256
FP16_MAX = 65504.0
_TINY = torch.finfo(torch.float32).tiny
_ABS_MASK = 0x7FFFFFFF
_TAG_DENSE, _TAG_SPARSE = 0, 1


class CodecError(ValueError):
    """Bytes a codec cannot (or must not) decode, or a tensor it cannot encode."""


# ------------------------------------------------------------------------------------------- shared helpers


def _check_values(values: Any, limit: int) -> torch.Tensor:
    """The encoders' input: a 1-D float32 CPU tensor of at most ``limit`` values (contiguous on return)."""
    if not isinstance(values, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(values).__name__}")
    if values.dtype != torch.float32 or values.dim() != 1 or values.device.type != "cpu":
        raise CodecError(f"expected a 1-D float32 CPU tensor, got {values.dtype} {tuple(values.shape)} "
                         f"on {values.device}")
    if values.numel() > limit:
        raise CodecError(f"{values.numel()} values do not fit a segment of {limit}")
    return values.detach().contiguous()


def _check_request(data: Any, numel: Any, limit: int) -> bytes:
    """The decoders' input: bytes-like ``data`` and a caller's ``numel`` in [0, limit]."""
    if isinstance(numel, bool) or not isinstance(numel, int) or not 0 <= numel <= limit:
        raise CodecError(f"numel must be an int in [0, {limit}], got {numel!r}")
    if isinstance(data, memoryview):
        data = data.tobytes()
    if not isinstance(data, (bytes, bytearray)):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    return bytes(data)


def _expect_length(data: bytes, expected: int, what: str) -> None:
    if len(data) != expected:
        raise CodecError(f"{what}: {len(data)} bytes, expected {expected}")


def _read(data: bytes, dtype: str, count: int, offset: int) -> torch.Tensor:
    """``count`` little-endian values of numpy ``dtype`` at ``offset``, as a writable native tensor (a copy)."""
    array = np.frombuffer(data, dtype=np.dtype(dtype), count=count, offset=offset)
    return torch.from_numpy(array.astype(array.dtype.newbyteorder("="), copy=True))


def _le_bytes(tensor: torch.Tensor, dtype: str) -> bytes:
    return tensor.numpy().astype(np.dtype(dtype), copy=False).tobytes()


def _canonical_nan_(values: torch.Tensor) -> torch.Tensor:
    """Replace every NaN by the one quiet NaN (CPUs differ in the payloads their conversions produce)."""
    return values.masked_fill_(torch.isnan(values), math.nan)


def _to_half(values: torch.Tensor) -> torch.Tensor:
    """float32 → fp16 with finite overflow clamped to ±65504 and ±inf kept: one conversion pass plus one min/max
    pass (NaN propagates into it); the fix-ups run only when a value is NaN or beyond ±65504."""
    half = values.to(torch.float16)
    low, high = torch.aminmax(values) if values.numel() else (values.new_zeros(()), values.new_zeros(()))
    if not -FP16_MAX <= float(low) <= float(high) <= FP16_MAX:
        overflowed = torch.isinf(half) & torch.isfinite(values)
        half[overflowed] = torch.where(values[overflowed] > 0, FP16_MAX, -FP16_MAX).to(torch.float16)
        _canonical_nan_(half)
    return half


def _from_half(half: torch.Tensor) -> torch.Tensor:
    """fp16 → float32; NaNs canonical (an exponent-bits check on the int16 view says whether any is there)."""
    values = half.to(torch.float32)
    if half.numel() and int(half.view(torch.int16).bitwise_and(0x7FFF).max()) > 0x7C00:
        _canonical_nan_(values)
    return values


def _bit_pack(codes: torch.Tensor, width: int) -> bytes:
    """Unsigned ``codes`` (< 2**width, width ≤ 16), ``width`` bits each, little-endian by bit, zero-padded."""
    as_bytes = codes.numpy().astype("<u2").view(np.uint8).reshape(-1, 2)
    bits = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :width]
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def _bit_unpack(data: bytes, offset: int, count: int, width: int) -> tuple[torch.Tensor, int]:
    """Inverse of :func:`_bit_pack`: (int64 codes, offset after the stream); CodecError on nonzero padding bits.
    Each code is read from the three bytes that hold it (width ≤ 16 and a start bit ≤ 7 fit in 24 bits)."""
    nbytes = _bitstream_bytes(count, width)
    raw = np.zeros(nbytes + 2, dtype=np.int64)
    raw[:nbytes] = np.frombuffer(data, dtype=np.uint8, count=nbytes, offset=offset)
    used = count * width
    if used % 8 and raw[nbytes - 1] >> (used % 8):
        raise CodecError("nonzero padding bits after a bitstream")
    start = np.arange(count, dtype=np.int64) * width
    first = start >> 3
    window = raw[first] | (raw[first + 1] << 8) | (raw[first + 2] << 16)
    return torch.from_numpy((window >> (start & 7)) & ((1 << width) - 1)), offset + nbytes


def _bitstream_bytes(count: int, width: int) -> int:
    return -(-count * width // 8)


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")


# ------------------------------------------------------------------------------------------------- the API


class SegmentCodec(ABC):
    """Encodes one segment (≤ ``segment_values`` float32 values) to bytes and back; see the module docstring."""

    name: str
    segment_values: int
    error_feedback: bool = False

    @property
    def settings(self) -> Any:
        """What besides name and segment size changes the bytes (None for the dense codecs)."""
        return None

    @abstractmethod
    def encode(self, values: torch.Tensor) -> bytes:
        """A 1-D float32 CPU tensor of at most ``segment_values`` values → bytes (CodecError for another tensor)."""

    @abstractmethod
    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        """Bytes → 1-D float32 tensor of exactly ``numel`` values; CodecError for any malformed bytes."""

    @abstractmethod
    def encoded_size(self, numel: int) -> int:
        """The exact length of ``encode`` of ``numel`` values."""

    def encode_average(self, values: torch.Tensor) -> bytes:
        """A reducer's averaged segment → the bytes every member receives."""
        return self.encode(values)

    def decode_average(self, data: bytes, numel: int) -> torch.Tensor:
        return self.decode(data, numel)

    def max_average_size(self, numel: int) -> int:
        """The most bytes ``encode_average`` of ``numel`` values can take (a receiver's bound)."""
        return self.encoded_size(numel)

    def __repr__(self) -> str:
        extra = f", {self.settings}" if self.settings is not None else ""
        return f"{type(self).__name__}(segment_values={self.segment_values}{extra})"


class DenseCodec(SegmentCodec):
    """A codec that stores every value (``none``, ``fp16``, ``int8``): fixed segment size, no residual."""

    granularity = 1  # segment_values must be a multiple of this (the int8 block)

    def __init__(self, segment_values: int = DENSE_SEGMENT_VALUES) -> None:
        _check_int("segment_values", segment_values, 1, MAX_SEGMENT_VALUES)
        if segment_values % self.granularity:
            raise ValueError(f"segment_values {segment_values} is not a multiple of {self.granularity}")
        self.segment_values = segment_values


class RawCodec(DenseCodec):
    """``none``: raw little-endian float32 (lossless)."""

    name = "none"

    def encode(self, values: torch.Tensor) -> bytes:
        return _le_bytes(_check_values(values, self.segment_values), "<f4")

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        data = _check_request(data, numel, self.segment_values)
        _expect_length(data, self.encoded_size(numel), "float32 segment")
        return _read(data, "<f4", numel, 0)

    def encoded_size(self, numel: int) -> int:
        return 4 * numel


class Fp16Codec(DenseCodec):
    """``fp16``: IEEE half; finite overflow clamped to ±65504, ±inf and NaN kept."""

    name = "fp16"

    def encode(self, values: torch.Tensor) -> bytes:
        return _le_bytes(_to_half(_check_values(values, self.segment_values)), "<f2")

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        data = _check_request(data, numel, self.segment_values)
        _expect_length(data, self.encoded_size(numel), "fp16 segment")
        return _from_half(_read(data, "<f2", numel, 0))

    def encoded_size(self, numel: int) -> int:
        return 2 * numel


class Int8Codec(DenseCodec):
    """``int8``: ``float32 scales[ceil(n/256)] | int8 codes[n]``, per-block absmax (bound: s/2 per value)."""

    name = "int8"
    granularity = INT8_BLOCK

    def encode(self, values: torch.Tensor) -> bytes:
        values = _check_values(values, self.segment_values)
        numel = values.numel()
        blocks = -(-numel // INT8_BLOCK)
        padding = blocks * INT8_BLOCK - numel
        padded = (torch.nn.functional.pad(values, (0, padding)) if padding else values).view(blocks, INT8_BLOCK)
        absmax = torch.maximum(padded.amax(dim=1), -padded.amin(dim=1)) if numel else values  # NaN propagates
        scales = absmax / 127
        too_big = scales.double() * 127 > absmax.double()  # round toward zero: 127·s ≤ absmax, no overflow
        scales = torch.where(too_big, torch.nextafter(scales, torch.zeros_like(scales)), scales)
        scales = torch.where(absmax > 0, scales.clamp_min(_TINY), scales.new_zeros(()))
        poisoned = ~torch.isfinite(absmax)
        quotients = padded.div(torch.where(scales > 0, scales, 1.0)[:, None]).round_().clamp_(-127, 127)
        if bool(poisoned.any()):  # NaN → int8 is not portable; the NaN scale marks the block instead
            scales[poisoned] = math.nan
            quotients[poisoned] = 0
        codes = quotients.to(torch.int8).view(-1)[:numel]
        return _le_bytes(scales, "<f4") + codes.numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        data = _check_request(data, numel, self.segment_values)
        _expect_length(data, self.encoded_size(numel), "int8 segment")
        blocks = -(-numel // INT8_BLOCK)
        scales = _canonical_nan_(_read(data, "<f4", blocks, 0))
        codes = _read(data, "i1", numel, 4 * blocks).to(torch.float32)
        whole = numel // INT8_BLOCK * INT8_BLOCK
        codes[:whole].view(-1, INT8_BLOCK).mul_(scales[: whole // INT8_BLOCK, None])
        codes[whole:].mul_(scales[-1:] if whole < numel else 0.0)
        return codes

    def encoded_size(self, numel: int) -> int:
        return 4 * -(-numel // INT8_BLOCK) + numel


# --------------------------------------------------------------------------------------------------- sparse

SPARSE_QUANTIZERS = ("signmag", "uniform")


@dataclass(frozen=True)
class SparseSettings:
    """The sparse codec's run settings; every peer of a run must use equal ones (compare ``to_dict()``).

    - ``chunk``: values per chunk (top-k unit), 2 … 32768 (a chunk's count of averaged nonzeros fits a u16).
    - ``k``: entries kept per chunk, 1 … chunk (default 64 of 4096 = 1.56 %).
    - ``bits``: bits per kept value, 2 … 8.
    - ``quantizer``: ``signmag`` — 1 sign bit + (bits−1) magnitude bits, magnitudes ``m·s`` for m = 1 … L with
      ``L = 2**(bits−1)`` and ``s = absmax/L`` (no level is spent on 0: kept entries are a chunk's largest); or
      ``uniform`` — symmetric levels ``q·s`` for q = −(L−1) … L−1 with ``s = absmax/(L−1)`` (code 2L−1 unused).
    - ``error_feedback``: whether senders keep a residual (the product always does; off only to measure it).
    - ``segment_values``: a multiple of ``chunk``; None picks the smallest ``chunk·2**j`` whose encoded segment is
      ≥ 16 KiB (2**20 for the defaults: 29,696 bytes), so a segment's 32-byte digest and 64-byte signature cost
      < 0.6 % of its bytes.

    Why a float32 scale per chunk: fp16 would save 2 bytes of a default chunk's 116 (1.7 %), but its range ends at
    6e-5 (normal) / 6e-8 (subnormal), and pseudo-gradients of large models at small learning rates live there.
    Invalid settings raise ``ValueError``.
    """

    chunk: int = 4096
    k: int = 64
    bits: int = 2
    quantizer: str = "signmag"
    error_feedback: bool = True
    segment_values: int | None = None

    def __post_init__(self) -> None:
        _check_int("chunk", self.chunk, 2, 1 << 15)
        _check_int("k", self.k, 1, self.chunk)
        _check_int("bits", self.bits, 2, 8)
        if self.quantizer not in SPARSE_QUANTIZERS:
            raise ValueError(f"quantizer must be one of {SPARSE_QUANTIZERS}, got {self.quantizer!r}")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be a bool, got {self.error_feedback!r}")
        if self.segment_values is None:
            segment = self.chunk
            while self.encoded_size(segment) < SPARSE_TARGET_SEGMENT_BYTES and 2 * segment <= MAX_SEGMENT_VALUES:
                segment *= 2
            object.__setattr__(self, "segment_values", segment)
        _check_int("segment_values", self.segment_values, self.chunk, MAX_SEGMENT_VALUES)
        if self.segment_values % self.chunk:
            raise ValueError(f"segment_values {self.segment_values} is not a multiple of chunk {self.chunk}")

    @property
    def index_bits(self) -> int:
        return (self.chunk - 1).bit_length()

    @property
    def density(self) -> float:
        return self.k / self.chunk

    def sum_bits_per_value(self, union_density: float) -> float:
        """Bits per value of a sparse averaged segment whose chunks hold ``union_density`` × ``chunk`` nonzeros (a u16
        count per chunk, then an index and an fp16 value per nonzero); the reducer sends dense fp16 (16) instead
        when that is smaller."""
        return 16 / self.chunk + union_density * (self.index_bits + 16)

    def kept(self, numel: int) -> int:
        """Entries kept in a segment of ``numel`` values (the last chunk keeps at most its length)."""
        return numel // self.chunk * self.k + min(self.k, numel % self.chunk)

    def encoded_size(self, numel: int) -> int:
        kept = self.kept(numel)
        return 4 * -(-numel // self.chunk) + _bitstream_bytes(kept, self.index_bits) + _bitstream_bytes(kept, self.bits)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SparseSettings:
        """Settings from plain values (a config file, a message); ValueError on unknown or invalid fields."""
        known = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or set(raw) - known:
            raise ValueError(f"sparse settings take {sorted(known)}, got {raw!r}")
        return cls(**raw)


class SparseCodec(SegmentCodec):
    """``sparse``: per-chunk top-k, packed indices, ``bits``-bit values with a float32 scale per chunk."""

    name = "sparse"

    def __init__(self, settings: SparseSettings | None = None) -> None:
        self._settings = settings or SparseSettings()
        if not isinstance(self._settings, SparseSettings):
            raise ValueError(f"expected SparseSettings, got {type(settings).__name__}")
        self.segment_values = self._settings.segment_values
        self.error_feedback = self._settings.error_feedback
        self._levels = 1 << (self._settings.bits - 1)  # L

    @property
    def settings(self) -> SparseSettings:
        return self._settings

    def encoded_size(self, numel: int) -> int:
        return self._settings.encoded_size(numel)

    def max_average_size(self, numel: int) -> int:
        return 1 + 2 * numel  # the dense form; the sparse form is only chosen when smaller

    # ---- contributions

    def encode(self, values: torch.Tensor) -> bytes:
        values = _check_values(values, self.segment_values)
        s = self._settings
        positions, absmax = _top_k_per_chunk(values.numpy(), s.chunk, s.k)
        positions = torch.from_numpy(positions)
        row_of = positions // s.chunk
        scales = self._scales(torch.from_numpy(absmax).view(torch.float32))
        codes = self._quantize(values[positions], scales[row_of])
        return _le_bytes(scales, "<f4") + _bit_pack(positions % s.chunk, s.index_bits) + _bit_pack(codes, s.bits)

    def _scales(self, absmax: torch.Tensor) -> torch.Tensor:
        divisor = self._levels if self._settings.quantizer == "signmag" else self._levels - 1
        scales = absmax / divisor
        if divisor & (divisor - 1):  # not a power of two: round toward zero so that divisor·s ≤ absmax
            too_big = scales.double() * divisor > absmax.double()
            scales = torch.where(too_big, torch.nextafter(scales, torch.zeros_like(scales)), scales)
        scales = torch.where(absmax > 0, scales.clamp_min(_TINY), scales.new_zeros(()))
        return scales.masked_fill_(~torch.isfinite(absmax), math.nan)

    def _quantize(self, kept: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        usable = scales > 0  # False for a zero chunk (every code decodes to 0) and for a NaN scale
        ratio = torch.where(usable, kept / torch.where(usable, scales, 1.0), 0.0)
        if self._settings.quantizer == "signmag":
            magnitude = ratio.abs_().round_().clamp_(1, self._levels).to(torch.int64) - 1
            return torch.signbit(kept).to(torch.int64) * self._levels + magnitude
        return ratio.round_().clamp_(1 - self._levels, self._levels - 1).to(torch.int64) + (self._levels - 1)

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        data = _check_request(data, numel, self.segment_values)
        _expect_length(data, self.encoded_size(numel), "sparse segment")
        s = self._settings
        out = torch.zeros(numel, dtype=torch.float32)
        if numel == 0:
            return out
        chunks = -(-numel // s.chunk)
        scales = _read(data, "<f4", chunks, 0)
        if bool(((torch.signbit(scales) & ~torch.isnan(scales)) | torch.isinf(scales)).any()):
            raise CodecError("a sparse chunk scale is negative (or −0) or infinite")
        _canonical_nan_(scales)
        count = s.kept(numel)
        indices, offset = _bit_unpack(data, 4 * chunks, count, s.index_bits)
        codes, _ = _bit_unpack(data, offset, count, s.bits)
        row_of = torch.arange(count) // s.k
        _check_chunk_indices(indices, row_of, numel, s.chunk)
        out[row_of * s.chunk + indices] = self._dequantize(codes, scales[row_of])
        return out

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        levels = self._levels
        if self._settings.quantizer == "signmag":
            magnitude = (codes % levels + 1).to(torch.float32)
            return torch.where(codes >= levels, -magnitude, magnitude) * scales
        if bool((codes == 2 * levels - 1).any()):
            raise CodecError("unused uniform quantizer code")
        return (codes - (levels - 1)).to(torch.float32) * scales

    # ---- averaged segments

    def encode_average(self, values: torch.Tensor) -> bytes:
        values = _check_values(values, self.segment_values)
        half = _to_half(values)
        counts = self._nonzero_counts(half)
        if self._sparse_average_size(values.numel(), int(counts.sum())) >= 1 + 2 * values.numel():
            return bytes([_TAG_DENSE]) + _le_bytes(half, "<f2")
        positions = torch.nonzero(half != 0).reshape(-1)  # NaN != 0: non-finite values stay visible
        return b"".join((bytes([_TAG_SPARSE]), _le_bytes(counts, "<u2"),
                         _bit_pack(positions % self._settings.chunk, self._settings.index_bits),
                         _le_bytes(half[positions], "<f2")))

    def decode_average(self, data: bytes, numel: int) -> torch.Tensor:
        data = _check_request(data, numel, self.segment_values)
        if not data:
            raise CodecError("empty averaged segment")
        chunk, chunks = self._settings.chunk, -(-numel // self._settings.chunk)
        if data[0] == _TAG_DENSE:
            _expect_length(data, 1 + 2 * numel, "dense averaged segment")
            half = _read(data, "<f2", numel, 1)
            if self._sparse_average_size(numel, int(self._nonzero_counts(half).sum())) < len(data):
                raise CodecError("a dense averaged segment whose sparse form is smaller (not canonical)")
            return _from_half(half)
        if data[0] != _TAG_SPARSE:
            raise CodecError(f"unknown averaged-segment tag {data[0]}")
        if len(data) < 1 + 2 * chunks:
            raise CodecError(f"averaged segment of {len(data)} bytes cannot hold {chunks} chunk counts")
        counts = _read(data, "<u2", chunks, 1).to(torch.int64)
        lengths = torch.full((chunks,), chunk, dtype=torch.int64)
        lengths[-1:] = numel - (chunks - 1) * chunk
        if bool((counts > lengths).any()):
            raise CodecError("a chunk count exceeds the chunk's length")
        total = int(counts.sum())
        expected = self._sparse_average_size(numel, total)
        _expect_length(data, expected, "sparse averaged segment")
        if expected >= 1 + 2 * numel:
            raise CodecError("a sparse averaged segment no smaller than its dense form (not canonical)")
        indices, offset = _bit_unpack(data, 1 + 2 * chunks, total, self._settings.index_bits)
        half = _read(data, "<f2", total, offset)
        if bool((half == 0).any()):
            raise CodecError("an explicit zero in a sparse averaged segment (not canonical)")
        row_of = torch.repeat_interleave(torch.arange(chunks), counts)
        _check_chunk_indices(indices, row_of, numel, chunk)
        out = torch.zeros(numel, dtype=torch.float32)
        out[row_of * chunk + indices] = _from_half(half)
        return out

    def _nonzero_counts(self, half: torch.Tensor) -> torch.Tensor:
        """How many fp16 values of each chunk are nonzero (NaN counts as nonzero), int64."""
        chunk = self._settings.chunk
        chunks = -(-half.numel() // chunk)
        nonzero = torch.nn.functional.pad(half != 0, (0, chunks * chunk - half.numel()))
        return nonzero.view(chunks, chunk).sum(1)

    def _sparse_average_size(self, numel: int, nonzeros: int) -> int:
        chunks = -(-numel // self._settings.chunk)
        return 1 + 2 * chunks + _bitstream_bytes(nonzeros, self._settings.index_bits) + 2 * nonzeros


def _top_k_rows(keys: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat positions (ascending) of the k largest keys of each row, the lower column winning ties, and each row's
    largest key. The selected set does not depend on the selection algorithm: it is "every key above the row's
    k-th largest, then the first columns equal to it"."""
    width = keys.shape[1]
    partitioned = np.partition(keys, width - k, axis=1)
    kth = partitioned[:, width - k, None]
    chosen = keys >= kth
    tied = np.flatnonzero(np.count_nonzero(chosen, axis=1) > k)
    if tied.size:  # e.g. zeros in a chunk with fewer than k nonzero values
        rows, threshold = keys[tied], kth[tied]
        above = rows > threshold
        room = k - np.count_nonzero(above, axis=1)
        equal = rows == threshold
        chosen[tied] = above | (equal & (np.cumsum(equal, axis=1) <= room[:, None]))
    return np.flatnonzero(chosen), partitioned[:, width - k:].max(axis=1)


def _top_k_per_chunk(values: np.ndarray, chunk: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The positions (ascending, int64) a sparse segment keeps and the |x| bits of each chunk's largest value.

    Keys are |x|'s float32 bits as int32: their order is |x|'s order, and NaN > inf > every finite value, so a
    chunk's non-finite values are always kept and always its maximum. The last chunk, when shorter, keeps
    min(k, its length) entries."""
    keys = values.view(np.int32) & _ABS_MASK
    whole = values.size // chunk * chunk
    positions, absmax = [], []
    if whole:
        selected, top = _top_k_rows(keys[:whole].reshape(-1, chunk), k)
        positions.append(selected)
        absmax.append(top)
    tail = keys[whole:]
    if tail.size > k:
        selected, top = _top_k_rows(tail.reshape(1, -1), k)
        positions.append(selected + whole)
        absmax.append(top)
    elif tail.size:
        positions.append(np.arange(whole, values.size))
        absmax.append(tail.max(keepdims=True))
    if not positions:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
    return np.concatenate(positions).astype(np.int64), np.concatenate(absmax).astype(np.int32)


def _check_chunk_indices(indices: torch.Tensor, row_of: torch.Tensor, numel: int, chunk: int) -> None:
    """In-chunk indices must lie inside their chunk and rise strictly within it (so positions are unique and the
    encoding canonical); CodecError otherwise."""
    if indices.numel() == 0:
        return
    limit = torch.where(row_of == (numel - 1) // chunk, numel - row_of * chunk, chunk)
    if bool((indices >= limit).any()):
        raise CodecError("an index lies outside its chunk")
    positions = row_of * chunk + indices
    if bool((positions[1:] <= positions[:-1]).any()):
        raise CodecError("indices do not rise strictly within a chunk")


# ------------------------------------------------------------------------------------- factory and helpers

_DENSE = {"none": RawCodec, "fp16": Fp16Codec, "int8": Int8Codec}


def get_codec(name: str, **settings: Any) -> SegmentCodec:
    """A codec by name. Dense codecs take ``segment_values``; ``sparse`` takes the fields of
    :class:`SparseSettings`. ValueError (listing the names) for an unknown name or an invalid/unknown setting."""
    if name == "sparse":
        return SparseCodec(SparseSettings.from_dict(settings))
    if name not in _DENSE:
        raise ValueError(f"unknown codec {name!r}: expected one of {', '.join(CODEC_NAMES)}")
    if set(settings) - {"segment_values"}:
        raise ValueError(f"codec {name!r} takes only segment_values, got {sorted(settings)}")
    return _DENSE[name](**settings)


def segment_slices(numel: int, segment_values: int) -> Iterator[slice]:
    """The segments of a flat vector of ``numel`` values: consecutive, ``segment_values`` long, the last shorter."""
    return (slice(start, min(start + segment_values, numel)) for start in range(0, numel, segment_values))


def encode_segments(codec: SegmentCodec, flat: torch.Tensor, average: bool = False) -> tuple[list[bytes], torch.Tensor]:
    """Encode a whole flat float32 vector segment by segment (``encode_average`` when ``average``); return the bytes
    of each segment and the vector every receiver decodes from them."""
    flat = _check_values(flat.reshape(-1) if isinstance(flat, torch.Tensor) else flat, math.inf)
    encode, decode = (codec.encode_average, codec.decode_average) if average else (codec.encode, codec.decode)
    segments, decoded = [], torch.empty_like(flat)
    for part in segment_slices(flat.numel(), codec.segment_values):
        segments.append(encode(flat[part]))
        decoded[part] = decode(segments[-1], part.stop - part.start)
    return segments, decoded


def encode_with_feedback(codec: SegmentCodec, values: torch.Tensor,
                         residual: torch.Tensor | None) -> tuple[list[bytes], torch.Tensor, torch.Tensor | None]:
    """A sender's whole contribution with error feedback: ``target = values + residual``, encoded per segment;
    returns (segment bytes, decoded, ``target − decoded``). For a codec without feedback the target is ``values``,
    ``residual`` must be None and so is the returned one.

    ``residual`` None means zero (the first round). Non-finite values are not hidden here either: they reach the
    bytes (receivers refuse them) and the new residual, so a caller must reset the residual after such a round
    (the engine refuses a non-finite Δ before encoding). A residual of another size raises CodecError.
    """
    values = _check_values(values.reshape(-1) if isinstance(values, torch.Tensor) else values, math.inf)
    if not codec.error_feedback:
        if residual is not None:
            raise CodecError(f"codec {codec.name} keeps no residual, but one was given")
        return *encode_segments(codec, values), None
    if residual is not None and residual.shape != values.shape:
        raise CodecError(f"residual of shape {tuple(residual.shape)} for {values.numel()} values")
    target = values.clone() if residual is None else values + residual
    segments, decoded = encode_segments(codec, target)
    return segments, decoded, target.sub_(decoded)
