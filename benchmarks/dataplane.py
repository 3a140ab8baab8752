"""Could another data plane bring the accountable all-reduce within 3× of gloo? torch.distributed point-to-point.

``python -m benchmarks.dataplane [--quick] [--size 10000000] [--peers 2,4] [--repeats 3]``

hivemind's transport alone (every byte through the p2p daemon, no compute) was measured at 2–4× gloo's whole
all-reduce on this machine (docs/benchmarks.md §2), so the hivemind butterfly cannot reach 3×. This measures the
same accountable butterfly with torch.distributed's gloo point-to-point (``isend``/``irecv`` over TCP on 127.0.0.1)
as the data plane — what hivemind would keep is discovery and matchmaking, not measured here — and the same work on
every segment as :mod:`template.allreduce.runner` does:

- the contribution is encoded once with the run's codec (fp16) into segments, their Merkle leaves committed before
  the all-reduce (exchanged with ``all_gather`` outside the timed window, as the gather carries the signed root);
- scatter-reduce: each sender sends its segments of every owner's range; the owner hashes each segment against the
  sender's leaf before it counts, and applies the owner's rule (:func:`template.allreduce.reduction.reduce_segment`:
  decode, finite and weight checks, norm clipping, float64 weighted mean, encode once);
- all-gather: the owner signs a certificate over the digest of its averaged segments (sr25519, one per member) and
  sends the same bytes to every member; each member checks the certificate, decodes every segment, checks it finite.

Reported per peer count, in the same run and the same process group: gloo's float32 ``all_reduce`` (the baseline),
this data plane's time (slowest rank, from a barrier), their ratio, whether every rank holds bit-identical averages,
and the max abs error against the exact mean. fp16 only (its averaged segments have a fixed size).

Safety among untrusted peers (``oversize_probe`` in the JSON, always run, ~1 s): gloo matches a message to the
receive its peer posted and *aborts the receiving process* (``gloo::EnforceNotMet`` thrown on gloo's I/O thread:
``terminate``, SIGABRT) when the message is longer than the posted buffer. The probe has one rank post a 1 KiB
receive and the other send 2 KiB, and reports how the receiver exited. In a subnet any groupmate could send that
message, so this data plane may carry segments only inside a process that a peer is allowed to kill.

That process is measured too (``child_*`` in each row): the same butterfly with every transfer made by a transport
child per rank (spawned once, a new gloo group per round as a round's group changes, the segments handed over in
shared memory allocated once), the checks still in the rank's own process. ``child_round_setup_s`` is the per-round
group rendezvous (slowest rank; the leader's store listens before the members join, else a member that connects
first waits out a retry back-off, measured at 0.4–0.75 s), ``child_respawn_s`` what replacing a killed child costs
(not measured with ``--quick``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import torch
import torch.multiprocessing as mp

from benchmarks.common import REPO_ROOT, emit, free_port, machine_info, median, ratio, setup_logging

DEFAULT_GOAL = 3.0
PROBE_POSTED_BYTES = 1024
SIGNATURE_BYTES = 64  # sr25519
CHILD_REPLY_TIMEOUT_S = 120.0


def make_tensor(rank: int, repeat: int, size: int) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(1000 * repeat + rank))


def rank_main(args: argparse.Namespace) -> None:
    """One rank: gloo all_reduce and the checked point-to-point butterfly, ``warmup + repeats`` times each."""
    import torch.distributed as dist

    from template.allreduce.codecs import all_finite, get_codec
    from template.allreduce.contribution import encode_contribution, leaf_digest
    from template.allreduce.messages import certificate_bytes, segments_digest
    from template.allreduce.reduction import OwnerRule, SegmentInput, reduce_segment, weight_cap
    from template.allreduce.terms import SegmentLayout
    from template.p2p.keys import ephemeral_signer, verify_signature

    rank, world, size = args.rank, args.world, args.size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    codec = get_codec("fp16")
    layout = SegmentLayout(size, codec.segment_values)
    ranges = layout.ranges([1.0] * world)
    weights = [1.0] * world
    cap = weight_cap(weights)
    signer = ephemeral_signer()
    keys = _all_gather_bytes(dist, signer.key.encode(), world)  # ss58 addresses (equal length): in the gather

    def sizes(start: int, stop: int) -> list[int]:
        return [codec.encoded_size(layout.numel_of(k)) for k in range(start, stop)]

    # Every transfer's buffer, allocated once in shared memory: both transports move the same bytes.
    start, stop = ranges[rank]
    mine = sizes(start, stop)
    owners = [o for o in range(world) if ranges[o][1] > ranges[o][0]]  # a rank may own nothing
    def buffer(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8).share_memory_()

    send_to = {o: buffer(sum(sizes(*ranges[o]))) for o in owners if o != rank}
    inbox = {s: buffer(sum(mine)) for s in range(world) if s != rank and mine}
    share = buffer(sum(mine) + SIGNATURE_BYTES)
    received = {o: buffer(sum(sizes(*ranges[o])) + SIGNATURE_BYTES) for o in owners if o != rank}
    phases = dict(scatter=(send_to, inbox), gather=({m: share for m in range(world) if m != rank and mine}, received))

    def butterfly(contribution, exchange) -> tuple[torch.Tensor, float]:
        """The timed part: scatter-reduce with checks, then all-gather of the certified averages; ``exchange(phase)``
        moves one phase's buffers."""
        leaves = _all_gather_leaves(dist, contribution.leaves, world)  # committed before: untimed in real runs
        dist.barrier()
        started = time.perf_counter()
        for o, tensor in send_to.items():
            tensor.copy_(torch.frombuffer(bytearray(b"".join(contribution.segments[slice(*ranges[o])])),
                                          dtype=torch.uint8))
        exchange("scatter")
        averaged, offset = [], 0
        for k, length in zip(range(start, stop), mine, strict=True):
            inputs = []
            for s in range(world):
                data = contribution.segments[k] if s == rank else inbox[s][offset:offset + length].numpy().tobytes()
                if leaf_digest(data) != leaves[s][k]:
                    raise RuntimeError(f"segment {k} of sender {s} does not match its leaf")
                inputs.append(SegmentInput(s, data, weights[s]))
            averaged.append(reduce_segment(inputs, layout.numel_of(k), codec, weights, OwnerRule(), cap).data)
            offset += length
        digest = segments_digest(averaged)
        signature = signer.sign(certificate_bytes("bench", 0, b"group", rank, start, stop, digest, bytes(32)))
        assert len(signature) == SIGNATURE_BYTES
        if mine:
            share.copy_(torch.frombuffer(bytearray(b"".join(averaged) + signature), dtype=torch.uint8))
        exchange("gather")
        output = torch.empty(size, dtype=torch.float32)
        for o in owners:
            o_start, o_stop = ranges[o]
            blob = share.numpy().tobytes() if o == rank else received[o].numpy().tobytes()
            parts, offset = [], 0
            for k, length in zip(range(o_start, o_stop), sizes(o_start, o_stop), strict=True):
                data = blob[offset:offset + length]
                offset += length
                values = codec.decode_average(data, layout.numel_of(k))
                if not all_finite(values):
                    raise RuntimeError(f"owner {o}'s average of segment {k} is not finite")
                first, last = layout.values(k, k + 1)
                output[first:last] = values
                parts.append(data)
            message = certificate_bytes("bench", 0, b"group", o, o_start, o_stop, segments_digest(parts), bytes(32))
            if not verify_signature(keys[o].decode(), message, blob[offset:]):
                raise RuntimeError(f"owner {o}'s certificate does not verify")
        return output, slowest(time.perf_counter() - started)

    def slowest(seconds: float) -> float:
        elapsed = torch.tensor([seconds])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    def in_process(phase: str) -> None:
        _exchange(dist, *phases[phase])

    child = _TransportChild(rank, world, phases)
    respawn_s = None
    if not args.quick:  # a second spawn per rank: left out of the smoke test, which runs beside seven others
        started = time.perf_counter()
        child.respawn()
        respawn_s = slowest(time.perf_counter() - started)

    rows = []
    for repeat in range(args.warmup + args.repeats):
        x = make_tensor(rank, repeat, size)
        reduced = x.clone()
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(reduced)
        reduced.div_(world)
        gloo = slowest(time.perf_counter() - started)
        contribution = encode_contribution(codec, x)
        output, seconds = butterfly(contribution, in_process)
        digests = _all_gather_bytes(dist, hashlib.sha256(output.numpy().tobytes()).digest(), world)
        port = torch.tensor([free_port() if rank == 0 else 0])  # the round's rendezvous, as its leader announces
        dist.broadcast(port, 0)
        started = time.perf_counter()
        if rank == 0:  # the leader's store listens before any member connects (no client retry back-off)
            child.listen(int(port))
        dist.barrier()
        child.open_round(int(port))
        setup = slowest(time.perf_counter() - started)
        child_output, child_seconds = butterfly(contribution, child.exchange)
        same = torch.equal(output.view(torch.int32), child_output.view(torch.int32))
        exact = sum(make_tensor(r, repeat, size).double() for r in range(world)) / world
        if repeat >= args.warmup:
            rows.append(dict(gloo_s=gloo, dataplane_s=seconds, child_s=child_seconds, child_round_setup_s=setup,
                             identical=len(set(digests)) == 1 and same,
                             max_abs_error=float((output.double() - exact).abs().max())))
    child.close()
    if rank == 0:
        print(json.dumps(dict(world=world, rows=rows, child_respawn_s=respawn_s)), flush=True)
    dist.destroy_process_group()


def _exchange(dist, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]) -> None:
    """Post every receive, then every send, and wait for all: one phase of the butterfly on the current group."""
    work = [dist.irecv(tensor, src=peer) for peer, tensor in receives.items()]
    work += [dist.isend(tensor, dst=peer) for peer, tensor in sends.items()]
    for w in work:
        w.wait()


class _TransportChild:
    """A rank's transfers made in a child process that a hostile groupmate may abort (module docstring): spawned
    once with the phases' shared buffers, told each round's rendezvous and each phase to run, over a pipe."""

    def __init__(self, rank: int, world: int, phases: dict):
        self.rank, self.world, self.phases = rank, world, phases
        self.conn = self.process = None
        self.respawn()

    def respawn(self) -> None:
        """Replace the child (as after it was killed): what a member pays once per abort."""
        if self.process is not None:
            self.process.kill()
            self.process.join(10)
        context = mp.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_transport_child_main, args=(theirs, self.rank, self.world, self.phases),
                                       daemon=True)
        self.process.start()
        self._expect("ready")

    def listen(self, port: int) -> None:
        """The leader's child opens the round's store (what the leader would do right after matchmaking)."""
        self.conn.send(("listen", port))
        self._expect("listen")

    def open_round(self, port: int) -> None:
        self.conn.send(("round", port))
        self._expect("round")

    def exchange(self, phase: str) -> None:
        self.conn.send(("exchange", phase))
        self._expect("exchange")

    def close(self) -> None:
        self.conn.send(("stop", None))
        self.process.join(10)

    def _expect(self, reply: str) -> None:
        if not self.conn.poll(CHILD_REPLY_TIMEOUT_S):
            raise TimeoutError(f"the transport child did not answer {reply!r} in {CHILD_REPLY_TIMEOUT_S}s")
        answer = self.conn.recv()  # EOFError when the child died
        if answer != reply:
            raise RuntimeError(f"the transport child answered {answer!r}, not {reply!r}")


def _transport_child_main(conn, rank: int, world: int, phases: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    conn.send("ready")
    store = None
    while True:
        command, value = conn.recv()
        if command == "stop":
            break
        if command == "listen":
            store = dist.TCPStore("127.0.0.1", value, world, is_master=True, wait_for_workers=False)
        elif command == "round":  # a new group every round: the round's members, at its leader's rendezvous
            if dist.is_initialized():
                dist.destroy_process_group()
            if store is None:
                store = dist.TCPStore("127.0.0.1", value, world, is_master=False)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
            store = None
        else:
            _exchange(dist, *phases[value])
        conn.send(command)
    if dist.is_initialized():
        dist.destroy_process_group()


def probe_main(args: argparse.Namespace) -> None:
    """One rank of the oversize probe: rank 0 posts a 1 KiB receive, rank 1 sends 2 KiB (what a hostile groupmate
    can do); rank 0 prints whether it survived (it exits by SIGABRT when gloo aborts it)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
    if args.rank == 0:
        inbox = torch.empty(PROBE_POSTED_BYTES, dtype=torch.uint8)
        try:
            dist.irecv(inbox, src=1).wait()
            outcome = "received"
        except RuntimeError as err:  # what a safe transport would do: fail this receive, keep the process
            outcome = f"raised: {err}"
        print(json.dumps(dict(survived=True, outcome=outcome)), flush=True)
    else:
        dist.isend(torch.zeros(2 * PROBE_POSTED_BYTES, dtype=torch.uint8), dst=0).wait()
        time.sleep(2.0)  # keep the connection open until the receiver has read the message


def _all_gather_bytes(dist, data: bytes, world: int) -> list[bytes]:
    """Equal-length byte strings from every rank (no pickling: fixed-size uint8 tensors)."""
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return [g.numpy().tobytes() for g in gathered]


def _all_gather_leaves(dist, leaves: tuple[bytes, ...], world: int) -> list[list[bytes]]:
    joined = _all_gather_bytes(dist, b"".join(leaves), world)
    return [[blob[i:i + 32] for i in range(0, len(blob), 32)] for blob in joined]


def start_ranks(world: int, options: list[str], timeout: float) -> tuple[int | None, str]:
    """Run ``world`` ranks of this module with ``options``; rank 0's exit status and stdout."""
    port = free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "benchmarks.dataplane", *options, "--world", str(world), "--port", str(port)]
    ranks = [subprocess.Popen([*command, "--rank", str(r)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL if "--probe-oversize" in options else None, text=True)
             for r in range(world)]
    try:
        out, _ = ranks[0].communicate(timeout=timeout)
        for process in ranks[1:]:
            process.wait(timeout=60)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    return ranks[0].returncode, out


def oversize_probe(timeout: float) -> dict:
    """How the receiving rank ends when its peer sends more than it posted (module docstring)."""
    returncode, out = start_ranks(2, ["--probe-oversize"], timeout)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    survived = bool(lines) and lines[0].get("survived") is True and returncode == 0
    return dict(posted_bytes=PROBE_POSTED_BYTES, sent_bytes=2 * PROBE_POSTED_BYTES, receiver_survived=survived,
                receiver_exit_status=returncode,
                receiver_signal=signal.Signals(-returncode).name if returncode is not None and returncode < 0 else None,
                outcome=lines[0].get("outcome") if lines else None)


def run_world(world: int, args: argparse.Namespace) -> dict:
    options = ["--size", str(args.size), "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    options += ["--quick"] if args.quick else []
    returncode, out = start_ranks(world, options, args.timeout)
    if returncode != 0:
        raise RuntimeError(f"rank 0 of {world} exited with {returncode}")
    result = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    rows = result["rows"]
    gloo, plane = median([r["gloo_s"] for r in rows]), median([r["dataplane_s"] for r in rows])
    child, setup = median([r["child_s"] for r in rows]), median([r["child_round_setup_s"] for r in rows])
    return dict(peers=world, size=args.size, codec="fp16", gloo_s=gloo, dataplane_s=plane,
                dataplane_over_gloo=ratio(plane, gloo), child_s=child, child_round_setup_s=setup,
                child_over_gloo=ratio(child + setup, gloo), child_respawn_s=result["child_respawn_s"],
                identical=all(r["identical"] for r in rows),
                max_abs_error=max(r["max_abs_error"] for r in rows), repeats=rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dataplane", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="300k values, 2 peers, 1 repeat")
    parser.add_argument("--size", type=int, default=None, help="float32 values per peer (default 1e7)")
    parser.add_argument("--peers", default=None, help="peer counts (default 2,4)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (median); default 3")
    parser.add_argument("--warmup", type=int, default=None, help="untimed repeats first; default 1")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound of one peer count's run, seconds")
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)  # internal: one rank
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--probe-oversize", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.size = args.size or (300_000 if args.quick else 10_000_000)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    setup_logging()
    if args.rank is not None:
        (probe_main if args.probe_oversize else rank_main)(args)
        return
    peers = [int(p) for p in (args.peers or ("2" if args.quick else "2,4")).split(",")]
    machine, started = machine_info(), time.monotonic()
    rows = [run_world(world, args) for world in peers]
    probe = oversize_probe(args.timeout)
    worst = max(r["dataplane_over_gloo"] for r in rows)
    worst_child = max(r["child_over_gloo"] for r in rows)
    emit(dict(benchmark="dataplane", quick=args.quick, machine=machine, seconds=time.monotonic() - started,
              rows=rows, oversize_probe=probe, summary=dict(goal_over_gloo=DEFAULT_GOAL, worst_over_gloo=worst,
                                      goal_met=worst <= DEFAULT_GOAL, worst_child_over_gloo=worst_child,
                                      child_goal_met=worst_child <= DEFAULT_GOAL,
                                      all_identical=all(r["identical"] for r in rows),
                                      safe_among_untrusted_peers=probe["receiver_survived"])))


if __name__ == "__main__":
    main()
