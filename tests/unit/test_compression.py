"""Codecs of template.training.compression: error bounds, non-finite values, sizes, and hostile input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError
from hivemind.compression import CompressionInfo
from hivemind.proto import runtime_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from template.training.compression import (
    CODEC_NAMES,
    BlockInt8Compression,
    CodecError,
    get_compression,
)

INT8_BLOCK = BlockInt8Compression().block_size


def roundtrip(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, runtime_pb2.Tensor]:
    codec = get_compression(name)
    message = codec.compress(tensor, CompressionInfo.from_tensor(tensor))
    # what travels is the protobuf's bytes: decode from a re-parsed message, as a peer would
    return codec.extract(runtime_pb2.Tensor.FromString(message.SerializeToString())), message


def int8_scales(tensor: torch.Tensor) -> torch.Tensor:
    """absmax / 127 per block (with the codec's floor), recomputed independently of the codec."""
    flat = tensor.reshape(-1).to(torch.float64)
    pad = (-flat.numel()) % INT8_BLOCK
    absmax = torch.nn.functional.pad(flat, (0, pad)).view(-1, INT8_BLOCK).abs().amax(dim=1)
    return torch.where(absmax > 0, (absmax / 127).clamp_min(torch.finfo(torch.float32).tiny), 0.0)


def assert_int8_error_bound(original: torch.Tensor, decoded: torch.Tensor) -> None:
    scales = int8_scales(original)
    error = (decoded.reshape(-1).double() - original.reshape(-1).double()).abs()
    per_value_bound = scales.repeat_interleave(INT8_BLOCK)[: error.numel()] / 2
    # s/2 exactly in real arithmetic; float32 rounding of x/s and q*s adds a few ulps of s
    assert bool((error <= per_value_bound * (1 + 1e-5) + 1e-45).all()), float((error - per_value_bound).max())


DATASETS = {
    "uniform": lambda g: torch.rand(50_000, generator=g) * 2 - 1,
    "unit_normal": lambda g: torch.randn(50_000, generator=g),
    # heavy tails with one large outlier per block: the case that hurts per-block scaling most
    "skewed": lambda g: (
        torch.distributions.LogNormal(0.0, 3.0).sample((50_000,)).float() * torch.sign(torch.randn(50_000, generator=g))
    ),
    "tiny_values": lambda g: torch.randn(50_000, generator=g) * 1e-7,
}


@pytest.mark.parametrize("dataset", sorted(DATASETS))
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_roundtrip_error_bounds(name: str, dataset: str):
    torch.manual_seed(0)
    original = DATASETS[dataset](torch.Generator().manual_seed(1))
    decoded, _ = roundtrip(name, original)
    assert decoded.dtype == original.dtype and decoded.shape == original.shape
    if name == "none":
        assert torch.equal(decoded, original)
    elif name == "fp16":
        expected = original.clamp(-65504, 65504).to(torch.float16).to(torch.float32)
        assert torch.equal(decoded, expected)
        in_range = original.abs() <= 65504
        # half of fp16's relative precision for normal values; subnormals: half of the smallest step
        bound = torch.maximum(original.abs() * 2.0**-11, torch.full_like(original, 2.0**-25))
        assert bool(((decoded - original).abs()[in_range] <= bound[in_range]).all())
    else:
        assert_int8_error_bound(original, decoded)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_zeros_are_exact(name: str):
    original = torch.zeros(3 * INT8_BLOCK + 5)
    decoded, _ = roundtrip(name, original)
    assert torch.equal(decoded, original)


def test_int8_extreme_magnitudes_stay_finite_and_bounded():
    largest = torch.finfo(torch.float32).max
    original = torch.tensor([largest, -largest, 1.0, 1e-45, 1e-40, -1e-38, 0.0])
    blocks = [original[:3], original[3:]]  # one block at float32's limit, one of subnormals (separately)
    for block in blocks:
        decoded, _ = roundtrip("int8", block)
        assert bool(torch.isfinite(decoded).all())
        assert_int8_error_bound(block, decoded)


@pytest.mark.parametrize("name", ["none", "fp16"])
def test_lossless_and_fp16_keep_non_finite_values(name: str):
    original = torch.randn(1000)
    original[[3, 500]] = float("nan")
    original[7], original[999] = float("inf"), float("-inf")
    decoded, _ = roundtrip(name, original)
    assert torch.equal(torch.isnan(decoded), torch.isnan(original))
    assert decoded[7] == float("inf") and decoded[999] == float("-inf")


def test_fp16_clamps_large_finite_values_but_not_inf():
    decoded, _ = roundtrip("fp16", torch.tensor([1e6, -1e6, float("inf")]))
    assert decoded.tolist() == [65504.0, -65504.0, float("inf")]


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), float("-inf")])
def test_int8_poisons_the_whole_block_of_a_non_finite_value(bad_value: float):
    original = torch.randn(4 * INT8_BLOCK + 10)
    bad_index = 2 * INT8_BLOCK + 17
    original[bad_index] = bad_value
    decoded, _ = roundtrip("int8", original)
    poisoned = slice(2 * INT8_BLOCK, 3 * INT8_BLOCK)
    assert bool(torch.isnan(decoded[poisoned]).all()), "a non-finite value must stay visible to the receiver"
    healthy = torch.ones_like(original, dtype=torch.bool)
    healthy[poisoned] = False
    assert bool(torch.isfinite(decoded[healthy]).all())
    clean = original.clone()
    clean[poisoned] = 0
    assert_int8_error_bound(clean[healthy], decoded[healthy])


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(), (0,), (1,), (3, 5, 7), (INT8_BLOCK + 1,), (2, 0, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_dtype_and_shape_preserved(name: str, dtype: torch.dtype, shape: tuple[int, ...]):
    original = torch.randn(shape).to(dtype)
    decoded, _ = roundtrip(name, original)
    assert decoded.dtype == dtype and decoded.shape == original.shape
    if name == "none":
        assert torch.equal(decoded, original)


@pytest.mark.parametrize("name", ["none", "int8", "fp16"])
def test_rejects_integer_tensors(name: str):
    with pytest.raises(CodecError):
        get_compression(name).compress(torch.arange(10), CompressionInfo.from_tensor(torch.arange(10)))


def test_int8_size_is_a_quarter_of_fp32_plus_scales():
    original = torch.randn(1_000_000)
    _, message = roundtrip("int8", original)
    blocks = math.ceil(original.numel() / INT8_BLOCK)
    assert len(message.buffer) == 16 + 4 * blocks + original.numel()
    ratio = len(message.buffer) / (4 * original.numel())
    assert 0.25 < ratio < 0.26
    # hivemind sizes all-reduce parts with this estimate: it must match what is actually sent
    estimate = get_compression("int8").estimate_compression_ratio(CompressionInfo.from_tensor(original))
    assert estimate == pytest.approx(ratio, rel=1e-3)


def test_get_compression_names_and_unknown_name():
    assert set(CODEC_NAMES) == {"none", "fp16", "int8"}
    for name in CODEC_NAMES:
        assert get_compression(name).name == name
    with pytest.raises(ValueError, match="unknown compression 'zstd'.*none, fp16, int8"):
        get_compression("zstd")


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decoder_refuses_a_huge_claimed_shape_without_allocating(name: str):
    codec = get_compression(name)
    message = codec.compress(torch.randn(10), CompressionInfo.from_tensor(torch.randn(10)))
    del message.size[:]
    message.size.extend([2**31, 2**31])
    with pytest.raises(CodecError):
        codec.extract(message)


def test_int8_decoder_refuses_another_codecs_message():
    message = get_compression("fp16").compress(torch.randn(10), CompressionInfo.from_tensor(torch.randn(10)))
    with pytest.raises(CodecError, match="codec mismatch"):
        get_compression("int8").extract(message)
    message.compression = runtime_pb2.CompressionType.BLOCKWISE_8BIT
    with pytest.raises(CodecError):
        get_compression("int8").extract(message)


def check_decoder_on(name: str, message: runtime_pb2.Tensor) -> None:
    """The decoder either raises CodecError or returns a tensor no larger than 4x the received bytes."""
    try:
        decoded = get_compression(name).extract(message)
    except CodecError:
        return
    assert decoded.numel() == math.prod(message.size)
    assert decoded.numel() * decoded.element_size() <= 4 * len(message.buffer) + 64


COMPRESSION_TYPES = list(runtime_pb2.CompressionType.values())
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(
    name=st.sampled_from(CODEC_NAMES),
    buffer=st.binary(max_size=2048),
    size=st.lists(st.integers(0, 2**32 - 1), max_size=5) | st.lists(st.integers(0, 64), max_size=3),
    dtype=st.sampled_from(["float32", "float16", "bfloat16", "float64", "int64", "object", "", "garbage", "V8"]),
    compression=st.sampled_from(COMPRESSION_TYPES),
)
def test_fuzz_decoder_with_arbitrary_fields(name, buffer, size, dtype, compression):
    check_decoder_on(name, runtime_pb2.Tensor(buffer=buffer, size=size, dtype=dtype, compression=compression))


@FUZZ
@given(name=st.sampled_from(CODEC_NAMES), data=st.binary(max_size=4096))
def test_fuzz_decoder_with_arbitrary_bytes(name, data):
    try:
        message = runtime_pb2.Tensor.FromString(data)
    except DecodeError:
        return  # protobuf refuses it cleanly before our decoder is involved
    check_decoder_on(name, message)


@FUZZ
@given(
    name=st.sampled_from(CODEC_NAMES),
    length=st.integers(0, 3 * INT8_BLOCK),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
    truncate=st.integers(0, 64),
)
def test_fuzz_decoder_with_corrupted_valid_messages(name, length, flips, truncate):
    codec = get_compression(name)
    tensor = torch.randn(length)
    message = codec.compress(tensor, CompressionInfo.from_tensor(tensor))
    buffer = bytearray(message.buffer)
    for position, value in flips:
        if buffer:
            buffer[position % len(buffer)] = value
    message.buffer = bytes(buffer[: max(len(buffer) - truncate, 0)])
    check_decoder_on(name, message)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(
        st.floats(width=32, allow_nan=False, allow_infinity=False) | st.sampled_from([0.0, -0.0, 1e-40, -3e38]),
        max_size=3 * INT8_BLOCK,
    )
)
def test_fuzz_int8_error_bound_on_arbitrary_finite_values(values):
    original = torch.tensor(np.asarray(values, dtype=np.float32))
    decoded, _ = roundtrip("int8", original)
    assert bool(torch.isfinite(decoded).all())
    assert_int8_error_bound(original, decoded)
