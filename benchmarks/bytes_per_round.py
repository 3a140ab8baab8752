"""Bytes per round per peer: DiLoCo's one compressed all-reduce vs data-parallel's H gradient all-reduces.

``python -m benchmarks.bytes_per_round [--quick]``

For every codec, N real peers (``template.training.peer`` processes on 127.0.0.1) train a couple of rounds of H
inner steps; each peer's ``RoundReport.bytes_sent`` is what it put on the wire in that round's all-reduce
(its compressed parts to the other owners plus the averaged parts it served back). The codecs' runs are
independent groups (own run id, own DHT swarm) and run at the same time: bytes do not depend on timing.

The baseline is analytic and exact for a bandwidth-optimal (ring or butterfly) all-reduce: synchronous
data-parallel sends 2(N−1)/N × P × 4 bytes (float32 gradients) per peer every step, so H × that per round of H
steps. DiLoCo's analytic value is 2(N−1)/N × P × bytes-per-value of the codec (int8: 1 + 4/256, one float32
scale per block of 256 values); the measured/analytic ratio shows the protocol's own overhead (protobuf framing).
The same analytic numbers are given for the small preset (its parameter count is taken from a meta-device build).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import (
    benchmark_parser,
    butterfly_bytes,
    data_name,
    emit,
    machine_info,
    median,
    parse_benchmark_args,
    run_peers,
)

log = logging.getLogger("benchmarks.bytes_per_round")

BYTES_PER_VALUE = {"none": 4.0, "fp16": 2.0, "int8": 1.0 + 4 / 256}  # dense codecs: the averaged bytes are the same
REFERENCE_H = (50, 100, 500)


def count_params(model: str) -> int:
    from template.training.data import ByteTokenizer
    from template.training.model import build_model, count_parameters

    return count_parameters(build_model(model, ByteTokenizer.vocab_size, 64, device="meta"))


def measure_codec(codec: str, peers: int, peer_args: list[str], timeout_s: float) -> dict[str, Any]:
    """Run one group of real peers with ``codec``; bytes each peer sent in each round. The peers' logs are kept (and
    named in ``logs``) when a round failed, deleted otherwise."""
    out = Path(tempfile.mkdtemp(prefix=f"bench-bytes-{codec}-"))
    run = run_peers(peers, ["--run-id", f"bytes{codec}", "--compression", codec, *peer_args], out, timeout_s,
                    threads=1, name_prefix=f"{codec}-peer")
    rounds = sorted({event["round"] for events in run.rounds.values() for event in events})
    per_round = []
    for r in rounds:
        reports = run.reports(r)
        sent = [rep["bytes_sent"] for rep in reports if rep["allreduce_ok"]]
        per_round.append(dict(round=r, peers_ok=len(sent), bytes_sent_mean=sum(sent) / len(sent) if sent else None,
                              bytes_sent_max=max(sent, default=None), bytes_sent_min=min(sent, default=None),
                              group_size=max((rep["group_size"] for rep in reports), default=0),
                              failures=sorted({rep.get("reason", "") for rep in reports
                                               if not rep["allreduce_ok"]})))
    for row in per_round:  # every peer that took the step must hold the same θ
        hashes = {rep["theta_hash"] for rep in run.reports(row["round"]) if rep["allreduce_ok"]}
        row["theta_identical"] = len(hashes) == 1
    ok_means = [row["bytes_sent_mean"] for row in per_round if row["peers_ok"] == peers]
    if run.finished and len(ok_means) == len(per_round):  # every round ok for every peer: the logs say nothing new
        shutil.rmtree(out, ignore_errors=True)
    params = [event.get("params") for event in run.ready.values()]
    return dict(codec=codec, finished=run.finished, errors=run.errors, seconds=round(run.seconds, 1),
                logs=str(out) if out.exists() else None,
                params=params[0] if params else None, per_round=per_round,
                bytes_per_round_per_peer=median(ok_means) if ok_means else None)


def analytic(params: int, peers: int, h_values: list[int]) -> dict[str, Any]:
    """Bytes per round per peer of DiLoCo (each codec) and of data-parallel over the same H steps."""
    diloco = {codec: butterfly_bytes(params, peers, bpv) for codec, bpv in BYTES_PER_VALUE.items()}
    dp = {f"H{h}": h * butterfly_bytes(params, peers, 4.0) for h in h_values}
    return dict(params=params, peers=peers, diloco_bytes=diloco, dp_float32_bytes=dp,
                dp_over_diloco={f"H{h}": {c: h * butterfly_bytes(params, peers, 4.0) / b for c, b in diloco.items()}
                                for h in h_values})


def sparse_bounds(codec_name: str, params: int, peers: int) -> dict[str, float]:
    """Bits per parameter a butterfly peer sends per round with a sparse codec (default settings): (N−1)/N × (its
    contribution + the averaged segments it serves). The contribution's size is exact; the averaged segments hold the
    union of the N supports: at least one support (every peer chose the same entries), at most N (disjoint)."""
    from template.allreduce.codecs import get_codec, segment_slices

    codec = get_codec(codec_name)
    settings, share = codec.settings, (peers - 1) / peers
    sizes = [s.stop - s.start for s in segment_slices(params, codec.segment_values)]
    contribution = 8 * sum(codec.encoded_size(n) for n in sizes) / params

    def sent(union_density: float) -> float:
        return share * (contribution + settings.sum_bits_per_value(union_density, peers))

    return dict(contribution_bits_per_param=contribution, lower_bits_per_param=sent(settings.density),
                upper_bits_per_param=sent(min(1.0, peers * settings.density)))


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser("bytes_per_round", __doc__, "2 peers, 1 round of 2 steps, 2 codecs (smoke test)")
    parser.add_argument("--peers", type=int, default=None, help="default 4; --quick 2")
    parser.add_argument("--inner-steps", type=int, default=None, help="H (default 50; --quick 2)")
    parser.add_argument("--rounds", type=int, default=None, help="default 2; --quick 1")
    parser.add_argument("--codecs", default=None,
                        help="default none,fp16,int8; --quick none,int8 (each codec is a group of peer processes)")
    parser.add_argument("--timeout", type=float, default=300.0, help="bound of each codec's run, seconds")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_benchmark_args(build_parser(), argv, peers=(4, 2), inner_steps=(50, 2), rounds=(2, 1),
                                codecs=("none,fp16,int8", "none,int8"))
    quick, data, peers, inner_steps, rounds = args.quick, args.data, args.peers, args.inner_steps, args.rounds
    codecs = args.codecs.split(",")
    # bytes depend only on the model's shapes and the codec: short windows and batches keep the runs fast
    peer_args = ["--preset", "tiny", "--data", data, "--seq-len", "32", "--batch-size", "2",
                 "--inner-steps", str(inner_steps), "--rounds", str(rounds), "--heldout-batches", "0",
                 "--matchmaking-time", "4" if quick else "5", "--join-timeout", "60"]
    result: dict[str, Any] = dict(benchmark="bytes_per_round", machine=machine_info(), quick=quick,
                                  settings=dict(data=data_name(data), peers=peers, inner_steps=inner_steps,
                                                rounds=rounds, codecs=codecs, model="tiny"))
    started = time.monotonic()
    with ThreadPoolExecutor(len(codecs)) as pool:
        measured = list(pool.map(lambda c: measure_codec(c, peers, peer_args, args.timeout), codecs))
    params = next((m["params"] for m in measured if m["params"]), None) or count_params("tiny")
    dp_same_h = inner_steps * butterfly_bytes(params, peers, 4.0)
    for m in measured:
        value = m["bytes_per_round_per_peer"]
        m.update(bits_per_param=8 * value / params if value else None, dp_bytes_same_h=dp_same_h,
                 dp_over_diloco=dp_same_h / value if value else None)
        if m["codec"] in BYTES_PER_VALUE:
            expected = butterfly_bytes(params, peers, BYTES_PER_VALUE[m["codec"]])
            m.update(analytic_bytes=expected, measured_over_analytic=value / expected if value else None)
        else:  # sparse: the contribution's size is exact, the averaged segments' depends on how supports overlap
            m.update(sparse_bounds=sparse_bounds(m["codec"], params, peers))
    result["codecs"] = measured
    h_values = sorted({inner_steps, *REFERENCE_H})
    result["analytic"] = dict(tiny=analytic(params, peers, h_values),
                              small=analytic(count_params("small"), peers, h_values))
    result["summary"] = dict(
        dp_over_diloco_same_h={m["codec"]: m["dp_over_diloco"] for m in measured},
        measured_over_analytic={m["codec"]: m.get("measured_over_analytic") for m in measured},
        all_finished=all(m["finished"] for m in measured),
        bits_per_param={m["codec"]: m["bits_per_param"] for m in measured},
        theta_identical_every_round={m["codec"]: all(row["theta_identical"] for row in m["per_round"])
                                     for m in measured},
    )
    result["seconds"] = round(time.monotonic() - started, 1)
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
