"""The chain facade the neurons use: one small, typed surface over ``bittensor.Subtensor``.

It hides which chain is behind it — ``finney``, ``test``, ``local``, a raw ``ws://``/``wss://`` endpoint, or our
loopback mock (``mock://127.0.0.1:PORT``) — and gives the neurons exactly what they need: the current block and the
block time, a metagraph sync, their own uid, serving their hivemind address as an axon, committing a short text for
their hotkey (the PeerID binding, formatted by ``template.p2p.identity``), and setting weights.

On failure: transport errors (``bt.RpcConnectionError``, socket errors, time-outs) are retried with exponential
backoff a bounded number of times and then re-raised; chain-side rejections (``bt.ChainError``: not registered,
rate limited, bad version key, ...) are never retried, since the chain would refuse them again, and reach the caller
as the SDK's typed error. Nothing above this module parses error strings.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import bittensor as bt
from bittensor.settings import resolve_endpoint

from template.chain.mock_server import MOCK_SCHEME, RemoteMockSubstrate, parse_mock_url
from template.config import NETWORK_HELP

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_COMMITMENT_BYTES = 128  # Commitments pallet: Data::Raw0..Raw128 per field


class NetworkConfigError(ValueError):
    """The network string names no chain we can reach."""


class NotRegisteredError(LookupError):
    """The hotkey holds no uid on the subnet; the message says how to register."""

    def __init__(self, hotkey: str, netuid: int, network: str):
        self.hotkey, self.netuid, self.network = hotkey, netuid, network
        super().__init__(
            f"hotkey {hotkey} is not registered on netuid {netuid} ({network}). Register it with "
            f"`btcli subnets register --netuid {netuid} --network {network} --wallet NAME --wallet-hotkey HOTKEY` "
            "(see docs/running_on_testnet.md), or on a mock chain with the local network tools."
        )


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff for transport errors: waits base, 2·base, 4·base, ... capped at max_delay_s.

    The defaults ride out a chain endpoint that is gone for up to ~30 s (0.5 + 1 + 2 + 4 + 8 + 8 + 8 s of waiting),
    e.g. a node or mock chain restarted by its process manager; a shorter budget turned such restarts into neuron
    crashes (tests/faults/test_chain_restart.py).
    """

    attempts: int = 8
    base_delay_s: float = 0.5
    max_delay_s: float = 8.0

    def delay(self, attempt: int) -> float:
        return min(self.max_delay_s, self.base_delay_s * (2**attempt))


# Errors worth another try: the link failed, not the chain's judgement (OSError covers sockets and time-outs).
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (bt.RpcConnectionError, OSError)
# What a caller sees once the retries are spent and the chain endpoint could not be reached (not every OSError).
CHAIN_UNREACHABLE: tuple[type[BaseException], ...] = (bt.RpcConnectionError, ConnectionError, TimeoutError)


def open_subtensor(network: str) -> bt.Subtensor:
    """A blocking ``bt.Subtensor`` for a network string, or NetworkConfigError with the accepted forms."""
    if network.startswith(MOCK_SCHEME):
        try:
            parse_mock_url(network)
        except ValueError as err:
            raise NetworkConfigError(str(err)) from None
        return bt.Subtensor("local", substrate=RemoteMockSubstrate(network))
    try:
        resolve_endpoint(network)
    except ValueError:
        raise NetworkConfigError(f"unknown network {network!r}: use {NETWORK_HELP}") from None
    return bt.Subtensor(network)


class ChainClient:
    """What a neuron needs from the chain, for one subnet."""

    def __init__(
        self, subtensor: bt.Subtensor, netuid: int, *, network: str = "local", retry: RetryPolicy = RetryPolicy()
    ):
        self.subtensor = subtensor
        self.netuid = netuid
        self.network = network
        self.retry = retry

    @classmethod
    def connect(cls, network: str, netuid: int, *, retry: RetryPolicy = RetryPolicy()) -> ChainClient:
        return cls(open_subtensor(network), netuid, network=network, retry=retry)

    def _with_retry(self, what: str, call: Callable[[], T]) -> T:
        for attempt in range(self.retry.attempts):
            try:
                return call()
            except bt.ChainError:
                raise
            except TRANSIENT_ERRORS as err:
                if attempt == self.retry.attempts - 1:
                    raise
                wait = self.retry.delay(attempt)
                log.warning("%s failed (%s: %s); retry %d/%d in %.1fs", what, type(err).__name__, err,
                            attempt + 1, self.retry.attempts - 1, wait)
                time.sleep(wait)
        raise AssertionError("unreachable: the loop returns or raises")

    def block(self) -> int:
        return self._with_retry("read block", lambda: int(self.subtensor.block))

    def block_time(self) -> float:
        """Seconds per block, as the chain reports it."""
        return self._with_retry("read block time", lambda: float(self.subtensor.block_time()))

    def metagraph(self) -> bt.Metagraph:
        """The subnet's metagraph; NetworkConfigError when the subnet does not exist."""
        graph = self._with_retry("sync metagraph", lambda: self.subtensor.subnets.metagraph(self.netuid))
        if graph is None:
            raise NetworkConfigError(f"subnet {self.netuid} does not exist on {self.network}")
        return graph

    def uid_of(self, hotkey: str, metagraph: bt.Metagraph | None = None) -> int | None:
        neuron = (metagraph or self.metagraph()).by_hotkey(hotkey)
        return None if neuron is None else neuron.uid

    def require_uid(self, hotkey: str, metagraph: bt.Metagraph | None = None) -> int:
        uid = self.uid_of(hotkey, metagraph)
        if uid is None:
            raise NotRegisteredError(hotkey, self.netuid, self.network)
        return uid

    def serve_axon(self, wallet: bt.Wallet, ip: str, port: int) -> bt.ExtrinsicResult:
        """Publish ``ip:port`` (our hivemind host) as this hotkey's axon; raises bt.ChainError on rejection."""
        intent = bt.ServeAxon(netuid=self.netuid, ip=ip, port=port)
        return self._with_retry("serve axon", lambda: self.subtensor.execute(intent, wallet).raise_for_failure())

    def set_weights(self, wallet: bt.Wallet, weights: dict[int, float], version_key: int) -> bt.ExtrinsicResult:
        """Set weights ``{uid: weight}`` (relative; the SDK normalizes); raises bt.ChainError on rejection."""
        intent = bt.SetWeights(netuid=self.netuid, weights=weights, version_key=version_key)
        return self._with_retry("set weights", lambda: self.subtensor.execute(intent, wallet).raise_for_failure())

    def set_commitment(self, wallet: bt.Wallet, text: str) -> None:
        """Commit ``text`` as this hotkey's commitment on the subnet, in one ``Raw`` field; a no-op when the chain
        already holds that text.

        Skipping an identical commitment matters on restarts: commitments cost a deposit and count against the
        pallet's per-interval space limit; it also makes a retry after a lost reply safe. ValueError for a text that
        is not ASCII or longer than :data:`MAX_COMMITMENT_BYTES`; raises bt.ChainError when the chain refuses.
        """
        raw = text.encode("ascii")
        if len(raw) > MAX_COMMITMENT_BYTES:
            raise ValueError(f"a commitment holds at most {MAX_COMMITMENT_BYTES} bytes, got {len(raw)}")
        hotkey = wallet.hotkey.ss58_address
        call = bt.calls.Commitments.set_commitment(netuid=self.netuid, info={"fields": [{f"Raw{len(raw)}": raw}]})

        def commit() -> bool:
            current = self.subtensor.read("commitment", netuid=self.netuid, hotkey_ss58=hotkey)
            if current is not None and current.data == text:
                return False
            self.subtensor.submit_call(call, wallet, signer="hotkey").raise_for_failure()
            return True

        if self._with_retry("set commitment", commit):
            log.info("committed %r for hotkey %s on netuid %d", text, hotkey, self.netuid)
        else:
            log.debug("%r already committed for hotkey %s on netuid %d", text, hotkey, self.netuid)

    def close(self) -> None:
        self.subtensor.close()
