"""What every segment codec shares: the :class:`SegmentCodec` interface, its error, its bounds and byte helpers, and
the dense codecs (``none``, ``fp16``, ``int8``). The formats and guarantees are stated in
:mod:`template.allreduce.codecs`, which is the module to import from.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

DENSE_SEGMENT_VALUES = 1 << 17  # 512 KiB of float32, 256 KiB of fp16, 130 KiB of int8 per segment
MAX_SEGMENT_VALUES = 1 << 26  # a decode never allocates more than 256 MiB, whatever the settings say
SPARSE_TARGET_SEGMENT_BYTES = 16 * 1024  # a 32-byte digest + 64-byte signature stay < 0.6 % of a segment
INT8_BLOCK = 256
FP16_MAX = 65504.0
_TINY = torch.finfo(torch.float32).tiny
_ABS_MASK = 0x7FFFFFFF
_TAG_DENSE, _TAG_SPARSE, _TAG_ATTRIBUTED = 0, 1, 2
MAX_ATTRIBUTED_GROUPS = 256  # senders an attributed average can name (template.allreduce.sparse_codec)


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


def all_finite(values: torch.Tensor) -> bool:
    """``bool(torch.isfinite(values).all())``, in one allocation-free pass: min and max propagate NaN, and ±inf is
    the min or the max when present (``isfinite`` builds several temporaries: ~20× slower on a 128K-value segment)."""
    if values.numel() == 0:
        return True
    low, high = torch.aminmax(values)
    return math.isfinite(float(low)) and math.isfinite(float(high))


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


def fp16_error_norm(decoded: torch.Tensor) -> float:
    """‖m − decoded‖₂ for the float32 m behind decoded fp16 values: per value half a unit in the last place
    (2^-11 relative, 2^-25 among the subnormals) plus float32's own rounding; at ±65504 it holds only for an m that
    was not clamped."""
    return (2.0**-11 + 2.0**-23) * _norm(decoded) + 2.0**-25 * decoded.numel() ** 0.5


def _norm(values: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(values, dtype=torch.float64))


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
    feedback_decay: float = 1.0  # β: a sender's residual counts β× in its next contribution (error_feedback only)
    mean_of_kept: bool = False  # an owner averages each value over the senders that kept it (nonzero), not all
    # random directions the in-round check of an average uses (template.allreduce.verification): enough that a
    # negated average slips through with probability ~1e-6 or less; coarser rounding needs more
    check_directions: int = 2

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

    @abstractmethod
    def average_error_norm(self, decoded: torch.Tensor) -> float:
        """A bound on ‖m − decoded‖₂, where ``decoded`` is ``decode_average(encode_average(m))`` of a float32 mean
        ``m``, computed from ``decoded`` alone (what a member holds): the rounding that the in-round check of an
        owner's average (:mod:`template.allreduce.verification`) allows. Per value the codec's rounding bound ε_j;
        this is ‖ε‖₂, summed by the triangle inequality where ε_j has several terms."""

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

    def average_error_norm(self, decoded: torch.Tensor) -> float:
        return 2.0**-23 * _norm(decoded)  # the float32 mean is sent as is: only its own rounding


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

    def average_error_norm(self, decoded: torch.Tensor) -> float:
        return fp16_error_norm(decoded)


class Int8Codec(DenseCodec):
    """``int8``: ``float32 scales[ceil(n/256)] | int8 codes[n]``, per-block absmax (bound: s/2 per value)."""

    name = "int8"
    granularity = INT8_BLOCK
    check_directions = 4  # its rounding (s/2) lets one direction miss a negated average ~4 % of the time

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

    def average_error_norm(self, decoded: torch.Tensor) -> float:
        """s/2 per value (plus float32's rounding of the quotient and of the mean): a block's largest |value|
        decodes to 127·s exactly (its code is ±127), so each block's s is read back from the decoded block."""
        numel = decoded.numel()
        padding = -numel % INT8_BLOCK
        blocks = torch.nn.functional.pad(decoded, (0, padding)).view(-1, INT8_BLOCK).abs().amax(dim=1)
        sizes = torch.full_like(blocks, INT8_BLOCK)
        sizes[-1:] -= padding
        scales = blocks.double() / 127
        return (0.5 + 2.0**-16) * float((scales.square() * sizes).sum().sqrt()) + 2.0**-23 * _norm(decoded)


# --------------------------------------------------------------------------------------------------- sparse
