"""Start a hivemind DHT node safely: no NAT traversal or relays, retried start-up, bounded waits.

Why a wrapper: hivemind's defaults turn on UPnP port mapping, AutoNAT and relays, which reach out to the
network on their own; we always switch them off and let a public deployment say its public address through
``announce_maddrs``. Start-up is also flaky on small machines ("failed to connect to bootstrap peers", 0.6–4.8 s
per start on 2 cores, DESIGN.md §7), so :func:`start_dht` retries with exponential backoff.

Guarantees on failure: every attempt is bounded by ``start_timeout``; a failed attempt's node is shut down
before the next one starts; after ``start_attempts`` failures :class:`DHTStartError` is raised (with the
last cause chained) and no node from this call is left running.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial

import hivemind
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.multiaddr import Multiaddr

from template.p2p.hivemind_compat import (
    DHTSurvivingDeadSenders,
    check_hivemind_version,
    dial,
    visible_maddrs_coroutine,
)

__all__ = [
    "DHTConfig", "DHTStartError", "connect_peers", "hivemind_log_level", "rejoin_connected_peers", "start_dht",
    "visible_maddrs",
]

logger = logging.getLogger(__name__)

HIVEMIND_LOGLEVEL = "HIVEMIND_LOGLEVEL"  # hivemind's own knob for its logger


def hivemind_log_level() -> None:
    """Quiet hivemind's logger down to warnings unless ``HIVEMIND_LOGLEVEL`` asks for more (``DEBUG`` shows each
    peer's matchmaking and DHT calls: how lost rounds were found). Every program that runs peers calls it once, so
    the variable means the same everywhere (neurons, the engine's CLI, benchmarks)."""
    logging.getLogger("hivemind").setLevel(os.environ.get(HIVEMIND_LOGLEVEL, "WARNING"))


# Never negotiable: these make hivemind contact third parties or open router ports on its own.
_NO_NAT_TRAVERSAL = dict(nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)


@dataclass
class DHTConfig:
    """Where the node listens, what it announces, whom it bootstraps from, and how hard it tries to start."""

    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)  # public address(es) of a deployed node
    initial_peers: list[str] = field(default_factory=list)  # multiaddrs with /p2p/<peer id>
    identity_path: str | None = None  # a private key file: a stable PeerID across restarts
    client_mode: bool = False  # True: no incoming connections (cannot reduce or share state)
    start_attempts: int = 3
    start_timeout: float = 30.0  # seconds per attempt
    start_backoff: float = 1.0  # seconds before the 2nd attempt, doubled for each next one

    def __post_init__(self) -> None:
        if self.start_attempts < 1:
            raise ValueError("start_attempts must be >= 1")
        if self.start_timeout <= 0 or self.start_backoff < 0:
            raise ValueError("start_timeout must be > 0 and start_backoff >= 0")
        if not self.host_maddrs:
            raise ValueError("host_maddrs must not be empty")


class DHTStartError(RuntimeError):
    """The DHT node did not start within the configured attempts."""


def _dht_kwargs(config: DHTConfig) -> dict:
    kwargs: dict = dict(
        initial_peers=list(config.initial_peers),
        host_maddrs=list(config.host_maddrs),
        client_mode=config.client_mode,
        startup_timeout=config.start_timeout,
        **_NO_NAT_TRAVERSAL,
    )
    if config.announce_maddrs:
        kwargs["announce_maddrs"] = list(config.announce_maddrs)
    if config.identity_path is not None:
        kwargs["identity_path"] = config.identity_path
    return kwargs


def start_dht(config: DHTConfig | None = None) -> hivemind.DHT:
    """Start a DHT node and wait until it serves requests; retry with backoff; raise :class:`DHTStartError`."""
    check_hivemind_version()
    config = config or DHTConfig()
    last_error: BaseException | None = None
    for attempt in range(1, config.start_attempts + 1):
        dht = DHTSurvivingDeadSenders(start=False, **_dht_kwargs(config))
        try:
            dht.run_in_background(await_ready=True, timeout=config.start_timeout)
            return dht
        except Exception as e:  # hivemind raises P2PDaemonError, TimeoutError, ... depending on the stage
            last_error = e
            logger.warning("DHT start attempt %d/%d failed: %r", attempt, config.start_attempts, e)
            _stop(dht)
        if attempt < config.start_attempts:
            time.sleep(config.start_backoff * 2 ** (attempt - 1))
    raise DHTStartError(f"DHT did not start after {config.start_attempts} attempts: {last_error!r}") from last_error


def _stop(dht: hivemind.DHT) -> None:
    """Shut a (possibly half-started) node down; hivemind's shutdown is bounded by its shutdown_timeout."""
    if dht.is_alive():
        dht.shutdown()  # joins for shutdown_timeout, then terminates


def visible_maddrs(dht: hivemind.DHT, timeout_s: float = 10.0) -> list[str]:
    """Multiaddrs (with /p2p/<peer id>) that other peers pass as ``initial_peers`` to join this node.

    hivemind's own ``get_visible_maddrs`` waits forever when the DHT process has died; this raises
    :class:`DHTStartError` instead (dead node) or ``TimeoutError`` (no answer within ``timeout_s``).
    """
    if not dht.is_alive():
        raise DHTStartError(f"the DHT process is not running (exit code {dht.exitcode})")
    future = dht.run_coroutine(visible_maddrs_coroutine(), return_future=True)
    return [str(maddr) for maddr in future.result(timeout=timeout_s)]


def connect_peers(dht: hivemind.DHT, maddrs: list[str], timeout_s: float = 15.0) -> int:
    """Dial peers that came up after this node started and add them to its routing table; returns how many answered.

    Neurons bootstrap from the axons on chain when they start, but two neurons that start at the same moment see
    each other's axon only later: calling this with the current axons every round joins the DHTs together. A peer
    that cannot be dialed is skipped (logged), each dial is bounded inside the DHT process, and the whole call by
    ``timeout_s``: a join that runs out of time is logged and counts no peer, for joining is best effort every round.
    It must never stop a neuron: a dial that hung (the DHT process left a pending call unanswered, seen on a loaded
    machine while an overlapped all-reduce used the same DHT) once ended a miner with a bare TimeoutError, which the
    neuron read as an unreachable chain.
    """
    own = str(dht.peer_id)
    targets = [maddr for maddr in maddrs if Multiaddr(maddr)["p2p"] != own]
    if not targets:
        return 0
    future = dht.run_coroutine(partial(_dial_all, maddrs=targets, timeout_s=timeout_s / 2), return_future=True)
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError:
        logger.warning("dialing %d peers took more than %.0f s: going on with the peers already known",
                       len(targets), timeout_s)
        return 0


async def _dial_all(_dht: hivemind.DHT, node: DHTNode, maddrs: list[str], timeout_s: float) -> int:
    """Runs inside the DHT process (hence module-level, with plain-string arguments); each peer within ``timeout_s``."""

    async def reach(maddr: str) -> bool:
        address = Multiaddr(maddr)
        peer_id = PeerID.from_base58(address["p2p"])
        try:
            await dial(node.p2p, peer_id, address.decapsulate(Multiaddr(f"/p2p/{address['p2p']}")))
            return await node.protocol.call_ping(peer_id) is not None
        except Exception as e:  # an unreachable or misbehaving peer must not stop the others
            logger.info("could not reach peer at %s: %r", maddr, e)
            return False

    async def bounded(maddr: str) -> bool:
        try:
            return await asyncio.wait_for(reach(maddr), timeout_s)
        except asyncio.TimeoutError:
            logger.info("could not reach peer at %s within %.0f s", maddr, timeout_s)
            return False

    return sum(await asyncio.gather(*(bounded(maddr) for maddr in maddrs)))


def rejoin_connected_peers(dht: hivemind.DHT) -> MPFuture:
    """Ask the DHT process to ping the peers its p2p host is connected to and its routing table lacks; the future
    says how many answered (a ping that is answered puts each node back in the other's table). Nobody has to wait.

    Why: hivemind's DHT drops a node from its routing table the first time a request to it goes unanswered (within
    ``wait_timeout``, 3 s) and takes it back only when that node sends it a request. In a small network that can cut
    the DHT in two for good: on two loaded cores with a third peer SIGKILLed, the two survivors' DHTs each timed out
    once on the other and each kept only the dead peer; from then on every declaration and every lookup of the next
    round's group stayed local, and both looked for that group until their deadline, 70 s (the overlapped kill test,
    1 run in 8 under one busy process; docs/reliability.md). Their libp2p connection lives on — they had just
    averaged together — so the peers connected to the host are the ones to ask back. Neurons also re-dial the
    chain's axons every round (:func:`connect_peers`); this needs no address.
    """
    return dht.run_coroutine(_ping_connected_peers_missing_from_the_routing_table, return_future=True)


async def _ping_connected_peers_missing_from_the_routing_table(_dht: hivemind.DHT, node: DHTNode) -> int:
    """Runs inside the DHT process."""
    table = node.protocol.routing_table
    missing = [info.peer_id for info in await node.p2p.list_peers() if table.get(peer_id=info.peer_id) is None]
    answered = await asyncio.gather(*(node.protocol.call_ping(peer_id) for peer_id in missing))
    return sum(node_id is not None for node_id in answered)
