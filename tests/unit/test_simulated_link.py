"""The simulated access link (a test knob): a connection through a peer's proxy is paced by the link of both ends,
delayed by the latency, named by its dialer's listen port, and carries every byte unchanged.

Only lower bounds on time are asserted (the pacer never delivers early); how close it comes to the rate is measured
by the benchmarks that use it, not here.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from template.p2p.simulated_link import BURST_S, LOOPBACK, LinkSpec, SimulatedNetwork


async def _sink(port: int, received: list[bytes]) -> asyncio.base_events.Server:
    """A listener on the peer's daemon port that keeps what it reads and answers ``ok`` at end of stream."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.read())
        writer.write(b"ok")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(serve, LOOPBACK, port)


async def _send_from(source_port: int | None, proxy_port: int, data: bytes) -> tuple[bytes, float]:
    """Dial the proxy from ``source_port`` (as go-libp2p does from its listen port), send, read the answer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if source_port is not None:
        sock.bind((LOOPBACK, source_port))
    sock.setblocking(False)
    started = time.monotonic()
    await asyncio.get_running_loop().sock_connect(sock, (LOOPBACK, proxy_port))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(data)
    await writer.drain()
    writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    return answer, time.monotonic() - started


@pytest.fixture
def network():
    net = SimulatedNetwork(LinkSpec(mbit=16, latency_ms=50))
    yield net
    net.close()


def test_a_connection_is_paced_delayed_named_and_carries_every_byte(network):
    a, b = network.add_peer("a"), network.add_peer("b")
    data = os.urandom(1_000_000)  # 0.5 s at 16 Mbit/s
    received: list[bytes] = []

    async def run() -> tuple[bytes, float]:
        server = await _sink(b.host_port, received)
        try:
            return await _send_from(a.host_port, b.proxy_port, data)
        finally:
            server.close()

    answer, seconds = asyncio.run(run())
    assert answer == b"ok" and received == [data]
    # the transfer at the rate (less what an idle link may burst), and the latency each way
    assert seconds >= len(data) * 8 / 16e6 - BURST_S + 2 * 0.050
    assert network.stats.sent == {"a": len(data), "b": 2} and network.stats.received == {"b": len(data), "a": 2}
    assert (network.stats.connections, network.stats.unnamed) == (1, 0)


def test_a_slow_peer_paces_what_it_sends_and_an_unnamed_dialer_is_counted(network):
    slow, fast = network.add_peer("slow", mbit=4), network.add_peer("fast")
    data = os.urandom(250_000)  # 0.5 s at 4 Mbit/s, 0.125 s at 16
    received: list[bytes] = []

    async def run() -> tuple[float, float]:
        server = await _sink(fast.host_port, received)
        try:
            _, from_slow = await _send_from(slow.host_port, fast.proxy_port, data)
            _, unnamed = await _send_from(None, fast.proxy_port, data)
            return from_slow, unnamed
        finally:
            server.close()

    from_slow, unnamed = asyncio.run(run())
    assert received == [data, data]
    assert from_slow >= len(data) * 8 / 4e6 - BURST_S  # the slow uplink, not the fast downlink, sets the pace
    assert unnamed >= len(data) * 8 / 16e6 - BURST_S  # only the listener's downlink paces an unnamed dialer
    assert network.stats.unnamed == 1 and network.stats.sent == {"slow": len(data), "fast": 4}


def test_a_link_slowed_down_paces_from_then_on(network):
    a, b = network.add_peer("a"), network.add_peer("b")
    network.set_rate("a", 4)
    data = os.urandom(250_000)  # 0.5 s at 4 Mbit/s, 0.125 s at the network's 16
    received: list[bytes] = []

    async def run() -> float:
        server = await _sink(b.host_port, received)
        try:
            return (await _send_from(a.host_port, b.proxy_port, data))[1]
        finally:
            server.close()

    assert asyncio.run(run()) >= len(data) * 8 / 4e6 - BURST_S and received == [data]
    with pytest.raises(ValueError, match="not on the simulated network"):
        network.set_rate("c", 4)
    with pytest.raises(ValueError, match="rate must be > 0"):
        network.set_rate("a", 0)


def test_bad_links_and_names_are_refused(network):
    with pytest.raises(ValueError, match="rate must be > 0"):
        LinkSpec(mbit=0)
    with pytest.raises(ValueError, match="latency must be within"):
        LinkSpec(mbit=10, latency_ms=-1)
    network.add_peer("a")
    with pytest.raises(ValueError, match="already on the simulated network"):
        network.add_peer("a")
