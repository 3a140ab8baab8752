"""One :class:`~template.chain.mock.MockSubstrate` shared by many processes over 127.0.0.1.

:class:`MockChainServer` owns the chain (and, optionally, a block clock and a state file); every other process talks
to it through :class:`RemoteMockSubstrate`, a ``Substrate`` for the SDK::

    python -m template.chain.mock_server --port 9946 --seconds-per-block 1 --state-file chain.json
    sub = bt.Subtensor("local", substrate=RemoteMockSubstrate("mock://127.0.0.1:9946"))

Wire format: each message is a 4-byte big-endian length and that many bytes of UTF-8 JSON (never pickle). A request
is ``{"method": NAME, "params": {...}}``; a reply is ``{"result": VALUE}`` or ``{"error": {"type", "message", ...}}``.
JSON carries bytes as ``{"$bytes": HEX}`` and generated calls as ``{"$call": [MODULE, FUNCTION, PARAMS]}``; nothing
else is special. Writes are signed: the client cannot send a keypair, so it signs :func:`signing_payload` (the
chain's genesis hash, the signer, its nonce and the call, as canonical JSON) with the key, and the server verifies
the signature against the claimed ss58 address (sr25519 or ed25519) before it dispatches. The nonce must be the
account's next one, so a captured request cannot be replayed. The test helpers (``create_subnet``, ``register``,
``advance_blocks``, ...) are unauthenticated: this is a loopback development chain, and only loopback addresses are
ever bound or dialled.

On failure: the server answers every bad request with an error reply and keeps serving with the state intact:
malformed JSON, a non-object request, an unknown method or wrong arguments (``BadRequest``), a request over
:data:`MAX_REQUEST_BYTES` (``RequestTooLarge``; the connection is then closed, since the rest of the frame is not
read), too many connections (``TooManyConnections``). Once a request's first byte arrives, the rest must arrive
within ``request_timeout`` or the connection is dropped; a client that disconnects mid-request only loses its own
connection. Chain errors travel as ``{"type": "ChainError", "name", "code", "message"}`` and are re-raised by the
client as ``bt.ChainError`` with the same name and code; a bad signature or nonce is a failed ``ExtrinsicResult``
(``BadProof``/``Stale``/``Future``), as on chain. On the client, a lost connection or time-out raises
``bt.RpcConnectionError``; reads are retried once on a fresh connection, writes never (their outcome is unknown).
The state file is written atomically (temporary file + ``os.replace``) after every change, so a crash leaves the
previous or the new state, never a torn file.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import ipaddress
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bittensor as bt
from bittensor._generated.calls import Call
from bittensor.result import ErrorCode
from bittensor.sp_core import verify as verify_signature

from template.chain.mock import SPEC_VERSION, MockSubstrate, UnmodelledMembers, finish_receipt, poll_heads

MOCK_SCHEME = "mock://"
MAX_REQUEST_BYTES = 1 << 20  # 1 MiB: the largest legitimate request (a full weight row) is far smaller
MAX_REPLY_BYTES = 64 << 20  # a metagraph of 4096 uids is a few MiB
_HEADER = struct.Struct(">I")
_READS = frozenset({
    "genesis_hash", "block_hash", "block_number", "block_time", "spec_version", "query", "query_map",
    "query_batch", "map_has_entries", "runtime_call", "constant", "compose", "estimate_fee", "account_next_index",
    "to_json",
})  # safe to retry on a fresh connection


class MockServerError(RuntimeError):
    """The mock chain server refused a request for a protocol reason (not a chain error); ``kind`` says which."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class FrameTooLarge(ValueError):
    """A length prefix announced more bytes than the receiver accepts."""


# --- Addresses ---------------------------------------------------------------------------------------------------


def loopback_host(host: str) -> str:
    """The loopback IP for ``host`` (``localhost`` → ``127.0.0.1``); ``ValueError`` for anything else."""
    candidate = "127.0.0.1" if host == "localhost" else host
    try:
        address = ipaddress.ip_address(candidate)
    except ValueError:
        raise ValueError(f"mock chain host {host!r} is not an IP address or 'localhost'") from None
    if not address.is_loopback:
        raise ValueError(f"mock chain host {host!r} is not a loopback address: the mock chain only serves 127.0.0.1")
    return str(address)


def _check_port(port: Any, *, allow_zero: bool = False) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not (0 if allow_zero else 1) <= port <= 65535:
        raise ValueError(f"mock chain port must be an integer in 1..65535, got {port!r}")
    return port


def parse_mock_url(url: str) -> tuple[str, int]:
    """``"mock://127.0.0.1:9946"`` → ``("127.0.0.1", 9946)``; ``ValueError`` saying what is wrong otherwise."""
    if not isinstance(url, str) or not url.startswith(MOCK_SCHEME):
        raise ValueError(f"mock chain URL must look like mock://127.0.0.1:PORT, got {url!r}")
    rest = url[len(MOCK_SCHEME):]
    host, sep, port_text = rest.rpartition(":")
    if not sep or not host or not port_text:
        raise ValueError(f"mock chain URL {url!r} needs a host and a port: mock://127.0.0.1:PORT")
    if not port_text.isdigit():
        raise ValueError(f"mock chain URL {url!r}: port {port_text!r} is not a number")
    return loopback_host(host.strip("[]")), _check_port(int(port_text))


# --- Wire codec ----------------------------------------------------------------------------------------------------


def encode_value(value: Any) -> Any:
    """A JSON-ready copy of ``value``: bytes and generated calls tagged, tuples as lists; anything else refused."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": bytes(value).hex()}
    if isinstance(value, Call):
        return {"$call": [value.module, value.function, encode_value(value.params)]}
    if isinstance(value, (list, tuple)):
        return [encode_value(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: encode_value(item) for key, item in value.items()}
    raise TypeError(f"cannot send {type(value).__name__} to the mock chain: {value!r}")


def decode_value(value: Any) -> Any:
    """The inverse of :func:`encode_value`; ``ValueError`` for a malformed ``$bytes``/``$call`` tag."""
    if isinstance(value, list):
        return [decode_value(item) for item in value]
    if isinstance(value, dict):
        if set(value) == {"$bytes"}:
            if not isinstance(value["$bytes"], str):
                raise ValueError(f"$bytes must hold a hex string, got {value['$bytes']!r:.80}")
            return bytes.fromhex(value["$bytes"])
        if set(value) == {"$call"}:
            call = value["$call"]
            if not (isinstance(call, list) and len(call) == 3 and all(isinstance(x, str) for x in call[:2])):
                raise ValueError(f"$call must be [MODULE, FUNCTION, PARAMS], got {call!r:.80}")
            module, function, params = call
            return Call(module, function, decode_value(params))
        return {key: decode_value(item) for key, item in value.items()}
    return value


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def signing_payload(genesis_hash: str, signer: str, nonce: int, encoded_call: Any) -> bytes:
    """The bytes a write's signature covers: which chain, who, which nonce, which call."""
    document = {"chain": genesis_hash, "signer": signer, "nonce": nonce, "call": encoded_call}
    return b"mock-chain-extrinsic:" + canonical_json(document)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, missing = [], n
    while missing:
        chunk = sock.recv(min(missing, 1 << 16))
        if not chunk:
            raise ConnectionError("connection closed in the middle of a message")
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket, limit: int, timeout: float, idle_timeout: float | None) -> bytes | None:
    """One message, or None when the peer closed cleanly between messages.

    Waits up to ``idle_timeout`` (None: forever) for the first byte, then ``timeout`` for the rest.
    """
    sock.settimeout(idle_timeout)
    first = sock.recv(1)
    if not first:
        return None
    sock.settimeout(timeout)
    (length,) = _HEADER.unpack(first + _recv_exact(sock, _HEADER.size - 1))
    if length > limit:
        raise FrameTooLarge(f"message of {length} bytes is over the {limit}-byte limit")
    return _recv_exact(sock, length)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _error_reply(kind: str, message: str, **extra: Any) -> bytes:
    return json.dumps({"error": {"type": kind, "message": message, **extra}}).encode()


def result_to_wire(result: bt.ExtrinsicResult) -> dict:
    error = result.error
    return {
        "success": result.success,
        "message": result.message,
        "block_hash": result.block_hash,
        "extrinsic_id": result.extrinsic_id,
        "fee_rao": None if result.fee is None else result.fee.rao,
        "events": encode_value(result.events),
        "error": None if error is None else {"message": error.message, "name": error.name, "code": error.code.value},
    }


def result_from_wire(wire: dict) -> bt.ExtrinsicResult:
    error = wire["error"]
    return bt.ExtrinsicResult(
        success=wire["success"],
        message=wire["message"],
        block_hash=wire["block_hash"],
        extrinsic_id=wire["extrinsic_id"],
        fee=None if wire["fee_rao"] is None else bt.Balance.from_rao(wire["fee_rao"]),
        events=decode_value(wire["events"]),
        error=None if error is None else bt.ChainError(error["message"], error["name"], ErrorCode(error["code"])),
    )


# --- Server --------------------------------------------------------------------------------------------------------


class MockChainServer:
    """Serves ``mock`` on a loopback TCP port from background threads; blocks advance every ``seconds_per_block``."""

    def __init__(
        self,
        mock: MockSubstrate,
        host: str = "127.0.0.1",
        port: int = 0,
        seconds_per_block: float = 1.0,
        *,
        state_file: str | Path | None = None,
        request_timeout: float = 10.0,
        max_connections: int = 256,
    ):
        if not seconds_per_block >= 0:
            raise ValueError(f"seconds_per_block must be >= 0 (0 stops the clock), got {seconds_per_block!r}")
        self.mock = mock
        self.host = loopback_host(host)
        self._requested_port = _check_port(port, allow_zero=True)
        self.seconds_per_block = float(seconds_per_block)
        self.state_file = Path(state_file) if state_file is not None else None
        self.request_timeout = request_timeout
        self.max_connections = max_connections
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        self._persist_lock = threading.Lock()
        self._stopping = threading.Event()
        self._methods = self._method_table()

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("the mock chain server is not started")
        return self._listener.getsockname()[1]

    @property
    def url(self) -> str:
        return f"{MOCK_SCHEME}{self.host}:{self.port}"

    def start(self) -> MockChainServer:
        if self.seconds_per_block > 0:
            self.mock.set_seconds_per_block(self.seconds_per_block)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self._requested_port))
        listener.listen(128)
        listener.settimeout(0.2)  # the accept loop checks for stop() this often
        self._listener = listener
        self._persist()
        self._spawn(self._accept_loop, "mock-chain-accept")
        if self.seconds_per_block > 0:
            self._spawn(self._clock_loop, "mock-chain-clock")
        return self

    def stop(self) -> None:
        """Stop accepting, drop every connection, stop the clock, write the state one last time."""
        with self._connections_lock:  # the accept loop adds connections under this lock: none slips past
            self._stopping.set()
            for conn in self._connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for thread in self._threads:
            thread.join(timeout=5)
        if self._listener is not None:
            self._listener.close()
        self._persist()

    def __enter__(self) -> MockChainServer:
        return self.start()

    def __exit__(self, *_exc: Any) -> None:
        self.stop()

    # --- threads ---

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _clock_loop(self) -> None:
        while not self._stopping.wait(self.seconds_per_block):
            self.mock.advance_blocks(1)
            self._persist()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._connections_lock:
                if self._stopping.is_set():
                    conn.close()
                    return
                full = len(self._connections) >= self.max_connections
                if not full:
                    self._connections.add(conn)
            if full:
                with conn:
                    conn.settimeout(self.request_timeout)
                    try:
                        send_frame(conn, _error_reply("TooManyConnections", f"over {self.max_connections} open"))
                    except OSError:
                        pass
                continue
            threading.Thread(target=self._serve_connection, args=(conn,), name="mock-chain-conn", daemon=True).start()

    def _serve_connection(self, conn: socket.socket) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    request = recv_frame(conn, MAX_REQUEST_BYTES, self.request_timeout, idle_timeout=None)
                except FrameTooLarge as error:
                    send_frame(conn, _error_reply("RequestTooLarge", str(error)))
                    return
                if request is None:
                    return
                send_frame(conn, self._handle(request))
        except OSError:
            return  # the client went away or stalled mid-request: only this connection is dropped
        finally:
            with self._connections_lock:
                self._connections.discard(conn)
            conn.close()

    # --- requests ---

    def _handle(self, raw: bytes) -> bytes:
        try:
            request = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            return _error_reply("BadRequest", f"request is not valid JSON: {error}")
        if not isinstance(request, dict) or not isinstance(request.get("method"), str):
            return _error_reply("BadRequest", 'a request is {"method": NAME, "params": {...}}')
        method, params = request["method"], request.get("params", {})
        function = self._methods.get(method)
        if function is None:
            return _error_reply("BadRequest", f"unknown method {method!r}; known: {', '.join(sorted(self._methods))}")
        if not isinstance(params, dict):
            return _error_reply("BadRequest", f"params of {method!r} must be an object")
        try:
            params = decode_value(params)
            inspect.signature(function).bind(**params)
        except (TypeError, ValueError) as error:
            return _error_reply("BadRequest", f"wrong arguments for {method!r}: {error}")
        try:
            result = function(**params)
            reply = json.dumps({"result": encode_value(result)}).encode()
        except bt.ChainError as error:
            return _error_reply("ChainError", error.message, name=error.name, code=error.code.value)
        except ValueError as error:
            return _error_reply("ValueError", str(error))
        except Exception as error:  # a bug must not take the server down; the reply names it
            return _error_reply("InternalError", f"{type(error).__name__}: {error}")
        finally:
            if method not in _READS:
                self._persist()
        return reply

    def _method_table(self) -> dict[str, Callable[..., Any]]:
        mock = self.mock
        return {
            "genesis_hash": lambda: mock.block_hash_sync(0),
            "block_hash": lambda block=None: mock.block_hash_sync(block),
            "block_number": mock.block_number_sync,
            "block_time": mock.block_time_sync,
            "spec_version": lambda: SPEC_VERSION,
            "query": mock.query_sync,
            "query_map": mock.query_map_sync,
            "query_batch": mock.query_batch_sync,
            "map_has_entries": lambda module, storage_function, params, block_hash=None: bool(
                mock.query_map_sync(module, storage_function, params, block_hash)
            ),
            "runtime_call": mock.runtime_call_sync,
            "constant": mock.constant_sync,
            "compose": mock.compose_sync,
            "estimate_fee": self._estimate_fee,
            "account_next_index": mock.account_next_index_sync,
            "submit": self._submit,
            "create_subnet": mock.create_subnet,
            "register": mock.register,
            "set_stake": mock.set_stake,
            "advance_blocks": mock.advance_blocks,
            "to_json": mock.to_json,
        }

    def _estimate_fee(self, call: Any) -> int:
        self.mock.compose_sync(call)  # refuses calls the mock does not model
        return 0  # the mock chain charges no fees

    def _submit(self, call: Any, signer: str, crypto_type: int, nonce: int, signature: str) -> dict:
        """Verify the signature over :func:`signing_payload`, then include the call (nonce checked atomically)."""
        if isinstance(nonce, bool) or not isinstance(nonce, int) or not isinstance(signer, str):
            raise ValueError("submit needs an ss58 signer string and an integer nonce")
        payload = signing_payload(self.mock.block_hash_sync(0), signer, nonce, encode_value(call))
        try:
            valid = verify_signature(payload, bytes.fromhex(str(signature).removeprefix("0x")), signer, crypto_type)
        except (ValueError, TypeError):
            valid = False
        if not valid:
            error = bt.ChainError(f"transaction has a bad signature: not signed by {signer}", "BadProof")
            return result_to_wire(bt.ExtrinsicResult(success=False, message=error.message, error=error))
        return result_to_wire(self.mock.apply_extrinsic(call, signer, nonce=nonce))

    def _persist(self) -> None:
        if self.state_file is None:
            return
        with self._persist_lock:
            text = self.mock.to_json()
            temporary = self.state_file.with_name(self.state_file.name + ".tmp")
            temporary.write_text(text)
            os.replace(temporary, self.state_file)


# --- Client --------------------------------------------------------------------------------------------------------


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
            self.host, self.port = loopback_host(url_or_host), _check_port(port)
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
                    if attempt == 1 or method not in _READS:
                        raise bt.RpcConnectionError(f"mock chain at {self.url}: {method} failed: {error}") from error
        try:
            reply = json.loads(raw)
        except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
            raise MockServerError("BadReply", f"the reply to {method} is not JSON: {error}") from None
        return _unwrap(reply)

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


def _unwrap(reply: Any) -> Any:
    """A reply's result, or its error raised; a reply of any other shape is ``MockServerError("BadReply")``."""
    if not isinstance(reply, dict) or ("result" not in reply and "error" not in reply):
        raise MockServerError("BadReply", f"unexpected reply {reply!r:.200}")
    if "result" in reply:
        try:
            return decode_value(reply["result"])
        except ValueError as error:
            raise MockServerError("BadReply", str(error)) from None
    error = reply["error"]
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        raise MockServerError("BadReply", f"unexpected error reply {error!r:.200}")
    if error.get("type") == "ChainError":
        name, code = error.get("name"), error.get("code")
        known = {c.value: c for c in ErrorCode}.get(code) if isinstance(code, str) else None
        raise bt.ChainError(error["message"], name if isinstance(name, str) else None, known)
    if error.get("type") == "ValueError":
        raise ValueError(error["message"])
    raise MockServerError(str(error.get("type")), error["message"])


# --- Command line --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m template.chain.mock_server", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="TCP port (0: pick a free one; the ready line says which)")
    parser.add_argument("--seconds-per-block", type=float, default=1.0, help="block clock; 0 stops it")
    parser.add_argument("--state-file", default=None, help="JSON state: loaded at start if present, kept up to date")
    args = parser.parse_args(argv)

    state_file = Path(args.state_file) if args.state_file else None
    try:
        if state_file is not None and state_file.exists():
            mock = MockSubstrate.from_json(state_file.read_text())
        else:
            mock = MockSubstrate()
        server = MockChainServer(mock, args.host, args.port, args.seconds_per_block, state_file=state_file)
    except ValueError as error:  # a non-loopback host, a negative clock, an unreadable state file
        parser.error(str(error))
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    server.start()
    print(f"mock chain listening on {server.url}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
