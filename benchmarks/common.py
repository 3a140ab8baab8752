"""Shared helpers of the benchmarks: data, machine facts, the one-JSON-object output, and a real-peer launcher.

Every benchmark is run from the repository root as ``python -m benchmarks.<name>``; it prints exactly one JSON
object on stdout and logs to stderr. What is guaranteed on failure: every wait here is bounded (``run_peers``
stops every peer it started — SIGTERM, then SIGKILL — before it returns or raises), so a benchmark never leaves
processes behind and never runs past its time bound by more than the stop grace period.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import queue
import signal
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from template.p2p.simulated_link import LinkSpec, LinkStats, SimulatedNetwork
from template.training.cli import log_to_stderr
from template.training.data import STDLIB_SOURCE, names_files

REPO_ROOT = Path(__file__).resolve().parents[1]
# The text the recorded results were measured on, where it exists (our machines and CI keep it beside the clone);
# a fresh clone falls back to the ``stdlib`` source (real English prose every Python carries).
DEFAULT_DATA = str(REPO_ROOT.parent / "shared" / "data" / "tinyshakespeare.txt")

log = logging.getLogger("benchmarks")


def setup_logging() -> None:
    """Logs to stderr (stdout carries the one JSON result), as the engine's CLI logs."""
    log_to_stderr()


def benchmark_parser(name: str, description: str, quick_help: str) -> argparse.ArgumentParser:
    """``python -m benchmarks.NAME``'s parser with the flags every benchmark takes: ``--quick`` and ``--data``."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--data", default=DEFAULT_DATA,
                        help="text file, 'stdlib' (used when the file is missing) or 'builtin'")
    return parser


def parse_benchmark_args(parser: argparse.ArgumentParser, argv: list[str] | None,
                         **sizes: tuple[Any, Any]) -> argparse.Namespace:
    """Parse a benchmark's command line (bad flags: usage and exit status 2) and set up logging.

    ``args.data`` becomes a source that exists (:func:`resolve_data`). Every option named in ``sizes`` as
    ``dest=(full, quick)`` that was left unset (None, or 0) gets its default for a full run or for ``--quick``.
    """
    args = parser.parse_args(argv)
    setup_logging()
    args.data = resolve_data(args.data)
    for dest, (full, quick) in sizes.items():
        if not getattr(args, dest):
            setattr(args, dest, quick if args.quick else full)
    return args


def resolve_data(data: str) -> str:
    """``data`` if it is a file that exists or needs none (``stdlib``, ``builtin``), else ``stdlib`` (with a
    warning): benchmarks must run on a fresh clone that has no ``../shared/data``."""
    if not names_files(data) or Path(data).is_file():
        return data
    log.warning("data file %s is missing: using the stdlib text instead", data)
    return STDLIB_SOURCE


def data_name(data: str) -> str:
    return Path(data).name if names_files(data) else data


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on; the load average says how much other work shared the cores."""
    import hivemind
    import torch

    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        cpus=os.cpu_count(),
        load_average_1m=round(os.getloadavg()[0], 2),
        platform=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
        hivemind=hivemind.__version__,
        device="cpu",
    )


def emit(result: dict[str, Any]) -> None:
    """The benchmark's result: one JSON object, one line, on stdout."""
    result.setdefault("machine", {})["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result), flush=True)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def butterfly_bytes(num_values: int, peers: int, bytes_per_value: float) -> float:
    """Bytes one peer sends in a butterfly (or ring) all-reduce: 2(N−1)/N × the vector's size."""
    return 2 * (peers - 1) / peers * num_values * bytes_per_value


# ------------------------------------------------------------------------------------------ real DiLoCo peers


@dataclass
class PeerRunResult:
    """What a group of real peer processes reported: ``rounds[peer]`` is that peer's list of round events."""

    peers: list[str]
    rounds: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    ready: dict[str, dict[str, Any]] = field(default_factory=dict)
    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    log_tails: dict[str, list[str]] = field(default_factory=dict)  # last log lines of each peer, when not finished
    link_stats: LinkStats | None = None  # what crossed the simulated links, when the peers had one

    @property
    def finished(self) -> bool:
        return set(self.done) == set(self.peers) and not self.errors

    def reports(self, round: int) -> list[dict[str, Any]]:
        return [event for events in self.rounds.values() for event in events if event["round"] == round]


def run_peers(
    num_peers: int, peer_args: list[str], out_dir: Path, timeout_s: float, threads: int | None = None,
    name_prefix: str = "peer", follower_args: Sequence[str] = (), link: LinkSpec | None = None,
) -> PeerRunResult:
    """Run ``num_peers`` real ``template.training.peer`` processes on 127.0.0.1 until they finish or ``timeout_s``.

    Like ``python -m template.training.run`` (first peer bootstraps the others, peers split the cores), but it
    returns every peer's full round reports instead of printing a summary. ``follower_args`` are appended for every
    peer but the first (later flags win). With ``link``, every peer sits behind a simulated access link
    (:mod:`template.p2p.simulated_link`, a test knob) and ``link_stats`` counts what crossed it. All peers are
    stopped before it returns.
    """
    from template.training.run import PeerProcess, wait_for_event

    out_dir.mkdir(parents=True, exist_ok=True)
    names = [f"{name_prefix}{i}" for i in range(num_peers)]
    threads = threads or max(1, (os.cpu_count() or 1) // num_peers)
    common = ["--expected-peers", str(num_peers), "--torch-threads", str(threads), *peer_args]
    network = SimulatedNetwork(link) if link is not None else None
    hosts = {name: _behind_link(network, name) for name in names}
    result = PeerRunResult(peers=names)
    events: queue.Queue = queue.Queue()
    processes: list[PeerProcess] = []
    started = time.monotonic()
    deadline = started + timeout_s
    try:
        processes.append(PeerProcess(names[0], [*common, *hosts[names[0]], "--checkpoint-dir",
                                                str(out_dir / names[0])], out_dir, events=events))
        first = wait_for_event(events, lambda e: e["event"] in ("listening", "error", "exit"), timeout_s)
        if first["event"] != "listening":
            raise RuntimeError(f"{names[0]} did not start: {first.get('error', 'exited')} (log {out_dir})")
        for name in names[1:]:
            processes.append(PeerProcess(name, [*common, *hosts[name], "--checkpoint-dir", str(out_dir / name),
                                                *follower_args, "--initial-peers", *first["maddrs"]], out_dir,
                                         events=events))
        exited: set[str] = set()
        while len(exited) < num_peers and time.monotonic() < deadline:
            try:
                event = events.get(timeout=1.0)
            except queue.Empty:
                continue
            kind, peer = event["event"], event["peer_key"]
            if kind == "exit":
                exited.add(peer)
            elif kind == "round":
                result.rounds.setdefault(peer, []).append(event)
            elif kind == "ready":
                result.ready[peer] = event
            elif kind == "done":
                result.done[peer] = event
            elif kind == "error":
                result.errors[peer] = event.get("error", "")
        if len(exited) < num_peers:
            result.errors["timeout"] = f"peers still running after {timeout_s:.0f}s"
    finally:
        for process in processes:
            process.stop()
            _kill_group(process.process.pid)
        result.seconds = time.monotonic() - started
        if network is not None:
            network.close()
            result.link_stats = network.stats
        if not result.finished:
            for process in processes:
                lines = process.log_path.read_text(errors="replace").splitlines()
                result.log_tails[process.peer_key] = [line for line in lines if "Warning" not in line][-8:]
    return result


def _behind_link(network: SimulatedNetwork | None, name: str) -> list[str]:
    """A peer's flags to listen behind its simulated link's proxy (none without a simulated network)."""
    if network is None:
        return []
    peer = network.add_peer(name)
    return ["--host-maddr", peer.host_maddr, "--announce-maddr", peer.announce_maddr]


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of a peer's process group: a peer that exits on SIGTERM can leave its hivemind
    children (DHT, averager, p2pd) behind, and ``PeerProcess.stop`` only kills a group whose leader is alive."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous the benchmark starts next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
