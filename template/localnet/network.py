"""One command runs the whole subnet on this machine: ``python -m template.localnet --miners 3 --rounds 3``.

In order: start the mock chain server (its own process); create throwaway wallets under ``DIR/wallets``; create the
subnet and register one validator (with stake, so it holds the only validator permit) and N miners, through the
server; start the validator and the miners as separate processes (``neurons/validator.py``, ``neurons/miner.py``,
each in its own process group, logging to ``DIR/<name>.log`` and appending JSON events to ``DIR/<name>.events``);
run until every miner has reported R rounds; wait until the validator has set weights and a Yuma epoch has run on
them; read weights, incentive and emission from the chain; stop everything; write ``DIR/report.json``, two PNG plots
and ``DIR/report.html`` (:mod:`template.localnet.report`). Everything listens on 127.0.0.1 only.

While it runs, the terminal shows one status line per neuron (role, uid, round, step or scored miners, loss,
tokens/s), redrawn every second, and one line per finished round (group size, all-reduce seconds, bytes, weights).
With ``--dashboard`` every neuron also serves its live web dashboard on its own free port of 127.0.0.1; the addresses
are printed at start (``dashboard of NAME: URL``) and kept in the report's ``run``.

Exit status: 0 only when the report's checks pass (held-out loss fell, honest miners identical after every round,
weights on chain turned into incentive); 1 when they do not, a child died or the run timed out; 2 for bad options;
130 on Ctrl-C or SIGTERM. On every exit path all children are stopped (SIGTERM, then SIGKILL of each whole process
group, hivemind's helpers included) before the command returns; a child that died early is named, with the tail of
its log. Only a SIGKILL of this command itself can leave children behind.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from template.allreduce.codecs import CODEC_NAMES
from template.base.behaviours import BUILTIN, load_behaviour
from template.chain.client import ChainClient
from template.chain.mock_server import RemoteMockSubstrate
from template.chain.wallets import create_wallet
from template.localnet.report import (
    HONEST,
    ChainSnapshot,
    NeuronInfo,
    build_report,
    parse_events,
    round_rows,
    write_report,
)
from template.localnet.view import LiveView, print_summary, tail_text
from template.p2p.simulated_link import LinkSpec, SimulatedNetwork, SimulatedPeer
from template.training.cli import codec_in_effect
from template.training.data import names_files
from template.training.model import MODEL_PRESETS
from template.training.outer import default_overlap
from template.training.run import PeerProcess

REPO = Path(__file__).resolve().parents[2]  # template/localnet/network.py -> the repository root
RUN_MARKER_ENV = "DILOCO_LOCALNET_RUN"  # every child (and whatever it forks) inherits it: how tests find leftovers
NETUID = 1
VALIDATOR_STAKE_TAO = 1000.0
POLL_S = 0.25
CHAIN_START_TIMEOUT_S = 60.0
T = TypeVar("T")


@dataclass(frozen=True)
class LocalnetConfig:
    """Everything one local network run needs; the defaults finish in a few minutes on 2 CPU cores."""

    out: Path
    miners: int = 3
    rounds: int = 3
    behaviours: tuple[str, ...] = ()  # one per miner; empty: all honest
    model: str = "tiny"
    data: str = "builtin"
    blocks_per_round: int = 40  # 20 s rounds: room for a loaded 2-core machine to train, match and average
    seconds_per_block: float = 0.5
    tempo: int = 10  # blocks between Yuma epochs
    compression: str | None = None  # None: the preset's codec (template.training.cli.PRESET_COMPRESSION)
    inner_steps: int = 10
    seq_len: int = 64
    matchmaking_time: float = 5.0
    timeout_s: float = 900.0
    dashboard: bool = False  # every neuron serves its dashboard on a free port of 127.0.0.1
    link_mbit: float | None = None  # every neuron behind a simulated access link (a test knob: simulated_link.py)
    link_latency_ms: float = 0.0
    overlap: bool | None = None  # every neuron trains the next round while a round's all-reduce runs
    # (--run.overlap); None: the codec's default (template.training.outer.default_overlap)

    def miner_behaviours(self) -> list[str]:
        return list(self.behaviours) or [HONEST] * self.miners

    def overlapped(self) -> bool:
        """Whether the neurons overlap: as asked, or the default of the codec in effect."""
        codec = codec_in_effect(self.compression, self.model)
        return default_overlap(codec) if self.overlap is None else self.overlap


class ChildDied(RuntimeError):
    """A neuron or the chain exited while the network was still meant to run."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM, noticed at a point where every started child is on record (so none can be missed)."""


class NeuronProcess(PeerProcess):
    """A child in its own process group, stopped as a training peer is (SIGTERM, then SIGKILL of the whole group).

    It differs from :class:`PeerProcess` only in what it runs (any command; stdout and stderr go to its log) and where
    its events come from: the JSON lines it appends to ``events_file``, tailed on a background thread into the shared
    queue and tagged with ``peer_key`` (the neuron's name); ``{"event": "exit", "code": ...}`` follows its exit.
    """

    def __init__(self, name: str, command: list[str], log_dir: Path, env: dict[str, str], events: queue.Queue,
                 events_file: Path | None = None) -> None:
        self.peer_key = name
        self.events = events
        self.events_file = events_file
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log.write(f"$ {shlex.join(command)}\n".encode())  # the log says how to rerun the process by hand
        self._log.flush()
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.last: dict[str, Any] = {}
        self._reader = threading.Thread(target=self._tail, name=f"tail-{name}", daemon=True)
        self._reader.start()

    def _tail(self) -> None:
        offset, partial = 0, b""
        while True:
            exited = self.process.poll() is not None  # read once more after the exit: its last lines count
            if self.events_file is not None and self.events_file.exists():
                with open(self.events_file, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                *lines, partial = (partial + chunk).split(b"\n")
                for event in parse_events(lines):
                    event["peer_key"] = self.peer_key
                    self.last = event
                    self.events.put(event)
            if exited:
                break
            time.sleep(POLL_S)
        self.events.put(dict(event="exit", peer_key=self.peer_key, code=self.process.returncode))


def child_env(out: Path) -> dict[str, str]:
    """The children's environment: unbuffered output, the SDK's token-symbol cache kept inside the run directory
    (a mock chain's symbols must not land in the user's real cache), and the run marker."""
    return dict(os.environ, PYTHONUNBUFFERED="1", BTCLI_TOKEN_SYMBOLS_CACHE=str(out / "token_symbols.json"),
                **{RUN_MARKER_ENV: str(out)})


def create_neurons(remote: RemoteMockSubstrate, config: LocalnetConfig, wallet_dir: Path) -> list[NeuronInfo]:
    """Wallets, the subnet and the registrations, all through the chain server. The validator alone has stake, and
    only one permit exists, so miners never become validators from their emission."""
    remote.create_subnet(NETUID, tempo=config.tempo, weights_rate_limit=2, serving_rate_limit=0,
                         max_allowed_validators=1, name="localnet")
    plan = [("validator", "validator", None)] + [
        (f"miner{i}", "miner", behaviour) for i, behaviour in enumerate(config.miner_behaviours(), start=1)
    ]
    neurons = []
    for name, role, behaviour in plan:
        wallet = create_wallet(name, "default", wallet_dir)
        hotkey = wallet.hotkey.ss58_address
        stake = VALIDATOR_STAKE_TAO if role == "validator" else 0.0
        uid = remote.register(NETUID, hotkey, wallet.coldkeypub.ss58_address, stake)
        honest = load_behaviour(behaviour).honest if role == "miner" else None
        neurons.append(NeuronInfo(name=name, role=role, uid=uid, hotkey=hotkey, behaviour=behaviour, honest=honest))
    return neurons


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now (the neuron that is given it binds it soon after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def neuron_command(config: LocalnetConfig, neuron: NeuronInfo, url: str, out: Path,
                   dashboard_port: int = 0, link: SimulatedPeer | None = None) -> list[str]:
    """The neuron's command line as an operator would type it; the --run.* values are the same for every neuron.
    Behind a simulated ``link`` its host listens on the link's port and serves the proxy's on chain, as a node
    behind a port-forwarding router would."""
    script = "neurons/validator.py" if neuron.role == "validator" else "neurons/miner.py"
    command = [
        sys.executable, script, "--netuid", str(NETUID), "--wallet.name", neuron.name, "--wallet.hotkey", "default",
        "--wallet.path", str(out / "wallets"), "--subtensor.network", url,
        "--neuron.full_path", str(out / neuron.name), "--neuron.blocks_per_round", str(config.blocks_per_round),
        "--neuron.events_file", str(out / f"{neuron.name}.events"), "--neuron.torch_threads", "1",
        "--run.preset", config.model, "--run.data", config.data, "--run.inner_steps", str(config.inner_steps),
        "--run.seq_len", str(config.seq_len), "--averaging.matchmaking_time", str(config.matchmaking_time),
        "--wandb.off",
    ]
    if config.compression:
        command += ["--averaging.compression", config.compression]
    command += ["--run.overlap" if config.overlapped() else "--no-run.overlap"]
    if neuron.role == "miner":
        command += ["--miner.behaviour", str(neuron.behaviour)]
    if dashboard_port:
        command += ["--dashboard.port", str(dashboard_port)]
    if link is not None:
        command += ["--axon.port", str(link.host_port), "--axon.external_port", str(link.proxy_port)]
    return command


def read_chain(url: str, validator_uids: list[int]) -> ChainSnapshot:
    """Weights, incentive and emission as the SDK reads them from the chain (metagraph and the Weights map)."""
    client = ChainClient.connect(url, NETUID)
    try:
        graph = client.metagraph()
        weights = client.subtensor.weights.weights(NETUID)
        return ChainSnapshot(
            block=client.block(),
            weights={uid: weights.get(uid, {}) for uid in validator_uids},
            incentive={n.uid: float(n.incentive) for n in graph.neurons},
            emission={n.uid: float(n.emission.alpha) for n in graph.neurons},
        )
    finally:
        client.close()


class Localnet:
    """One run: the children, their events, and the phases from start to report."""

    def __init__(self, config: LocalnetConfig, stream=sys.stderr) -> None:
        self.config = config
        self.out = config.out
        self.env = child_env(self.out)
        self.queue: queue.Queue[dict] = queue.Queue()
        self.children: dict[str, NeuronProcess] = {}
        self.events: dict[str, list[dict]] = {}
        self.neurons: list[NeuronInfo] = []
        self.dashboards: dict[str, str] = {}  # neuron name -> its dashboard's address (--dashboard)
        self.view = LiveView(stream)
        self.remote: RemoteMockSubstrate | None = None
        self.url = ""
        self.interrupt = threading.Event()  # set by the SIGINT/SIGTERM handler; checked by check_interrupt()
        self.link = SimulatedNetwork(LinkSpec(config.link_mbit, config.link_latency_ms)) \
            if config.link_mbit is not None else None

    def run(self) -> dict[str, Any]:
        """Start, train, wait for weights and incentive, read the chain; returns the report (files written)."""
        config = self.config
        deadline = time.monotonic() + config.timeout_s
        self.start_chain()
        self.neurons = create_neurons(self.remote, config, self.out / "wallets")
        self.view.line(f"local network on {self.url}: 1 validator + {config.miners} miners "
                       f"({', '.join(config.miner_behaviours())}), {config.rounds} rounds of "
                       f"{config.blocks_per_round} blocks; logs in {self.out}")
        for neuron in self.neurons:
            self.check_interrupt()
            port = free_port() if config.dashboard else 0
            link = self.link.add_peer(neuron.name) if self.link is not None else None
            command = neuron_command(config, neuron, self.url, self.out, port, link)
            self.children[neuron.name] = NeuronProcess(neuron.name, command, self.out, self.env, self.queue,
                                                       self.out / f"{neuron.name}.events")
            if port:
                self.dashboards[neuron.name] = f"http://127.0.0.1:{port}/"
                self.view.line(f"dashboard of {neuron.name}: {self.dashboards[neuron.name]}")
        self.view.track(self.neurons, {n.name: self.children[n.name].log_path for n in self.neurons})
        last_round = self.pump(self.rounds_done, deadline, f"every miner to report {config.rounds} rounds")
        self.wait_for_incentive(deadline)
        validators = [n.uid for n in self.neurons if n.role == "validator"]
        snapshot = read_chain(self.url, validators)
        run = dict(asdict(config), overlap=config.overlapped(), out=str(self.out), chain=self.url, netuid=NETUID,
                   behaviours=config.miner_behaviours(), dashboards=self.dashboards)
        if self.link is not None:
            run["link_bytes_sent"] = dict(self.link.stats.sent)
        report = build_report(self.neurons, self.events, snapshot, last_round=last_round, run=run)
        write_report(report, self.out)
        return report

    def wait_for_incentive(self, deadline: float) -> None:
        """Wait for weights set after the last round, then for the Yuma epoch that turns them into incentive. Each
        wait is bounded by what a working validator needs; running out is a failed check in the report, not an error.
        """
        config = self.config
        since = time.time()
        round_s = config.blocks_per_round * config.seconds_per_block
        try:
            weights_by = min(deadline, time.monotonic() + 3 * round_s + 60)
            weights = self.pump(lambda: self.weights_set_since(since), weights_by,
                                "the validator to set weights after the last round")
            set_at = weights.get("block") or self.block()
            self.view.line(f"waiting for the Yuma epoch after block {set_at} (tempo {config.tempo} blocks) to turn "
                           "weights into incentive")
            epoch_wait = (config.tempo + 2) * config.seconds_per_block + 30
            self.pump(lambda: self.block() > set_at + config.tempo, min(deadline, time.monotonic() + epoch_wait),
                      f"block {set_at + config.tempo + 1}")
        except TimeoutError as err:
            self.view.line(f"{err}; the report will show it")

    def start_chain(self) -> None:
        command = [sys.executable, "-m", "template.chain.mock_server", "--port", "0",
                   "--seconds-per-block", str(self.config.seconds_per_block),
                   "--state-file", str(self.out / "chain.json")]
        chain = NeuronProcess("chain", command, self.out, self.env, self.queue)
        self.children["chain"] = chain
        deadline = time.monotonic() + CHAIN_START_TIMEOUT_S
        while time.monotonic() < deadline:
            self.check_interrupt()
            for line in tail_text(chain.log_path, 5).splitlines():
                if line.startswith("mock chain listening on "):
                    self.url = line.removeprefix("mock chain listening on ").strip()
                    self.remote = RemoteMockSubstrate(self.url)
                    return
            if not chain.alive():
                raise ChildDied(self.died_message("chain", chain.process.returncode))
            time.sleep(POLL_S)
        raise TimeoutError(f"the mock chain did not start within {CHAIN_START_TIMEOUT_S:.0f}s ({chain.log_path})")

    def pump(self, until: Callable[[], T], deadline: float, what: str) -> T:
        """Handle events and redraw the view until ``until()`` returns something true, which is returned."""
        while True:
            try:
                event = self.queue.get(timeout=1.0)
            except queue.Empty:
                event = None
            while event is not None:
                self.handle(event)
                event = self.queue.get_nowait() if not self.queue.empty() else None
            self.check_interrupt()
            self.view.refresh()
            result = until()
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"gave up waiting for {what}")

    def handle(self, event: dict) -> None:
        name = event["peer_key"]
        if event["event"] == "exit":
            raise ChildDied(self.died_message(name, event["code"]))
        self.events.setdefault(name, []).append(event)
        self.view.handle(event)
        if event["event"] == "round":
            self.maybe_print_round(event["round"])

    def maybe_print_round(self, r: int) -> None:
        """Round ``r`` is over once every miner reported it or a later round."""
        miners = [n for n in self.neurons if n.role == "miner"]
        if all(any(e["event"] == "round" and e["round"] >= r for e in self.events.get(m.name, [])) for m in miners):
            rows = [row for row in round_rows(self.neurons, self.events, r) if row["round"] == r]
            if rows:
                self.view.round_line(rows[0])

    def rounds_done(self) -> int | None:
        """The last round of the run once every miner has reported ``rounds`` rounds; None before."""
        counts, last = [], None
        for neuron in self.neurons:
            if neuron.role == "miner":
                rounds = [e["round"] for e in self.events.get(neuron.name, []) if e["event"] == "round"]
                counts.append(len(rounds))
                last = max([last or 0, *rounds])
        return last if counts and min(counts) >= self.config.rounds else None

    def weights_set_since(self, since: float) -> dict | None:
        return next((e for n in self.neurons if n.role == "validator" for e in self.events.get(n.name, [])
                     if e["event"] == "weights" and e.get("ok") and e["time"] >= since), None)

    def check_interrupt(self) -> None:
        if self.interrupt.is_set():
            raise Interrupted

    def block(self) -> int:
        return int(self.remote.request("block_number"))

    def died_message(self, name: str, code: int | None) -> str:
        child = self.children[name]
        uid = next((f" (uid {n.uid})" for n in self.neurons if n.name == name), "")
        tail = "\n".join("    " + line for line in tail_text(child.log_path, 25).splitlines())
        return f"{name}{uid} exited with code {code} while the network was running; the end of {child.log_path}:\n" \
               f"{tail}"

    def stop(self) -> None:
        """Stop the neurons together (each: SIGTERM, grace, SIGKILL of its group), then the chain they talk to."""
        neurons = [child for name, child in self.children.items() if name != "chain"]
        if neurons:
            with ThreadPoolExecutor(len(neurons)) as pool:
                list(pool.map(NeuronProcess.stop, neurons))
        if self.link is not None:
            self.link.close()
        if "chain" in self.children:
            self.children["chain"].stop()
        if self.remote is not None:
            asyncio.run(self.remote.close())
        self.view.close()


# --- Command line ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    defaults = LocalnetConfig(out=Path())
    parser = argparse.ArgumentParser(prog="python -m template.localnet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--miners", type=int, default=defaults.miners, help="number of miners (>= 2)")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="rounds every miner must finish (>= 2)")
    parser.add_argument("--out", default=None, help="run directory, new or empty (default runs/localnet-TIME)")
    parser.add_argument("--miner-behaviours", default="",
                        help="comma-separated, one per miner: " + ", ".join(sorted(BUILTIN))
                             + " or module:Class, a MinerBehaviour subclass (default: all honest; what each does: "
                               "template/base/behaviours.py)")
    parser.add_argument("--model", default=defaults.model, choices=sorted(MODEL_PRESETS), help="model preset")
    parser.add_argument("--data", default=defaults.data,
                        help="'builtin' (generated, no download), 'stdlib' (Python's own English docs) or files")
    parser.add_argument("--blocks-per-round", type=int, default=defaults.blocks_per_round)
    parser.add_argument("--seconds-per-block", type=float, default=defaults.seconds_per_block)
    parser.add_argument("--tempo", type=int, default=defaults.tempo, help="blocks between Yuma epochs")
    parser.add_argument("--compression", default=defaults.compression, choices=CODEC_NAMES,
                        help="codec of the all-reduce (default: the preset's, fp16 for tiny, sparse for small and 1b)")
    parser.add_argument("--inner-steps", type=int, default=defaults.inner_steps, help="H: inner steps per round")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--matchmaking-time", type=float, default=defaults.matchmaking_time)
    parser.add_argument("--timeout", type=float, default=defaults.timeout_s, help="give up after this many seconds")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=defaults.overlap,
                        help="every neuron trains the next round while a round's all-reduce runs (--run.overlap: "
                             "a round is published and scored one round later); --no-overlap blocks (default: on "
                             "for the dense codecs, off for sparse, as the neurons' own default)")
    parser.add_argument("--dashboard", action="store_true",
                        help="every neuron serves its live web dashboard on a free port of 127.0.0.1 (addresses "
                             "printed at start)")
    parser.add_argument("--link.mbit", dest="link_mbit", type=float, default=None,
                        help="TEST KNOB: put every neuron behind a simulated access link of this many Mbit/s per "
                             "direction (a pacing proxy on 127.0.0.1: template/p2p/simulated_link.py)")
    parser.add_argument("--link.latency_ms", dest="link_latency_ms", type=float, default=0.0,
                        help="one-way delay of the simulated link, milliseconds (with --link.mbit)")
    return parser


def config_from_args(argv: list[str] | None) -> LocalnetConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    behaviours = tuple(b.strip() for b in args.miner_behaviours.split(",") if b.strip())
    problems = []
    if args.miners < 2:
        problems.append("--miners must be >= 2 (one miner has nobody to average with)")
    if args.rounds < 2:
        problems.append("--rounds must be >= 2 (the loss check compares the first round with the last)")
    if behaviours and len(behaviours) != args.miners:
        problems.append(f"--miner-behaviours names {len(behaviours)} behaviours for {args.miners} miners")
    if args.blocks_per_round < 4 or args.seconds_per_block <= 0 or args.tempo < 1:
        problems.append("need --blocks-per-round >= 4, --seconds-per-block > 0 and --tempo >= 1")
    for behaviour in behaviours:
        try:
            load_behaviour(behaviour)
        except ValueError as err:
            problems.append(str(err))
    if args.link_mbit is not None:
        try:
            LinkSpec(args.link_mbit, args.link_latency_ms)
        except ValueError as err:
            problems.append(f"--link.mbit/--link.latency_ms: {err}")
    elif args.link_latency_ms:
        problems.append("--link.latency_ms needs --link.mbit")
    out = Path(args.out) if args.out else Path("runs") / time.strftime("localnet-%Y%m%d-%H%M%S")
    if out.exists() and any(out.iterdir()):
        problems.append(f"--out {out} is not empty: choose a new directory")
    if problems:
        parser.error("; ".join(problems))
    return LocalnetConfig(
        out=out.resolve(), miners=args.miners, rounds=args.rounds, behaviours=behaviours, model=args.model,
        data=absolute_sources(args.data), blocks_per_round=args.blocks_per_round,
        seconds_per_block=args.seconds_per_block, tempo=args.tempo, compression=args.compression,
        inner_steps=args.inner_steps, seq_len=args.seq_len, matchmaking_time=args.matchmaking_time,
        timeout_s=args.timeout, dashboard=args.dashboard, link_mbit=args.link_mbit,
        link_latency_ms=args.link_latency_ms, overlap=args.overlap,
    )


def absolute_sources(data: str) -> str:
    """File sources made absolute (the neurons run from the repository root); ``builtin``, ``stdlib`` and ``hf:`` as
    they are."""
    if not names_files(data):
        return data
    return ",".join(str(Path(part).expanduser().resolve()) for part in data.split(","))


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(argv)
    config.out.mkdir(parents=True, exist_ok=True)
    os.environ["BTCLI_TOKEN_SYMBOLS_CACHE"] = str(config.out / "token_symbols.json")  # our own chain reads, too
    net = Localnet(config)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # `kill` or a closed terminal: as Ctrl-C
        signal.signal(signum, lambda *_: net.interrupt.set())
    report = None
    status = 1
    try:
        report = net.run()
        status = 0 if report["passed"] else 1
    except Interrupted:
        net.view.line("interrupted: stopping every process")
        status = 130
    except (ChildDied, TimeoutError) as err:
        net.view.line(f"error: {err}")
    finally:
        net.stop()  # a second Ctrl-C only sets the flag again: it cannot cut the clean-up short
    if report is not None:
        print_summary(report, config.out)
    return status

