"""What miners and validators share: chain, wallet, the hivemind host bound to the hotkey, the round clock, signals.

Start-up order (``start_neuron``): open the wallet, connect to the chain, require a uid (a clear
``NotRegisteredError`` otherwise), read who-is-who from the metagraph (PeerID commitments + axons), start the
hivemind host bootstrapped from the other neurons' axons, publish our address with ``ServeAxon`` and bind our PeerID
to our hotkey with a commitment. Rounds are counted from chain blocks: ``round = block // blocks_per_round``, so
every neuron agrees on the round without a coordinator.

On failure: a chain that cannot be reached is retried by the chain facade and then raises; an axon that the chain
refuses to re-serve (serving rate limit) is logged and the previous record stands; SIGINT/SIGTERM set a stop flag that
the loops check between steps, so a neuron leaves its round cleanly and closes its host. SIGUSR1 (what
``scripts/auto_update.py`` sends before it restarts a neuron on a new release) asks for a stop after the round in
progress: inner training and the all-reduce run to their end, the round is checkpointed, then the neuron exits 0.
With ``--dashboard.port`` a read-only web dashboard (``template/base/dashboard.py``) shows every event the neuron
emits; a port that cannot be bound stops the neuron at start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import bittensor as bt
import hivemind
import torch

from template.allreduce.averager import AveragingConfig
from template.base.config import NeuronConfig
from template.base.dashboard import DashboardError, DashboardServer, start_dashboard
from template.chain.client import CHAIN_UNREACHABLE, ChainClient, NetworkConfigError, NotRegisteredError
from template.chain.wallets import open_wallet
from template.p2p.dht import DHTConfig, DHTStartError, connect_peers, hivemind_log_level, start_dht, visible_maddrs
from template.p2p.identity import PeerDirectory, commitment_value, peer_directory
from template.training.checkpoint import CheckpointError
from template.training.cli import averaging_config
from template.training.spec import RunMismatchError

log = logging.getLogger(__name__)
T = TypeVar("T")
# Failures an operator can fix (flags, wallet, registration, data, network): one line and exit code 2, no traceback.
SETUP_ERRORS: tuple[type[BaseException], ...] = (NotRegisteredError, NetworkConfigError, DHTStartError,
                                                  RunMismatchError, FileNotFoundError, ValueError, DashboardError)
NEURON_ERRORS = SETUP_ERRORS + CHAIN_UNREACHABLE + (CheckpointError,)


def fatal_error(err: BaseException, network: str) -> int:
    """Print one ``error:`` line for an error of :data:`NEURON_ERRORS` and return the neuron's exit code (the
    traceback is logged at debug level: ``--logging.debug`` shows it)."""
    log.debug("stopping on %s", type(err).__name__, exc_info=err)
    if isinstance(err, CheckpointError):
        print(f"error: {err} (what was saved before is intact)", file=sys.stderr)
        return 1
    if isinstance(err, CHAIN_UNREACHABLE) and not isinstance(err, SETUP_ERRORS):
        print(f"error: cannot reach the chain at {network}: {err}", file=sys.stderr)
        return 2
    print(f"error: {err}", file=sys.stderr)
    return 2


def prepare_process(config: NeuronConfig) -> StopFlag:
    """What every neuron process does first: logging (hivemind's chatter from warnings up), torch's thread count,
    and a stop flag that SIGINT/SIGTERM set."""
    logging.basicConfig(level=logging.DEBUG if config.debug else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    hivemind_log_level()
    if config.neuron.torch_threads:
        torch.set_num_threads(config.neuron.torch_threads)
    stop = StopFlag()
    stop.install()
    return stop


class StopFlag:
    """Set by SIGINT/SIGTERM, or by SIGUSR1 ("stop after this round"); loops check it between steps instead of being
    killed mid-write.

    Nothing checks the flag inside a round's inner training or all-reduce: the neurons' loops check it between rounds
    (after the round's checkpoint), so both signals end the neuron there. They differ in who receives them: a stop
    sent to the neuron's whole process group or tree (Ctrl-C, the local network, ``pm2 stop``) also reaches the
    p2p daemon, which dies of it, so an all-reduce in flight fails and the round keeps the old θ; the auto-updater
    sends SIGUSR1 to the neuron's own process only, so the round in progress ends normally. With overlap the round in
    progress includes the all-reduce still in flight: after SIGUSR1 a miner lands it (by its deadline, a round at
    most) and reports it; after SIGINT/SIGTERM it gives it up (its daemon is gone or going).

    hivemind's Python helpers (the DHT and averager processes) are forked from the neuron and inherit these
    handlers: a group signal only sets their copy of the flag, which nothing reads there. They are left running on
    purpose — the neuron's host side waits on them, and a helper that died mid-call would leave that wait to its
    timeout — and stopped by the neuron's shutdown, which kills one that outlives hivemind's own shutdown
    (:func:`template.p2p.hivemind_compat.kill_if_alive`).
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self.finish_round = False  # SIGUSR1 alone: an overlapped round's all-reduce in flight is landed too

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self._now())
        signal.signal(signal.SIGUSR1, lambda *_: self._after_round())

    def _now(self) -> None:
        self.finish_round = False
        self._event.set()

    def _after_round(self) -> None:
        log.info("SIGUSR1: stopping after the round in progress (its checkpoint included)")
        self.finish_round = not self._event.is_set()
        self._event.set()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True if a stop was requested meanwhile."""
        return self._event.wait(max(seconds, 0.0))


class AsyncRunner:
    """One event-loop thread for the hivemind calls that are async (P2P replicas, the publication RPC)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="neuron-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run_on_close(self, coro: Coroutine[Any, Any, Any], what: str, timeout: float = 10.0) -> None:
        """Best effort at shutdown: the hivemind daemon may be gone already (a SIGTERM to the neuron's process group
        reaches it too), and a failed goodbye must not keep the rest of the neuron from closing."""
        try:
            self.run(coro, timeout)
        except Exception as err:  # any failure here only means there is nothing left to close
            log.debug("closing %s: %r", what, err)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


@dataclass(frozen=True)
class RoundTime:
    round: int
    block: int
    round_end: float  # time.time() estimate of the round's last block
    seconds_per_block: float


# The all-reduce gets at least this many seconds on each side of the round's last block.
MIN_ALLREDUCE_GRACE_S = 2.0
# How long a starting neuron that reached live peers waits for one's state (NeuronContext.join_for_state).
PEER_STATE_TIMEOUT_S = 5.0


def allreduce_grace(round_s: float, allreduce_fraction: float) -> float:
    """Seconds the all-reduce gets on each side of a round's last block."""
    return max(MIN_ALLREDUCE_GRACE_S, allreduce_fraction * round_s)


class RoundClock:
    """Rounds from chain blocks: round r spans blocks [r·B, (r+1)·B)."""

    def __init__(self, chain: ChainClient, blocks_per_round: int, allreduce_fraction: float,
                 overlap: bool = False) -> None:
        if blocks_per_round < 2:
            raise ValueError("--neuron.blocks_per_round must be at least 2")
        if not 0 <= allreduce_fraction < 0.5:
            raise ValueError("--neuron.allreduce_fraction must be within [0, 0.5)")
        self.chain = chain
        self.blocks_per_round = blocks_per_round
        self.allreduce_fraction = allreduce_fraction
        self.overlap = overlap  # the run's all-reduces run while the next round trains (RunSpec.overlap)
        self.seconds_per_block = chain.block_time()

    def phases(self, now: RoundTime, matchmaking_time: float) -> tuple[float, float]:
        """(train_until, finish_by) of the round, as time.time() values: every neuron derives the same ones.

        Blocking: training stops ``matchmaking_time + grace`` before the round's last block, and the all-reduce may
        run ``grace`` past it (the next round then trains a little less), with grace = max(2 s, fraction × round).
        Overlap (``--run.overlap``): the all-reduce runs while the next round trains, so training goes on until
        ``grace`` before the last block (time to land the round before, whose all-reduce is due then, and to hand
        this one over) and the all-reduce may run until the next round's training ends, when it is landed.
        """
        grace = self._grace()
        if self.overlap:
            return now.round_end - grace, now.round_end + self.round_s - grace
        return now.round_end - matchmaking_time - grace, now.round_end + grace

    @property
    def allreduce_phase_s(self) -> float:
        """How long a round's all-reduce may take: ``grace`` on each side of the round's last block (overlap: a
        round)."""
        return self.round_s if self.overlap else 2 * self._grace()

    @property
    def round_s(self) -> float:
        """Seconds per round."""
        return self.blocks_per_round * self.seconds_per_block

    @property
    def round_timeout_s(self) -> float:
        """How long to wait for the next round before giving up on the chain (four rounds and a minute)."""
        return 4 * self.round_s + 60

    def _grace(self) -> float:
        return allreduce_grace(self.round_s, self.allreduce_fraction)

    def now(self) -> RoundTime:
        block = self.chain.block()
        round = block // self.blocks_per_round
        blocks_left = (round + 1) * self.blocks_per_round - block
        return RoundTime(round, block, time.time() + blocks_left * self.seconds_per_block, self.seconds_per_block)

    def wait_for_round(self, round: int, stop: StopFlag, timeout_s: float) -> RoundTime | None:
        """Block until the chain reaches ``round`` (or later); None on stop or timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = self.now()
            if now.round >= round:
                return now
            if stop.sleep(min(self.seconds_per_block / 2, 1.0)):
                return None
        return None


@dataclass
class NeuronContext:
    """A started neuron: everything its role-specific loop needs."""

    config: NeuronConfig
    wallet: bt.Wallet
    chain: ChainClient
    uid: int
    dht: hivemind.DHT
    runner: AsyncRunner
    clock: RoundClock
    stop: StopFlag
    dashboard: DashboardServer | None = None

    @property
    def hotkey(self) -> str:
        return self.wallet.hotkey.ss58_address

    @property
    def netuid(self) -> int:
        return self.config.chain.netuid

    @property
    def state_dir(self) -> Path:
        return self.config.state_dir

    def averaging_config(self, expected_peers: int, *, auxiliary: bool = False) -> AveragingConfig:
        """The all-reduce settings of this neuron's rounds: groups sized for ``expected_peers`` neurons (validators
        join as auxiliary peers, so the group must have room for every neuron), timeouts cut to the round's
        all-reduce phase."""
        return averaging_config(self.config.averaging, max(2, expected_peers),
                                phase_s=self.clock.allreduce_phase_s, auxiliary=auxiliary)

    def directory(self) -> PeerDirectory:
        return peer_directory(self.chain.metagraph())

    def settled_directory(self, timeout_s: float = 15.0, quiet_s: float = 3.0) -> PeerDirectory:
        """The directory once it stops growing: every registered neuron has committed a PeerID, or no new one did
        for ``quiet_s``, or ``timeout_s`` passed. Neurons that start together size their all-reduce groups from it,
        so a neuron that started a second earlier than the rest must not see only itself."""
        deadline = time.monotonic() + timeout_s
        directory, since = None, time.monotonic()
        while True:
            graph = self.chain.metagraph()  # one read gives both the registered neurons and their commitments
            fresh = peer_directory(graph)
            if directory is None or len(fresh) != len(directory):
                directory, since = fresh, time.monotonic()
            if (len(directory) >= len(graph.hotkeys) or time.monotonic() >= deadline
                    or time.monotonic() - since >= quiet_s or self.stop.sleep(0.5)):
                return directory

    def join_peers(self, directory: PeerDirectory) -> int:
        """Dial the neurons the chain lists (axon + PeerID), so neurons that started together find each other."""
        return connect_peers(self.dht, directory.bootstrap_maddrs(exclude_hotkey=self.hotkey))

    def join_for_state(self, directory: PeerDirectory) -> float:
        """Dial the chain's neurons before restoring; how long to wait for a live peer's state: none when none
        answered. A neuron alone (the first of a run, or restarted while the others are down) has nobody to download
        from, and waited the whole timeout at every start for it."""
        return PEER_STATE_TIMEOUT_S if self.join_peers(directory) else 0.0

    def emit(self, event: str, **fields: Any) -> None:
        """One JSON line in ``--neuron.events_file`` (nothing without it), and the same event to the dashboard."""
        record = dict(event=event, time=time.time(), **fields)
        path = self.config.neuron.events_file
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.dashboard is not None:
            self.dashboard.record(record)

    def close(self) -> None:
        if self.dashboard is not None:
            self.dashboard.close()
        self.dht.shutdown()
        self.runner.close()
        self.chain.close()


def start_neuron(config: NeuronConfig, stop: StopFlag) -> NeuronContext:
    """Everything before the role's loop (see the module docstring); raises NotRegisteredError, NetworkConfigError."""
    wallet_config = config.chain.wallet
    wallet = open_wallet(wallet_config.name, wallet_config.hotkey, wallet_config.path)
    chain = ChainClient.connect(config.chain.subtensor.network, config.chain.netuid)
    clock = RoundClock(chain, config.neuron.blocks_per_round, config.neuron.allreduce_fraction, config.run.overlap)
    graph = chain.metagraph()
    uid = chain.require_uid(wallet.hotkey.ss58_address, graph)
    directory = peer_directory(graph)
    bootstrap = directory.bootstrap_maddrs(exclude_hotkey=wallet.hotkey.ss58_address)  # not our previous run
    log.info("uid %d on netuid %d; bootstrapping from %d peers", uid, config.chain.netuid, len(bootstrap))
    axon = config.axon
    external_ip = axon.external_ip or axon.ip
    external_port = axon.external_port or axon.port
    announce = [f"/ip4/{external_ip}/tcp/{external_port}"] if axon.external_port or (axon.port and axon.external_ip) \
        else []
    host = DHTConfig(host_maddrs=[f"/ip4/{axon.ip}/tcp/{axon.port}"], announce_maddrs=announce)
    try:
        dht = start_dht(dataclasses.replace(host, initial_peers=bootstrap))
    except DHTStartError as err:
        if not bootstrap:
            raise
        # The chain still lists neurons that are gone (their axons outlive them): start alone; join_peers dials
        # whoever is alive at every round.
        log.warning("none of the %d neurons on chain could be reached (%s); starting without them", len(bootstrap), err)
        dht = start_dht(host)
    runner = AsyncRunner()
    try:
        port = int(visible_maddrs(dht)[0].split("/tcp/")[1].split("/")[0])
        serve_axon_once(chain, wallet, graph, uid, external_ip, port)
        chain.set_commitment(wallet, commitment_value(str(dht.peer_id)))
        dashboard = start_dashboard(config.dashboard, "validator" if config.validator is not None else "miner")
    except BaseException:
        dht.shutdown()
        runner.close()
        raise
    if dashboard is not None:
        print(f"dashboard: {dashboard.url}", file=sys.stderr, flush=True)
    config.state_dir.mkdir(parents=True, exist_ok=True)
    return NeuronContext(config, wallet, chain, uid, dht, runner, clock, stop, dashboard)


def serve_axon_once(chain: ChainClient, wallet: bt.Wallet, graph: bt.Metagraph, uid: int, ip: str, port: int) -> None:
    """Serve ``ip:port`` unless the chain already holds it; a refusal (serving rate limit) is logged, not fatal."""
    if graph.neuron(uid).axon == f"{ip}:{port}":
        return
    try:
        chain.serve_axon(wallet, ip, port)
    except bt.ChainError as err:
        log.warning("could not serve axon %s:%d (%s); peers will use the previous record", ip, port, err)
