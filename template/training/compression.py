"""Tensor codecs for the pseudo-gradient all-reduce, as hivemind ``CompressionBase`` subclasses.

Three codecs, chosen by name with :func:`get_compression`:

- ``none``: the raw bytes (hivemind ``NoCompression``), lossless.
- ``fp16``: IEEE half precision; finite values beyond ±65504 are clamped to ±65504 (as hivemind does).
- ``int8``: per-block scaled int8. The flat tensor is cut into blocks of ``block_size`` values; each block
  stores one float32 scale ``s = absmax / 127`` and round-to-nearest codes ``q = round(x / s)`` in
  [-127, 127]. Decoding is ``q * s``, so the error of every value is at most ``s / 2`` of its block (up to
  float32 rounding). Size: 1 byte per value + 4 bytes per block (≈ 1/4 of float32). hivemind's own 8-bit
  codecs are not used: their decoders are broken under numpy 2 (DESIGN.md §7).

Guarantees on bad data:

- **Non-finite values are never hidden.** ``none`` and ``fp16`` carry NaN/±inf through unchanged. ``int8``
  marks a block that contains any NaN/±inf with a NaN scale, so *every* value of that block decodes to NaN:
  the receiver's finite check sees the block is bad (the finite values of a poisoned block are lost, which
  is fine because the receiver must reject that part anyway).
- **Decoding never trusts the sender.** ``extract`` checks the codec id, the dtype name (a float dtype from
  a fixed list), the shape and the exact buffer length *before* allocating anything, and raises
  :class:`CodecError` (a ``ValueError``) on any mismatch. The output is at most 4× the size of the received
  buffer, so a hostile message cannot make the receiver allocate unbounded memory.
- Decoding is deterministic: the same bytes give the same tensor bits on every peer (one multiply per
  value, no reductions), which the all-reduce relies on to make peers bit-identical.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.proto import runtime_pb2

__all__ = [
    "CODEC_NAMES",
    "BlockInt8Compression",
    "CodecError",
    "Float16Codec",
    "RawCodec",
    "get_compression",
]

_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_MAX_DIMS = 32  # a tensor part is 1-D and a whole tensor has a handful of dims; more is a malformed message


class CodecError(ValueError):
    """A tensor message that this codec cannot (or must not) decode, or a tensor it cannot encode."""


def _dtype_name(tensor: torch.Tensor) -> str:
    name = str(tensor.dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise CodecError(f"unsupported dtype {tensor.dtype}: expected one of {sorted(_DTYPES)}")
    return name


def _checked_header(serialized: runtime_pb2.Tensor, compression_type: int) -> tuple[tuple[int, ...], int, torch.dtype]:
    """Validate the fields every codec shares; return (shape, numel, dtype) without allocating anything."""
    if serialized.compression != compression_type:
        raise CodecError(
            f"codec mismatch: got {runtime_pb2.CompressionType.Name(serialized.compression)}, "
            f"expected {runtime_pb2.CompressionType.Name(compression_type)}"
        )
    dtype = _DTYPES.get(serialized.dtype)
    if dtype is None:
        raise CodecError(f"unsupported dtype name {serialized.dtype!r}")
    if len(serialized.size) > _MAX_DIMS:
        raise CodecError(f"too many dimensions: {len(serialized.size)}")
    shape = tuple(int(dim) for dim in serialized.size)
    return shape, math.prod(shape), dtype


class RawCodec(NoCompression):
    """hivemind ``NoCompression`` with a validating decoder (lossless; NaN/inf pass through)."""

    name = "none"

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        _dtype_name(tensor)
        return super().compress(tensor.detach().cpu(), info, allow_inplace)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape, numel, dtype = _checked_header(serialized_tensor, self.compression_type)
        itemsize = torch.empty((), dtype=dtype).element_size()
        allowed = {numel * itemsize}
        if dtype == torch.bfloat16:
            allowed.add(numel * 4)  # hivemind's legacy bfloat16 layout travels as float32
        if len(serialized_tensor.buffer) not in allowed:
            raise CodecError(f"buffer of {len(serialized_tensor.buffer)} bytes does not hold {numel} {dtype} values")
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        return super().extract(serialized_tensor)


class Float16Codec(Float16Compression):
    """IEEE half precision; unlike hivemind's ``Float16Compression`` it keeps ±inf as ±inf instead of clamping."""

    name = "fp16"

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        dtype_name = _dtype_name(tensor)
        values = tensor.detach().cpu().to(torch.float32)
        clamped = torch.where(torch.isinf(values), values, values.clamp(self.FP16_MIN, self.FP16_MAX))
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=clamped.to(torch.float16).numpy().tobytes(),
            size=tensor.shape,
            dtype=dtype_name,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape, numel, dtype = _checked_header(serialized_tensor, self.compression_type)
        if len(serialized_tensor.buffer) != 2 * numel:
            raise CodecError(f"buffer of {len(serialized_tensor.buffer)} bytes does not hold {numel} fp16 values")
        halves = torch.from_numpy(np.frombuffer(serialized_tensor.buffer, dtype=np.float16).copy())
        return halves.to(dtype).reshape(shape)


class BlockInt8Compression(CompressionBase):
    """Per-block absmax-scaled int8 (see the module docstring for the format and its error bound).

    Buffer layout: ``b"BQ8\\x01"`` | block_size (u32 LE) | numel (u64 LE) | float32 scales[nblocks] | int8 codes[numel].
    It travels under hivemind's ``BLOCKWISE_8BIT`` id, so only our decoder (never hivemind's) must read it;
    the magic bytes make a mix-up fail loudly instead of decoding garbage.
    """

    name = "int8"
    compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT
    MAGIC = b"BQ8\x01"
    _HEADER = struct.Struct("<4sIQ")
    MAX_BLOCK_SIZE = 1 << 20

    def __init__(self, block_size: int = 256):
        if not 1 <= block_size <= self.MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in [1, {self.MAX_BLOCK_SIZE}], got {block_size}")
        self.block_size = block_size

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        dtype_name = _dtype_name(tensor)
        flat = tensor.detach().cpu().reshape(-1).to(torch.float32)
        numel, block = flat.numel(), self.block_size
        num_blocks = -(-numel // block)
        blocks = torch.nn.functional.pad(flat, (0, num_blocks * block - numel)).view(num_blocks, block)

        absmax = blocks.abs().amax(dim=1) if numel else flat.new_empty(0)  # amax propagates NaN
        scales = absmax / 127
        # round the scale toward zero so that 127 * s <= absmax: decoding can then never overflow to inf
        # (at absmax = float32 max, round-to-nearest would give 127 * s > max); codes are clamped to ±127.
        scales = torch.where(
            scales.double() * 127 > absmax.double(), torch.nextafter(scales, torch.zeros_like(scales)), scales
        )
        # the smallest normal float32 as a floor keeps scales out of the subnormal range, where absmax/127
        # would round so badly that codes could exceed 127; the error bound s/2 holds with the stored s.
        scales = torch.where(absmax > 0, scales.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        scales = torch.where(torch.isfinite(absmax), scales, torch.nan)  # poisoned block: decodes to all-NaN
        usable = (scales > 0)[:, None]
        codes = torch.where(usable, blocks / torch.where(usable, scales[:, None], 1.0), 0.0)
        codes = codes.round_().clamp_(-127, 127).to(torch.int8).view(-1)[:numel]

        header = self._HEADER.pack(self.MAGIC, block, numel)
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=b"".join((header, scales.numpy().tobytes(), codes.numpy().tobytes())),
            size=tensor.shape,
            dtype=dtype_name,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape, numel, dtype = _checked_header(serialized_tensor, self.compression_type)
        buffer = serialized_tensor.buffer
        if len(buffer) < self._HEADER.size:
            raise CodecError(f"int8 buffer of {len(buffer)} bytes is shorter than its header")
        magic, block, header_numel = self._HEADER.unpack_from(buffer)
        if magic != self.MAGIC:
            raise CodecError(f"bad int8 magic {magic!r}")
        if not 1 <= block <= self.MAX_BLOCK_SIZE:
            raise CodecError(f"bad int8 block size {block}")
        if header_numel != numel:
            raise CodecError(f"int8 header says {header_numel} values, shape {shape} has {numel}")
        num_blocks = -(-numel // block)
        expected = self._HEADER.size + 4 * num_blocks + numel
        if len(buffer) != expected:
            raise CodecError(f"int8 buffer has {len(buffer)} bytes, expected {expected}")
        if numel == 0:
            return torch.empty(shape, dtype=dtype)

        scales = torch.from_numpy(
            np.frombuffer(buffer, dtype=np.float32, count=num_blocks, offset=self._HEADER.size).copy()
        )
        codes = torch.from_numpy(
            np.frombuffer(buffer, dtype=np.int8, count=numel, offset=self._HEADER.size + 4 * num_blocks).copy()
        )
        padded = torch.nn.functional.pad(codes, (0, num_blocks * block - numel)).view(num_blocks, block)
        values = (padded.to(torch.float32) * scales[:, None]).view(-1)[:numel]
        return values.to(dtype).reshape(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        bits = torch.finfo(info.descriptor.dtype).bits if info.descriptor.dtype is not None else 32
        return (8 + 32 / self.block_size) / bits


_CODECS = {"none": RawCodec, "fp16": Float16Codec, "int8": BlockInt8Compression}
CODEC_NAMES: tuple[str, ...] = tuple(_CODECS)


def get_compression(name: str) -> CompressionBase:
    """A fresh codec by name: one of :data:`CODEC_NAMES` (``none``, ``fp16``, ``int8``)."""
    try:
        return _CODECS[name]()
    except KeyError:
        raise ValueError(f"unknown compression {name!r}: expected one of {', '.join(CODEC_NAMES)}") from None
