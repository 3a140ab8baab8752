"""Projection of one DiLoCo round of the ``1b`` preset: bytes per peer, all-reduce seconds and GPU utilization.

``python -m benchmarks.projection [--gpu-tflops 100] [--tokens-per-step 16384] [--latency-ms 20] [--outer-s 0]``

Pure arithmetic (no torch, no network, well under a second): what the measurements of ``docs/benchmarks.md`` imply
for a round of the 1.1 B-parameter preset at N = 8, 32, 64 peers on 100 Mbit/s and 1 Gbit/s links, for this
subnet's dense fp16 and sparse codecs, blocking and with overlap, beside two reference systems. Per peer and round:

    compute   = H × 6 · P · tokens_per_step / gpu_flops                       (the GPU's inner steps)
    transfer  = bytes on the link × 8 / link bits per second
    allreduce = transfer + round_trips × latency + codec CPU seconds          (what a blocking round waits for)
    blocking:  wall = compute + allreduce + outer_s
    overlap:   wall = max(compute, transfer + latency + background codec) + foreground codec + outer_s
    utilization = compute / wall

*Butterfly* (this subnet, Subnet 38): a peer sends (N−1)/N of its contribution to the other owners and serves its
1/N share of the averaged segments to the N−1 others, and receives as much (full duplex: the link time is the bytes
sent). *Templar*: every miner uploads its contribution to object storage and, after the upload window, downloads the
N−1 others' (upload and download in sequence: the link time is N contributions).

Constants (values and sources also in the JSON's ``constants``):

- P = 1,100,048,384: ``template/training/model.py`` ``MODEL_PRESETS["1b"]`` at its vocabulary (32,000), counted on
  the meta device like ``benchmarks/bytes_per_round.py`` ``count_params``.
- fp16: 16 bits per value, contribution and averaged (§4: measured bytes = analytic within 0.11 %).
- sparse contribution 0.227 bits per parameter (§4, §6: exact). Its averaged segments hold the union of the N
  supports, each value naming a sender that kept it: ``8N/chunk + u·(index_bits + 16)`` bits
  (``SparseSettings.sum_bits_per_value``: chunk 4096, k 64, 12-bit indices, a byte per chunk and sender; never dense,
  design change 27), with u = 1 − (1 − k/chunk)^N for independent supports (the codec_speed benchmark's formula). It
  reproduces what §6 measured on independent contributions within 1 % (1.713 at N = 4, 3.32 at N = 8, 11.09 at
  N = 32, before the naming's +0.004 / +0.012 / +0.059 bits) and passes dense fp16's 16 bits from N = 54; real
  pseudo-gradients of one model overlap more (§7: 1.43–1.69 at N = 4), so the sparse bytes are upper bounds.
- Codec CPU seconds per round on one core (§6 ``round``, N = 8, 1.1 B values): fp16 encode 0.52, decode own 0.58,
  owner's rule 1.39, decode average 2.02; sparse 3.39, 2.67, 5.24, 2.40. Taken as the same at every N: encoding and
  decoding one's own contribution do not depend on N, the owner's rule decodes N inputs of a 1/N share (≈ one model's
  worth), and the average is decoded once. Encode and decode-own run in the training process before the all-reduce
  starts (``DiLoCoPeer._encode``): *foreground*, never hidden. The owner's rule and decoding the average run in the
  averager process: *background*, hidden behind training with overlap (an assumption: a spare core for it).
- Subnet 38: fp16 butterfly, blocking (this repo's docs do not name its codec; fp16 is assumed), with this subnet's
  fp16 codec seconds. Templar: this subnet's sparse contribution (0.227 bits) and sparse codec
  seconds (its gather decodes N−1 whole contributions — on the GPU in Templar's code — which this does not charge).

Not measured here, hence flags (see ``--help``): the GPU's throughput, the tokens per step, the latency and its
round trips, and the per-round outer step / checkpoint time (``--outer-s``, 0 by default). 6·P FLOPs per token leaves
out attention's (~+17 % at 2048 tokens) and activation checkpointing's recomputation (+⅓): ``--gpu-tflops`` is the
rate of those 6·P FLOPs alone, so it is lower than what the GPU sustains of all its work. Also left out: matchmaking
(the engine starts it during the last inner steps, §3), the accountable protocol's digests and signatures (+0.04 % of
fp16's bytes, §4), and any ceiling of the transport itself (§2b: hivemind's p2p daemon alone moved the 4-peer,
10 M-value fp16 butterfly's 30 MB per peer in 0.30–0.41 s on loopback, 0.6–0.8 Gbit/s with half a core per peer: at
1 Gbit/s the transport may bind, not the link).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from dataclasses import asdict, dataclass
from typing import Any

PARAMS_1B = 1_100_048_384
FP16_BITS = 16.0
SPARSE_CONTRIBUTION_BITS = 0.227
SPARSE_CHUNK, SPARSE_K, SPARSE_INDEX_BITS = 4096, 64, 12
SPARSE_AVERAGED_MEASURED = {4: 1.713, 8: 3.32, 32: 11.09}  # independent contributions (§6), before the naming
CODEC_MEASURED_VALUES = 1.1e9  # §6 scaled its times to 1.1 B values
# (foreground: encode + decode own, background: owner's rule + decode average), seconds per round on one core
CODEC_SECONDS = {"fp16": (0.52 + 0.58, 1.39 + 2.02), "sparse": (3.39 + 2.67, 5.24 + 2.40)}


@dataclass(frozen=True)
class Constant:
    """A number the projection rests on, and the measurement or code it comes from."""

    value: Any
    source: str


CONSTANTS = {
    "params": Constant(PARAMS_1B, "template/training/model.py MODEL_PRESETS['1b'], vocab 32000, meta-device count"),
    "fp16_bits_per_value": Constant(FP16_BITS, "docs/benchmarks.md §4: fp16 bytes = 2(N−1)/N·P·2 within 0.11 %"),
    "sparse_contribution_bits": Constant(SPARSE_CONTRIBUTION_BITS, "docs/benchmarks.md §4 and §6 (exact size)"),
    "sparse_chunk_k_index_bits": Constant([SPARSE_CHUNK, SPARSE_K, SPARSE_INDEX_BITS],
                                          "template/allreduce/sparse_codec.py SparseSettings defaults"),
    "sparse_averaged_bits_measured": Constant(SPARSE_AVERAGED_MEASURED,
                                              "docs/benchmarks.md §6 (N = 4, 8, 32; before design change 27)"),
    "codec_seconds_foreground_background": Constant(
        CODEC_SECONDS, "docs/benchmarks.md §6 'round' at N = 8, one core, 1.1 B values: (encode + decode own, "
                       "owner's rule + decode average); taken as the same at every N"),
}


@dataclass(frozen=True)
class System:
    """One way to average: whose, which codec, whether it can overlap, butterfly or gather-everything."""

    name: str
    codec: str
    overlaps: tuple[bool, ...]
    gather: bool = False  # Templar: upload once, download the N−1 others' (object storage)


SYSTEMS = (System("this subnet", "fp16", (False, True)), System("this subnet", "sparse", (False, True)),
           System("Subnet 38", "fp16", (False,)), System("Templar", "sparse", (False,), gather=True))


# What is not measured in this repo: the flags' defaults, and why each (also in the JSON's ``assumptions``).
ASSUMPTIONS = {
    "gpu_tflops": "sustained model TFLOP/s of one miner's GPU (default 100: ~40 % MFU of a GPU with ~250 dense bf16 "
                  "TFLOP/s, between an RTX 4090 and an A100 by their datasheets; not measured here — the repo has no "
                  "GPU measurement of the 1b step)",
    "tokens_per_step": "tokens per inner step (default 8 × 2048: the repo has no 1b run config; the run flags' "
                       "defaults, 8 × 128, suit the CPU presets)",
    "latency_ms": "round-trip time between peers (default 20)",
    "round_trips": "round trips per all-reduce (default 4: send parts, averaged parts back, commitments, "
                   "confirmation; Templar: upload, listing, download, one spare)",
    "outer_s": "seconds per round that nothing overlaps: outer step, θ hash, checkpoint (default 0; §3 measured 4.9 s "
               "for the 85 M small preset on CPU, mostly the fsync'ed checkpoint)",
}


@dataclass(frozen=True)
class Settings:
    """What a projection is computed for: the grid (N, link, H) and the assumptions (flags)."""

    peers: tuple[int, ...]
    links_mbit: tuple[float, ...]
    inner_steps: tuple[int, ...]
    gpu_tflops: float
    tokens_per_step: int
    latency_ms: float
    round_trips: int
    outer_s: float

    @property
    def step_s(self) -> float:
        """One inner step: 6 FLOPs per parameter and token (forward + backward) at the sustained rate."""
        return 6 * PARAMS_1B * self.tokens_per_step / (self.gpu_tflops * 1e12)


@dataclass(frozen=True)
class Row:
    """One peer's round in one case; seconds are per round, bytes per peer (received: Templar's downloads)."""

    system: str
    codec: str
    peers: int
    link_mbit: float
    inner_steps: int
    overlap: bool
    bytes_sent_per_peer: float
    bytes_received_per_peer: float
    transfer_s: float
    codec_s: float
    latency_s: float
    allreduce_s: float
    compute_s: float
    wall_s: float
    utilization: float


def sparse_averaged_bits(peers: int) -> float:
    """Bits per parameter of the sparse averaged segments of ``peers`` independent contributions (module docstring)."""
    union = 1 - (1 - SPARSE_K / SPARSE_CHUNK) ** peers
    return 8 * peers / SPARSE_CHUNK + union * (SPARSE_INDEX_BITS + 16)


def butterfly_bits(codec: str, peers: int) -> float:
    """Bits per parameter a butterfly peer sends (and receives) per round: (N−1)/N × (contribution + averaged)."""
    if codec == "fp16":
        contribution, averaged = FP16_BITS, FP16_BITS
    else:
        contribution, averaged = SPARSE_CONTRIBUTION_BITS, sparse_averaged_bits(peers)
    return (peers - 1) / peers * (contribution + averaged)


def traffic(system: System, peers: int) -> tuple[float, float, float]:
    """(bytes sent, bytes received, bytes the link carries one after the other) per peer per round."""
    if system.gather:
        contribution = PARAMS_1B * SPARSE_CONTRIBUTION_BITS / 8
        return contribution, (peers - 1) * contribution, peers * contribution
    sent = PARAMS_1B * butterfly_bits(system.codec, peers) / 8
    return sent, sent, sent


def project(system: System, peers: int, link_mbit: float, inner_steps: int, overlap: bool,
            settings: Settings) -> Row:
    """One round of one peer (module docstring's formulas)."""
    sent, received, serial = traffic(system, peers)
    transfer = serial * 8 / (link_mbit * 1e6)
    foreground, background = (s * PARAMS_1B / CODEC_MEASURED_VALUES for s in CODEC_SECONDS[system.codec])
    latency = settings.round_trips * settings.latency_ms / 1000
    allreduce = transfer + latency + foreground + background
    compute = inner_steps * settings.step_s
    if overlap:
        wall = max(compute, transfer + latency + background) + foreground + settings.outer_s
    else:
        wall = compute + allreduce + settings.outer_s
    return Row(system.name, system.codec, peers, link_mbit, inner_steps, overlap, sent, received, transfer,
               foreground + background, latency, allreduce, compute, wall, compute / wall)


def rows(settings: Settings) -> list[Row]:
    return [project(system, peers, link, h, overlap, settings)
            for system in SYSTEMS for overlap in system.overlaps for peers in settings.peers
            for link in settings.links_mbit for h in settings.inner_steps]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.projection", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="8,32,64", help="N values (default 8,32,64)")
    parser.add_argument("--links-mbit", default="100,1000", help="link speeds per direction (default 100,1000)")
    parser.add_argument("--inner-steps", default="100,500", help="H values (default 100,500)")
    for dest, kind, default in (("gpu_tflops", float, 100.0), ("tokens_per_step", int, 8 * 2048),
                                ("latency_ms", float, 20.0), ("round_trips", int, 4), ("outer_s", float, 0.0)):
        parser.add_argument("--" + dest.replace("_", "-"), type=kind, default=default,
                            help=ASSUMPTIONS[dest].replace("%", "%%"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = Settings(peers=tuple(int(n) for n in args.peers.split(",")),
                        links_mbit=tuple(float(b) for b in args.links_mbit.split(",")),
                        inner_steps=tuple(int(h) for h in args.inner_steps.split(",")),
                        gpu_tflops=args.gpu_tflops, tokens_per_step=args.tokens_per_step,
                        latency_ms=args.latency_ms, round_trips=args.round_trips, outer_s=args.outer_s)
    result = dict(
        benchmark="projection",
        machine=dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                     python=platform.python_version(), note="analytic: nothing is measured by this run"),
        settings={**asdict(settings), "step_s": settings.step_s},
        constants={name: asdict(constant) for name, constant in CONSTANTS.items()},
        assumptions=ASSUMPTIONS,
        sparse_averaged_bits={n: sparse_averaged_bits(n) for n in sorted({*settings.peers, *SPARSE_AVERAGED_MEASURED})},
        rows=[asdict(row) for row in rows(settings)],
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
