"""All-reduce throughput: our hivemind butterfly (``PseudoGradientAverager``) vs ``torch.distributed`` gloo.

``python -m benchmarks.allreduce [--quick] [--sizes 1000000,10000000,50000000] [--peers 2,4]``

Both sides average the same float32 vectors (one tensor of SIZE values per peer, equal weights) with one process
per peer/rank on 127.0.0.1:

- gloo: ``init_process_group("gloo", init_method="tcp://127.0.0.1:PORT")``, ``GLOO_SOCKET_IFNAME=lo``; a barrier,
  then ``all_reduce`` + divide by N; the time of a repeat is the slowest rank's.
- hivemind: each peer is its own process with its own DHT (``start_dht``: loopback only). Each peer encodes its
  contribution once (timed apart: ``encode_s``), commits to it and forms the group (``begin()``, then wait until the
  step awaits its trigger), then every peer calls ``finish()`` at the same instant; the time of a repeat is from
  that instant to the last peer having its result, confirmation included (matchmaking excluded; ``with_encode_s``
  adds the slowest peer's encoding).

Reported per (peers, size, codec): median time of the repeats and its ratio to gloo's float32 time, the max
abs error of the result vs the exact (float64) mean (gloo) or the exact mean the owners' rule takes (hivemind: from
6 senders, ``OwnerRule.own_input_min_senders``, each owner leaves its own input out of its segments), whether all
peers hold bit-identical results, and the bytes each peer sent vs the butterfly/ring bound 2(N−1)/N × size × 4
bytes. Each codec runs at its own ``segment_values`` (the product's: 131,072 for the dense codecs, 1,048,576 for
sparse). A short sweep of the codec's ``segment_values`` (the unit of the butterfly) is run for the default codec on
the largest default config below 50M values.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import REPO_ROOT, butterfly_bytes, emit, free_port, machine_info, median, ratio, setup_logging

log = logging.getLogger("benchmarks.allreduce")

DEFAULT_CODEC_GOAL = 3.0  # the default codec's time must be <= this many times gloo's float32 time
ARM_REPLY_MARGIN_S = 60.0  # how long past an all-reduce's bound the host waits for a worker to say its group formed


def make_tensor(rank: int, repeat: int, size: int) -> torch.Tensor:
    """Peer ``rank``'s vector in repeat ``repeat``: reproducible, so the exact mean can be recomputed anywhere."""
    return torch.randn(size, generator=torch.Generator().manual_seed(1000 * repeat + rank))


def exact_mean(world: int, repeat: int, size: int) -> torch.Tensor:
    total = torch.zeros(size, dtype=torch.float64)
    for rank in range(world):
        total.add_(make_tensor(rank, repeat, size).to(torch.float64))
    return total.div_(world)


def rule_mean(result: Any, repeat: int, size: int, segment_values: int) -> torch.Tensor:
    """The exact (float64) mean the owners' rule takes of the peers' equal-weight vectors: per segment, over the
    senders its average includes — every peer, or from ``OwnerRule.own_input_min_senders`` senders every peer but the
    segment's owner (``result``: an ``AveragingResult`` whose group gathered each peer's rank)."""
    total = torch.zeros(size, dtype=torch.float64)
    count = torch.zeros(size, dtype=torch.float64)
    for sender, peer in enumerate(result.evidence.senders):
        vector = make_tensor(result.group[peer]["rank"], repeat, size).to(torch.float64)
        for segment, record in result.evidence.segments.items():
            if sender in record.included:
                start, stop = segment * segment_values, min((segment + 1) * segment_values, size)
                total[start:stop] += vector[start:stop]
                count[start:stop] += 1
    return total.div_(count)


def max_abs_error(result: torch.Tensor, expected: torch.Tensor) -> float:
    return float((result.to(torch.float64) - expected).abs().max())


def threads_per_peer(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def cpu_seconds_by_role(roles: dict[int, str]) -> dict[str, float]:
    """CPU seconds (user + system) used so far by this process and all its descendants, summed by role.

    ``roles`` names some pids (this process, the DHT process); ``p2pd`` is recognised by its name and every other
    descendant is a hivemind averager process. Linux only (``/proc``); elsewhere an empty dict.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        return {}
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    stack = [os.getpid()]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            fields = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
            name = (proc / str(pid) / "comm").read_text().strip()
        except (OSError, IndexError):
            continue  # exited meanwhile
        role = roles.get(pid) or ("p2pd" if name == "p2pd" else "averager")
        totals[role] = totals.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return totals


# ------------------------------------------------------------------------------------------------- workers


def gloo_worker(rank: int, world: int, port: int, sizes: list[int], repeats: int, warmup: int) -> None:
    """One gloo rank; rank 0 prints the results (one JSON line)."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(threads_per_peer(world))
    sys.stdin.readline()  # the parent says "go" once nothing else of the benchmark is starting up
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = []
    for size in sizes:
        vector = make_tensor(rank, 0, size)
        buffer = torch.empty_like(vector)
        times = []
        for repeat in range(warmup + repeats):
            buffer.copy_(vector)
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(buffer)
            buffer.div_(world)
            slowest = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if repeat >= warmup:
                times.append(float(slowest))
        error = max_abs_error(buffer, exact_mean(world, 0, size)) if rank == 0 else None
        results.append(dict(size=size, times_s=times, seconds=median(times), max_abs_error=error))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(results), flush=True)


def hivemind_worker(rank: int, world: int) -> None:
    """One hivemind peer: its own DHT, then averagers set up and stepped on the parent's commands (stdin).

    Rank 0 starts its DHT at once; the others import everything first and then wait for a ``join`` command with
    rank 0's addresses, so that the slow imports of all workers overlap.
    """
    from hivemind.averaging.control import AveragingStage

    from template.allreduce.averager import AveragingConfig, PseudoGradientAverager
    from template.allreduce.codecs import get_codec
    from template.p2p.dht import DHTConfig, start_dht, visible_maddrs

    torch.set_num_threads(threads_per_peer(world))
    setup_logging()

    def reply(**fields: Any) -> None:
        print(json.dumps(fields), flush=True)

    initial_peers = json.loads(sys.stdin.readline())["initial_peers"] if rank else []
    dht = start_dht(DHTConfig(initial_peers=initial_peers))
    averager = handle = vector = None
    size = 0
    try:
        reply(event="ready", maddrs=visible_maddrs(dht))
        for line in sys.stdin:
            command = json.loads(line)
            kind = command["cmd"]
            if kind == "setup":
                size = command["size"]
                config = AveragingConfig(
                    prefix=command["prefix"], target_group_size=world, min_group_size=world,
                    matchmaking_time=command["matchmaking_time"], request_timeout=command["matchmaking_time"] / 2,
                    allreduce_timeout=command["timeout"], next_chunk_timeout=command["timeout"] / 4,
                    compression=command["codec"],
                )
                codec = get_codec(command["codec"], segment_values=command["segment_values"])
                averager = PseudoGradientAverager(dht, [torch.Size([size])], config, codec=codec)
                reply(event="setup")
            elif kind == "arm":  # encode and commit our contribution, form the group; the all-reduce runs at "go"
                vector = make_tensor(rank, command["repeat"], size)
                encoding = time.perf_counter()
                contribution = averager.contribute([vector])
                encode_s = time.perf_counter() - encoding
                deadline = time.time() + command["timeout"]
                handle = averager.begin(contribution, 1.0, {"rank": rank}, time.time() + command["matchmaking_time"],
                                        deadline)
                while handle.control.stage != AveragingStage.AWAITING_TRIGGER and time.time() < deadline:
                    if handle.control.done():
                        break
                    time.sleep(0.01)
                reply(event="armed", stage=handle.control.stage.name, encode_s=encode_s)
            elif kind == "go":
                roles = {os.getpid(): "host", dht.pid: "dht"}
                time.sleep(max(command["at"] - time.time(), 0.0))
                cpu_before = cpu_seconds_by_role(roles)
                result = averager.finish(handle, handle.deadline)
                ended = time.time()
                cpu_after = cpu_seconds_by_role(roles)
                cpu = {role: cpu_after[role] - cpu_before.get(role, 0.0) for role in cpu_after}
                fields = dict(event="result", ok=result.ok, reason=result.reason, end=ended, seconds=result.seconds,
                              bytes_sent=result.bytes_sent, group_size=result.group_size, cpu_s=cpu)
                if command["check"] and result.ok:
                    averaged = result.averaged[0]
                    fields["sha256"] = hashlib.sha256(averaged.numpy().tobytes()).hexdigest()
                    if rank == 0:
                        expected = rule_mean(result, command["repeat"], size, codec.segment_values)
                        fields["max_abs_error"] = max_abs_error(averaged, expected)
                reply(**fields)
            elif kind == "teardown":
                averager.shutdown()
                averager = None
                reply(event="teardown")
            elif kind == "exit":
                break
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


# ------------------------------------------------------------------------------------------------- parent


class Worker:
    """A worker subprocess spoken to in JSON lines (commands on stdin, replies on stdout)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        command = [sys.executable, "-m", "benchmarks.allreduce", "--worker", *args]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        cwd=REPO_ROOT, env=env, start_new_session=True)
        self.replies: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                self.replies.put(json.loads(line))
            except json.JSONDecodeError:
                continue  # a library printing to stdout
        self.replies.put(None)

    def send(self, **command: Any) -> None:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def reply(self, timeout_s: float) -> Any:
        try:
            message = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"worker {self.process.args[4:]} did not answer within {timeout_s:.0f}s") from None
        if message is None:
            raise RuntimeError(f"worker {self.process.args[4:]} exited with {self.process.wait()}")
        return message

    def kill(self) -> None:
        """SIGKILL the worker's whole process group: also what an exited worker left behind (DHT, p2pd)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait(timeout=10)


def stop_workers(workers: list[Worker], timeout_s: float = 20.0) -> None:
    """Ask every worker to exit (all at once: shutdowns take a second or two each), SIGKILL the ones that do not."""
    for worker in workers:
        try:
            if worker.process.poll() is None:
                worker.send(cmd="exit")
        except OSError:
            pass
    deadline = time.monotonic() + timeout_s
    for worker in workers:
        try:
            worker.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
        worker.kill()


class GlooGroup:
    """``world`` gloo ranks, spawned early (their imports overlap the hivemind workers'), measured on ``run``."""

    def __init__(self, world: int, sizes: list[int], repeats: int, warmup: int) -> None:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")  # gloo's own sockets on loopback too
        args = ["gloo", "--world", str(world), "--port", str(free_port()), "--sizes", ",".join(map(str, sizes)),
                "--repeats", str(repeats), "--warmup", str(warmup)]
        self.workers = [Worker([*args, "--rank", str(rank)], env=env) for rank in range(world)]

    def run(self, timeout_s: float) -> dict[int, dict]:
        """Measure now (every other process of the benchmark is idle); {size: result}."""
        try:
            for worker in self.workers:
                worker.send(cmd="go")
            results = self.workers[0].reply(timeout_s)
            for worker in self.workers:
                worker.process.wait(timeout=30)
        finally:
            for worker in self.workers:
                worker.kill()
        return {entry["size"]: entry for entry in results}


@dataclass
class HivemindGroup:
    """N hivemind worker processes, each with its own DHT; the first bootstraps the others."""

    world: int
    matchmaking_time: float
    timeout_s: float

    def __post_init__(self) -> None:
        self.workers = [Worker(["hivemind", "--rank", str(rank), "--world", str(self.world)])
                        for rank in range(self.world)]

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        first = self.workers[0].reply(timeout_s)
        for worker in self.workers[1:]:
            worker.send(cmd="join", initial_peers=first["maddrs"])
        for worker in self.workers[1:]:
            worker.reply(timeout_s)

    def stop(self) -> None:
        stop_workers(self.workers)

    def _all(self, timeout_s: float, **command: Any) -> list[dict]:
        for worker in self.workers:
            worker.send(**command)
        return [worker.reply(timeout_s) for worker in self.workers]

    def measure(self, size: int, codec: str, segment_values: int, repeats: int, warmup: int) -> dict[str, Any]:
        """Set up one averager per peer, run warmup + repeats all-reduces, tear down."""
        self._all(120, cmd="setup", size=size, codec=codec, segment_values=segment_values,
                  prefix=f"bench{uuid.uuid4().hex[:10]}", matchmaking_time=self.matchmaking_time,
                  timeout=self.timeout_s)
        times, encodes, failures, check, cpu = [], [], [], {}, {}
        try:
            for repeat in range(warmup + repeats):
                # a worker whose group did not form answers at its own deadline, with its stage: wait past it, so
                # that such a round counts as a failed all-reduce instead of ending the benchmark
                stages = self._all(self.timeout_s + ARM_REPLY_MARGIN_S, cmd="arm", repeat=repeat,
                                   matchmaking_time=self.matchmaking_time, timeout=self.timeout_s)
                at = time.time() + 0.3
                # correctness is checked on the first all-reduce that succeeds (outside the timed window)
                results = self._all(2 * self.timeout_s, cmd="go", at=at, check=not check, repeat=repeat)
                if not all(r["ok"] for r in results):
                    failures.append(dict(stages=[s["stage"] for s in stages],
                                         reasons=[r["reason"] for r in results if not r["ok"]]))
                    continue
                if not check:
                    check = dict(max_abs_error=results[0]["max_abs_error"],
                                 identical=len({r["sha256"] for r in results}) == 1,
                                 bytes_sent_per_peer=max(r["bytes_sent"] for r in results))
                if repeat >= warmup:
                    times.append(max(r["end"] for r in results) - at)
                    encodes.append(max(s["encode_s"] for s in stages))
                    cpu = {role: round(sum(r["cpu_s"].get(role, 0.0) for r in results), 3)
                           for role in sorted({role for r in results for role in r["cpu_s"]})}
        finally:
            self._all(60, cmd="teardown")
        # cpu: CPU seconds of the last timed repeat, all peers together, by process (host = the caller's process)
        return dict(times_s=times, seconds=median(times) if times else None, failures=failures,
                    encode_s=median(encodes) if encodes else None,
                    with_encode_s=median([t + e for t, e in zip(times, encodes, strict=True)]) if times else None,
                    cpu_s_last_repeat=cpu, **check)


def row(world: int, size: int, codec: str, segment_values: int, gloo: dict, measured: dict) -> dict[str, Any]:
    """One result line: hivemind's measurement next to gloo's for the same peers and size."""
    bound = butterfly_bytes(size, world, 4)
    return dict(
        peers=world, size=size, codec=codec, segment_values=segment_values,
        gloo_s=gloo["seconds"], gloo_max_abs_error=gloo["max_abs_error"],
        hivemind_over_gloo=ratio(measured["seconds"], gloo["seconds"]) if measured["seconds"] else None,
        float32_bound_bytes=round(bound),
        bytes_over_float32_bound=ratio(measured.get("bytes_sent_per_peer", 0), bound),
        **measured,
    )


def parse_ints(text: str) -> list[int]:
    return [int(float(item)) for item in text.split(",") if item]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.allreduce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100k values, 2 peers, 1 repeat (smoke test)")
    parser.add_argument("--sizes", default=None, help="float32 values per tensor (default 1e6,1e7,5e7)")
    parser.add_argument("--peers", default=None, help="peer counts (default 2,4)")
    parser.add_argument("--codecs", default="none,fp16,int8")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (median); default 3, --quick 1")
    parser.add_argument("--warmup", type=int, default=None, help="untimed repeats first; default 1, --quick 0")
    parser.add_argument("--segment-sweep", default=None,
                        help="segment_values for the default codec (default 32768,131072,524288,2097152)")
    parser.add_argument("--matchmaking-time", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=300.0, help="bound of one all-reduce, seconds")
    parser.add_argument("--worker", choices=["gloo", "hivemind"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker == "gloo":
        gloo_worker(args.rank, args.world, args.port, parse_ints(args.sizes), args.repeats, args.warmup)
        return 0
    if args.worker == "hivemind":
        hivemind_worker(args.rank, args.world)
        return 0
    setup_logging()
    from template.allreduce.averager import AveragingConfig
    from template.allreduce.codecs import get_codec

    quick = args.quick
    sizes = parse_ints(args.sizes or ("100000" if quick else "1000000,10000000,50000000"))
    peer_counts = parse_ints(args.peers or ("2" if quick else "2,4"))
    codecs = args.codecs.split(",")
    repeats = args.repeats or (1 if quick else 3)
    warmup = args.warmup if args.warmup is not None else (0 if quick else 1)
    default_codec = AveragingConfig.compression
    default_part = get_codec(default_codec).segment_values
    sweep = parse_ints(args.segment_sweep or ("" if quick else "32768,131072,524288,2097152"))
    sweep_size = max([s for s in sizes if s < 50_000_000] or sizes)
    result: dict[str, Any] = dict(
        benchmark="allreduce", machine=machine_info(), quick=quick,
        settings=dict(sizes=sizes, peers=peer_counts, codecs=codecs, repeats=repeats, warmup=warmup,
                      default_codec=default_codec, default_segment_values=default_part,
                      matchmaking_time=args.matchmaking_time, threads_per_peer={n: threads_per_peer(n)
                                                                                for n in peer_counts}),
    )
    started = time.monotonic()
    rows, sweep_rows = [], []
    for world in peer_counts:
        gloo_group = GlooGroup(world, sizes, repeats, warmup)
        group = HivemindGroup(world, args.matchmaking_time, args.timeout)
        try:
            group.wait_ready()
            log.info("gloo: %d ranks", world)
            gloo = gloo_group.run(args.timeout * len(sizes))
            for size in sizes:
                for codec in codecs:
                    log.info("hivemind: %d peers, %d values, %s", world, size, codec)
                    part = get_codec(codec).segment_values  # each codec's own, as the product uses it
                    measured = group.measure(size, codec, part, repeats, warmup)
                    rows.append(row(world, size, codec, part, gloo[size], measured))
                if size == sweep_size and world == max(peer_counts):
                    for part in sweep:
                        log.info("segment sweep: %d peers, %d values, %s, %d values", world, size, default_codec, part)
                        measured = group.measure(size, default_codec, part, repeats, 0)
                        sweep_rows.append(row(world, size, default_codec, part, gloo[size], measured))
        finally:
            group.stop()
            for worker in gloo_group.workers:
                worker.kill()
    result["rows"] = rows
    result["segment_sweep"] = sweep_rows
    default_rows = [r for r in rows if r["codec"] == default_codec and r["hivemind_over_gloo"] is not None]
    worst = max((r["hivemind_over_gloo"] for r in default_rows), default=None)
    result["summary"] = dict(
        default_codec=default_codec, goal_default_codec_over_gloo=DEFAULT_CODEC_GOAL,
        default_codec_over_gloo={f"{r['peers']}p_{r['size']}": r["hivemind_over_gloo"] for r in default_rows},
        worst_default_codec_over_gloo=worst,
        goal_met=worst is not None and worst <= DEFAULT_CODEC_GOAL and len(default_rows) == sum(
            1 for r in rows if r["codec"] == default_codec),
        checked_rows=sum("identical" in r for r in rows),
        all_identical=all(r["identical"] for r in rows if "identical" in r),
        failed_allreduces=sum(len(r["failures"]) for r in rows),
    )
    result["seconds"] = round(time.monotonic() - started, 1)
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
