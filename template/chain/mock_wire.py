"""What travels between :class:`~template.chain.mock_server.MockChainServer` and its client, and where it goes.

Addresses: the mock chain lives on loopback only; :func:`parse_mock_url` reads ``mock://127.0.0.1:PORT`` and
:func:`loopback_host` refuses any other host.

Wire format: each message is a 4-byte big-endian length and that many bytes of UTF-8 JSON (never pickle). A request
is ``{"method": NAME, "params": {...}}``; a reply is ``{"result": VALUE}`` or ``{"error": {"type", "message", ...}}``
(:func:`error_reply`; read back by :func:`unwrap_reply`). JSON carries bytes as ``{"$bytes": HEX}`` and generated calls
as ``{"$call": [MODULE, FUNCTION, PARAMS]}`` (:func:`encode_value`/:func:`decode_value`); nothing else is special.
An ``ExtrinsicResult`` travels as a plain object (:func:`result_to_wire`/:func:`result_from_wire`). A write's
signature covers :func:`signing_payload`: the chain's genesis hash, the signer, its nonce and the call, as canonical
JSON. :data:`READ_METHODS` are the methods that change nothing (safe to retry; no state file write).

On bad input: :func:`loopback_host` and :func:`parse_mock_url` raise ``ValueError`` saying what is wrong;
:func:`encode_value` raises ``TypeError`` for a value JSON cannot carry, :func:`decode_value` ``ValueError`` for a
malformed ``$bytes``/``$call`` tag; :func:`recv_frame` raises :class:`FrameTooLarge` for a length prefix over its limit
and ``ConnectionError`` for a message cut short. :func:`unwrap_reply` re-raises a chain error as ``bt.ChainError``
(same name and code) and a ``ValueError`` reply as ``ValueError``; any other error reply, and a reply of any other
shape, is :class:`MockServerError`.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import struct
from typing import Any

import bittensor as bt
from bittensor._generated.calls import Call
from bittensor.result import ErrorCode

MOCK_SCHEME = "mock://"
MAX_REQUEST_BYTES = 1 << 20  # 1 MiB: the largest legitimate request (a full weight row) is far smaller
MAX_REPLY_BYTES = 64 << 20  # a metagraph of 4096 uids is a few MiB
_HEADER = struct.Struct(">I")
READ_METHODS = frozenset({
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


def check_port(port: Any, *, allow_zero: bool = False) -> int:
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
    return loopback_host(host.strip("[]")), check_port(int(port_text))


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


def error_reply(kind: str, message: str, **extra: Any) -> bytes:
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


def unwrap_reply(reply: Any) -> Any:
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


__all__ = [
    "MAX_REPLY_BYTES",
    "MAX_REQUEST_BYTES",
    "MOCK_SCHEME",
    "READ_METHODS",
    "FrameTooLarge",
    "MockServerError",
    "canonical_json",
    "check_port",
    "decode_value",
    "encode_value",
    "error_reply",
    "loopback_host",
    "parse_mock_url",
    "recv_frame",
    "result_from_wire",
    "result_to_wire",
    "send_frame",
    "signing_payload",
    "unwrap_reply",
]
