"""Lost all-reduces under load: how many fresh all-reduces end partial or failed while others share the cores.

``python -m benchmarks.allreduce_load [--quick] [--lanes 7] [--rounds 30] [--peers 3] [--values 1000000]``

``--lanes`` independent lanes run at the same time, each its own process (CI runs several all-reduce benchmarks at
once on two cores: this is that load). A lane starts ``--peers`` DHT nodes on 127.0.0.1 once, then runs ``--rounds``
*fresh* all-reduces one after the other: every round builds new averagers (a new averager process and p2p host per
peer, a new run prefix), all peers average their own random vector of ``--values`` float32 values with the run's
default codec, and the averagers are shut down again (the stalls measured before were first all-reduces of fresh
averagers). Every member's outcome is one JSON line from its lane.

Reported: all-reduces (groups) and member outcomes; members ``ok``, ``partial`` ("partial all-reduce: …", a lost
transfer nobody could make good), ``failed`` (any other reason: no group in time, a refused round); groups in which
members that succeeded hold different bytes (``split``, must be 0); shares a member fetched from a groupmate because
its owner's transfer was lost (``shares_recovered``: each one a round that used to be lost); groups a member gave
up because every groupmate said it was not in them (``groups_given_up``: hivemind's leader had counted in a follower
that left; the round formed again in time); seconds per round.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common import REPO_ROOT, emit, machine_info, median, setup_logging

LANE_FLAG = "--lane"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.allreduce_load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 lanes × 2 rounds of 2 peers, 100k values")
    parser.add_argument("--lanes", type=int, help="concurrent lanes (default 7; --quick 2)")
    parser.add_argument("--rounds", type=int, help="fresh all-reduces per lane (default 30; --quick 2)")
    parser.add_argument("--peers", type=int, help="members per all-reduce (default 3; --quick 2)")
    parser.add_argument("--values", type=int, help="float32 values per peer (default 1e6; --quick 1e5)")
    parser.add_argument("--codec", default="fp16", help="the all-reduce codec (default fp16, the engine's)")
    parser.add_argument("--timeout", type=float, default=60.0, help="bound of one all-reduce, seconds")
    parser.add_argument("--absent", type=int, default=0,
                        help="expected peers that never come (default 0): groups are sized for --peers + ABSENT, so "
                             "every group forms when its leader's matchmaking time ends, as after a miner died, "
                             "instead of the moment it is full")
    parser.add_argument(LANE_FLAG, type=int, help=argparse.SUPPRESS)  # internal: run one lane, print its outcomes
    args = parser.parse_args(argv)
    for name, full, quick in (("lanes", 7, 2), ("rounds", 30, 2), ("peers", 3, 2), ("values", 1_000_000, 100_000)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
        if getattr(args, name) < (2 if name == "peers" else 1):
            parser.error(f"--{name} must be at least {2 if name == 'peers' else 1}")
    if args.absent < 0:
        parser.error("--absent must be at least 0")
    return args


def run_lane(args: argparse.Namespace) -> None:
    """One lane: ``rounds`` fresh all-reduces among ``peers`` peers; one JSON line per member and round."""
    import torch

    from template.allreduce.averager import AveragingConfig, PseudoGradientAverager
    from template.p2p.dht import DHTConfig, start_dht, visible_maddrs

    torch.set_num_threads(1)
    first = start_dht()
    nodes = [first] + [start_dht(DHTConfig(initial_peers=visible_maddrs(first))) for _ in range(args.peers - 1)]
    shapes = [torch.Size([args.values])]
    try:
        for round in range(args.rounds):
            config = AveragingConfig(prefix=f"load{uuid.uuid4().hex[:10]}", target_group_size=args.peers + args.absent,
                                     min_group_size=args.peers, compression=args.codec)
            averagers = []
            started = time.monotonic()
            try:
                for node in nodes:
                    averagers.append(PseudoGradientAverager(node, shapes, config))
                deadline = time.time() + args.timeout
                with ThreadPoolExecutor(args.peers) as pool:
                    futures = [pool.submit(peer.average, [torch.randn(args.values)], 1.0, {}, deadline)
                               for peer in averagers]
                    results = [future.result(timeout=args.timeout + 30) for future in futures]
                outcomes = [dict(ok=r.ok, reason=r.reason, recovered=len(r.evidence.recovered), group_id=r.group_id,
                                 regrouped=len(r.abandoned_groups),
                                 digest=hashlib.sha256(r.averaged[0].numpy().tobytes()).hexdigest() if r.ok else "")
                            for r in results]
            except Exception as err:  # an averager that could not even start is a failed all-reduce too
                outcomes = [dict(ok=False, reason=f"{type(err).__name__}: {err}", recovered=0, group_id="",
                                 regrouped=0, digest="")] * args.peers
            finally:
                for averager in averagers:
                    averager.shutdown()
            seconds = time.monotonic() - started
            for member, outcome in enumerate(outcomes):
                print(json.dumps(dict(lane=args.lane, round=round, member=member, seconds=seconds, **outcome)),
                      flush=True)
    finally:
        for node in nodes:
            node.shutdown()


def run_lanes(args: argparse.Namespace) -> list[dict]:
    """Start every lane at once; collect their lines until all exit (bounded: each round by its timeout)."""
    command = [sys.executable, "-m", "benchmarks.allreduce_load", "--rounds", str(args.rounds), "--peers",
               str(args.peers), "--values", str(args.values), "--codec", args.codec, "--timeout", str(args.timeout),
               "--absent", str(args.absent)]
    bound = args.rounds * (args.timeout + 90) + 120
    lanes = [subprocess.Popen([*command, LANE_FLAG, str(lane)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
             for lane in range(args.lanes)]
    lines: list[dict] = []
    lock = threading.Lock()

    def read(process: subprocess.Popen) -> None:
        for line in process.stdout:
            if line.startswith("{"):
                with lock:
                    lines.append(json.loads(line))

    readers = [threading.Thread(target=read, args=(p,), daemon=True) for p in lanes]
    for reader in readers:
        reader.start()
    try:
        for process in lanes:
            process.wait(timeout=max(bound, 1))
    finally:
        for process in lanes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        for reader in readers:
            reader.join(timeout=10)
    return lines


def summarize(lines: list[dict], args: argparse.Namespace) -> dict:
    groups: dict[tuple[int, int], list[dict]] = {}
    for line in lines:
        groups.setdefault((line["lane"], line["round"]), []).append(line)
    members = Counter("ok" if m["ok"] else "partial" if m["reason"].startswith("partial all-reduce") else "failed"
                      for m in lines)
    split = sum(1 for outcome in groups.values() if len({m["digest"] for m in outcome if m["ok"]}) > 1)
    reasons = Counter(m["reason"].split(":")[0] for m in lines if not m["ok"])
    return dict(
        allreduces=len(groups),
        allreduces_expected=args.lanes * args.rounds,
        allreduces_all_ok=sum(1 for outcome in groups.values() if all(m["ok"] for m in outcome)),
        member_outcomes=len(lines),
        members_ok=members["ok"],
        members_partial=members["partial"],
        members_failed=members["failed"],
        failure_reasons=dict(reasons.most_common(8)),
        split=split,
        shares_recovered=sum(m["recovered"] for m in lines),
        groups_given_up=sum(m.get("regrouped", 0) for m in lines),  # a follower had left: formed again in time
        round_s_median=median([m["seconds"] for m in lines]) if lines else None,
        round_s_max=max((m["seconds"] for m in lines), default=None),
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    if args.lane is not None:
        run_lane(args)
        return
    machine, started = machine_info(), time.monotonic()
    lines = run_lanes(args)
    emit(dict(benchmark="allreduce_load", quick=args.quick, machine=machine, seconds=time.monotonic() - started,
              settings=dict(lanes=args.lanes, rounds=args.rounds, peers=args.peers, values=args.values,
                            codec=args.codec, timeout_s=args.timeout, absent=args.absent),
              **summarize(lines, args)))


if __name__ == "__main__":
    main()
