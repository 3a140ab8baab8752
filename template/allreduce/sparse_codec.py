"""The ``sparse`` codec (SparseLoCo/DeMo family): chunked top-k with low-bit values, meant for error feedback.

Format and guarantees: :mod:`template.allreduce.codecs`, which is the module to import from.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import numpy as np
import torch

from template.allreduce.codec_base import (
    _ABS_MASK,
    _TAG_ATTRIBUTED,
    _TAG_DENSE,
    _TAG_SPARSE,
    _TINY,
    MAX_ATTRIBUTED_GROUPS,
    MAX_SEGMENT_VALUES,
    SPARSE_TARGET_SEGMENT_BYTES,
    CodecError,
    SegmentCodec,
    _bit_pack,
    _bit_unpack,
    _bitstream_bytes,
    _canonical_nan_,
    _check_int,
    _check_request,
    _check_values,
    _expect_length,
    _from_half,
    _le_bytes,
    _read,
    _to_half,
    fp16_error_norm,
)

SPARSE_QUANTIZERS = ("signmag", "uniform")
SPARSE_MEANS = ("kept", "all")


@dataclass(frozen=True)
class SparseSettings:
    """The sparse codec's run settings; every peer of a run must use equal ones (compare ``to_dict()``).

    - ``chunk``: values per chunk (top-k unit), 2 … 32768 (a chunk's count of averaged nonzeros fits a u16).
    - ``k``: entries kept per chunk, 1 … chunk (default 64 of 4096 = 1.56 %).
    - ``bits``: bits per kept value, 1 … 8 (``uniform``: 2 … 8).
    - ``quantizer``: ``signmag`` — 1 sign bit + (bits−1) magnitude bits, magnitudes ``m·s`` for m = 1 … L with
      ``L = 2**(bits−1)`` and ``s = absmax/L`` (no level is spent on 0: kept entries are a chunk's largest); at
      1 bit (the sign alone) ``s`` is the mean |x| of the chunk's kept values instead, the scale that minimizes a
      sign code's squared error (``absmax`` would inflate every kept value but the largest); or
      ``uniform`` — symmetric levels ``q·s`` for q = −(L−1) … L−1 with ``s = absmax/(L−1)`` (code 2L−1 unused).
    - ``error_feedback``: whether senders keep a residual (the product always does; off only to measure it).
    - ``feedback_decay``: β in (0, 1] of the error feedback, e ← β·e + Δ before each encoding (SparseLoCo): what
      waited longer fades instead of arriving rounds late at full size; 1.0 keeps everything.
    - ``mean_of``: how an owner averages a coordinate. ``kept``: the weighted mean over the senders that kept it (a
      nonzero value), so a value kept by one sender of four arrives whole, as in Templar's scatter-mean; ``all``:
      over every sender's weight, zeros included, so it arrives at a quarter (measured: four sparse miners then
      learned less than one alone — docs/benchmarks.md §7).
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
    feedback_decay: float = 0.95
    mean_of: str = "kept"
    segment_values: int | None = None

    def __post_init__(self) -> None:
        _check_int("chunk", self.chunk, 2, 1 << 15)
        _check_int("k", self.k, 1, self.chunk)
        if self.quantizer not in SPARSE_QUANTIZERS:
            raise ValueError(f"quantizer must be one of {SPARSE_QUANTIZERS}, got {self.quantizer!r}")
        _check_int("bits", self.bits, 1 if self.quantizer == "signmag" else 2, 8)
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be a bool, got {self.error_feedback!r}")
        decay = self.feedback_decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
            raise ValueError(f"feedback_decay must be a number in (0, 1], got {decay!r}")
        object.__setattr__(self, "feedback_decay", float(decay))
        if self.mean_of not in SPARSE_MEANS:
            raise ValueError(f"mean_of must be one of {SPARSE_MEANS}, got {self.mean_of!r}")
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

    @property
    def count_bytes(self) -> int:
        """Bytes of each per-chunk, per-sender count of an attributed average: one while ``k`` < 256 (a sender
        keeps at most ``k`` values of a chunk)."""
        return 1 if self.k < 256 else 2

    def sum_bits_per_value(self, union_density: float, senders: int) -> float:
        """Bits per value of an averaged segment of ``senders`` whose chunks hold ``union_density`` × ``chunk``
        nonzeros (an index and an fp16 value each). ``mean_of`` "kept" (the default): the attributed form — a count
        per chunk and sender (a byte while ``k`` < 256), never dense (SparseCodec.encode_attributed_average); "all": a
        u16 count per chunk, or dense fp16 (16) when that is smaller."""
        entries = union_density * (self.index_bits + 16)
        if self.mean_of == "kept":
            return senders * 8 * self.count_bytes / self.chunk + entries
        return min(16.0, 16 / self.chunk + entries)

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


class AttributedAverage(NamedTuple):
    """A decoded attributed average: its values, and for each of its nonzeros (``positions``) the position among the
    averaged senders of the one it names as having kept it (``keepers``); ``groups``: how many senders it names."""

    values: torch.Tensor
    positions: torch.Tensor
    keepers: torch.Tensor
    groups: int

    def named(self, sender: int) -> torch.Tensor:
        """The positions of the values it names ``sender`` for."""
        return self.positions[self.keepers == sender]

    def keepers_per_value(self) -> torch.Tensor:
        """Whom it names for each value, −1 where it is zero."""
        out = torch.full((self.values.numel(),), -1, dtype=torch.int64)
        out[self.positions] = self.keepers
        return out


class SparseCodec(SegmentCodec):
    """``sparse``: per-chunk top-k, packed indices, ``bits``-bit values with a float32 scale per chunk."""

    name = "sparse"

    def __init__(self, settings: SparseSettings | None = None) -> None:
        self._settings = settings or SparseSettings()
        if not isinstance(self._settings, SparseSettings):
            raise ValueError(f"expected SparseSettings, got {type(settings).__name__}")
        self.segment_values = self._settings.segment_values
        self.error_feedback = self._settings.error_feedback
        self.feedback_decay = self._settings.feedback_decay
        self.mean_of_kept = self._settings.mean_of == "kept"
        self._levels = 1 << (self._settings.bits - 1)  # L

    @property
    def settings(self) -> SparseSettings:
        return self._settings

    def encoded_size(self, numel: int) -> int:
        return self._settings.encoded_size(numel)

    def max_average_size(self, numel: int) -> int:
        # the dense form (the plain sparse form is only chosen when smaller), or an attributed one of every value
        chunks = -(-numel // self._settings.chunk)
        return max(1 + 2 * numel, self._attributed_size(chunks, MAX_ATTRIBUTED_GROUPS, numel))

    # ---- contributions

    def encode(self, values: torch.Tensor) -> bytes:
        values = _check_values(values, self.segment_values)
        s = self._settings
        positions, absmax = _top_k_per_chunk(values.numpy(), s.chunk, s.k)
        positions = torch.from_numpy(positions)
        row_of = positions // s.chunk
        absmax = torch.from_numpy(absmax).view(torch.float32)
        kept = values[positions]
        scales = self._scales(_mean_abs_per_chunk(kept, s.k) if self._levels == 1 else absmax, absmax)
        codes = self._quantize(kept, scales[row_of])
        return _le_bytes(scales, "<f4") + _bit_pack(positions % s.chunk, s.index_bits) + _bit_pack(codes, s.bits)

    def _scales(self, magnitude: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        """Each chunk's scale from its ``magnitude`` (absmax, or the mean |kept| for a sign code): 0 for a zero
        chunk, NaN for a chunk with a non-finite value."""
        divisor = self._levels if self._settings.quantizer == "signmag" else self._levels - 1
        scales = magnitude / divisor
        if divisor & (divisor - 1):  # not a power of two: round toward zero so that divisor·s ≤ absmax
            too_big = scales.double() * divisor > magnitude.double()
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

    def average_error_norm(self, decoded: torch.Tensor) -> float:
        return fp16_error_norm(decoded)  # both forms carry the fp16-rounded mean

    def decode_average(self, data: bytes, numel: int) -> torch.Tensor:
        data = _check_request(data, numel, self.segment_values)
        if not data:
            raise CodecError("empty averaged segment")
        chunk, chunks = self._settings.chunk, -(-numel // self._settings.chunk)
        if (attributed := self.decode_attributed_average(data, numel)) is not None:
            return attributed.values
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

    def encode_attributed_average(self, values: torch.Tensor, kept: Sequence[torch.Tensor]) -> bytes:
        """An average over the kept values in which every nonzero names the first sender that kept it: ``kept[i]`` is
        the ``i``-th averaged sender's input (nonzero where it kept a value); ValueError for a nonzero none kept.

        Why: members check an average over the kept values against what each sender can vouch for
        (template.allreduce.disputes), and a value nobody kept must be zero — only its keepers can say so. The
        attribution costs no index: each chunk's nonzeros are listed by keeper, then by position (the positions are
        paid anyway), with one count per chunk and keeper (a byte while ``k`` < 256; +0.3 % of an averaged chunk
        of four senders with the defaults). Always this form, never the dense one: the attribution needs the list."""
        values = _check_values(values, self.segment_values)
        groups = len(kept)
        _check_int("senders", groups, 1, MAX_ATTRIBUTED_GROUPS)
        if any(x.shape != values.shape for x in kept):
            raise ValueError("each sender's input must have the average's shape")
        half = _to_half(values)
        positions = torch.nonzero(half != 0).reshape(-1)  # NaN != 0: non-finite values stay visible
        owners = torch.full_like(positions, groups)  # read at the average's nonzeros only: a few % of the values
        for sender in reversed(range(groups)):
            owners = torch.where(kept[sender][positions] != 0, sender, owners)
        if bool((owners == groups).any()):
            raise ValueError("a nonzero average value that no averaged sender kept")
        chunk, chunks = self._settings.chunk, -(-values.numel() // self._settings.chunk)
        cell = positions // chunk * groups + owners  # (chunk, keeper), in listing order
        order = torch.argsort(cell * chunk + positions % chunk)
        counts = torch.bincount(cell, minlength=chunks * groups)
        return b"".join((bytes([_TAG_ATTRIBUTED]), struct.pack("<H", groups), _le_bytes(counts, self._count_dtype),
                         _bit_pack(positions[order] % chunk, self._settings.index_bits),
                         _le_bytes(half[positions[order]], "<f2")))

    def decode_attributed_average(self, data: bytes, numel: int) -> AttributedAverage | None:
        """An attributed average (:meth:`encode_attributed_average`) decoded, None for another form; CodecError when
        malformed (a count above ``k``, a position listed twice, an explicit zero)."""
        data = _check_request(data, numel, self.segment_values)
        groups = self.attributed_groups(data)
        if groups is None:
            return None
        if not 1 <= groups <= MAX_ATTRIBUTED_GROUPS:
            raise CodecError(f"an attributed averaged segment of {groups} senders")
        chunk, chunks = self._settings.chunk, -(-numel // self._settings.chunk)
        width = self._settings.count_bytes
        if len(data) < 3 + chunks * groups * width:
            raise CodecError(f"attributed averaged segment of {len(data)} bytes cannot hold its counts")
        counts = _read(data, self._count_dtype, chunks * groups, 3).to(torch.int64)
        if bool((counts > self._settings.k).any()):
            raise CodecError(f"a sender kept more than k = {self._settings.k} values of a chunk")
        total = int(counts.sum())
        _expect_length(data, self._attributed_size(chunks, groups, total), "attributed averaged segment")
        indices, offset = _bit_unpack(data, 3 + chunks * groups * width, total, self._settings.index_bits)
        half = _read(data, "<f2", total, offset)
        if bool((half == 0).any()):
            raise CodecError("an explicit zero in an attributed averaged segment (not canonical)")
        cell = torch.repeat_interleave(torch.arange(chunks * groups), counts)
        row_of, keepers = cell // groups, cell % groups
        _check_chunk_indices(indices, row_of, numel, chunk, lists=cell)
        positions = row_of * chunk + indices
        out = torch.zeros(numel, dtype=torch.float32)
        out[positions] = _from_half(half)
        if int(torch.count_nonzero(out)) != total:  # no value is zero: a position written twice counts once
            raise CodecError("a value listed for two senders")
        return AttributedAverage(out, positions, keepers, groups)

    @staticmethod
    def attributed_groups(data: bytes) -> int | None:
        """How many senders an attributed average names (read from its header only); None for another form."""
        if len(data) < 3 or data[0] != _TAG_ATTRIBUTED:
            return None
        return struct.unpack_from("<H", data, 1)[0]

    @property
    def _count_dtype(self) -> str:
        return f"<u{self._settings.count_bytes}"

    def _attributed_size(self, chunks: int, groups: int, nonzeros: int) -> int:
        return (3 + chunks * groups * self._settings.count_bytes + _bitstream_bytes(nonzeros, self._settings.index_bits)
                + 2 * nonzeros)

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


def _mean_abs_per_chunk(kept: torch.Tensor, k: int) -> torch.Tensor:
    """The mean |x| of each chunk's kept values (``k`` per chunk, fewer in a short last chunk), float32, summed in
    float64 over a fixed shape so the same values give the same scale."""
    magnitudes = kept.abs().double()
    full = magnitudes.numel() // k
    means = magnitudes[:full * k].view(full, k).sum(1) / k
    if magnitudes.numel() > full * k:
        means = torch.cat((means, magnitudes[full * k:].mean().reshape(1)))
    return means.float()


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


def _check_chunk_indices(indices: torch.Tensor, row_of: torch.Tensor, numel: int, chunk: int,
                         lists: torch.Tensor | None = None) -> None:
    """In-chunk indices must lie inside their chunk and rise strictly within each list — a chunk, or with ``lists``
    (an attributed average: per index, the rank of its chunk's sender list) that list — so that the encoding is
    canonical; CodecError otherwise."""
    if indices.numel() == 0:
        return
    limit = torch.where(row_of == (numel - 1) // chunk, numel - row_of * chunk, chunk)
    if bool((indices >= limit).any()):
        raise CodecError("an index lies outside its chunk")
    listed = (row_of if lists is None else lists) * chunk + indices
    if bool((listed[1:] <= listed[:-1]).any()):
        raise CodecError("indices do not rise strictly within a chunk" + ("" if lists is None else "'s sender"))


# ------------------------------------------------------------------------------------- factory and helpers
