"""An in-memory Subtensor the bittensor 11 SDK runs against unchanged: ``bt.Subtensor("local", substrate=mock)``.

:class:`MockSubstrate` implements the SDK's ``Substrate`` protocol (``bittensor/_substrate.py``) over plain
dataclasses (:class:`ChainState` → :class:`SubnetState` → :class:`NeuronState`), so the SDK's own reads and intents
work as they do on a real chain: ``subnets.metagraph`` (one ``SubnetInfoRuntimeApi.get_metagraph`` runtime call plus
two ``Commitments`` maps), ``weights.weights``, ``execute(SetWeights)`` (its preflight reads ``Uids``,
``WeightsSetRateLimit``, ``LastUpdate``, ... and then submits ``set_mechanism_weights``), ``execute(ServeAxon)`` and
the raw ``Commitments.set_commitment`` call. It is a product feature (a whole subnet runs locally on it, shared
between processes by :mod:`template.chain.mock_server`), not only a test double.

Chain rules it follows (subtensor ``pallets/subtensor``):

- ``set_weights``/``set_mechanism_weights`` run the chain's checks in the chain's order, each failing with the chain's
  error name (``WeightVecNotEqualSize``, ``SubnetNotExists``, ``UidsLengthExceedUidsInSubNet``,
  ``HotKeyNotRegisteredInSubNet``, ``IncorrectWeightVersionKey``, ``SettingWeightsTooFast``,
  ``NeuronNoValidatorPermit``, ``DuplicateUids``, ``UidVecContainInvalidOne``, ``WeightVecLengthIsLow``,
  ``MaxWeightExceeded``). Registration sets ``LastUpdate`` to the registration block, so a new hotkey waits
  ``weights_rate_limit`` blocks before its first weights (unless it registered at block 0). Commit-reveal is off.
- Epochs: the current chain's stateful schedule, an epoch runs when ``block >= LastEpochBlock + tempo`` (so
  ``advance_blocks(tempo)`` runs exactly one); ``LastEpochBlock`` starts at the subnet's creation block. The epoch is
  :func:`template.chain.yuma.yuma_epoch` on the stake, the weights (a weight set before its target uid was
  (re)registered is dropped, as on chain), the permits and the previous bonds; it stores incentive, dividends, trust,
  consensus, ranks, validator trust, bonds, the emission of the epoch (``emission_per_block_rao`` × blocks since the
  last epoch), and adds each uid's emission to its alpha stake.
- Validator permits: the top ``max_allowed_validators`` uids by stake among those with non-zero stake (ties to the lower
  uid), recomputed after every epoch, registration and :meth:`MockSubstrate.set_stake` (the chain recomputes them only
  in the epoch; recomputing at registration lets a freshly staked validator set weights at once).
- Registration on a full subnet replaces the non-immune uid with the lowest pruning score (oldest registration, then
  lowest uid, on ties); when every uid is still immune it raises ``NoNeuronIdAvailable``. A hotkey belongs to one
  coldkey on every subnet (``NonAssociatedColdKey``). ``create_subnet`` with an owner registers the owner hotkey as
  uid 0, as ``register_network`` does.
- ``serve_axon`` checks registration, ip type, ip value, the serving rate limit and the port as the chain does,
  except that loopback addresses are accepted (the chain refuses 127.0.0.1; a local network lives on it).

Simplifications: no balances, fees (0), burn, owner cut, root/TAO stake, delegation, commit-reveal, mechanisms other
than 0, timelocked commitments, or events history; stake is alpha stake set by the helpers plus emission. The state is
not versioned: a read pinned to one of the last :data:`HISTORY_WINDOW` blocks sees the head state, an older block is
refused.

On failure: every write validates completely before it changes anything, so a rejected write leaves the state exactly
as it was. A chain-side rejection comes back as a failed ``bt.ExtrinsicResult`` whose ``error`` is a ``bt.ChainError``
with the chain's error name and code (what the SDK's RPC backend returns); the nonce is consumed, as on chain. Reads of
storage items, maps, runtime APIs, constants or calls the mock does not model raise ``bt.ChainError`` naming the item
and listing what is supported; malformed keys raise ``bt.ChainError`` (code ``invalid_argument``). The test helpers
raise ``ValueError`` for bad arguments and ``bt.ChainError`` when the chain state refuses (unknown subnet, ...).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import bittensor as bt
import numpy as np
from bittensor._generated.errors import ERRORS
from bittensor.result import ErrorCode
from bittensor.settings import GLOBAL_MAX_SUBNET_COUNT, U16_MAX
from bittensor.sp_core import ss58_decode, ss58_encode

from template.chain.yuma import YumaParams, yuma_epoch

RAO_PER_TAO = 1_000_000_000
MAX_ADVANCE = 100_000  # blocks per advance_blocks call: bounds how long one call holds the lock
HISTORY_WINDOW = 64  # reads may be pinned to this many recent blocks (they see the head state)
MAX_COMMITMENT_FIELDS = 3  # the runtime's Commitments::MaxFields
MAX_RAW_COMMITMENT_BYTES = 128  # Data::Raw0..Raw128
SPEC_VERSION = 1  # reported runtime spec_version; nothing in the SDK paths above branches on it
STATE_FORMAT = 1  # version of the to_json() document
ZERO_ACCOUNT = ss58_encode(bytes(32))  # what the chain shows for an unset account
POOL_REJECTIONS = ("Stale", "Future", "BadProof")  # refused before inclusion: no nonce consumed
_HASH_VARIANTS = ("BlakeTwo256", "Sha256", "Keccak256", "ShaThree256")
_GREEK = "αβγδεζηθικλμνξοπρστυφχψω"
_DOCS = {info.name: info.docs for info in ERRORS.values()}
_YUMA = YumaParams()


def chain_error(name: str, detail: str = "") -> bt.ChainError:
    """A ``bt.ChainError`` as the RPC backend builds it from a failed receipt: the error's docs, its exact name."""
    docs = _DOCS.get(name, name)
    return bt.ChainError(f"{docs} ({detail})" if detail else docs, name)


def invalid_argument(message: str) -> bt.ChainError:
    """A rejection with no chain error name: the call would not even encode (wrong type, missing field, ...)."""
    return bt.ChainError(message, code=ErrorCode.INVALID_ARGUMENT)


def unsupported(what: str, supported: Any = ()) -> bt.ChainError:
    listed = f"; supported: {', '.join(sorted(supported))}" if supported else ""
    return bt.ChainError(f"the mock chain does not support {what}{listed}", code=ErrorCode.DISABLED)


# --- State ------------------------------------------------------------------------------------------------------


@dataclass
class AxonInfo:
    """What ``serve_axon`` stores (``Axons`` storage); ``ip`` is the integer form, ``ip_type`` 4 or 6."""

    block: int
    version: int
    ip: int
    port: int
    ip_type: int
    protocol: int
    placeholder1: int = 0
    placeholder2: int = 0


@dataclass
class NeuronState:
    """One uid of a subnet. Scores are fractions in [0, 1]; stake and emission are rao."""

    uid: int
    hotkey: str
    coldkey: str
    block_at_registration: int
    last_update: int
    alpha_stake_rao: int = 0
    validator_permit: bool = False
    weights: list[list[int]] = field(default_factory=list)  # [[dest_uid, u16], ...] as last set
    bonds: list[list[float]] = field(default_factory=list)  # [[dest_uid, bond], ...] from the last epoch
    axon: AxonInfo | None = None
    rank: float = 0.0
    trust: float = 0.0
    consensus: float = 0.0
    incentive: float = 0.0
    dividends: float = 0.0
    validator_trust: float = 0.0
    pruning_score: float = 0.0
    emission_rao: int = 0  # paid at the last epoch


@dataclass
class SubnetState:
    """A subnet's hyperparameters, epoch clock, neurons (index = uid) and commitments (by hotkey)."""

    netuid: int
    tempo: int
    owner_hotkey: str
    owner_coldkey: str
    name: str
    symbol: str
    registered_at: int
    last_epoch_block: int
    epoch_index: int = 0
    max_uids: int = 256
    max_allowed_validators: int = 64
    weights_rate_limit: int = 100
    min_allowed_weights: int = 1
    max_weights_limit: int = U16_MAX  # u16 fraction of the normalized row
    weights_version_key: int = 0
    immunity_period: int = 4096
    activity_cutoff: int = 5000
    serving_rate_limit: int = 50
    emission_per_block_rao: int = RAO_PER_TAO
    neurons: list[NeuronState] = field(default_factory=list)
    commitments: dict[str, dict] = field(default_factory=dict)  # hotkey -> CommitmentOf record

    def uid_of(self, hotkey: str) -> int | None:
        for neuron in self.neurons:
            if neuron.hotkey == hotkey:
                return neuron.uid
        return None


@dataclass
class ChainState:
    """The whole chain: head block, clock, subnets and account nonces. Plain data, so it snapshots to JSON."""

    block: int = 0
    seconds_per_block: float = 12.0
    genesis_seed: str = "mock"
    genesis_unix_ms: int = 0
    extrinsics_in_block: int = 0
    subnets: dict[int, SubnetState] = field(default_factory=dict)
    nonces: dict[str, int] = field(default_factory=dict)


def state_to_dict(state: ChainState) -> dict:
    """The JSON document of :meth:`MockSubstrate.to_json`: subnets as a list (JSON keys cannot be integers)."""
    document = asdict(replace(state, subnets={}))
    document["subnets"] = [asdict(subnet) for _, subnet in sorted(state.subnets.items())]
    return {"format": STATE_FORMAT, **document}


def state_from_dict(document: dict) -> ChainState:
    """The inverse of :func:`state_to_dict`; ``ValueError`` naming the problem for any other document."""
    if not isinstance(document, dict) or document.get("format") != STATE_FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"not a mock chain state (format {found!r}, expected {STATE_FORMAT})")
    try:
        subnets = {}
        for raw in document["subnets"]:
            neurons = [
                NeuronState(**{**n, "axon": AxonInfo(**n["axon"]) if n["axon"] else None}) for n in raw["neurons"]
            ]
            subnets[int(raw["netuid"])] = SubnetState(**{**raw, "neurons": neurons})
        fields = {k: v for k, v in document.items() if k not in ("format", "subnets")}
        return ChainState(**fields, subnets=subnets)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"malformed mock chain state: {type(error).__name__}: {error}") from None


def _blank_subnet(netuid: int) -> SubnetState:
    """What storage reads see for a netuid that does not exist: the chain's defaults (empty vectors, zero account)."""
    return SubnetState(netuid, 360, ZERO_ACCOUNT, ZERO_ACCOUNT, "", "", 0, 0)


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_address(what: str, value: Any) -> None:
    try:
        ss58_decode(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be an ss58 address, got {value!r}") from None


def _u16(fraction: float) -> int:
    return int(round(min(max(fraction, 0.0), 1.0) * U16_MAX))


def _key_list(params: Any) -> list:
    if params is None:
        return []
    if not isinstance(params, (list, tuple)):
        raise invalid_argument(f"storage keys must be a list, got {params!r}")
    return list(params)


def _keys(what: str, params: list, names: tuple[str, ...]) -> list:
    if len(params) != len(names):
        raise invalid_argument(f"{what} takes keys ({', '.join(names)}), got {params!r}")
    return params


def _int_key(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_argument(f"{what}: expected an integer key, got {value!r}")
    return value


def _axon_dict(axon: AxonInfo | None) -> dict:
    return asdict(axon) if axon else asdict(AxonInfo(0, 0, 0, 0, 0, 0))


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


class MockSubstrate(UnmodelledMembers):
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
        self._reads, self._maps = self._storage_tables()
        self._runtime: dict[tuple[str, str], Callable[[list], Any]] = {
            ("SubnetInfoRuntimeApi", "get_metagraph"): self._rt_metagraph,
            ("SubnetInfoRuntimeApi", "get_next_epoch_start_block"): self._rt_next_epoch_start_block,
        }
        self._constants: dict[tuple[str, str], Callable[[], Any]] = {
            ("Aura", "SlotDuration"): lambda: int(self.state.seconds_per_block * 1000),
            ("Commitments", "MaxFields"): lambda: MAX_COMMITMENT_FIELDS,
        }
        self._calls: dict[tuple[str, str], Callable[[str, dict], list]] = {
            ("SubtensorModule", "set_mechanism_weights"): self._call_set_weights,
            ("SubtensorModule", "set_weights"): self._call_set_weights,
            ("SubtensorModule", "serve_axon"): self._call_serve_axon,
            ("Commitments", "set_commitment"): self._call_set_commitment,
        }

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

    # --- Test helpers (synchronous) --------------------------------------------------------------------------

    def create_subnet(
        self,
        netuid: int,
        tempo: int = 360,
        *,
        owner_hotkey: str | None = None,
        owner_coldkey: str | None = None,
        max_uids: int = 256,
        weights_rate_limit: int = 100,
        min_allowed_weights: int = 1,
        max_weights_limit: float = 1.0,
        weights_version_key: int = 0,
        immunity_period: int = 4096,
        emission_per_block_rao: int = RAO_PER_TAO,
        name: str = "",
        max_allowed_validators: int = 64,
        serving_rate_limit: int = 50,
        activity_cutoff: int = 5000,
    ) -> int:
        """Add a subnet (``tempo`` 0 = never runs epochs); with an owner, the owner hotkey becomes uid 0."""
        checks = {
            "netuid": _is_int(netuid, 1, GLOBAL_MAX_SUBNET_COUNT - 1),
            "tempo": _is_int(tempo, 0, U16_MAX),
            "max_uids": _is_int(max_uids, 1, U16_MAX),
            "max_weights_limit": _is_number(max_weights_limit) and 0.0 < max_weights_limit <= 1.0,
            "min_allowed_weights": _is_int(min_allowed_weights, 0, U16_MAX),
            "max_allowed_validators": _is_int(max_allowed_validators, 0, U16_MAX),
            "owner_hotkey/owner_coldkey": (owner_hotkey is None) == (owner_coldkey is None),
            "name": isinstance(name, str),
            "rate limits, periods and emission": all(
                _is_int(x, 0, 2**63 - 1)
                for x in (weights_rate_limit, weights_version_key, immunity_period, emission_per_block_rao,
                          serving_rate_limit, activity_cutoff)
            ),
        }
        invalid = [what for what, ok in checks.items() if not ok]
        if invalid:
            raise ValueError(f"create_subnet: invalid {', '.join(invalid)}")
        if owner_hotkey is not None:
            _check_address("owner_hotkey", owner_hotkey)
            _check_address("owner_coldkey", owner_coldkey)
        with self._lock:
            if netuid in self.state.subnets:
                raise bt.ChainError(f"subnet {netuid} already exists", code=ErrorCode.ALREADY_EXISTS)
            if owner_hotkey is not None:
                self._check_hotkey_owner(owner_hotkey, owner_coldkey)
            block = self.state.block
            subnet = SubnetState(
                netuid=netuid, tempo=tempo,
                owner_hotkey=owner_hotkey or ZERO_ACCOUNT, owner_coldkey=owner_coldkey or ZERO_ACCOUNT,
                name=name, symbol=_GREEK[(netuid - 1) % len(_GREEK)], registered_at=block, last_epoch_block=block,
                max_uids=max_uids, max_allowed_validators=max_allowed_validators,
                weights_rate_limit=weights_rate_limit, min_allowed_weights=min_allowed_weights,
                max_weights_limit=_u16(max_weights_limit), weights_version_key=weights_version_key,
                immunity_period=immunity_period, activity_cutoff=activity_cutoff,
                serving_rate_limit=serving_rate_limit, emission_per_block_rao=emission_per_block_rao,
            )
            if owner_hotkey is not None:
                subnet.neurons.append(NeuronState(0, owner_hotkey, owner_coldkey, block, block))
            self.state.subnets[netuid] = subnet
            return netuid

    def register(self, netuid: int, hotkey_ss58: str, coldkey_ss58: str, stake_tao: float = 0.0) -> int:
        """Register a hotkey (no burn) and give it ``stake_tao`` of alpha stake; returns its uid.

        Registering an already registered hotkey returns its uid and changes nothing.
        """
        if not (_is_number(stake_tao) and stake_tao >= 0):
            raise ValueError(f"stake_tao must be a non-negative number, got {stake_tao!r}")
        _check_address("hotkey_ss58", hotkey_ss58)
        _check_address("coldkey_ss58", coldkey_ss58)
        with self._lock:
            subnet = self._subnet(netuid)
            self._check_hotkey_owner(hotkey_ss58, coldkey_ss58)
            existing = subnet.uid_of(hotkey_ss58)
            if existing is not None:
                return existing
            block = self.state.block
            neuron = NeuronState(len(subnet.neurons), hotkey_ss58, coldkey_ss58, block, block,
                                 alpha_stake_rao=int(round(stake_tao * RAO_PER_TAO)))
            if len(subnet.neurons) < subnet.max_uids:
                subnet.neurons.append(neuron)
            else:
                neuron.uid = self._uid_to_prune(subnet)
                subnet.neurons[neuron.uid] = neuron
                for other in subnet.neurons:  # bonds held on the replaced uid go with it
                    other.bonds = [pair for pair in other.bonds if pair[0] != neuron.uid]
            self._refresh_permits(subnet)
            return neuron.uid

    def set_stake(self, netuid: int, hotkey_ss58: str, tao: float) -> None:
        """Set a registered hotkey's alpha stake on a subnet (and recompute permits)."""
        if not (_is_number(tao) and tao >= 0):
            raise ValueError(f"tao must be a non-negative number, got {tao!r}")
        with self._lock:
            subnet = self._subnet(netuid)
            uid = subnet.uid_of(hotkey_ss58)
            if uid is None:
                raise chain_error("HotKeyNotRegisteredInSubNet", f"{hotkey_ss58} on netuid {netuid}")
            subnet.neurons[uid].alpha_stake_rao = int(round(tao * RAO_PER_TAO))
            self._refresh_permits(subnet)

    def advance_blocks(self, n: int = 1) -> int:
        """Produce ``n`` blocks (at most :data:`MAX_ADVANCE` per call), running each subnet's epoch when it is due;
        returns the new head block."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_ADVANCE:
            raise ValueError(f"advance_blocks needs an integer in 0..{MAX_ADVANCE}, got {n!r}")
        with self._lock:
            for _ in range(n):
                self.state.block += 1
                self.state.extrinsics_in_block = 0
                for subnet in self.state.subnets.values():
                    if subnet.tempo > 0 and self.state.block - subnet.last_epoch_block >= subnet.tempo:
                        self._run_epoch(subnet)
            return self.state.block

    def set_seconds_per_block(self, seconds: float) -> None:
        """What ``block_time`` reports (and ``Aura.SlotDuration``); the server sets it to its clock."""
        if not (_is_number(seconds) and seconds > 0):
            raise ValueError(f"seconds per block must be positive, got {seconds!r}")
        with self._lock:
            self.state.seconds_per_block = float(seconds)

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

    def compose_sync(self, call: Any) -> Any:
        """A generated ``Call`` stays as it is (``(module, function, params)``); unknown calls are refused here."""
        module, function, _params = _split_call(call)
        if (module, function) not in self._calls:
            raise unsupported(f"call {module}.{function}", (f"{m}.{f}" for m, f in self._calls))
        return call

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

    def apply_extrinsic(self, call: Any, signer: str, *, nonce: int | None = None) -> bt.ExtrinsicResult:
        """Include ``call`` signed by ``signer`` in the head block and return the receipt as the RPC backend would.

        An explicit ``nonce`` must be the account's next one (``Stale``/``Future`` otherwise, nothing consumed);
        a dispatch failure consumes the nonce and changes nothing else.
        """
        module, function, params = _split_call(call)
        with self._lock:
            expected = self.state.nonces.get(signer, 0)
            if nonce is not None and nonce != expected:
                name = "Stale" if nonce < expected else "Future"
                error = bt.ChainError(f"nonce {nonce} rejected: the account's next nonce is {expected}", name)
                return bt.ExtrinsicResult(success=False, message=error.message, error=error)
            handler = self._calls.get((module, function))
            if handler is None:  # would not even encode for this runtime: refused like compose refuses it
                raise unsupported(f"call {module}.{function}", (f"{m}.{f}" for m, f in self._calls))
            self.state.nonces[signer] = expected + 1
            receipt = {
                "block_hash": self.block_hash_sync(),
                "extrinsic_id": f"{self.state.block}-{self.state.extrinsics_in_block:04d}",
                "fee": bt.Balance.from_rao(0),
            }
            self.state.extrinsics_in_block += 1
            try:
                events = handler(signer, dict(params))
            except bt.ChainError as error:
                return bt.ExtrinsicResult(success=False, message=error.message, error=error, **receipt)
            return bt.ExtrinsicResult(success=True, message="Success", events=events, **receipt)

    async def submit(self, call: Any, keypair: Any, *, nonce: int | None = None, period: int | None = None,
                     wait_for_inclusion: bool = True, wait_for_finalization: bool = True) -> bt.ExtrinsicResult:
        result = self.apply_extrinsic(call, keypair.ss58_address, nonce=nonce)
        return finish_receipt(result, wait_for_inclusion or wait_for_finalization)

    # --- Internals: subnets, registration, permits, epochs -------------------------------------------------------

    def _subnet(self, netuid: int) -> SubnetState:
        subnet = self.state.subnets.get(netuid) if _is_int(netuid, 0, U16_MAX) else None
        if subnet is None:
            raise chain_error("SubnetNotExists", f"netuid {netuid}")
        return subnet

    def _check_hotkey_owner(self, hotkey: str, coldkey: str) -> None:
        for subnet in self.state.subnets.values():
            for neuron in subnet.neurons:
                if neuron.hotkey == hotkey and neuron.coldkey != coldkey:
                    raise chain_error("NonAssociatedColdKey", f"hotkey {hotkey} belongs to coldkey {neuron.coldkey}")

    def _uid_to_prune(self, subnet: SubnetState) -> int:
        block = self.state.block
        candidates = [n for n in subnet.neurons if block - n.block_at_registration >= subnet.immunity_period]
        if not candidates:
            raise chain_error("NoNeuronIdAvailable", f"netuid {subnet.netuid} is full and every uid is immune")
        return min(candidates, key=lambda n: (n.pruning_score, n.block_at_registration, n.uid)).uid

    @staticmethod
    def _refresh_permits(subnet: SubnetState) -> None:
        staked = [n for n in subnet.neurons if n.alpha_stake_rao > 0]
        top = sorted(staked, key=lambda n: (-n.alpha_stake_rao, n.uid))[: subnet.max_allowed_validators]
        permitted = {n.uid for n in top}
        for neuron in subnet.neurons:
            neuron.validator_permit = neuron.uid in permitted

    def _run_epoch(self, subnet: SubnetState) -> None:
        block = self.state.block
        neurons = subnet.neurons
        n = len(neurons)
        emission_rao = subnet.emission_per_block_rao * (block - subnet.last_epoch_block)
        subnet.last_epoch_block = block
        subnet.epoch_index += 1
        if n == 0:
            return
        weights = np.zeros((n, n))
        bonds = np.zeros((n, n))
        for i, neuron in enumerate(neurons):
            for dest, value in neuron.weights:
                # The chain drops a weight set before its target was (re)registered.
                if dest < n and neuron.last_update >= neurons[dest].block_at_registration:
                    weights[i, dest] = value
            for dest, value in neuron.bonds:
                if dest < n:
                    bonds[i, dest] = value
        result = yuma_epoch(
            stake=np.array([x.alpha_stake_rao for x in neurons], dtype=np.float64),
            weights=weights,
            validator_permit=np.array([x.validator_permit for x in neurons]),
            bonds=bonds,
            emission_rao=emission_rao,
            params=_YUMA,
            active=np.array([block - x.last_update <= subnet.activity_cutoff for x in neurons]),
        )
        top_emission = int(result.emission.max())
        for i, neuron in enumerate(neurons):
            neuron.rank = float(result.ranks[i])
            neuron.trust = float(result.trust[i])
            neuron.consensus = float(result.consensus[i])
            neuron.incentive = float(result.incentive[i])
            neuron.dividends = float(result.dividends[i])
            neuron.validator_trust = float(result.validator_trust[i])
            neuron.emission_rao = int(result.emission[i])
            neuron.alpha_stake_rao += neuron.emission_rao
            neuron.pruning_score = neuron.emission_rao / top_emission if top_emission else 0.0
            neuron.bonds = [[j, float(b)] for j, b in enumerate(result.bonds[i]) if b > 0]
        self._refresh_permits(subnet)

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

    # --- Internals: storage, maps and runtime APIs ---------------------------------------------------------------

    def _storage_tables(self) -> tuple[dict, dict]:
        """``(module, item) -> fn(params)`` for single reads and for map iteration, built from per-subnet values."""
        subnet_values: dict[str, Callable[[SubnetState], Any]] = {
            "Tempo": lambda s: s.tempo,
            "WeightsSetRateLimit": lambda s: s.weights_rate_limit,
            "MinAllowedWeights": lambda s: s.min_allowed_weights,
            "MaxWeightsLimit": lambda s: s.max_weights_limit,
            "WeightsVersionKey": lambda s: s.weights_version_key,
            "ImmunityPeriod": lambda s: s.immunity_period,
            "ActivityCutoff": lambda s: s.activity_cutoff,
            "ServingRateLimit": lambda s: s.serving_rate_limit,
            "MaxAllowedUids": lambda s: s.max_uids,
            "MaxAllowedValidators": lambda s: s.max_allowed_validators,
            "SubnetworkN": lambda s: len(s.neurons),
            "NetworksAdded": lambda s: s.netuid in self.state.subnets,
            "NetworkRegisteredAt": lambda s: s.registered_at,
            "SubnetOwner": lambda s: s.owner_coldkey,
            "SubnetOwnerHotkey": lambda s: s.owner_hotkey,
            "TokenSymbol": lambda s: list(s.symbol.encode()),
            "Burn": lambda s: 0,
            "Kappa": lambda s: _u16(_YUMA.kappa),
            "CommitRevealWeightsEnabled": lambda s: False,
            "RevealPeriodEpochs": lambda s: 1,
            "SubnetEpochConsensus": lambda s: "Yuma",
            "LastEpochBlock": lambda s: s.last_epoch_block,
            "BlocksSinceLastStep": lambda s: self.state.block - s.last_epoch_block,
            "SubnetEpochIndex": lambda s: s.epoch_index,
            "PendingEpochAt": lambda s: 0,
            "LastUpdate": lambda s: [n.last_update for n in s.neurons],
            "ValidatorPermit": lambda s: [n.validator_permit for n in s.neurons],
            "Active": lambda s: [self._active(s, n) for n in s.neurons],
            "Rank": lambda s: [_u16(n.rank) for n in s.neurons],
            "Trust": lambda s: [_u16(n.trust) for n in s.neurons],
            "Consensus": lambda s: [_u16(n.consensus) for n in s.neurons],
            "Incentive": lambda s: [_u16(n.incentive) for n in s.neurons],
            "Dividends": lambda s: [_u16(n.dividends) for n in s.neurons],
            "ValidatorTrust": lambda s: [_u16(n.validator_trust) for n in s.neurons],
            "PruningScores": lambda s: [_u16(n.pruning_score) for n in s.neurons],
            "Emission": lambda s: [n.emission_rao for n in s.neurons],
        }
        # Keyed by the mechanism storage index (mechid * 4096 + netuid); mechanism 0 is the only one here.
        by_index = {"LastUpdate", "Weights", "Bonds"}
        reads: dict[tuple[str, str], Callable[[list], Any]] = {}
        maps: dict[tuple[str, str], Callable[[list], list]] = {}
        for item, value in subnet_values.items():
            key = "netuid_index" if item in by_index else "netuid"
            reads[("SubtensorModule", item)] = partial(self._read_subnet_value, item, key, value)
            maps[("SubtensorModule", item)] = partial(self._map_subnet_values, item, value)
        sm = "SubtensorModule"
        reads.update({
            (sm, "Uids"): self._read_uid,
            (sm, "Keys"): self._read_key,
            (sm, "BlockAtRegistration"): self._read_block_at_registration,
            (sm, "Axons"): self._read_axon,
            (sm, "IsNetworkMember"): self._read_is_network_member,
            (sm, "Owner"): self._read_hotkey_owner,
            (sm, "TotalHotkeyAlpha"): self._read_total_hotkey_alpha,
            (sm, "Weights"): partial(self._read_row, "Weights", self._weight_row),
            (sm, "Bonds"): partial(self._read_row, "Bonds", self._bond_row),
            ("Commitments", "CommitmentOf"): self._read_commitment,
            ("Commitments", "LastCommitment"): self._read_last_commitment,
            ("Commitments", "RevealedCommitments"): lambda params: None,  # no timelocked commitments
            ("Timestamp", "Now"): self._read_timestamp,
        })
        maps.update({
            (sm, "Uids"): lambda p: [(n.hotkey, n.uid) for n in self._prefix_subnet("Uids", p).neurons],
            (sm, "Keys"): lambda p: [(n.uid, n.hotkey) for n in self._prefix_subnet("Keys", p).neurons],
            (sm, "Axons"): lambda p: [
                (n.hotkey, asdict(n.axon)) for n in self._prefix_subnet("Axons", p).neurons if n.axon
            ],
            (sm, "Weights"): partial(self._map_rows, "Weights", self._weight_row),
            (sm, "Bonds"): partial(self._map_rows, "Bonds", self._bond_row),
            ("Commitments", "CommitmentOf"): lambda p: list(self._prefix_subnet("CommitmentOf", p).commitments.items()),
            ("Commitments", "RevealedCommitments"): lambda p: [],
        })
        return reads, maps

    def _subnet_or_blank(self, netuid: int) -> SubnetState:
        return self.state.subnets.get(netuid) or _blank_subnet(netuid)

    def _subnet_at_index(self, index: int) -> SubnetState:
        return self._subnet_or_blank(index) if index < GLOBAL_MAX_SUBNET_COUNT else _blank_subnet(index)

    def _read_subnet_value(self, item: str, key: str, value: Callable[[SubnetState], Any], params: list) -> Any:
        (netuid,) = _keys(f"SubtensorModule.{item}", params, (key,))
        netuid = _int_key(item, netuid)
        return value(self._subnet_at_index(netuid) if key == "netuid_index" else self._subnet_or_blank(netuid))

    def _map_subnet_values(self, item: str, value: Callable[[SubnetState], Any], params: list) -> list:
        _keys(f"SubtensorModule.{item} (map)", params, ())
        return [(netuid, value(subnet)) for netuid, subnet in sorted(self.state.subnets.items())]

    def _prefix_subnet(self, item: str, params: list) -> SubnetState:
        (netuid,) = _keys(f"{item} (map)", params, ("netuid",))
        return self._subnet_or_blank(_int_key(item, netuid))

    def _neuron_by_hotkey(self, item: str, params: list) -> NeuronState | None:
        netuid, hotkey = _keys(item, params, ("netuid", "hotkey"))
        subnet = self._subnet_or_blank(_int_key(item, netuid))
        uid = subnet.uid_of(str(hotkey))
        return None if uid is None else subnet.neurons[uid]

    def _neuron_by_uid(self, item: str, params: list) -> NeuronState | None:
        netuid, uid = _keys(item, params, ("netuid", "uid"))
        neurons = self._subnet_or_blank(_int_key(item, netuid)).neurons
        uid = _int_key(item, uid)
        return neurons[uid] if 0 <= uid < len(neurons) else None

    def _read_uid(self, params: list) -> int | None:
        neuron = self._neuron_by_hotkey("SubtensorModule.Uids", params)
        return None if neuron is None else neuron.uid

    def _read_key(self, params: list) -> str:
        neuron = self._neuron_by_uid("SubtensorModule.Keys", params)
        return ZERO_ACCOUNT if neuron is None else neuron.hotkey

    def _read_block_at_registration(self, params: list) -> int:
        neuron = self._neuron_by_uid("SubtensorModule.BlockAtRegistration", params)
        return 0 if neuron is None else neuron.block_at_registration

    def _read_axon(self, params: list) -> dict | None:
        neuron = self._neuron_by_hotkey("SubtensorModule.Axons", params)
        return asdict(neuron.axon) if neuron is not None and neuron.axon else None

    def _read_is_network_member(self, params: list) -> bool:
        hotkey, netuid = _keys("SubtensorModule.IsNetworkMember", params, ("hotkey", "netuid"))
        return self._subnet_or_blank(_int_key("IsNetworkMember", netuid)).uid_of(str(hotkey)) is not None

    def _read_hotkey_owner(self, params: list) -> str:
        (hotkey,) = _keys("SubtensorModule.Owner", params, ("hotkey",))
        for subnet in self.state.subnets.values():
            for neuron in subnet.neurons:
                if neuron.hotkey == hotkey:
                    return neuron.coldkey
        return ZERO_ACCOUNT

    def _read_total_hotkey_alpha(self, params: list) -> int:
        hotkey, netuid = _keys("SubtensorModule.TotalHotkeyAlpha", params, ("hotkey", "netuid"))
        subnet = self._subnet_or_blank(_int_key("TotalHotkeyAlpha", netuid))
        uid = subnet.uid_of(str(hotkey))
        return 0 if uid is None else subnet.neurons[uid].alpha_stake_rao

    @staticmethod
    def _weight_row(neuron: NeuronState) -> list:
        return [(dest, value) for dest, value in neuron.weights]

    @staticmethod
    def _bond_row(neuron: NeuronState) -> list:
        return [(dest, _u16(value)) for dest, value in neuron.bonds]

    def _read_row(self, item: str, row: Callable[[NeuronState], list], params: list) -> list:
        index, uid = _keys(f"SubtensorModule.{item}", params, ("netuid_index", "uid"))
        neurons = self._subnet_at_index(_int_key(item, index)).neurons
        uid = _int_key(item, uid)
        return row(neurons[uid]) if 0 <= uid < len(neurons) else []

    def _map_rows(self, item: str, row: Callable[[NeuronState], list], params: list) -> list:
        (index,) = _keys(f"SubtensorModule.{item} (map)", params, ("netuid_index",))
        rows = [(n.uid, row(n)) for n in self._subnet_at_index(_int_key(item, index)).neurons]
        return [(uid, values) for uid, values in rows if values]

    def _read_commitment(self, params: list) -> dict | None:
        netuid, hotkey = _keys("Commitments.CommitmentOf", params, ("netuid", "hotkey"))
        return self._subnet_or_blank(_int_key("CommitmentOf", netuid)).commitments.get(str(hotkey))

    def _read_last_commitment(self, params: list) -> int | None:
        record = self._read_commitment(params)
        return None if record is None else record["block"]

    def _read_timestamp(self, params: list) -> int:
        _keys("Timestamp.Now", params, ())
        return self.state.genesis_unix_ms + int(self.state.block * self.state.seconds_per_block * 1000)

    def _active(self, subnet: SubnetState, neuron: NeuronState) -> bool:
        return self.state.block - neuron.last_update <= subnet.activity_cutoff

    def _rt_next_epoch_start_block(self, params: list) -> int | None:
        (netuid,) = _keys("SubnetInfoRuntimeApi.get_next_epoch_start_block", params, ("netuid",))
        subnet = self.state.subnets.get(_int_key("get_next_epoch_start_block", netuid))
        if subnet is None or subnet.tempo == 0:
            return None
        return subnet.last_epoch_block + subnet.tempo

    def _rt_metagraph(self, params: list) -> dict | None:
        """The runtime's ``Metagraph`` record: u16 fractions for scores, rao for stake/emission, axons as dicts."""
        (netuid,) = _keys("SubnetInfoRuntimeApi.get_metagraph", params, ("netuid",))
        subnet = self.state.subnets.get(_int_key("get_metagraph", netuid))
        if subnet is None:
            return None
        neurons = subnet.neurons
        return {
            "netuid": subnet.netuid,
            "name": list(subnet.name.encode()),
            "symbol": list(subnet.symbol.encode()),
            "identity": None,
            "network_registered_at": subnet.registered_at,
            "owner_hotkey": subnet.owner_hotkey,
            "owner_coldkey": subnet.owner_coldkey,
            "block": self.state.block,
            "tempo": subnet.tempo,
            "last_step": subnet.last_epoch_block,
            "blocks_since_last_step": self.state.block - subnet.last_epoch_block,
            "kappa": _u16(_YUMA.kappa),
            "min_allowed_weights": subnet.min_allowed_weights,
            "max_weights_limit": subnet.max_weights_limit,
            "weights_version": subnet.weights_version_key,
            "weights_rate_limit": subnet.weights_rate_limit,
            "activity_cutoff": subnet.activity_cutoff,
            "max_validators": subnet.max_allowed_validators,
            "num_uids": len(neurons),
            "max_uids": subnet.max_uids,
            "burn": 0,
            "immunity_period": subnet.immunity_period,
            "serving_rate_limit": subnet.serving_rate_limit,
            "commit_reveal_weights_enabled": False,
            "hotkeys": [n.hotkey for n in neurons],
            "coldkeys": [n.coldkey for n in neurons],
            "identities": [None for _ in neurons],
            "axons": [_axon_dict(n.axon) for n in neurons],
            "active": [self._active(subnet, n) for n in neurons],
            "validator_permit": [n.validator_permit for n in neurons],
            "pruning_score": [_u16(n.pruning_score) for n in neurons],
            "last_update": [n.last_update for n in neurons],
            "emission": [n.emission_rao for n in neurons],
            "dividends": [_u16(n.dividends) for n in neurons],
            "incentives": [_u16(n.incentive) for n in neurons],
            "consensus": [_u16(n.consensus) for n in neurons],
            "trust": [_u16(n.trust) for n in neurons],
            "rank": [_u16(n.rank) for n in neurons],
            "block_at_registration": [n.block_at_registration for n in neurons],
            "alpha_stake": [n.alpha_stake_rao for n in neurons],
            "tao_stake": [0 for _ in neurons],
            "total_stake": [n.alpha_stake_rao for n in neurons],
        }

    # --- Internals: call handlers (validate everything, then apply) -----------------------------------------------

    def _call_set_weights(self, signer: str, params: dict) -> list:
        """``set_weights`` / ``set_mechanism_weights``: the chain's checks in the chain's order."""
        netuid = _param_int(params, "netuid")
        mecid = _param_int(params, "mecid") if "mecid" in params else 0
        dests = _param_u16_list(params, "dests")
        values = _param_u16_list(params, "weights")
        version_key = _param_int(params, "version_key")
        if len(dests) != len(values):
            raise chain_error("WeightVecNotEqualSize", f"{len(dests)} uids, {len(values)} weights")
        subnet = self.state.subnets.get(netuid)
        if subnet is None:
            raise chain_error("SubnetNotExists", f"netuid {netuid}")
        if mecid != 0:
            raise chain_error("MechanismDoesNotExist", f"mechanism {mecid} on netuid {netuid}")
        if len(dests) > len(subnet.neurons):
            raise chain_error("UidsLengthExceedUidsInSubNet", f"{len(dests)} uids > {len(subnet.neurons)}")
        uid = subnet.uid_of(signer)
        if uid is None:
            raise chain_error("HotKeyNotRegisteredInSubNet", f"{signer} on netuid {netuid}")
        if subnet.weights_version_key and version_key < subnet.weights_version_key:
            raise chain_error("IncorrectWeightVersionKey", f"{version_key} < {subnet.weights_version_key}")
        neuron = subnet.neurons[uid]
        block = self.state.block
        if neuron.last_update and block - neuron.last_update < subnet.weights_rate_limit:
            raise chain_error(
                "SettingWeightsTooFast",
                f"last set at block {neuron.last_update}, rate limit {subnet.weights_rate_limit}, now {block}",
            )
        self_weight = len(dests) == 1 and dests[0] == uid
        if not (self_weight or neuron.validator_permit or signer == subnet.owner_hotkey):
            raise chain_error("NeuronNoValidatorPermit", f"uid {uid} on netuid {netuid}")
        if len(set(dests)) != len(dests):
            raise chain_error("DuplicateUids")
        if any(dest >= len(subnet.neurons) for dest in dests):
            raise chain_error("UidVecContainInvalidOne", f"netuid {netuid} has {len(subnet.neurons)} uids")
        if not self_weight and len(values) < min(len(subnet.neurons), subnet.min_allowed_weights):
            raise chain_error("WeightVecLengthIsLow", f"{len(values)} < {subnet.min_allowed_weights}")
        top = max(values, default=0)
        upscaled = [(v * U16_MAX + top // 2) // top for v in values] if top else list(values)
        total = sum(upscaled)
        if (not self_weight and subnet.max_weights_limit < U16_MAX and total
                and max(v * U16_MAX // total for v in upscaled) > subnet.max_weights_limit):
            raise chain_error("MaxWeightExceeded", f"limit {subnet.max_weights_limit}/{U16_MAX}")
        neuron.weights = [[dest, value] for dest, value in zip(dests, upscaled, strict=True)]
        neuron.last_update = block
        return [_event("SubtensorModule", "WeightsSet", {"netuid": netuid, "uid": uid})]

    def _call_serve_axon(self, signer: str, params: dict) -> list:
        netuid = _param_int(params, "netuid")
        fields = {name: _param_int(params, name) for name in ("version", "ip", "port", "ip_type", "protocol")}
        fields.update({name: _param_int(params, name) for name in ("placeholder1", "placeholder2") if name in params})
        subnet = self.state.subnets.get(netuid)
        if subnet is None:
            raise chain_error("SubnetNotExists", f"netuid {netuid}")
        uid = subnet.uid_of(signer)
        if uid is None:
            raise chain_error("HotKeyNotRegisteredInNetwork", f"{signer} on netuid {netuid}")
        ip, ip_type = fields["ip"], fields["ip_type"]
        if ip_type not in (4, 6):
            raise chain_error("InvalidIpType", f"ip_type {ip_type}")
        if ip < 0 or (ip_type == 4 and ip >= 2**32 - 1) or (ip_type == 6 and ip >= 2**128 - 1):
            raise chain_error("InvalidIpAddress", f"{ip} is not an IPv{ip_type} address")
        neuron = subnet.neurons[uid]
        block = self.state.block
        last = neuron.axon.block if neuron.axon else 0
        if subnet.serving_rate_limit and last and block - last < subnet.serving_rate_limit:
            raise chain_error("ServingRateLimitExceeded", f"served at block {last}, limit {subnet.serving_rate_limit}")
        if not 0 < fields["port"] <= U16_MAX:
            raise chain_error("InvalidPort", f"port {fields['port']}")
        neuron.axon = AxonInfo(block=block, **fields)
        return [_event("SubtensorModule", "AxonServed", {"netuid": netuid, "hotkey": signer})]

    def _call_set_commitment(self, signer: str, params: dict) -> list:
        netuid = _param_int(params, "netuid")
        info = params.get("info")
        if not isinstance(info, dict) or not isinstance(info.get("fields"), (list, tuple)):
            raise invalid_argument(f"set_commitment: info must be {{'fields': [...]}}, got {info!r}")
        subnet = self.state.subnets.get(netuid)
        if subnet is None or subnet.uid_of(signer) is None:
            raise chain_error("AccountNotAllowedCommit", f"{signer} is not registered on netuid {netuid}")
        if len(info["fields"]) > MAX_COMMITMENT_FIELDS:
            raise chain_error("TooManyFieldsInCommitmentInfo", f"{len(info['fields'])} > {MAX_COMMITMENT_FIELDS}")
        fields = [_commitment_field(entry) for entry in info["fields"]]
        subnet.commitments[signer] = {"deposit": 0, "block": self.state.block, "info": {"fields": fields}}
        return [_event("Commitments", "Commitment", {"netuid": netuid, "who": signer})]


def finish_receipt(result: bt.ExtrinsicResult, waited: bool) -> bt.ExtrinsicResult:
    """Without waiting for inclusion the SDK reports only that the pool accepted the extrinsic (as RpcSubstrate)."""
    rejected_by_pool = not result.success and result.error is not None and result.error.name in POOL_REJECTIONS
    if waited or rejected_by_pool:
        return result
    return bt.ExtrinsicResult(success=True, message="Submitted (not waiting).")


def _split_call(call: Any) -> tuple[str, str, dict]:
    """``(module, function, params)`` of a generated ``Call``, or a clear error for anything else."""
    if not (isinstance(call, (tuple, list)) and len(call) == 3 and isinstance(call[0], str)
            and isinstance(call[1], str) and isinstance(call[2], dict)):
        raise invalid_argument(f"expected a generated call (module, function, params), got {call!r}")
    return call[0], call[1], call[2]


def _event(module: str, event: str, attributes: dict) -> dict:
    return {"event": {"module_id": module, "event_id": event, "attributes": attributes}}


def _param_int(params: dict, name: str) -> int:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid_argument(f"call parameter {name!r} must be a non-negative integer, got {value!r}")
    return value


def _param_u16_list(params: dict, name: str) -> list[int]:
    values = params.get(name)
    if not isinstance(values, (list, tuple)) or any(
        isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= U16_MAX for v in values
    ):
        raise invalid_argument(f"call parameter {name!r} must be a list of u16 integers, got {values!r}")
    return list(values)


def _commitment_field(entry: Any) -> dict:
    """One ``Data`` variant as the chain decodes it: ``{"Raw5": "0x68656c6c6f"}`` (Raw0..Raw128 or a 32-byte hash)."""
    if not (isinstance(entry, dict) and len(entry) == 1):
        raise invalid_argument(f"commitment field must be a one-key dict like {{'Raw5': b'hello'}}, got {entry!r}")
    ((variant, payload),) = entry.items()
    if isinstance(payload, str):
        try:
            payload = bytes.fromhex(payload[2:]) if payload.startswith("0x") else payload.encode()
        except ValueError:
            raise invalid_argument(f"commitment field {variant}: bad hex {payload!r}") from None
    elif isinstance(payload, (list, tuple)) and all(isinstance(b, int) and 0 <= b < 256 for b in payload):
        payload = bytes(payload)
    if not isinstance(payload, (bytes, bytearray)):
        raise invalid_argument(f"commitment field {variant}: payload must be bytes, hex or text, got {payload!r}")
    if variant.startswith("Raw") and variant[3:].isdigit():
        expected = int(variant[3:])
        if expected > MAX_RAW_COMMITMENT_BYTES or len(payload) != expected:
            raise invalid_argument(f"commitment field {variant} carries {len(payload)} bytes")
    elif variant in _HASH_VARIANTS:
        if len(payload) != 32:
            raise invalid_argument(f"commitment field {variant} needs 32 bytes, got {len(payload)}")
    else:
        raise unsupported(f"commitment field variant {variant!r}", ("Raw0..Raw128", *_HASH_VARIANTS))
    return {variant: "0x" + bytes(payload).hex()}


__all__ = [
    "AxonInfo",
    "ChainState",
    "MockSubstrate",
    "NeuronState",
    "SubnetState",
    "chain_error",
    "finish_receipt",
    "poll_heads",
    "state_from_dict",
    "state_to_dict",
]
