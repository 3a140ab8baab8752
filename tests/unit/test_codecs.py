"""Segment codecs (template.allreduce.codecs): error bounds, exact sizes, determinism, non-finite values, hostile
bytes, error feedback and the averaged-segment encoding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from template.allreduce.codecs import (
    CODEC_NAMES,
    FP16_MAX,
    CodecError,
    SparseCodec,
    SparseSettings,
    all_finite,
    encode_segments,
    encode_with_feedback,
    get_codec,
)

SMALL_SPARSE = dict(chunk=64, k=4, bits=2, segment_values=256)  # 4 chunks per segment: fast to fuzz


def small_codecs():
    """One codec of each kind with small segments (what the fuzz tests use)."""
    return [get_codec("none", segment_values=300), get_codec("fp16", segment_values=300),
            get_codec("int8", segment_values=512), get_codec("sparse", **SMALL_SPARSE),
            get_codec("sparse", **{**SMALL_SPARSE, "bits": 3, "quantizer": "uniform"})]


def gaussian(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def stored_scales(data: bytes, count: int) -> torch.Tensor:
    """The float32 scales at the start of an int8 or sparse segment, read independently of the codec."""
    return torch.from_numpy(np.frombuffer(data, dtype="<f4", count=count).astype(np.float64))


# ----------------------------------------------------------------------------------------- round-trip bounds


def test_none_is_bit_exact_including_nan_payloads():
    codec = get_codec("none")
    x = gaussian(1000)
    x[3], x[4], x[5] = math.inf, -math.inf, math.nan
    x.view(torch.int32)[6] = 0x7FC00123  # a NaN with a payload
    data = codec.encode(x)
    assert data == x.numpy().astype("<f4").tobytes()
    assert torch.equal(codec.decode(data, 1000).view(torch.int32), x.view(torch.int32))


def test_fp16_relative_error_clamping_and_infinities():
    codec = get_codec("fp16")
    x = gaussian(4096) * 100
    y = codec.decode(codec.encode(x), 4096)
    assert ((y - x).abs() <= x.abs() * 2.0**-11).all()
    special = torch.tensor([1e6, -1e6, 65519.0, math.inf, -math.inf, math.nan, 0.0, -0.0])
    decoded = codec.decode(codec.encode(special), special.numel())
    assert decoded[:3].tolist() == [FP16_MAX, -FP16_MAX, FP16_MAX]
    assert decoded[3:5].tolist() == [math.inf, -math.inf] and math.isnan(decoded[5])
    assert decoded[6:].tolist() == [0.0, 0.0]


def test_int8_error_is_at_most_half_a_scale_per_block():
    codec = get_codec("int8")
    x = gaussian(1000) * torch.linspace(1e-3, 10, 1000)  # blocks of very different magnitudes, a partial last one
    data = codec.encode(x)
    scales = stored_scales(data, 4)
    padded = torch.nn.functional.pad(x.double(), (0, 24)).view(4, 256)
    absmax = padded.abs().max(dim=1).values
    assert ((scales <= absmax / 127) & (scales >= absmax / 127 * (1 - 2**-22))).all()
    error = torch.nn.functional.pad((codec.decode(data, 1000).double() - x.double()).abs(), (0, 24)).view(4, 256)
    assert (error <= scales[:, None] / 2 * (1 + 2**-20)).all()


def reference_top_k(x: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """Boolean mask of the entries a sparse codec must keep: per chunk the k largest |x|, lower index on ties
    (a stable sort of −|x| keeps tied entries in index order)."""
    n = x.numel()
    rows = torch.nn.functional.pad(x.abs(), (0, -n % chunk), value=-1.0).view(-1, chunk)
    order = torch.sort(-rows, dim=1, stable=True).indices[:, :k]
    return torch.zeros_like(rows, dtype=torch.bool).scatter_(1, order, True).view(-1)[:n]


@pytest.mark.parametrize("quantizer", ["signmag", "uniform"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_sparse_keeps_exactly_the_top_k_within_the_quantization_bound(quantizer, bits):
    settings_ = SparseSettings(chunk=256, k=8, bits=bits, quantizer=quantizer, segment_values=1024)
    codec = SparseCodec(settings_)
    x = gaussian(1000, seed=bits)  # 3 whole chunks and a partial one of 232 values
    x[300:310] = 3.5  # ten tied maxima in chunk 1, k = 8: the eight lower indices win
    data = codec.encode(x)
    y = codec.decode(data, 1000)
    kept = reference_top_k(x, 256, 8)
    assert kept.sum() == 32 and kept[300:308].all() and not kept[308:310].any()
    assert (y[~kept] == 0).all()
    levels = 2 ** (bits - 1)
    scales = stored_scales(data, 4)
    absmax = torch.nn.functional.pad(x.abs().double(), (0, 24)).view(4, 256).max(dim=1).values
    divisor = levels if quantizer == "signmag" else levels - 1
    assert ((scales <= absmax / divisor) & (scales >= absmax / divisor * (1 - 2**-22))).all()
    s = scales.repeat_interleave(256)[:1000][kept]
    error = (y[kept].double() - x[kept].double()).abs()
    if quantizer == "signmag":  # levels ±m·s, m = 1…L: no level at 0, so a value below s/2 is off by s − |x|
        bound = torch.where(x[kept].abs() >= s / 2, s / 2, s - x[kept].abs().double())
    else:
        bound = s / 2
    assert (error <= bound * (1 + 2**-20)).all()
    if quantizer == "signmag":
        assert (torch.sign(y[kept]) == torch.sign(x[kept])).all()


def test_sparse_one_bit_sends_the_sign_at_the_mean_kept_magnitude():
    """At 1 bit a kept value is its sign times its chunk's mean |kept|, the scale that minimizes the squared error
    of a sign code; non-finite chunks still decode non-finite, zero chunks to zero."""
    settings_ = SparseSettings(chunk=256, k=8, bits=1, segment_values=1024)
    codec = SparseCodec(settings_)
    x = gaussian(1000, seed=3)  # 3 whole chunks and a partial one of 232 values
    x[520:540] = 0.0
    x[768:] = 0.0
    x[0] = math.inf
    data = codec.encode(x)
    assert len(data) == 4 * 4 + 32 * 8 // 8 + 32 // 8 == codec.encoded_size(1000)
    y = codec.decode(data, 1000)
    kept = reference_top_k(x, 256, 8)
    assert (y[~kept] == 0).all() and torch.isnan(y[:256][kept[:256]]).all() and (y[768:] == 0).all()
    for row in (1, 2):
        chunk_kept = kept[256 * row:256 * (row + 1)]
        values, decoded = x[256 * row:256 * (row + 1)][chunk_kept], y[256 * row:256 * (row + 1)][chunk_kept]
        mean = float(values.abs().double().mean())
        assert torch.equal(torch.sign(decoded), torch.sign(values)) and math.isclose(float(decoded.abs()[0]), mean,
                                                                                      rel_tol=1e-6)
        assert (decoded.abs() == decoded.abs()[0]).all()
    assert codec.encode(x) == data  # the same values give the same bytes


def test_sparse_last_chunk_shorter_than_k_keeps_all_its_values():
    codec = SparseCodec(SparseSettings(chunk=64, k=16, bits=8, segment_values=256))
    x = gaussian(64 + 10)
    y = codec.decode(codec.encode(x), 74)
    assert (y[64:] != 0).all() and (y[:64] != 0).sum() == 16


def test_sparse_zero_chunk_and_zero_vector_decode_to_zero():
    codec = get_codec("sparse", **SMALL_SPARSE)
    x = gaussian(256)
    x[64:128] = 0
    y = codec.decode(codec.encode(x), 256)
    assert (y[64:128] == 0).all() and (y[:64] != 0).sum() == 4
    assert (codec.decode(codec.encode(torch.zeros(256)), 256) == 0).all()


# --------------------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_encoded_sizes_are_exact(name):
    codec = get_codec(name)
    for numel in (0, 1, 255, 256, 257, 4095, 4096, 4097, 70_001, codec.segment_values):
        assert len(codec.encode(gaussian(numel))) == codec.encoded_size(numel)


def test_size_formulas():
    assert get_codec("none").encoded_size(10) == 40 and get_codec("fp16").encoded_size(10) == 20
    assert get_codec("int8").encoded_size(257) == 2 * 4 + 257
    default = get_codec("sparse")
    # 256 chunks × (4-byte scale + 64 × 12 index bits + 64 × 2 value bits)
    assert default.segment_values == 2**20 and default.encoded_size(2**20) == 256 * (4 + 96 + 16) == 29_696
    assert default.encoded_size(4096 + 10) == 2 * 4 + math.ceil(74 * 12 / 8) + math.ceil(74 * 2 / 8)


def test_default_segment_sizes():
    assert all(get_codec(name).segment_values == 2**17 for name in ("none", "fp16", "int8"))
    for k, bits in ((20, 2), (64, 2), (256, 8)):
        s = SparseSettings(k=k, bits=bits)
        assert s.encoded_size(s.segment_values) >= 16 * 1024 > s.encoded_size(s.segment_values // 2)
        assert 96 / s.encoded_size(s.segment_values) < 0.01  # digest + signature per segment


# ------------------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_same_input_same_bytes_same_bits_on_any_thread_count(name):
    codec = get_codec(name, segment_values=2**18) if name != "sparse" else get_codec(name)
    x = gaussian(2**18 + 5)[: codec.segment_values]
    x[::97] = 0.25  # many exact ties
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (codec.encode(x), codec.encode_average(x))
        torch.set_num_threads(2)
        two = (codec.encode(x), codec.encode_average(x))
    finally:
        torch.set_num_threads(threads)
    assert one == two
    n = x.numel()
    first, second = codec.decode(one[0], n), codec.decode(one[0], n)
    assert torch.equal(first.view(torch.int32), second.view(torch.int32))
    assert torch.equal(codec.decode_average(one[1], n).view(torch.int32),
                       codec.decode_average(one[1], n).view(torch.int32))


# ------------------------------------------------------------------------------------------- non-finite


@given(st.integers(0, 2000), st.integers(0, 1999), st.sampled_from([None, math.nan, -math.nan, math.inf, -math.inf]),
       st.integers(0, 2**31 - 1))
@settings(max_examples=300, deadline=None)
def test_all_finite_is_isfinite_all(n, position, bad, seed):
    x = gaussian(n, seed)
    if bad is not None and n:
        x[position % n] = bad
    assert all_finite(x) == bool(torch.isfinite(x).all())
    assert all_finite(x.to(torch.float16).to(torch.float32)) == bool(torch.isfinite(x.to(torch.float16)).all())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_int8_marks_a_poisoned_block_with_a_nan_scale(bad):
    codec = get_codec("int8")
    x = gaussian(600)
    x[300] = bad
    y = codec.decode(codec.encode(x), 600)
    assert torch.isnan(y[256:512]).all() and torch.isfinite(y[:256]).all() and torch.isfinite(y[512:]).all()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("quantizer", ["signmag", "uniform"])
def test_sparse_chunk_with_a_non_finite_value_decodes_non_finite(bad, quantizer):
    codec = get_codec("sparse", **{**SMALL_SPARSE, "quantizer": quantizer})
    x = gaussian(256) * 1e-3
    x[100] = bad
    y = codec.decode(codec.encode(x), 256)
    assert torch.isnan(y[64:128]).sum() == 4  # every kept entry of chunk 1, the bad one among them
    assert torch.isfinite(y[:64]).all() and torch.isfinite(y[128:]).all()


def test_sparse_average_keeps_non_finite_values():
    codec = get_codec("sparse", **SMALL_SPARSE)
    x = torch.zeros(256)
    x[[3, 70]] = torch.tensor([math.nan, math.inf])
    y = codec.decode_average(codec.encode_average(x), 256)
    others = torch.ones(256, dtype=torch.bool)
    others[[3, 70]] = False
    assert math.isnan(y[3]) and y[70] == math.inf and (y[others] == 0).all()


# ---------------------------------------------------------------------------------------- hostile bytes


def decodes_safely(codec, data: bytes, numel: int, average: bool) -> None:
    """The decoder's contract on any bytes: CodecError, or a float32 tensor of exactly ``numel`` values."""
    try:
        out = (codec.decode_average if average else codec.decode)(data, numel)
    except CodecError:
        return
    assert out.dtype == torch.float32 and out.shape == (numel,)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, 4), data=st.binary(max_size=1200), numel=st.integers(0, 600), average=st.booleans())
def test_decoders_survive_arbitrary_bytes(which, data, numel, average):
    codec = small_codecs()[which]
    decodes_safely(codec, data, min(numel, codec.segment_values), average)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, 4), numel=st.integers(1, 256), seed=st.integers(0, 2**16), sparsity=st.integers(0, 3),
       position=st.integers(0, 2**20), value=st.integers(0, 255), average=st.booleans())
def test_decoders_survive_single_byte_corruptions(which, numel, seed, sparsity, position, value, average):
    codec = small_codecs()[which]
    x = gaussian(numel, seed)
    x[torch.arange(numel) % 4 < sparsity] = 0  # sparse sums get the sparse averaged form
    data = bytearray((codec.encode_average if average else codec.encode)(x))
    if data:
        data[position % len(data)] = value
    decodes_safely(codec, bytes(data), numel, average)


def attributed(codec: SparseCodec, numel: int, senders: int, seed: int) -> tuple[bytes, torch.Tensor, torch.Tensor]:
    """An owner's attributed average of ``senders`` sparse inputs: its bytes, the mean and whom it names per value."""
    kept = [codec.decode(codec.encode(gaussian(numel, seed + s)), numel) for s in range(senders)]
    keepers = torch.full((numel,), -1, dtype=torch.int64)
    for s in reversed(range(senders)):
        keepers[kept[s] != 0] = s
    mean = torch.stack(kept).sum(0) / torch.stack(kept).ne(0).sum(0).clamp_min(1)
    return codec.encode_attributed_average(mean, kept), mean, keepers


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(numel=st.integers(1, 256), seed=st.integers(0, 2**16), senders=st.integers(1, 5),
       position=st.integers(0, 2**20), value=st.integers(0, 255))
def test_the_attributed_average_decoder_survives_single_byte_corruptions(numel, seed, senders, position, value):
    codec = small_codecs()[3]
    data = bytearray(attributed(codec, numel, senders, seed)[0])
    data[position % len(data)] = value
    decodes_safely(codec, bytes(data), numel, True)


def test_an_attributed_average_names_a_sender_that_kept_each_value_and_refuses_anything_else():
    """The form a mean over the kept values travels in (template.allreduce.verification): each nonzero listed under
    one sender; the same values and names come back, and a nonzero named for nobody (encoding), a count above k, a
    value listed under two senders, an explicit zero or trailing bytes (decoding) are refused."""
    codec = get_codec("sparse", chunk=64, k=4, bits=2, segment_values=256)
    data, mean, keepers = attributed(codec, 250, 3, seed=7)
    decoded = codec.decode_attributed_average(data, 250)
    values, names = decoded.values, decoded.keepers_per_value()
    assert decoded.groups == 3 == codec.attributed_groups(data) and torch.equal(values, mean.half().float())
    assert torch.equal(names[values != 0], keepers[values != 0]) and bool((names[values == 0] == -1).all())
    assert sorted(decoded.named(1).tolist()) == torch.nonzero(names == 1).reshape(-1).tolist()
    assert torch.equal(codec.decode_average(data, 250), values) and len(data) <= codec.max_average_size(250)
    assert codec.decode_attributed_average(codec.encode_average(mean), 250) is None  # the plain form: no names
    assert codec.attributed_groups(codec.encode_average(mean)) is None
    first = int(torch.nonzero(names == 0)[0])
    kept = [names == s for s in range(3)]
    with pytest.raises(ValueError, match="no averaged sender kept"):
        codec.encode_attributed_average(mean, [kept[0] & (torch.arange(250) != first), *kept[1:]])
    with pytest.raises(ValueError, match="no averaged sender kept"):
        codec.encode_attributed_average(mean, kept[:2])
    over = bytearray(data)
    over[3] = 5  # chunk 0, sender 0: 5 values of a chunk, k = 4
    with pytest.raises(CodecError, match="more than k"):
        codec.decode_attributed_average(bytes(over), 250)
    one = np.array([1.0, 1.0], dtype="<f2").tobytes()
    twice = bytes([2]) + (2).to_bytes(2, "little") + bytes([1, 1]) + bytes([5 | (5 << 6) & 0xFF, 5 >> 2]) + one
    with pytest.raises(CodecError, match="two senders"):  # value 5 of a 64-value segment, listed under both
        codec.decode_attributed_average(twice, 64)
    apart = twice[:5] + bytes([5 | (6 << 6) & 0xFF, 6 >> 2]) + one  # values 5 and 6: one each
    assert codec.decode_attributed_average(apart, 64).keepers_per_value()[5:7].tolist() == [0, 1]
    zero = bytearray(data)
    zero[-2:] = b"\0\0"
    with pytest.raises(CodecError, match="explicit zero"):
        codec.decode_attributed_average(bytes(zero), 250)
    with pytest.raises(CodecError):
        codec.decode_attributed_average(data + b"\0", 250)


@pytest.mark.parametrize("codec", small_codecs(), ids=lambda c: f"{c.name}-{c.segment_values}")
def test_decoders_refuse_bad_requests(codec):
    data = codec.encode(gaussian(10))
    for numel in (-1, codec.segment_values + 1, 10.0, True, None):
        with pytest.raises(CodecError):
            codec.decode(data, numel)
    with pytest.raises(CodecError):
        codec.decode("text", 10)
    with pytest.raises(CodecError):
        codec.decode(data + b"\0", 10)
    assert torch.equal(codec.decode(memoryview(data), 10), codec.decode(data, 10))


def test_sparse_decoder_refuses_non_canonical_structure():
    codec = get_codec("sparse", chunk=64, k=2, bits=8, segment_values=256)
    good = codec.encode(gaussian(64))  # 4-byte scale | 2 × 6 index bits (2 bytes) | 2 value bytes
    indices = int.from_bytes(good[4:6], "little")
    first, second = indices & 63, indices >> 6
    swapped = bytearray(good)
    swapped[4:6] = (second | first << 6).to_bytes(2, "little")
    repeated = bytearray(good)
    repeated[4:6] = (first | first << 6).to_bytes(2, "little")
    padded = bytearray(good)
    padded[5] |= 0x80
    negative = bytearray(good)
    negative[3] |= 0x80
    for bad in (swapped, repeated, padded, negative):
        with pytest.raises(CodecError):
            codec.decode(bytes(bad), 64)
    uniform = get_codec("sparse", chunk=64, k=1, bits=2, quantizer="uniform", segment_values=256)
    unused_code = bytearray(uniform.encode(gaussian(64)))
    unused_code[-1] |= 0b11
    with pytest.raises(CodecError):
        uniform.decode(bytes(unused_code), 64)


def test_encoders_refuse_other_tensors():
    codec = get_codec("fp16", segment_values=8)
    for bad in (torch.zeros(9), torch.zeros(2, 2), torch.zeros(4, dtype=torch.float64), [0.0, 1.0]):
        with pytest.raises(CodecError):
            codec.encode(bad)


# ------------------------------------------------------------------------------------ averaged segments


def test_average_encoding_picks_the_smaller_form():
    settings_ = SparseSettings(chunk=4096, k=64, bits=2, segment_values=2**16)
    codec = SparseCodec(settings_)
    dense_size = 1 + 2 * 2**16
    for peers in (1, 4, 64):
        total = sum(codec.decode(codec.encode(gaussian(2**16, seed)), 2**16) for seed in range(peers)) / peers
        data = codec.encode_average(total)
        half = total.to(torch.float16)
        nonzeros = int((half != 0).sum())
        sparse_size = 1 + 2 * 16 + math.ceil(nonzeros * 12 / 8) + 2 * nonzeros
        assert len(data) == min(sparse_size, dense_size)
        assert data[0] == (1 if sparse_size < dense_size else 0)
        assert torch.equal(codec.decode_average(data, 2**16), half.float())
    assert data[0] == 0  # 64 peers × 64 of 4096: dense fp16 is smaller
    with pytest.raises(CodecError):  # the dense form of a vector whose sparse form is smaller is not canonical
        codec.decode_average(b"\0" + torch.zeros(2**16, dtype=torch.float16).numpy().tobytes(), 2**16)


def test_dense_codecs_average_like_they_encode():
    x = gaussian(3000)
    for name in ("none", "fp16", "int8"):
        codec = get_codec(name)
        assert codec.encode_average(x) == codec.encode(x) and codec.max_average_size(3000) == codec.encoded_size(3000)
    sparse = get_codec("sparse")
    # the bound covers the dense form (6001 bytes) and an attributed one naming 256 senders for all 3000 values
    assert len(sparse.encode_average(x)) <= sparse.max_average_size(3000) == 3 + 256 + 4500 + 6000


# -------------------------------------------------------------------------------------- error feedback


def feedback_error(codec, rounds: int) -> list[float]:
    """Send the same vector ``rounds`` times; the relative error of the running mean of what was received."""
    x = gaussian(2048, seed=7)
    received, residual, errors = torch.zeros(2048, dtype=torch.float64), None, []
    for r in range(1, rounds + 1):
        _, decoded, residual = encode_with_feedback(codec, x, residual)
        received += decoded
        if codec.error_feedback:  # nothing is lost: what was sent plus what is kept is exactly what was given
            assert torch.allclose(received + residual, r * x.double(), atol=1e-4 * r)
        errors.append(float((received / r - x).norm() / x.norm()))
    return errors


def test_error_feedback_makes_the_received_sum_converge_to_the_sent_sum():
    keep_all = dict(chunk=64, k=2, bits=2, segment_values=512, feedback_decay=1.0)
    with_feedback = feedback_error(get_codec("sparse", **keep_all), 400)
    without = feedback_error(get_codec("sparse", chunk=64, k=2, bits=2, segment_values=512, error_feedback=False), 400)
    assert with_feedback[-1] < 0.05 and with_feedback[-1] < with_feedback[49] / 4
    assert without[-1] > 0.8  # 3 % of the entries, 2 bits: without the residual most of x is never sent


def test_feedback_decay_fades_what_waited_and_bounds_the_residual():
    """e ← β·e + Δ: the residual counts β× in the next target, and under a constant Δ it stays below ‖Δ‖/(1−β)
    where β = 1 lets it grow with every round that does not send it."""
    x = gaussian(2048, seed=7)
    codec = get_codec("sparse", chunk=64, k=2, bits=2, segment_values=512, feedback_decay=0.5)
    residual = gaussian(2048, seed=8)
    _, decoded, new_residual = encode_with_feedback(codec, x, residual)
    assert torch.equal(new_residual, (x + 0.5 * residual) - decoded)
    norms = {}
    for decay in (0.5, 0.95, 1.0):
        codec = get_codec("sparse", chunk=64, k=2, bits=2, segment_values=512, feedback_decay=decay)
        residual = None
        for _ in range(200):
            _, _, residual = encode_with_feedback(codec, x, residual)
        norms[decay] = float(residual.norm() / x.norm())
    assert norms[0.5] < 2.0 and norms[0.95] < 20.0 and norms[1.0] > norms[0.95] > norms[0.5]


def test_encode_with_feedback_cuts_segments_like_the_engine():
    codec = get_codec("sparse", **SMALL_SPARSE)
    x, residual = gaussian(1000), gaussian(1000, seed=1) * 0.1
    segments, decoded, new_residual = encode_with_feedback(codec, x, residual)
    assert [len(s) for s in segments] == [codec.encoded_size(256)] * 3 + [codec.encoded_size(232)]
    expected = torch.cat([codec.decode(s, n) for s, n in zip(segments, (256, 256, 256, 232), strict=True)])
    assert torch.equal(decoded, expected) and torch.equal(new_residual, (x + codec.feedback_decay * residual) - decoded)
    dense = get_codec("fp16", segment_values=300)
    segments, decoded, none = encode_with_feedback(dense, x, None)
    assert none is None and len(segments) == 4 and torch.equal(decoded, x.half().float())
    with pytest.raises(CodecError):
        encode_with_feedback(dense, x, residual)
    with pytest.raises(CodecError):
        encode_with_feedback(codec, x, residual[:10])
    assert encode_segments(codec, x, average=True)[0][0] == codec.encode_average(x[:256])


# ------------------------------------------------------------------------------------------- settings


def test_settings_validate_and_serialize():
    s = SparseSettings(chunk=1024, k=16, bits=4)
    assert SparseSettings.from_dict(s.to_dict()) == s and hash(s) == hash(SparseSettings.from_dict(s.to_dict()))
    assert get_codec("sparse", **s.to_dict()).settings == s
    for bad in (dict(chunk=1), dict(chunk=1 << 16), dict(k=0), dict(k=5000), dict(bits=0), dict(bits=9),
                dict(bits=1, quantizer="uniform"),
                dict(quantizer="log"), dict(segment_values=4097), dict(error_feedback=1), dict(k=2.0),
                dict(feedback_decay=0.0), dict(feedback_decay=1.5), dict(feedback_decay=True), dict(mean_of="median")):
        with pytest.raises(ValueError):
            SparseSettings(**bad)
    with pytest.raises(ValueError):
        SparseSettings.from_dict(dict(chunk=64, extra=1))


def test_get_codec_names_and_settings():
    assert [get_codec(name).name for name in CODEC_NAMES] == list(CODEC_NAMES)
    assert [get_codec(name).error_feedback for name in CODEC_NAMES] == [False, False, False, True]
    with pytest.raises(ValueError, match="none, fp16, int8, sparse"):
        get_codec("int4")
    with pytest.raises(ValueError):
        get_codec("fp16", chunk=64)
    with pytest.raises(ValueError):
        get_codec("int8", segment_values=1000)  # not a multiple of the 256-value block
