"""Codec speed and size: encode + decode of a whole model's pseudo-gradient on ONE CPU core, per segment codec.

``python -m benchmarks.codec_speed [--quick] [--values 1100000000] [--slice 134217728] [--peers 4] [--round-peers 8]``

What it measures, for each codec of ``template.allreduce.codecs`` with its default settings (``torch.set_num_threads
(1)``):

- **Time.** A slice of ``--slice`` float32 values (N(0, 1), seeded) is encoded and decoded segment by segment, as
  the engine does (a sender encodes its contribution; a reducer decodes the contributions of its segments and
  encodes their average; every peer decodes the averaged segments). Times are per value and scaled linearly to
  ``--values`` (default 1.1B, a 1.1B-parameter model): every codec is a loop over fixed-size segments whose cost is
  linear in their number, so the slice only has to hold many segments. The whole 1.1B vector (4.4 GB, plus as much
  again for its decoded copy) is not materialized: with other work sharing this machine's memory the slice is the
  safer measurement, and the JSON says so (``scaled_from``).
- **Bits per parameter.** Of one contribution (exact: ``encoded_size``), and of the averaged segments of N peers
  (``--peers``), measured on N independent contributions: for the dense codecs it equals the contribution; for
  ``sparse`` (a mean over the kept values, its default) it is the attributed sum (a count per chunk and sender,
  index bits and an fp16 value per nonzero of the union of the N supports: what an owner sends); for a mean over
  all values, the smaller of the sparse sum (a u16 count per chunk) and dense fp16.
- **Butterfly traffic per peer and round** (sent; received is the same): (N−1)/N × contribution + (N−1)/N × averaged
  bytes (a peer sends (N−1)/N of its contribution to the other owners and serves its 1/N share of the averaged
  segments to the N−1 others).
- **One round of one peer** at ``--round-peers`` N (default 8): it encodes its contribution and decodes it (the
  engine keeps the decoded vector: the error feedback's residual), reduces its 1/N share of the segments from N
  contributions with the owner's rule (:func:`template.allreduce.reduction.reduce_segment`: decode, norms, the
  float64 mean, ``encode_average``; timed on N independent contributions of a 1/N slice), and decodes every averaged
  segment. Reported per operation and in total, scaled to ``--values``, beside fp16's in the same run.
- **Crossover N** where the sparse sum stops being smaller than dense fp16 (beyond it a mean over the kept values
  costs more than dense fp16 would; one over all values falls back to it): analytic for disjoint supports (the worst
  case, N·k nonzeros per chunk) and for independent uniformly placed supports (1 − (1 − k/chunk)^N of a chunk),
  and measured on independent contributions.

Prints one JSON object; numbers are from one process on a shared machine (see ``machine.load_average_1m``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.common import benchmark_parser, emit, machine_info, parse_benchmark_args
from template.allreduce.codecs import (
    CODEC_NAMES,
    SegmentCodec,
    SparseCodec,
    encode_segments,
    get_codec,
    segment_slices,
)
from template.allreduce.reduction import OwnerRule, SegmentInput, reduce_segment, weight_cap


def timed(repeats: int, function, *args) -> tuple[Any, float]:
    """The result and the fastest of ``repeats`` runs (other work on the machine only ever adds time)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        result = function(*args)
        best = min(best, time.perf_counter() - started)
    return result, best


def decode_all(codec: SegmentCodec, segments: list[bytes], numel: int, average: bool) -> torch.Tensor:
    """The receiver's side: every segment decoded into one flat vector."""
    decode = codec.decode_average if average else codec.decode
    out = torch.empty(numel, dtype=torch.float32)
    for index, data in enumerate(segments):
        start = index * codec.segment_values
        stop = min(start + codec.segment_values, numel)
        out[start:stop] = decode(data, stop - start)
    return out


def contributions(count: int, numel: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=generator) for _ in range(count)]


def decoded_contributions(codec: SegmentCodec, count: int, numel: int, seed: int) -> list[torch.Tensor]:
    """What receivers decode from ``count`` independent N(0, 1) contributions."""
    return [encode_segments(codec, v)[1] for v in contributions(count, numel, seed)]


def averaged_bits(codec: SegmentCodec, decoded: list[torch.Tensor]) -> float:
    """Bits per value of the averaged segments of these peers' decoded contributions, in the form an owner sends
    (a mean over the kept values: the attributed form, naming a sender that kept each value)."""
    mean = torch.stack(decoded).double().mean(dim=0).to(torch.float32)
    if not codec.mean_of_kept:
        segments, _ = encode_segments(codec, mean, average=True)
        return 8 * sum(len(s) for s in segments) / mean.numel()
    total = sum(len(codec.encode_attributed_average(mean[part], [x[part] for x in decoded]))
                for part in segment_slices(mean.numel(), codec.segment_values))
    return 8 * total / mean.numel()


def speed(codec: SegmentCodec, values: torch.Tensor, total: int, peers: int, repeats: int) -> dict[str, Any]:
    """One codec: times of the four operations on ``values``, per value and scaled to ``total`` values. The
    averaged-segment operations run on the decoded contribution (for ``sparse``: k/chunk nonzeros, so its sparse
    form), which costs what a mean of a few contributions costs: one fp16 pass and a nonzero count."""
    numel = values.numel()
    segments, encode_s = timed(repeats, lambda: [codec.encode(values[s : s + codec.segment_values])
                                                 for s in range(0, numel, codec.segment_values)])
    decoded, decode_s = timed(repeats, decode_all, codec, segments, numel, False)
    averaged, encode_average_s = timed(repeats, lambda: [codec.encode_average(decoded[s : s + codec.segment_values])
                                                         for s in range(0, numel, codec.segment_values)])
    _, decode_average_s = timed(repeats, decode_all, codec, averaged, numel, True)
    seconds = dict(encode=encode_s, decode=decode_s, encode_average=encode_average_s, decode_average=decode_average_s)
    contribution_bits = 8 * sum(len(s) for s in segments) / numel
    row: dict[str, Any] = dict(
        codec=codec.name, segment_values=codec.segment_values,
        settings=codec.settings.to_dict() if isinstance(codec, SparseCodec) else None,
        ns_per_value={k: 1e9 * v / numel for k, v in seconds.items()},
        seconds_at_total={k: v * total / numel for k, v in seconds.items()},
        contribution_bits_per_param=contribution_bits,
    )
    row["encode_plus_decode_s_at_total"] = (encode_s + decode_s) * total / numel
    sample = min(numel, 4 * codec.segment_values)  # the averaged size: N independent contributions of a few segments
    row["averaged_bits_per_param"] = averaged_bits(codec, decoded_contributions(codec, peers, sample, seed=1))
    share = (peers - 1) / peers
    row["butterfly_bits_per_param_sent"] = share * (contribution_bits + row["averaged_bits_per_param"])
    row["butterfly_bytes_sent_at_total"] = row["butterfly_bits_per_param_sent"] * total / 8
    return row


def reduce_share(codec: SegmentCodec, numel: int, peers: int, repeats: int) -> float:
    """Seconds an owner spends on the owner's rule for ``numel`` values of ``peers`` independent contributions."""
    encoded = [encode_segments(codec, v)[0] for v in contributions(peers, numel, seed=3)]
    weights = [1.0] * peers
    cap = weight_cap(weights)

    def run() -> None:
        for index in range(len(encoded[0])):
            start = index * codec.segment_values
            inputs = [SegmentInput(s, encoded[s][index], 1.0) for s in range(peers)]
            reduce_segment(inputs, min(codec.segment_values, numel - start), codec, weights, OwnerRule(), cap)

    return timed(repeats, run)[1]


def round_cost(row: dict[str, Any], codec: SegmentCodec, slice_values: int, total: int, peers: int,
               repeats: int) -> dict[str, Any]:
    """One peer's codec work in one round at ``peers`` N, scaled to ``total`` values (module docstring)."""
    share = max(codec.segment_values, slice_values // peers)
    measured = row["seconds_at_total"]
    seconds = dict(encode=measured["encode"], decode_own=measured["decode"],
                   reduce_share=reduce_share(codec, share, peers, repeats) * (total / peers) / share,
                   decode_average=measured["decode_average"])
    return dict(peers=peers, seconds_at_total=seconds, total_s=sum(seconds.values()),
                dominated_by=max(seconds, key=seconds.get))


def crossover(codec: SparseCodec, max_peers: int) -> dict[str, Any]:
    """The smallest N at which the averaged segment is no smaller than dense fp16: where a mean over all values
    falls back to it, and from where the attributed form of a mean over the kept values (the default) costs more."""
    s = codec.settings
    dense = 16.0  # bits per value of dense fp16 (the 1-byte tag is per segment)

    def first(union_density) -> int:
        return next(n for n in range(1, 10_000) if s.sum_bits_per_value(union_density(n), n) >= dense)

    disjoint = first(lambda n: min(1.0, n * s.density))
    independent = first(lambda n: 1 - (1 - s.density) ** n)
    decoded = decoded_contributions(codec, max_peers, codec.segment_values, seed=2)
    measured = {}
    for peers in sorted({2, 4, 8, 16, 32, disjoint - 1, disjoint, independent - 1, independent, max_peers}):
        if 1 <= peers <= max_peers:
            measured[peers] = averaged_bits(codec, decoded[:peers])
    measured_crossover = next((n for n, bits in measured.items() if bits >= dense), None)
    return dict(
        formula=("averaged bits/param = N·8/chunk + u(N)·(index_bits + 16) (a mean over the kept values, attributed; "
                 "over all values: min(16, 16/chunk + u(N)·(index_bits + 16))); u(N) = min(1, N·k/chunk) for "
                 "disjoint supports, 1 − (1 − k/chunk)^N for independent ones"),
        disjoint_supports=disjoint, independent_supports=independent,
        measured_bits_per_param=measured, measured_first_dense=measured_crossover,
        note="real pseudo-gradients of one model share part of their supports, so their crossover is later still",
    )


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("codec_speed", __doc__, "a 2**20-value slice (seconds)")
    parser.add_argument("--values", type=int, default=1_100_000_000, help="model size the times are scaled to")
    parser.add_argument("--slice", type=int, default=None, help="values actually encoded (default 2**27)")
    parser.add_argument("--peers", type=int, default=4, help="N of the averaged-segment size")
    parser.add_argument("--crossover-peers", type=int, default=None, help="most peers tried for the crossover")
    parser.add_argument("--round-peers", type=int, default=8, help="N of the one-round cost (encode, reduce, decode)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each operation; the fastest counts")
    args = parse_benchmark_args(parser, argv, slice=(2**27, 2**21), crossover_peers=(64, 8))
    torch.set_num_threads(1)
    values = contributions(1, args.slice, seed=0)[0]
    started = time.monotonic()
    rows = [speed(get_codec(name), values, args.values, args.peers, args.repeats) for name in CODEC_NAMES]
    for row, name in zip(rows, CODEC_NAMES, strict=True):
        row["round"] = round_cost(row, get_codec(name), args.slice, args.values, args.round_peers, args.repeats)
    fp16 = next(row["round"]["total_s"] for row in rows if row["codec"] == "fp16")
    for row in rows:
        row["round"]["over_fp16"] = row["round"]["total_s"] / fp16
    result: dict[str, Any] = dict(
        benchmark="codec_speed", machine=machine_info(), quick=args.quick,
        settings=dict(values=args.values, slice=args.slice, peers=args.peers, torch_threads=1, repeats=args.repeats,
                      scaled_from=f"{args.slice} values, linearly (segment loop; see the module docstring)"),
        codecs=rows,
        butterfly_formula=("bits sent per peer per round per parameter = (N−1)/N × (contribution + averaged); "
                           "received: the same"),
        sparse_crossover=crossover(get_codec("sparse"), args.crossover_peers),
    )
    result["seconds"] = round(time.monotonic() - started, 1)
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
