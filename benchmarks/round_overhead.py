"""Round overhead: wall time a DiLoCo round loses to the all-reduce, the outer step and bookkeeping.

``python -m benchmarks.round_overhead [--quick] [--skip-small] [--link-mbit M --link-latency-ms L] [--overlap both]``

Real peers (``template.training.peer`` processes on 127.0.0.1, started like ``python -m template.training.run``)
train a few rounds; from every peer's ``RoundReport`` of every round after the first (round 0 has no step-time
estimate to start matchmaking ahead, and pays one-time costs):

    overhead = round_s − inner_s            (all-reduce incl. waiting for the group, outer step, checkpoint, ...)
    overhead_steps = overhead / t_step      (t_step = inner_s / inner_steps of the same peer and round)
    utilization(H) = H·t_step / (H·t_step + overhead)        for H = 100 and 500
    wall_utilization = inner_s / round_s                      (the round as it ran: inner compute over wall time)

``--link-mbit M [--link-latency-ms L]`` puts every peer of the tiny run behind a simulated access link of M Mbit/s
per direction (:mod:`template.p2p.simulated_link`, a loopback test knob): ``allreduce_over_compute`` then says how
much of a round's compute the all-reduce takes on that link, and ``wall_utilization`` what the blocking engine
keeps of the compute. ``--overlap both`` runs the tiny peers twice in the same run, blocking and then overlapped (round
r's all-reduce runs while round r+1 trains: ``wall_utilization`` should approach 1; ``allreduce_s`` is then the
all-reduce's own duration, most of it hidden behind training, ``allreduce_wait_s`` what training still waited for it
and ``paced_s`` how long a peer waited after a round's training for that round's group to form).

The baseline measured in the same run is the step time itself: ``t_step`` as the peers saw it (N peers share
the cores, so it is slower than alone), and ``t_step_solo`` of one process training alone with the same torch
thread count, measured just before the peers start. Held-out evaluation is off (``--heldout-batches 0``): it is
optional work, not overhead of the protocol. The tiny preset runs with 4 peers (goal: overhead ≤ 5 inner steps);
the small preset (~86M parameters with the byte vocabulary) with 2 peers, batch 1, seq 64, if not skipped.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    benchmark_parser,
    data_name,
    emit,
    machine_info,
    median,
    parse_benchmark_args,
    run_peers,
)
from template.p2p.simulated_link import LinkSpec

log = logging.getLogger("benchmarks.round_overhead")

OVERHEAD_GOAL_STEPS = 5.0  # tiny preset, 4 peers
OVERLAP_UTILIZATION_GOAL = 0.95  # inner compute / wall with overlap, when the all-reduce is 50–80 % of the compute
UTILIZATION_H = (100, 500)
# Resident memory of one peer process tree (peer + averager), measured: small ≈ 3.9 GB peer + 2.2 GB averager.
MEMORY_PER_PEER_GB = {"tiny": 0.8, "small": 6.5}


@dataclass(frozen=True)
class Config:
    model: str
    peers: int
    seq_len: int
    batch_size: int
    inner_steps: int
    rounds: int
    compression: str
    matchmaking_time: float
    threads: int
    link_mbit: float | None = None  # every peer behind a simulated access link (template.p2p.simulated_link)
    link_latency_ms: float = 0.0
    overlap: bool = False  # round r's all-reduce runs while round r+1 trains (template.training.diloco)


def solo_step_time(config: Config, data: str, steps: int) -> float:
    """Seconds per inner step of one process training alone (same model, batch, threads): the baseline."""
    from template.training.data import ByteTokenizer, DataAssignment, build_corpus
    from template.training.inner import InnerConfig, InnerTrainer
    from template.training.model import build_model

    previous = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        corpus = build_corpus(data, ByteTokenizer(), config.seq_len)
        assignment = DataAssignment(corpus.fingerprint, corpus.num_windows, 0)
        windows = assignment.assigned_windows("solo", 0, (steps + 2) * config.batch_size)
        batches = list(corpus.batches(windows, config.batch_size))
        model = build_model(config.model, ByteTokenizer.vocab_size, config.seq_len)
        trainer = InnerTrainer(model, InnerConfig(), "cpu")
        trainer.train(batches[:2], 2)  # warm-up: allocator, AdamW state
        stats = trainer.train(batches[2:], steps)
        return stats.seconds / stats.steps
    finally:
        torch.set_num_threads(previous)


def available_memory_gb() -> float | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return None


def utilization(t_step: float, overhead_s: float) -> dict[str, float]:
    return {f"H{h}": h * t_step / (h * t_step + overhead_s) for h in UTILIZATION_H}


def measure(config: Config, data: str, timeout_s: float, solo_steps: int) -> dict[str, Any]:
    """Run the peers, turn their round reports into overhead numbers."""
    t_solo = solo_step_time(config, data, solo_steps)
    log.info("%s: solo step %.3fs; starting %d peers", config.model, t_solo, config.peers)
    args = ["--run-id", f"overhead{config.model}", "--preset", config.model, "--data", data,
            "--seq-len", str(config.seq_len), "--batch-size", str(config.batch_size),
            "--inner-steps", str(config.inner_steps), "--rounds", str(config.rounds),
            "--compression", config.compression, "--matchmaking-time", str(config.matchmaking_time),
            "--heldout-batches", "0", "--join-timeout", "60", "--overlap" if config.overlap else "--no-overlap"]
    # Fresh peers build the same θ_0 from the seed; a short join timeout keeps the followers from downloading the
    # first peer's state at start (minutes for the small preset), which is start-up cost, not round overhead.
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as out:
        link = LinkSpec(config.link_mbit, config.link_latency_ms) if config.link_mbit is not None else None
        run = run_peers(config.peers, args, Path(out), timeout_s, threads=config.threads,
                        follower_args=["--join-timeout", "3"] if config.model != "tiny" else [], link=link)
    result: dict[str, Any] = dict(asdict(config), finished=run.finished, errors=run.errors,
                                  seconds=round(run.seconds, 1), t_step_solo_s=t_solo, log_tails=run.log_tails)
    if run.link_stats is not None:
        result["link_bytes_sent"], result["link_connections"] = run.link_stats.sent, run.link_stats.connections
        result["link_unnamed_dialers"] = run.link_stats.unnamed
    params = [event.get("params") for event in run.ready.values()]
    result["params"] = params[0] if params else None
    samples, per_round = [], []
    for r in range(1, config.rounds):  # round 0 pays one-time costs (see the module docstring)
        reports = [rep for rep in run.reports(r) if rep["inner_steps"] > 0]
        if not reports:
            continue
        rows = [dict(overhead_s=rep["round_s"] - rep["inner_s"], allreduce_s=rep["allreduce_s"],
                     allreduce_wait_s=rep["allreduce_wait_s"], paced_s=rep["paced_s"],
                     wall_utilization=rep["inner_s"] / rep["round_s"], inner_s=rep["inner_s"],
                     t_step_s=rep["inner_s"] / rep["inner_steps"], ok=rep["allreduce_ok"], reason=rep["reason"])
                for rep in reports]
        samples.extend(rows)
        per_round.append(dict(round=r, peers=len(rows), ok=sum(row["ok"] for row in rows),
                              overhead_s=median([row["overhead_s"] for row in rows]),
                              allreduce_s=median([row["allreduce_s"] for row in rows]),
                              t_step_s=median([row["t_step_s"] for row in rows])))
    result["per_round"] = per_round
    result["failed_allreduces"] = sum(not row["ok"] for row in samples)
    result["failure_reasons"] = sorted({row["reason"] for row in samples if not row["ok"]})
    if not samples:
        return result
    overhead = median([row["overhead_s"] for row in samples])
    t_step = median([row["t_step_s"] for row in samples])
    allreduce = median([row["allreduce_s"] for row in samples])
    inner = median([row["inner_s"] for row in samples])
    result.update(
        samples=len(samples), t_step_s=t_step, overhead_s=overhead,
        overhead_s_max=max(row["overhead_s"] for row in samples), allreduce_s=allreduce,
        allreduce_wait_s=median([row["allreduce_wait_s"] for row in samples]),
        paced_s=median([row["paced_s"] for row in samples]),
        outer_step_and_bookkeeping_s=median([row["overhead_s"] - row["allreduce_wait_s"] - row["paced_s"]
                                             for row in samples]),
        overhead_steps=overhead / t_step, overhead_steps_vs_solo=overhead / t_solo,
        utilization=utilization(t_step, overhead), utilization_vs_solo=utilization(t_solo, overhead),
        inner_s=inner, allreduce_over_compute=allreduce / inner,
        wall_utilization=median([row["wall_utilization"] for row in samples]),
    )
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser("round_overhead", __doc__, "2 tiny peers, 2 short rounds (smoke test)")
    parser.add_argument("--peers", type=int, default=None, help="tiny-preset peers (default 4; --quick 2)")
    parser.add_argument("--inner-steps", type=int, default=None, help="H of the tiny run (default 20; --quick 3)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the tiny run (default 5; --quick 2)")
    parser.add_argument("--compression", default="fp16", help="all-reduce codec (the engine's default)")
    parser.add_argument("--matchmaking-time", type=float, default=None, help="default 5 (the engine's); --quick 2")
    parser.add_argument("--skip-small", action="store_true", help="do not run the small preset")
    parser.add_argument("--timeout", type=float, default=300.0, help="bound of each peer run, seconds")
    parser.add_argument("--link-mbit", type=float, default=None,
                        help="put every tiny-run peer behind a simulated access link of this many Mbit/s per "
                             "direction (a loopback test knob: template/p2p/simulated_link.py)")
    parser.add_argument("--link-latency-ms", type=float, default=0.0, help="one-way delay of the simulated link")
    parser.add_argument("--overlap", choices=("off", "on", "both"), default="off",
                        help="the tiny run blocking (off), overlapped (on: round r's all-reduce runs while round r+1 "
                             "trains), or both in this run, blocking first")
    return parser


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_benchmark_args(parser, argv, peers=(4, 2), inner_steps=(20, 3), rounds=(5, 2),
                                matchmaking_time=(5.0, 2.0))
    if args.link_mbit is not None:
        try:
            LinkSpec(args.link_mbit, args.link_latency_ms)
        except ValueError as err:
            parser.error(str(err))
    quick, data, matchmaking_time = args.quick, args.data, args.matchmaking_time
    tiny = Config("tiny", args.peers, seq_len=32 if quick else 128, batch_size=2 if quick else 8,
                  inner_steps=args.inner_steps, rounds=args.rounds,
                  compression=args.compression, matchmaking_time=matchmaking_time, threads=1,
                  link_mbit=args.link_mbit, link_latency_ms=args.link_latency_ms)
    overlaps = {"off": [False], "on": [True], "both": [False, True]}[args.overlap]
    configs = [replace(tiny, overlap=overlap) for overlap in overlaps]
    if not (quick or args.skip_small):
        configs.append(Config("small", 2, seq_len=64, batch_size=1, inner_steps=4, rounds=3,
                              compression=args.compression, matchmaking_time=matchmaking_time, threads=1))
    result: dict[str, Any] = dict(benchmark="round_overhead", machine=machine_info(), quick=quick,
                                  settings=dict(data=data_name(data), heldout_batches=0, utilization_h=UTILIZATION_H))
    started = time.monotonic()
    result["configs"] = []
    for config in configs:
        needed = config.peers * MEMORY_PER_PEER_GB.get(config.model, 0.0)
        available = available_memory_gb()
        if available is not None and needed > available:
            log.warning("skipping %s: needs ~%.1f GB, %.1f GB available", config.model, needed, available)
            result["configs"].append(dict(asdict(config), skipped=f"needs ~{needed:.1f} GB of memory "
                                          f"({MEMORY_PER_PEER_GB[config.model]} GB per peer), {available:.1f} GB "
                                          "available"))
            continue
        solo_steps = 3 if quick or config.model != "tiny" else 20
        result["configs"].append(measure(config, data, args.timeout, solo_steps))
    tiny = result["configs"][0]
    result["summary"] = dict(
        tiny_peers=tiny["peers"], tiny_overhead_steps=tiny.get("overhead_steps"),
        tiny_overhead_steps_vs_solo=tiny.get("overhead_steps_vs_solo"), goal_steps=OVERHEAD_GOAL_STEPS,
        goal_met=tiny.get("overhead_steps") is not None and tiny["overhead_steps"] <= OVERHEAD_GOAL_STEPS,
        utilization={c["model"]: c.get("utilization") for c in result["configs"]},
        tiny_wall_utilization=tiny.get("wall_utilization"), tiny_allreduce_over_compute=tiny.get(
            "allreduce_over_compute"), tiny_link_mbit=tiny.get("link_mbit"), tiny_overlap=tiny["overlap"],
    )
    overlapped = [c for c in result["configs"] if c["model"] == "tiny" and c["overlap"]]
    if args.overlap == "both" and overlapped:
        result["summary"].update(
            overlap_wall_utilization=overlapped[0].get("wall_utilization"),
            overlap_allreduce_over_compute=overlapped[0].get("allreduce_over_compute"),
            overlap_over_blocking_utilization=_ratio(overlapped[0].get("wall_utilization"),
                                                     tiny.get("wall_utilization")),
            overlap_goal=OVERLAP_UTILIZATION_GOAL,
            overlap_goal_met=(overlapped[0].get("wall_utilization") or 0.0) >= OVERLAP_UTILIZATION_GOAL,
        )
    result["seconds"] = round(time.monotonic() - started, 1)
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
