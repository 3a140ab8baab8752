"""The client of :class:`~template.chain.mock_server.MockChainServer`: a ``Substrate`` for the SDK in any process.

::

    sub = bt.Subtensor("local", substrate=RemoteMockSubstrate("mock://127.0.0.1:9946"))

:class:`RemoteMockSubstrate` forwards every protocol call to the server over one persistent loopback connection
(the messages are in :mod:`template.chain.mock_wire`). Writes are signed here: the client cannot send a keypair, so
it signs :func:`~template.chain.mock_wire.signing_payload` (the chain's genesis hash, the signer, its nonce and the
call, as canonical JSON) with the key, and the server verifies the signature before it dispatches. The test helpers
(``create_subnet``, ``register``, ``set_stake``, ``advance_blocks``, ``to_json``) are forwarded as they are.

On failure: chain errors are re-raised as ``bt.ChainError`` with the server's name and code, a ``ValueError`` reply as
``ValueError``, any other refusal or a malformed reply as :class:`~template.chain.mock_wire.MockServerError`. A lost
connection or time-out raises ``bt.RpcConnectionError``; reads (:data:`~template.chain.mock_wire.READ_METHODS`) are
retried once on a fresh connection, writes never (their outcome is unknown). A bad signature or nonce comes back as a
failed ``ExtrinsicResult`` (``BadProof``/``Stale``/``Future``), as on chain. Protocol members the mock chain does not
model are refused here (:class:`template.chain.mock.UnmodelledMembers`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import select
import socket
import threading
from typing import Any

import bittensor as bt

from template.chain.mock import UnmodelledMembers, finish_receipt, poll_heads
from template.chain.mock_wire import (
    MAX_REPLY_BYTES,
    MOCK_SCHEME,
    READ_METHODS,
    FrameTooLarge,
    MockServerError,
    check_port,
    encode_value,
    loopback_host,
    parse_mock_url,
    recv_frame,
    result_from_wire,
    send_frame,
    signing_payload,
    unwrap_reply,
)


class RemoteMockSubstrate(UnmodelledMembers):
    """The ``Substrate`` protocol over a :class:`MockChainServer`: every call is forwarded, writes are signed here.

    One persistent connection, used by one request at a time; the async methods run the blocking exchange in a worker
    thread, so the object works from the SDK's blocking facade and from any event loop. The test helpers are blocking.
    Protocol members the mock chain does not model are refused here, as the server would refuse them
    (:class:`template.chain.mock.UnmodelledMembers`).
    """

    def __init__(self, url_or_host: str, port: int | None = None, timeout: float = 10.0):
        if port is None:
            self.host, self.port = parse_mock_url(url_or_host)
        else:
            self.host, self.port = loopback_host(url_or_host), check_port(port)
        self.url = f"{MOCK_SCHEME}{self.host}:{self.port}"
        self.timeout = timeout
        self.token_symbols: dict[int, str] = {}
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._genesis_hash: str | None = None

    # --- transport ---

    def request(self, method: str, /, **params: Any) -> Any:
        """One request/reply; chain errors re-raised as ``bt.ChainError``, transport failures as RpcConnectionError."""
        frame = json.dumps({"method": method, "params": encode_value(params)}).encode()
        with self._lock:
            for attempt in range(2):
                try:
                    if self._sock is not None and _readable(self._sock):
                        self._drop_connection()  # between requests that means closed (or garbage): start afresh
                    if self._sock is None:
                        self._sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
                    send_frame(self._sock, frame)
                    raw = recv_frame(self._sock, MAX_REPLY_BYTES, self.timeout, idle_timeout=self.timeout)
                    if raw is None:
                        raise ConnectionError("the server closed the connection")
                    break
                except (OSError, FrameTooLarge) as error:
                    self._drop_connection()
                    if attempt == 1 or method not in READ_METHODS:
                        raise bt.RpcConnectionError(f"mock chain at {self.url}: {method} failed: {error}") from error
        try:
            reply = json.loads(raw)
        except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
            raise MockServerError("BadReply", f"the reply to {method} is not JSON: {error}") from None
        return unwrap_reply(reply)

    def _drop_connection(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _call(self, method: str, /, **params: Any) -> Any:
        return await asyncio.to_thread(self.request, method, **params)

    # --- test helpers (blocking; same arguments as MockSubstrate's) ---

    def create_subnet(self, netuid: int, tempo: int = 360, **options: Any) -> int:
        return self.request("create_subnet", netuid=netuid, tempo=tempo, **options)

    def register(self, netuid: int, hotkey_ss58: str, coldkey_ss58: str, stake_tao: float = 0.0) -> int:
        return self.request("register", netuid=netuid, hotkey_ss58=hotkey_ss58, coldkey_ss58=coldkey_ss58,
                            stake_tao=stake_tao)

    def set_stake(self, netuid: int, hotkey_ss58: str, tao: float) -> None:
        self.request("set_stake", netuid=netuid, hotkey_ss58=hotkey_ss58, tao=tao)

    def advance_blocks(self, n: int = 1) -> int:
        return self.request("advance_blocks", n=n)

    def to_json(self) -> str:
        return self.request("to_json")

    # --- Substrate protocol ---

    def balance(self, rao: int, netuid: int = 0) -> bt.Balance:
        symbol = self.token_symbols.get(netuid) if netuid else None
        return bt.Balance(int(rao), netuid, symbol)

    async def connect(self) -> None:
        self._genesis_hash = await self._call("genesis_hash")

    async def close(self) -> None:
        with self._lock:
            self._drop_connection()

    async def block_hash(self, block: int | None = None) -> str:
        return await self._call("block_hash", block=block)

    async def block_number(self) -> int:
        return await self._call("block_number")

    async def finalized_block_number(self) -> int:
        return await self._call("block_number")  # instant finality on the mock chain

    async def block_time(self) -> float:
        return await self._call("block_time")

    async def spec_version(self) -> int:
        return await self._call("spec_version")

    async def blocks(self, *, finalized: bool = False):
        async for header in poll_heads(self.block_number, self.block_hash, self.block_time):
            yield header

    async def query(self, module: str, storage_function: str, params: list | None = None,
                    block_hash: str | None = None) -> Any:
        return await self._call("query", module=module, storage_function=storage_function, params=params,
                                block_hash=block_hash)

    async def query_map(self, module: str, storage_function: str, params: list | None = None,
                        block_hash: str | None = None) -> list[tuple[Any, Any]]:
        rows = await self._call("query_map", module=module, storage_function=storage_function, params=params,
                                block_hash=block_hash)
        return [(key, value) for key, value in rows]

    async def query_batch(self, module: str, storage_function: str, param_sets: list[list],
                          block_hash: str | None = None) -> list[Any]:
        return await self._call("query_batch", module=module, storage_function=storage_function,
                                param_sets=param_sets, block_hash=block_hash)

    async def map_has_entries(self, module: str, storage_function: str, params: list,
                              block_hash: str | None = None) -> bool:
        return await self._call("map_has_entries", module=module, storage_function=storage_function, params=params,
                                block_hash=block_hash)

    async def runtime_call(self, api: str, method: str, params: list, block_hash: str | None = None) -> Any:
        return await self._call("runtime_call", api=api, method=method, params=params, block_hash=block_hash)

    async def constant(self, module: str, name: str) -> Any:
        return await self._call("constant", module=module, name=name)

    async def compose(self, call: Any) -> Any:
        return await self._call("compose", call=call)

    async def estimate_fee(self, call: Any, keypair: Any) -> bt.Balance:
        return bt.Balance.from_rao(await self._call("estimate_fee", call=call))

    async def account_next_index(self, address: str) -> int:
        return await self._call("account_next_index", address=address)

    async def mev_next_key(self) -> bytes | None:
        return None  # no MEV shield on the mock chain

    async def submit(self, call: Any, keypair: Any, *, nonce: int | None = None, period: int | None = None,
                     wait_for_inclusion: bool = True, wait_for_finalization: bool = True) -> bt.ExtrinsicResult:
        """Sign :func:`signing_payload` with ``keypair`` and send it; the server checks signature and nonce."""
        signer = keypair.ss58_address
        if self._genesis_hash is None:
            self._genesis_hash = await self._call("genesis_hash")
        if nonce is None:
            nonce = await self.account_next_index(signer)
        encoded_call = encode_value(call)
        signature = keypair.sign(signing_payload(self._genesis_hash, signer, nonce, encoded_call))
        if inspect.isawaitable(signature):
            signature = await signature
        wire = await self._call("submit", call=call, signer=signer, crypto_type=int(keypair.crypto_type),
                                nonce=nonce, signature=bytes(signature).hex())
        return finish_receipt(result_from_wire(wire), wait_for_inclusion or wait_for_finalization)

    def __repr__(self) -> str:
        return f"RemoteMockSubstrate({self.url!r})"


def _readable(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


__all__ = ["RemoteMockSubstrate"]
