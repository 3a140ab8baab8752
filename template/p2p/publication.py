"""The pseudo-gradient publication RPC: a miner serves its signed Δ of recent rounds, a validator fetches one.

Wire protocol (one libp2p stream per fetch, handler :data:`HANDLER_NAME` on the neuron's hivemind host). Frames are
those of hivemind's protobuf stream handlers — a 1-byte marker (``0x00`` message, ``0x01`` error), an 8-byte
big-endian length, then a protobuf — so hivemind's ``P2P.send_protobuf``/``receive_protobuf`` speak it too. Messages
reuse hivemind's ``runtime_pb2`` (no new protos):

- caller → miner: ``ExpertRequest(metadata=FetchRequest JSON)``, then hivemind's end-of-stream frame;
- miner → caller: ``ExpertResponse(metadata=FetchReply JSON)``; when the status is ``ok``, the reply carries the
  signed :class:`~template.protocol.PublicationMeta` and ``payload_bytes``, and is followed by
  ``ExpertResponse(tensors=[Tensor(buffer=chunk, size=[len], dtype="uint8")])`` frames of at most
  :data:`CHUNK_BYTES` each, which concatenate to the payload: the encoded segments the miner contributed to the
  round's all-reduce, exactly (:mod:`template.protocol`).

We frame by hand (``add_binary_stream_handler`` / ``call_binary_stream_handler``) instead of
``add_protobuf_handler`` because hivemind's reader trusts the 8-byte length and buffers whatever it announces; here
every frame's length is checked against a limit *before* a byte of it is read.

What happens when things go wrong:

- Refused caller (no PeerID commitment from a registered hotkey, no validator permit, or over its per-peer rate
  limit): the miner reads its small request (at most ``max_request_bytes``, so that the stream closes cleanly),
  answers ``refused``/``rate_limited`` with a reason and never sends the payload; the caller gets
  :class:`RefusedError` / :class:`RateLimitedError`. The remote PeerID is the one libp2p authenticated for the
  connection, so it cannot be spoofed.
- Malformed input: a request that is oversized, not protobuf, not valid JSON, from another protocol version or for
  another netuid gets ``bad_request``; an unknown or evicted round gets ``not_found`` (:class:`NotFoundError`).
  On the caller's side any malformed, oversized, truncated, inconsistent or wrongly signed answer raises
  :class:`~template.protocol.ProtocolError`: :func:`fetch_publication` never returns unverified data.
- Slow or disconnected peer: the miner bounds reading a request by ``request_timeout`` and a whole answer by
  ``response_timeout``, then closes the stream; the caller bounds the whole fetch by ``timeout``
  (:class:`FetchTimeoutError`, a ``TimeoutError``). A peer that cannot be dialed or drops the stream mid-answer raises
  :class:`TransportError` (a ``ConnectionError``) once ``attempts`` fetches in a row broke that way: a fetch is
  idempotent, and on a loaded machine a libp2p stream sometimes ends early (CI, two cores: 2 payload streams cut
  mid-frame in one run of the suite; 0 of 33 with a slow reader here), which must not cost an honest miner its round.
  Nothing from a failed fetch is kept.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import TypeVar

import bittensor as bt
from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2

from template.p2p.identity import PeerDirectory, is_peer_id, sign, verify
from template.p2p.ratelimit import RateLimiter as _RateLimiter
from template.protocol import (
    MAX_REASON_CHARS,
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    PROTOCOL_VERSION,
    FetchKind,
    FetchReply,
    FetchRequest,
    InputsMeta,
    ProtocolError,
    PublicationMeta,
    ReplyStatus,
    check_payload,
    payload_size_limit,
)

__all__ = [
    "CHUNK_BYTES",
    "HANDLER_NAME",
    "AuthDecision",
    "FetchError",
    "FetchTimeoutError",
    "NotFoundError",
    "ProtocolError",
    "Publication",
    "PublicationServer",
    "RateLimitedError",
    "RefusedError",
    "TransportError",
    "fetch_owner_inputs",
    "fetch_publication",
    "permit_holders",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

HANDLER_NAME = f"diloco.publication.v{PROTOCOL_VERSION}"
CHUNK_BYTES = 2 << 20  # 2 MiB of payload per frame
FETCH_ATTEMPTS = 3  # a fetch whose stream broke is tried again, within the same timeout
# seconds before attempt k + 1 (× k): libp2p refuses every dial to an address that failed one for ~5 s ("dial
# backoff"), so attempts made at once all fail together (an outsider's fetch in tests/integration/test_miner.py)
FETCH_RETRY_PAUSE_S = 2.0
_FRAME_OVERHEAD = 256  # protobuf tags and lengths around a chunk or a reply
_HEADER_LEN, _BYTEORDER = P2P.HEADER_LEN, P2P.BYTEORDER


# --- errors and results -----------------------------------------------------------------------------------------


class FetchError(Exception):
    """A fetch did not produce a verified publication (ProtocolError is raised for malformed answers)."""


class RefusedError(FetchError):
    """The miner refused us: unknown PeerID, no validator permit, ... (the reason is in the message)."""


class RateLimitedError(RefusedError):
    """The miner refused us because we called too often."""


class NotFoundError(FetchError, LookupError):
    """The miner has no publication for that round (never published, or evicted)."""


class FetchTimeoutError(FetchError, TimeoutError):
    """The fetch did not finish within its timeout."""


class TransportError(FetchError, ConnectionError):
    """The peer could not be reached, or the stream broke before the answer was complete."""


@dataclass(frozen=True)
class Publication:
    """A verified publication: the signature, payload hash, names and shapes checked; what the payload's segments
    decode to, and whether they match the commitment, is for the validator to check with the run's codec."""

    peer_id: str
    meta: PublicationMeta
    payload: bytes  # the contributed segments, concatenated


@dataclass(frozen=True)
class AuthDecision:
    """Whether a remote PeerID may fetch publications, which hotkey it is (when known), and why not."""

    allowed: bool
    hotkey: str | None = None
    reason: str = ""


Authorize = Callable[[str], AuthDecision]


def permit_holders(directory: Callable[[], PeerDirectory]) -> Authorize:
    """Allow exactly the PeerIDs bound (by commitment) to registered hotkeys holding a validator permit.

    ``directory`` is called per request, so the decision follows the latest metagraph sync the caller keeps.
    """

    def authorize(peer_id: str) -> AuthDecision:
        record = directory().get(peer_id)
        if record is None:
            return AuthDecision(False, None, "unknown peer: no PeerID commitment from a registered hotkey")
        if not record.validator_permit:
            return AuthDecision(False, record.hotkey, f"uid {record.uid} ({record.hotkey}) has no validator permit")
        return AuthDecision(True, record.hotkey)

    return authorize


# --- framing ----------------------------------------------------------------------------------------------------


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> tuple[bytes, bool]:
    """One hivemind frame → (body, is_error_frame); the announced length is checked before reading the body."""
    marker = await reader.readexactly(1)
    if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
        raise ProtocolError(f"unknown frame marker {marker!r}")
    length = int.from_bytes(await reader.readexactly(_HEADER_LEN), _BYTEORDER)
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {limit}")
    return await reader.readexactly(length), marker == P2P.ERROR_MARKER


def _parse(message_type, body: bytes, is_error: bool, what: str):
    if is_error:
        raise ProtocolError(f"expected the {what}, got an error frame")
    try:
        return message_type.FromString(body)
    except DecodeError:
        raise ProtocolError(f"{what} is not a valid {message_type.__name__} protobuf") from None


async def _read_request(reader: asyncio.StreamReader, limit: int) -> FetchRequest:
    """The caller's request frame, then its end-of-stream frame (hivemind's empty error frame), both bounded."""
    body, is_error = await _read_frame(reader, limit)
    if is_error:
        raise ProtocolError("expected the request, got an error frame")
    end, end_is_error = await _read_frame(reader, _FRAME_OVERHEAD)  # consumed before judging the request
    if not end_is_error or end != P2P.END_OF_STREAM.SerializeToString():
        raise ProtocolError("a request must be followed by the end-of-stream frame")
    return FetchRequest.decode(_parse(runtime_pb2.ExpertRequest, body, False, "request").metadata)


async def _send_reply(writer: asyncio.StreamWriter, reply: FetchReply) -> None:
    await P2P.send_protobuf(runtime_pb2.ExpertResponse(metadata=reply.encode()), writer)


def _reply(status: str, reason: str) -> FetchReply:
    return FetchReply(version=PROTOCOL_VERSION, status=status, reason=reason[:MAX_REASON_CHARS])


# --- miner side -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stored:
    meta: PublicationMeta
    payload: bytes


class PublicationServer:
    """Serves this miner's signed publications of its last ``keep_rounds`` rounds to authorized callers.

    ``publish`` is thread-safe (the training loop may call it from another thread); ``start``/``stop`` and the
    handler run on the event loop that owns ``p2p``.
    """

    def __init__(
        self,
        p2p: P2P,
        *,
        netuid: int,
        wallet: bt.Wallet,
        authorize: Authorize,
        keep_rounds: int = 3,
        max_requests_per_minute: int = 30,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        request_timeout: float = 10.0,
        response_timeout: float = 300.0,
        on_served: Callable[[int, str | None], None] | None = None,
    ):
        """``on_served(round, caller_hotkey)`` is called on the event loop after a publication was sent in full (the
        miner reports it); an exception it raises is logged with the stream and changes nothing else."""
        if keep_rounds < 1:
            raise ValueError("keep_rounds must be >= 1")
        self.p2p, self.netuid, self.wallet, self.authorize = p2p, netuid, wallet, authorize
        self.keep_rounds, self.on_served = keep_rounds, on_served
        self.max_request_bytes = max_request_bytes
        self.request_timeout, self.response_timeout = request_timeout, response_timeout
        self._limiter = _RateLimiter(max_requests_per_minute)
        self._published: dict[int, _Stored] = {}
        self._inputs: dict[int, tuple[InputsMeta, bytes]] = {}  # round -> what we averaged as an owner
        self._lock = threading.Lock()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(HANDLER_NAME, self._handle)

    async def stop(self) -> None:
        await self.p2p.remove_binary_stream_handler(HANDLER_NAME)

    @property
    def rounds(self) -> list[int]:
        with self._lock:
            return sorted(self._published)

    def publish(
        self,
        round: int,
        base_theta_hash: str,
        tokens: int,
        inner_steps: int,
        loss: float,
        layout: Sequence[tuple[str, Sequence[int]]],
        codec: str,
        commitment: Mapping,
        segments: Sequence[bytes],
        block: int,
    ) -> PublicationMeta:
        """Sign and keep the round's publication: the encoded segments this miner contributed (``segments``), the
        commitment it signed for them, and the model ``layout`` (names and shapes in ``model.parameters()`` order);
        evict the oldest rounds.

        Rounds must increase: a round at or below the newest one raises ValueError (a publication is final).
        Malformed fields raise ProtocolError before anything is stored.
        """
        payload = b"".join(segments)
        meta = PublicationMeta(
            version=PROTOCOL_VERSION, netuid=self.netuid, round=round, base_theta_hash=base_theta_hash,
            tokens=tokens, inner_steps=inner_steps, loss=loss, hotkey=self.wallet.hotkey.ss58_address,
            payload_sha256=hashlib.sha256(payload).hexdigest(), names=tuple(name for name, _ in layout),
            shapes=tuple(tuple(shape) for _, shape in layout), codec=codec, commitment=dict(commitment),
            published_at_block=block,
        )
        meta = meta.with_signature(sign(self.wallet.hotkey, meta.signing_bytes()))
        meta.encode()  # raises ProtocolError for oversized metadata now rather than when a validator asks
        with self._lock:
            if self._published and round <= max(self._published):
                raise ValueError(f"round {round} is not after the newest published round {max(self._published)}")
            self._published[round] = _Stored(meta, payload)
            for old in sorted(self._published)[: -self.keep_rounds]:
                del self._published[old]
        log.info("published round %d: %d segments, %d bytes (%s)", round, len(segments), len(payload), codec)
        return meta

    def keep_inputs(self, round: int, inputs: InputsMeta, payload: bytes) -> None:
        """Keep what this miner averaged as an owner in ``round`` (the senders' accepted segments) for validators
        that must recompute a segment whose senders did not all publish; kept as long as publications."""
        if inputs.round != round or inputs.payload_bytes != len(payload):
            raise ValueError("the inputs' round or sizes do not match")
        with self._lock:
            self._inputs[round] = (inputs, payload)
            for old in sorted(self._inputs)[: -self.keep_rounds]:
                del self._inputs[old]

    async def _handle(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = info.peer_id.to_base58()
        with closing(writer):
            try:
                await asyncio.wait_for(self._serve(remote, reader, writer), self.response_timeout)
            except asyncio.TimeoutError:  # request_timeout or response_timeout
                log.info("publication stream from %s timed out: closed", remote)
            except (ConnectionError, asyncio.IncompleteReadError) as err:
                log.debug("publication stream from %s broke: %r", remote, err)
            except Exception:  # a peer must never take the listener down; log it and close this stream only
                log.exception("publication handler failed for %s", remote)

    async def _serve(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # The caller's whole input is read (bounded) before any answer: closing a stream with unread input makes
        # the daemon reset it, which can destroy the answer in flight, e.g. a refusal sent before the request came.
        request: FetchRequest | None = None
        problem = ""
        try:
            request = await asyncio.wait_for(_read_request(reader, self.max_request_bytes), self.request_timeout)
        except ProtocolError as err:
            problem = str(err)
        if not self._limiter.allow(remote):  # malformed requests count too
            log.debug("rate limit: %s", remote)
            return await _send_reply(writer, _reply(ReplyStatus.RATE_LIMITED, "too many requests: slow down"))
        decision = self.authorize(remote)
        if not decision.allowed:
            log.info("refused %s: %s", remote, decision.reason)
            return await _send_reply(writer, _reply(ReplyStatus.REFUSED, decision.reason or "not authorized"))
        if request is None:
            return await _send_reply(writer, _reply(ReplyStatus.BAD_REQUEST, problem))
        if request.netuid != self.netuid:
            reason = f"this miner serves netuid {self.netuid}, not {request.netuid}"
            return await _send_reply(writer, _reply(ReplyStatus.BAD_REQUEST, reason))
        with self._lock:
            if request.kind == FetchKind.INPUTS:
                kept = self._inputs.get(request.round)
                reply = kept and FetchReply(PROTOCOL_VERSION, ReplyStatus.OK, inputs=kept[0],
                                            payload_bytes=len(kept[1]))
                available, payload = sorted(self._inputs), kept and kept[1]
            else:
                stored = self._published.get(request.round)
                reply = stored and FetchReply(PROTOCOL_VERSION, ReplyStatus.OK, meta=stored.meta,
                                              payload_bytes=len(stored.payload))
                available, payload = sorted(self._published), stored and stored.payload
        if reply is None:
            what = "published" if request.kind == FetchKind.PUBLICATION else "averaged (no inputs kept)"
            reason = f"round {request.round} is not {what} here (available: {available})"
            return await _send_reply(writer, _reply(ReplyStatus.NOT_FOUND, reason))
        await _send_reply(writer, reply)
        for offset in range(0, len(payload), CHUNK_BYTES):
            chunk = payload[offset : offset + CHUNK_BYTES]
            tensor = runtime_pb2.Tensor(buffer=chunk, size=[len(chunk)], dtype="uint8")
            await P2P.send_protobuf(runtime_pb2.ExpertResponse(tensors=[tensor]), writer)
        log.debug("served the %s of round %d to %s (%s)", request.kind, request.round, remote, decision.hotkey)
        if self.on_served is not None and request.kind == FetchKind.PUBLICATION:
            self.on_served(request.round, decision.hotkey)


# --- validator side ---------------------------------------------------------------------------------------------


async def fetch_publication(
    p2p: P2P,
    peer_id: str | PeerID,
    request: FetchRequest,
    *,
    expected_hotkey: str,
    timeout: float = 60.0,
    max_bytes: int | None = None,
    expected_layout: Sequence[tuple[str, Sequence[int]]] | None = None,
    attempts: int = FETCH_ATTEMPTS,
) -> Publication:
    """Fetch and fully verify the publication of ``request.round`` from the miner at ``peer_id``.

    ``expected_hotkey`` is the hotkey the caller's directory binds to ``peer_id``: the metadata must name it and
    carry its valid signature. ``max_bytes`` caps the payload (by default the size its own metadata allows);
    ``expected_layout`` (``[(name, shape), ...]``, e.g. from ``model.named_parameters()``) rejects a Δ for another
    model before its payload is downloaded. A stream that breaks is fetched again, ``attempts`` times in all, all
    within ``timeout``. Raises RefusedError, RateLimitedError, NotFoundError, ProtocolError, FetchTimeoutError or
    TransportError.
    """
    peer_id = _peer_id(peer_id)
    layout = None if expected_layout is None else [(name, tuple(shape)) for name, shape in expected_layout]
    return await _with_attempts(lambda: _fetch(p2p, peer_id, request, expected_hotkey, max_bytes, layout),
                                request, peer_id, timeout, attempts)


async def fetch_owner_inputs(p2p: P2P, peer_id: str | PeerID, request: FetchRequest, *, max_bytes: int,
                             timeout: float = 60.0, attempts: int = FETCH_ATTEMPTS) -> tuple[InputsMeta, bytes]:
    """Fetch what the miner at ``peer_id`` averaged as an owner in ``request.round`` (``request.kind`` inputs): the
    metadata, well-formed and for this round, and a payload of at most ``max_bytes`` that hashes to it. Whether
    the segments are the senders' is for the caller to check against their signed roots
    (:func:`template.allreduce.owner_inputs.verified_inputs`). Raises as :func:`fetch_publication`."""
    if request.kind != FetchKind.INPUTS:
        raise ValueError("fetch_owner_inputs asks for inputs")
    peer_id = _peer_id(peer_id)
    return await _with_attempts(lambda: _fetch_inputs(p2p, peer_id, request, max_bytes), request, peer_id, timeout,
                                attempts)


def _peer_id(peer_id: str | PeerID) -> PeerID:
    if isinstance(peer_id, str):
        if not is_peer_id(peer_id):
            raise ValueError(f"{peer_id!r} is not a PeerID")
        peer_id = PeerID.from_base58(peer_id)
    return peer_id


async def _with_attempts(fetch: Callable[[], Awaitable[T]], request: FetchRequest, peer_id: PeerID, timeout: float,
                         attempts: int) -> T:
    """``fetch()`` within ``timeout``, again when its stream broke, ``attempts`` times in all (a fetch is
    idempotent)."""
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    what = f"the {request.kind} of round {request.round} from {peer_id}"
    for attempt in range(1, attempts + 1):
        try:
            return await asyncio.wait_for(fetch(), deadline - loop.time())
        except asyncio.TimeoutError:
            raise FetchTimeoutError(f"fetching {what} took longer than {timeout}s") from None
        except (P2PDaemonError, OSError, asyncio.IncompleteReadError) as err:
            failure = f"fetching {what} failed (attempt {attempt} of {attempts}): {err!r}"
            if attempt == attempts:
                raise TransportError(failure) from None
            log.warning("%s: fetching again", failure)
            await asyncio.sleep(min(FETCH_RETRY_PAUSE_S * attempt, max(deadline - loop.time(), 0.0)))
    raise AssertionError("unreachable: the last attempt returns or raises TransportError")


async def _ask(p2p: P2P, peer_id: PeerID, request: FetchRequest) -> tuple[FetchReply, asyncio.StreamReader,
                                                                            asyncio.StreamWriter]:
    """Open a stream, send the request and read the reply's first frame (the caller closes the writer)."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, HANDLER_NAME)
    try:
        await P2P.send_protobuf(runtime_pb2.ExpertRequest(metadata=request.encode()), writer)
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
        body, is_error = await _read_frame(reader, MAX_REPLY_BYTES + _FRAME_OVERHEAD)
        reply = FetchReply.decode(_parse(runtime_pb2.ExpertResponse, body, is_error, "reply").metadata)
    except BaseException:
        writer.close()
        raise
    _raise_for_status(reply)
    return reply, reader, writer


async def _read_payload(reader: asyncio.StreamReader, size: int) -> bytes:
    """The payload frames after an ok reply, which must add up to exactly ``size`` bytes."""
    payload = bytearray()
    while len(payload) < size:
        body, is_error = await _read_frame(reader, CHUNK_BYTES + _FRAME_OVERHEAD)
        chunk = _parse(runtime_pb2.ExpertResponse, body, is_error, "payload chunk")
        if len(chunk.tensors) != 1 or chunk.metadata or chunk.tensors[0].dtype != "uint8":
            raise ProtocolError("a payload frame must carry exactly one uint8 tensor and no metadata")
        buffer = chunk.tensors[0].buffer
        if not buffer or len(payload) + len(buffer) > size:
            raise ProtocolError("payload frames do not add up to the announced size")
        payload += buffer
    return bytes(payload)


async def _fetch(
    p2p: P2P,
    peer_id: PeerID,
    request: FetchRequest,
    expected_hotkey: str,
    max_bytes: int | None,
    layout: list[tuple[str, tuple[int, ...]]] | None,
) -> Publication:
    reply, reader, writer = await _ask(p2p, peer_id, request)
    with closing(writer):
        meta = _check_reply(reply, request, expected_hotkey, layout)
        limit = payload_size_limit(meta.names, meta.shapes)
        limit = limit if max_bytes is None else min(limit, max_bytes)
        if reply.payload_bytes > limit:
            raise ProtocolError(f"the announced payload of {reply.payload_bytes} bytes exceeds the limit of {limit}")
        payload = await _read_payload(reader, reply.payload_bytes)
    return Publication(peer_id=peer_id.to_base58(), meta=meta, payload=check_payload(payload, meta, max_bytes=limit))


async def _fetch_inputs(p2p: P2P, peer_id: PeerID, request: FetchRequest, max_bytes: int) -> tuple[InputsMeta, bytes]:
    reply, reader, writer = await _ask(p2p, peer_id, request)
    with closing(writer):
        inputs = reply.inputs
        if inputs is None or (inputs.netuid, inputs.round) != (request.netuid, request.round):
            raise ProtocolError(f"asked for the inputs of netuid {request.netuid} round {request.round}, got other")
        if reply.payload_bytes > max_bytes:
            raise ProtocolError(f"the announced inputs of {reply.payload_bytes} bytes exceed the limit of {max_bytes}")
        payload = await _read_payload(reader, reply.payload_bytes)
    if hashlib.sha256(payload).hexdigest() != inputs.payload_sha256:
        raise ProtocolError("the inputs' payload does not hash to their metadata")
    return inputs, payload


def _raise_for_status(reply: FetchReply) -> None:
    """Map a non-ok status to its error."""
    errors = {
        ReplyStatus.RATE_LIMITED: RateLimitedError,
        ReplyStatus.REFUSED: RefusedError,
        ReplyStatus.NOT_FOUND: NotFoundError,
        ReplyStatus.BAD_REQUEST: ProtocolError,
    }
    if reply.status in errors:
        raise errors[reply.status](f"{reply.status}: {reply.reason}")


def _check_reply(
    reply: FetchReply,
    request: FetchRequest,
    expected_hotkey: str,
    layout: list[tuple[str, tuple[int, ...]]] | None,
) -> PublicationMeta:
    """Check that the metadata answers our request and is signed by the hotkey."""
    meta = reply.meta
    if meta is None:
        raise ProtocolError("asked for a publication, got another kind of reply")
    if (meta.netuid, meta.round) != (request.netuid, request.round):
        raise ProtocolError(f"asked for netuid {request.netuid} round {request.round}, got {meta.netuid}/{meta.round}")
    if meta.hotkey != expected_hotkey:
        raise ProtocolError(f"publication names hotkey {meta.hotkey}, this peer is bound to {expected_hotkey}")
    if not verify(expected_hotkey, meta.signing_bytes(), meta.signature):
        raise ProtocolError(f"the publication's signature does not verify for {expected_hotkey}")
    if layout is not None and list(zip(meta.names, meta.shapes, strict=True)) != layout:
        raise ProtocolError("the publication's tensor names/shapes differ from the expected model")
    return meta
