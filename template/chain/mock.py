"""An in-memory Subtensor the bittensor 11 SDK runs against unchanged: ``bt.Subtensor("local", substrate=mock)``.

:class:`MockSubstrate` implements the SDK's ``Substrate`` protocol (``bittensor/_substrate.py``) over plain
dataclasses (:class:`ChainState` → :class:`SubnetState` → :class:`NeuronState`), so the SDK's own reads and intents
work as they do on a real chain: ``subnets.metagraph`` (one ``SubnetInfoRuntimeApi.get_metagraph`` runtime call plus
two ``Commitments`` maps), ``weights.weights``, ``execute(SetWeights)`` (its preflight reads ``Uids``,
``WeightsSetRateLimit``, ``LastUpdate``, ... and then submits ``set_mechanism_weights``), ``execute(ServeAxon)`` and
the raw ``Commitments.set_commitment`` call. It is a product feature (a whole subnet runs locally on it, shared
between processes by :mod:`template.chain.mock_server`), not only a test double.

This module is the entry point: :class:`MockSubstrate` with the protocol surface (blocks, read entry points and block
pinning, composing and submitting calls, nonces), :func:`poll_heads` and :class:`UnmodelledMembers`. The rest is cut
by job, each part a mixin or plain functions, and re-exported here:

- :mod:`template.chain.mock_state`: the state dataclasses and their JSON document;
- :mod:`template.chain.mock_subnets`: the test helpers (``create_subnet``, ``register``, ``set_stake``,
  ``advance_blocks``, ...) and the chain rules they run: registration, validator permits, the epoch;
- :mod:`template.chain.mock_reads`: storage items, storage maps and runtime APIs;
- :mod:`template.chain.mock_calls`: the extrinsics (``set_weights``, ``serve_axon``, ``set_commitment``) with the
  chain's checks and error names;
- :mod:`template.chain.mock_errors`: the ``bt.ChainError`` builders.

Simplifications: no balances, fees (0), burn, owner cut, root/TAO stake, delegation, commit-reveal, mechanisms other
than 0, timelocked commitments, or events history; stake is alpha stake set by the helpers plus emission. The state is
not versioned: a read pinned to one of the last :data:`HISTORY_WINDOW` blocks sees the head state, an older block is
refused.

On failure: every write validates completely before it changes anything, so a rejected write leaves the state exactly
as it was. A chain-side rejection of an extrinsic comes back as a failed ``bt.ExtrinsicResult`` whose ``error`` is a
``bt.ChainError`` with the chain's error name and code (what the SDK's RPC backend returns); the nonce is consumed, as
on chain. Reads of storage items, maps, runtime APIs, constants or calls the mock does not model raise
``bt.ChainError`` naming the item and listing what is supported; malformed keys raise ``bt.ChainError`` (code
``invalid_argument``); a read pinned to an unknown block hash, or to one more than :data:`HISTORY_WINDOW` blocks old,
raises ``bt.ChainError`` (code ``NOT_FOUND``). The test helpers raise ``ValueError`` for bad arguments and
``bt.ChainError`` when the chain state refuses (unknown subnet, ...).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import bittensor as bt
from bittensor.result import ErrorCode

from template.chain.mock_calls import (
    MAX_COMMITMENT_FIELDS,
    MAX_RAW_COMMITMENT_BYTES,
    POOL_REJECTIONS,
    ExtrinsicCalls,
    finish_receipt,
)
from template.chain.mock_errors import chain_error, invalid_argument, unsupported
from template.chain.mock_reads import StorageReads
from template.chain.mock_state import (
    RAO_PER_TAO,
    STATE_FORMAT,
    ZERO_ACCOUNT,
    AxonInfo,
    ChainState,
    NeuronState,
    SubnetState,
    state_from_dict,
    state_to_dict,
)
from template.chain.mock_subnets import MAX_ADVANCE, SubnetHelpers

HISTORY_WINDOW = 64  # reads may be pinned to this many recent blocks (they see the head state)
SPEC_VERSION = 1  # reported runtime spec_version; nothing in the SDK paths above branches on it


def _key_list(params: Any) -> list:
    if params is None:
        return []
    if not isinstance(params, (list, tuple)):
        raise invalid_argument(f"storage keys must be a list, got {params!r}")
    return list(params)


async def poll_heads(
    block_number: Callable[[], Awaitable[int]],
    block_hash: Callable[[int], Awaitable[str]],
    block_time: Callable[[], Awaitable[float]],
) -> AsyncIterator[dict]:
    """``{"header": {...}}`` for the head and then every new block, found by polling (a mock has no push)."""
    interval = min(0.5, max(0.02, await block_time() / 4))
    last = await block_number() - 1
    while True:
        head = await block_number()
        for number in range(last + 1, head + 1):
            parent = await block_hash(number - 1) if number > 0 else "0x" + "00" * 32
            yield {"header": {"number": number, "hash": await block_hash(number), "parentHash": parent}}
        last = max(last, head)
        await asyncio.sleep(interval)


class UnmodelledMembers:
    """The ``Substrate`` protocol members no mock chain models, shared by :class:`MockSubstrate` and the server's
    client (``template.chain.mock_server.RemoteMockSubstrate``): each raises ``bt.ChainError`` (code DISABLED, "the
    mock chain does not support ...") rather than answering with made-up data. ``UNMODELLED_REASONS`` adds to the
    message, per member, why it is not modelled."""

    UNMODELLED_REASONS: dict[str, str] = {}

    def _unmodelled(self, member: str) -> bt.ChainError:
        reason = self.UNMODELLED_REASONS.get(member)
        return unsupported(f"{member} ({reason})" if reason else member)

    async def get_block(self, block_number: int | None = None, block_hash: str | None = None) -> dict | None:
        raise self._unmodelled("get_block")

    async def decode_scale(self, type_string: str, data: Any) -> Any:
        raise self._unmodelled("decode_scale")

    async def events(self, block_hash: str | None = None) -> list[dict]:
        raise self._unmodelled("events")

    async def estimate_weight(self, call: Any, keypair: Any) -> dict:
        raise self._unmodelled("estimate_weight")

    async def sign_extrinsic(self, call: Any, keypair: Any, *, nonce: int, period: int) -> tuple[bytes, str]:
        raise self._unmodelled("sign_extrinsic")

    async def find_extrinsic(self, extrinsic_hash: str, block_hash: str) -> bt.ExtrinsicResult | None:
        raise self._unmodelled("find_extrinsic")

    async def prepare(self, call: Any, **kwargs: Any) -> Any:
        raise self._unmodelled("prepare")

    async def submit_signature(self, unsigned: Any, signature: Any, **kwargs: Any) -> bt.ExtrinsicResult:
        raise self._unmodelled("submit_signature")

    async def submit_signed(self, extrinsic: Any, keypair: Any, **kwargs: Any) -> bt.ExtrinsicResult:
        raise self._unmodelled("submit_signed")

    def multisig_account(self, signatories: list[str], threshold: int) -> Any:
        raise self._unmodelled("multisig")

    async def submit_multisig(self, call: Any, keypair: Any, account: Any, **kwargs: Any) -> bt.ExtrinsicResult:
        raise self._unmodelled("multisig")


# --- The chain ----------------------------------------------------------------------------------------------------


class MockSubstrate(SubnetHelpers, StorageReads, ExtrinsicCalls, UnmodelledMembers):
    """bittensor's ``Substrate`` protocol in memory, plus synchronous test helpers.

    Thread-safe: one re-entrant lock guards the state, so a blocking ``bt.Subtensor`` (which runs on its own loop
    thread), a clock thread and helper calls can share one instance.
    """

    # Protocol members with no meaning on this chain (UnmodelledMembers refuses them): why, in the error message.
    UNMODELLED_REASONS = {
        "get_block": "blocks carry no extrinsics here",
        "decode_scale": "nothing is SCALE-encoded here",
        "events": "no event history is kept; receipts carry their events",
        "sign_extrinsic": "no MEV shield",
        "find_extrinsic": "no MEV shield",
        "prepare": "out-of-process signing",
        "submit_signature": "out-of-process signing",
        "submit_signed": "pre-signed extrinsics",
    }

    def __init__(self, *, seconds_per_block: float = 12.0, state: ChainState | None = None):
        if state is None:
            state = ChainState(seconds_per_block=float(seconds_per_block), genesis_unix_ms=int(time.time() * 1000))
        self.state = state
        self.token_symbols: dict[int, str] = {}
        self._lock = threading.RLock()
        # The dispatch tables: storage reads and runtime APIs from StorageReads, extrinsics from ExtrinsicCalls.
        self._reads, self._maps = self._storage_tables()
        self._runtime: dict[tuple[str, str], Callable[[list], Any]] = {
            ("SubnetInfoRuntimeApi", "get_metagraph"): self._rt_metagraph,
            ("SubnetInfoRuntimeApi", "get_next_epoch_start_block"): self._rt_next_epoch_start_block,
        }
        self._constants: dict[tuple[str, str], Callable[[], Any]] = {
            ("Aura", "SlotDuration"): lambda: int(self.state.seconds_per_block * 1000),
            ("Commitments", "MaxFields"): lambda: MAX_COMMITMENT_FIELDS,
        }
        self._calls = self._call_table()

    # --- JSON snapshot -----------------------------------------------------------------------------------------

    def to_json(self) -> str:
        with self._lock:
            return json.dumps(state_to_dict(self.state), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MockSubstrate:
        """A chain restored from :meth:`to_json`; ``ValueError`` for anything that is not such a document."""
        try:
            document = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"mock chain state is not JSON: {error}") from None
        return cls(state=state_from_dict(document))

    # --- Substrate protocol: lifecycle and blocks ---------------------------------------------------------------

    def balance(self, rao: int, netuid: int = 0) -> bt.Balance:
        symbol = self.token_symbols.get(netuid) if netuid else None
        return bt.Balance(int(rao), netuid, symbol)

    async def connect(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def block_hash_sync(self, block: int | None = None) -> str:
        with self._lock:
            head = self.state.block
            number = head if block is None else block
            if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= head:
                raise bt.ChainError(f"no block at height {block!r} (head is {head})", code=ErrorCode.NOT_FOUND)
            digest = hashlib.sha256(f"{self.state.genesis_seed}:{number}".encode()).digest()[:24]
            return "0x" + (digest + number.to_bytes(8, "big")).hex()

    async def block_hash(self, block: int | None = None) -> str:
        return self.block_hash_sync(block)

    def block_number_sync(self) -> int:
        with self._lock:
            return self.state.block

    def block_time_sync(self) -> float:
        with self._lock:
            return self.state.seconds_per_block

    async def block_number(self) -> int:
        return self.block_number_sync()

    async def finalized_block_number(self) -> int:
        return self.block_number_sync()  # instant finality: finalized = head

    async def block_time(self) -> float:
        return self.block_time_sync()

    async def spec_version(self) -> int:
        return SPEC_VERSION

    async def blocks(self, *, finalized: bool = False) -> AsyncIterator[dict]:
        async for header in poll_heads(self.block_number, self.block_hash, self.block_time):
            yield header

    # --- Substrate protocol: reads ------------------------------------------------------------------------------

    def query_sync(self, module: str, storage_function: str, params: list | None = None,
                   block_hash: str | None = None) -> Any:
        with self._lock:
            self._check_block_hash(block_hash)
            reader = self._reads.get((module, storage_function))
            if reader is None:
                raise unsupported(f"storage item {module}.{storage_function}", (f"{m}.{n}" for m, n in self._reads))
            return reader(_key_list(params))

    def query_map_sync(self, module: str, storage_function: str, params: list | None = None,
                       block_hash: str | None = None) -> list[tuple[Any, Any]]:
        with self._lock:
            self._check_block_hash(block_hash)
            mapper = self._maps.get((module, storage_function))
            if mapper is None:
                raise unsupported(f"storage map {module}.{storage_function}", (f"{m}.{n}" for m, n in self._maps))
            return mapper(_key_list(params))

    def runtime_call_sync(self, api: str, method: str, params: list, block_hash: str | None = None) -> Any:
        with self._lock:
            self._check_block_hash(block_hash)
            handler = self._runtime.get((api, method))
            if handler is None:
                raise unsupported(f"runtime API {api}.{method}", (f"{a}.{m}" for a, m in self._runtime))
            return handler(_key_list(params))

    def constant_sync(self, module: str, name: str) -> Any:
        with self._lock:
            getter = self._constants.get((module, name))
            if getter is None:
                raise unsupported(f"constant {module}.{name}", (f"{m}.{n}" for m, n in self._constants))
            return getter()

    async def query(self, module: str, storage_function: str, params: list | None = None,
                    block_hash: str | None = None) -> Any:
        return self.query_sync(module, storage_function, params, block_hash)

    async def query_map(self, module: str, storage_function: str, params: list | None = None,
                        block_hash: str | None = None) -> list[tuple[Any, Any]]:
        return self.query_map_sync(module, storage_function, params, block_hash)

    def query_batch_sync(self, module: str, storage_function: str, param_sets: list[list],
                         block_hash: str | None = None) -> list[Any]:
        if not isinstance(param_sets, (list, tuple)):
            raise invalid_argument(f"query_batch needs a list of key lists, got {param_sets!r}")
        with self._lock:
            return [self.query_sync(module, storage_function, params, block_hash) for params in param_sets]

    async def query_batch(self, module: str, storage_function: str, param_sets: list[list],
                          block_hash: str | None = None) -> list[Any]:
        return self.query_batch_sync(module, storage_function, param_sets, block_hash)

    async def map_has_entries(self, module: str, storage_function: str, params: list,
                              block_hash: str | None = None) -> bool:
        return bool(self.query_map_sync(module, storage_function, params, block_hash))

    async def runtime_call(self, api: str, method: str, params: list, block_hash: str | None = None) -> Any:
        return self.runtime_call_sync(api, method, params, block_hash)

    async def constant(self, module: str, name: str) -> Any:
        return self.constant_sync(module, name)

    # --- Substrate protocol: calls and writes -------------------------------------------------------------------

    async def compose(self, call: Any) -> Any:
        return self.compose_sync(call)

    async def estimate_fee(self, call: Any, keypair: Any) -> bt.Balance:
        self.compose_sync(call)
        return bt.Balance.from_rao(0)  # the mock charges no fees

    def account_next_index_sync(self, address: str) -> int:
        with self._lock:
            return self.state.nonces.get(address, 0)

    async def account_next_index(self, address: str) -> int:
        return self.account_next_index_sync(address)

    async def mev_next_key(self) -> bytes | None:
        return None  # no MEV shield: shielded submission reports "NextKey not available"

    async def submit(self, call: Any, keypair: Any, *, nonce: int | None = None, period: int | None = None,
                     wait_for_inclusion: bool = True, wait_for_finalization: bool = True) -> bt.ExtrinsicResult:
        result = self.apply_extrinsic(call, keypair.ss58_address, nonce=nonce)
        return finish_receipt(result, wait_for_inclusion or wait_for_finalization)

    # --- Internals: block pinning -----------------------------------------------------------------------------------

    def _check_block_hash(self, block_hash: str | None) -> None:
        """Reads may be pinned to a recent block of this chain; they see the head state (no history is kept)."""
        if block_hash is None:
            return
        try:
            raw = bytes.fromhex(str(block_hash).removeprefix("0x"))
        except ValueError:
            raw = b""
        number = int.from_bytes(raw[24:], "big") if len(raw) == 32 else -1
        if number < 0 or number > self.state.block or self.block_hash_sync(number) != block_hash:
            raise bt.ChainError(f"unknown block hash {block_hash!r}", code=ErrorCode.NOT_FOUND)
        if self.state.block - number > HISTORY_WINDOW:
            raise bt.ChainError(
                f"the mock chain keeps no history: block {number} is more than {HISTORY_WINDOW} blocks "
                f"behind the head ({self.state.block})",
                code=ErrorCode.NOT_FOUND,
            )


__all__ = [
    "HISTORY_WINDOW", "SPEC_VERSION", "MockSubstrate", "UnmodelledMembers", "poll_heads",  # defined here
    # re-exported from the parts
    "MAX_ADVANCE",  # mock_subnets
    "MAX_COMMITMENT_FIELDS", "MAX_RAW_COMMITMENT_BYTES", "POOL_REJECTIONS", "finish_receipt",  # mock_calls
    "RAO_PER_TAO", "STATE_FORMAT", "ZERO_ACCOUNT", "AxonInfo", "ChainState", "NeuronState", "SubnetState",
    "state_from_dict", "state_to_dict",  # mock_state
    "chain_error", "invalid_argument", "unsupported",  # mock_errors
]
