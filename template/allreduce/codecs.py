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
from collections.abc import Iterator
from typing import Any

import torch

from template.allreduce.codec_base import (
    DENSE_SEGMENT_VALUES,
    FP16_MAX,
    INT8_BLOCK,
    MAX_SEGMENT_VALUES,
    CodecError,
    DenseCodec,
    Fp16Codec,
    Int8Codec,
    RawCodec,
    SegmentCodec,
    _check_values,
    all_finite,
)
from template.allreduce.sparse_codec import SPARSE_MEANS, AttributedAverage, SparseCodec, SparseSettings

__all__ = [
    "CODEC_NAMES",
    "DENSE_SEGMENT_VALUES",
    "FP16_MAX",
    "INT8_BLOCK",
    "MAX_SEGMENT_VALUES",
    "SPARSE_MEANS",
    "AttributedAverage",
    "CodecError",
    "DenseCodec",
    "Fp16Codec",
    "Int8Codec",
    "RawCodec",
    "SegmentCodec",
    "SparseCodec",
    "SparseSettings",
    "all_finite",
    "encode_segments",
    "encode_with_feedback",
    "get_codec",
    "segment_slices",
    "with_feedback",
]

CODEC_NAMES: tuple[str, ...] = ("none", "fp16", "int8", "sparse")

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


def with_feedback(codec: SegmentCodec, values: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """What a sender encodes: its values plus its residual faded by the codec's β (``values + β·residual``)."""
    return values + codec.feedback_decay * residual


def encode_with_feedback(codec: SegmentCodec, values: torch.Tensor,
                         residual: torch.Tensor | None) -> tuple[list[bytes], torch.Tensor, torch.Tensor | None]:
    """A sender's whole contribution with error feedback: ``target = values + β·residual`` (β: the codec's
    ``feedback_decay``), encoded per segment; returns (segment bytes, decoded, ``target − decoded``). For a codec
    without feedback the target is ``values``, ``residual`` must be None and so is the returned one.

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
    target = values.clone() if residual is None else with_feedback(codec, values, residual)
    segments, decoded = encode_segments(codec, target)
    return segments, decoded, target.sub_(decoded)
