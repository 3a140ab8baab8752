"""A simulated access link on loopback: a TEST KNOB for benchmarks and the local network, never for a deployed node.

Why: every peer of a benchmark or of the local network talks over loopback (GB/s, microseconds), so nothing there
shows what a home link (50 Mbit/s up, 30 ms away) does to a round. This gives every peer a link of ``mbit`` in each
direction and ``latency_ms`` of one-way delay, on 127.0.0.1 alone, without root (no netem, no namespaces).

How: a peer's libp2p daemon listens on its own port and *announces* the port of a pacing proxy in front of it
(hivemind's ``announce_maddrs``), so every connection another peer opens to it passes through the proxy.
go-libp2p's TCP transport dials from its listen port (SO_REUSEPORT), so the proxy also knows who dialed: the bytes
of a connection from A to B are paced by A's uplink *and* B's downlink, the bytes back by B's uplink and A's
downlink (a dialer it cannot name — another source port — is paced by the listener's side alone, and counted in
``LinkStats.unnamed``). Each direction of each peer is one token bucket shared by all its connections: a chunk leaves
when both buckets it crosses are free, occupies them for ``bytes × 8 / rate``, and is delivered ``latency_ms`` later.
The proxy reads a connection only as fast as its link drains, so a sender feels the link through TCP back-pressure.

What it does not model: loss, jitter, congestion control over the long path (the delay is added to a loopback
connection whose window opens at once), and the unix-socket hop between a peer's processes and its own daemon
(which is local on a real machine too).

Everything runs in one background thread with its own event loop (:class:`SimulatedNetwork`); it listens on
127.0.0.1 only, and every port it opens is closed by :meth:`SimulatedNetwork.close`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

__all__ = ["LinkSpec", "LinkStats", "SimulatedNetwork", "SimulatedPeer"]

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 10  # read size: one reservation of the link per chunk
QUEUED_CHUNKS = 64  # per direction of a connection: what the proxy holds between reading and delivering
BURST_S = 0.02  # how far an idle link may catch up (a token bucket's depth, in seconds of its rate)
MAX_LATENCY_MS = 10_000.0
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LinkSpec:
    """A peer's access link: ``mbit`` per direction (megabits per second), and the one-way delay ``latency_ms``
    between any two peers."""

    mbit: float
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.mbit > 0:
            raise ValueError(f"a link's rate must be > 0 Mbit/s, not {self.mbit}")
        if not 0 <= self.latency_ms <= MAX_LATENCY_MS:
            raise ValueError(f"a link's latency must be within [0, {MAX_LATENCY_MS:.0f}] ms, not {self.latency_ms}")

    @property
    def bytes_per_s(self) -> float:
        return self.mbit * 1e6 / 8


@dataclass
class LinkStats:
    """What crossed the simulated links: bytes per peer and direction, and connections whose dialer was unnamed."""

    sent: dict[str, int] = field(default_factory=dict)  # peer name -> bytes it sent over its uplink
    received: dict[str, int] = field(default_factory=dict)  # peer name -> bytes delivered over its downlink
    connections: int = 0
    unnamed: int = 0


@dataclass(frozen=True)
class SimulatedPeer:
    """Where a peer's daemon listens (``host_maddr``) and what it announces (``announce_maddr``: its proxy)."""

    name: str
    host_port: int
    proxy_port: int

    @property
    def host_maddr(self) -> str:
        return f"/ip4/{LOOPBACK}/tcp/{self.host_port}"

    @property
    def announce_maddr(self) -> str:
        return f"/ip4/{LOOPBACK}/tcp/{self.proxy_port}"


class _Bucket:
    """One direction of one peer's link: the time from which it is free again."""

    def __init__(self, rate: float):
        self.rate, self.free_at = rate, 0.0


@dataclass
class _Link:
    up: _Bucket
    down: _Bucket


class SimulatedNetwork:
    """The proxies of every peer of one simulated network, served by one background thread (module docstring)."""

    def __init__(self, spec: LinkSpec):
        self.spec = spec
        self.stats = LinkStats()
        self._links: dict[str, _Link] = {}
        self._by_host_port: dict[int, str] = {}
        self._servers: list[asyncio.base_events.Server] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="simulated-link", daemon=True)
        self._thread.start()

    def add_peer(self, name: str, mbit: float | None = None) -> SimulatedPeer:
        """Reserve a listen port for the peer's daemon and start its proxy; ``mbit`` overrides the network's rate
        for this peer (a slow member), the latency is the network's."""
        if name in self._links:
            raise ValueError(f"peer {name!r} is already on the simulated network")
        rate = LinkSpec(mbit if mbit is not None else self.spec.mbit).bytes_per_s
        self._links[name] = _Link(_Bucket(rate), _Bucket(rate))
        host_port = _free_port()
        self._by_host_port[host_port] = name
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(lambda r, w: self._accept(name, host_port, r, w), LOOPBACK, 0), self._loop
        ).result(timeout=10)
        self._servers.append(server)
        return SimulatedPeer(name, host_port, server.sockets[0].getsockname()[1])

    def set_rate(self, name: str, mbit: float) -> None:
        """Change peer ``name``'s link to ``mbit`` per direction from now on, open connections included (a member
        whose link degrades: a test can let it join fast and then slow its all-reduce down)."""
        rate = LinkSpec(mbit).bytes_per_s
        if name not in self._links:
            raise ValueError(f"peer {name!r} is not on the simulated network")
        link = self._links[name]

        def apply() -> None:
            link.up.rate = link.down.rate = rate

        self._loop.call_soon_threadsafe(apply)

    def close(self) -> None:
        """Close every proxy and its connections, then stop the thread (bounded: 10 s)."""

        async def shutdown() -> None:
            for server in self._servers:
                server.close()
            for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                task.cancel()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------------------------------- the proxy

    async def _accept(self, listener: str, host_port: int, client_reader: asyncio.StreamReader,
                      client_writer: asyncio.StreamWriter) -> None:
        dialer = self._by_host_port.get(client_writer.get_extra_info("peername")[1])
        self.stats.connections += 1
        self.stats.unnamed += dialer is None
        try:
            server_reader, server_writer = await asyncio.wait_for(asyncio.open_connection(LOOPBACK, host_port), 10)
        except (OSError, asyncio.TimeoutError) as err:
            logger.debug("simulated link: %s's daemon is not reachable: %r", listener, err)
            client_writer.close()
            return
        listening = self._links[listener]
        dialing = self._links.get(dialer) if dialer is not None else None
        forward = self._pipe(client_reader, server_writer, dialing.up if dialing else None, listening.down,
                             dialer, listener)
        backward = self._pipe(server_reader, client_writer, listening.up, dialing.down if dialing else None,
                              listener, dialer)
        try:
            await asyncio.gather(forward, backward)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for writer in (client_writer, server_writer):
                writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: _Bucket | None,
                    down: _Bucket | None, sender: str | None, receiver: str | None) -> None:
        """One direction of one connection: read a chunk, reserve both buckets, deliver it after the latency."""
        latency = self.spec.latency_ms / 1000
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(QUEUED_CHUNKS)

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                deliver_at, chunk = item
                await asyncio.sleep(max(0.0, deliver_at - time.monotonic()))
                writer.write(chunk)
                await writer.drain()
                if receiver is not None:
                    self.stats.received[receiver] = self.stats.received.get(receiver, 0) + len(chunk)
            if writer.can_write_eof():
                writer.write_eof()

        delivering = asyncio.ensure_future(deliver())
        try:
            while chunk := await reader.read(CHUNK_BYTES):
                now = time.monotonic()
                buckets = [b for b in (up, down) if b is not None]
                # a bucket idle for a moment may catch up by BURST_S: the proxy's own wake-ups are late by a
                # millisecond or so per chunk, which would otherwise cost ~10 % of the rate
                start = max([now - BURST_S, *(b.free_at for b in buckets)])
                for bucket in buckets:
                    bucket.free_at = start + len(chunk) / bucket.rate
                leaves = max([now, *(b.free_at for b in buckets)])  # never before it was read
                if sender is not None:
                    self.stats.sent[sender] = self.stats.sent.get(sender, 0) + len(chunk)
                await queue.put((leaves + latency, chunk))
                await asyncio.sleep(max(0.0, leaves - time.monotonic()))  # read no faster than the link drains
            await queue.put(None)
            await delivering
        finally:
            delivering.cancel()


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the daemon binds it next: a small race, acceptable for a test knob)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]
