"""One :class:`~template.chain.mock.MockSubstrate` shared by many processes over 127.0.0.1.

:class:`MockChainServer` owns the chain (and, optionally, a block clock and a state file); every other process talks
to it through :class:`~template.chain.mock_client.RemoteMockSubstrate`, a ``Substrate`` for the SDK::

    python -m template.chain.mock_server --port 9946 --seconds-per-block 1 --state-file chain.json
    sub = bt.Subtensor("local", substrate=RemoteMockSubstrate("mock://127.0.0.1:9946"))

This module is the entry point (the server and the command line); the client is in :mod:`template.chain.mock_client`
and what travels between them (length-prefixed JSON frames, never pickle; tagged bytes and calls; the signing
payload; loopback addresses and ``mock://`` URLs) in :mod:`template.chain.mock_wire`, both re-exported here. Writes
are signed: the server verifies the signature over :func:`signing_payload` against the claimed ss58 address (sr25519
or ed25519) before it dispatches. The nonce must be the account's next one, so a captured request cannot be
replayed. The test helpers (``create_subnet``, ``register``, ``advance_blocks``, ...) are unauthenticated: this is a
loopback development chain, and only loopback addresses are ever bound or dialled.

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
import inspect
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bittensor as bt
from bittensor.sp_core import verify as verify_signature

from template.chain.mock import SPEC_VERSION, MockSubstrate
from template.chain.mock_client import RemoteMockSubstrate
from template.chain.mock_wire import (
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    MOCK_SCHEME,
    READ_METHODS,
    FrameTooLarge,
    MockServerError,
    canonical_json,
    check_port,
    decode_value,
    encode_value,
    error_reply,
    loopback_host,
    parse_mock_url,
    recv_frame,
    result_from_wire,
    result_to_wire,
    send_frame,
    signing_payload,
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
        self._requested_port = check_port(port, allow_zero=True)
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
                        send_frame(conn, error_reply("TooManyConnections", f"over {self.max_connections} open"))
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
                    send_frame(conn, error_reply("RequestTooLarge", str(error)))
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
            return error_reply("BadRequest", f"request is not valid JSON: {error}")
        if not isinstance(request, dict) or not isinstance(request.get("method"), str):
            return error_reply("BadRequest", 'a request is {"method": NAME, "params": {...}}')
        method, params = request["method"], request.get("params", {})
        function = self._methods.get(method)
        if function is None:
            return error_reply("BadRequest", f"unknown method {method!r}; known: {', '.join(sorted(self._methods))}")
        if not isinstance(params, dict):
            return error_reply("BadRequest", f"params of {method!r} must be an object")
        try:
            params = decode_value(params)
            inspect.signature(function).bind(**params)
        except (TypeError, ValueError) as error:
            return error_reply("BadRequest", f"wrong arguments for {method!r}: {error}")
        try:
            result = function(**params)
            reply = json.dumps({"result": encode_value(result)}).encode()
        except bt.ChainError as error:
            return error_reply("ChainError", error.message, name=error.name, code=error.code.value)
        except ValueError as error:
            return error_reply("ValueError", str(error))
        except Exception as error:  # a bug must not take the server down; the reply names it
            return error_reply("InternalError", f"{type(error).__name__}: {error}")
        finally:
            if method not in READ_METHODS:
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


__all__ = [
    "MockChainServer", "main",  # defined here
    "RemoteMockSubstrate",  # re-exported from mock_client
    # re-exported from mock_wire
    "MAX_REPLY_BYTES", "MAX_REQUEST_BYTES", "MOCK_SCHEME", "FrameTooLarge", "MockServerError", "canonical_json",
    "decode_value", "encode_value", "loopback_host", "parse_mock_url", "recv_frame", "result_from_wire",
    "result_to_wire", "send_frame", "signing_payload",
]


if __name__ == "__main__":
    sys.exit(main())
