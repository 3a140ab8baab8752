"""The mock chain's state as plain dataclasses, and its JSON document.

:class:`ChainState` → :class:`SubnetState` → :class:`NeuronState` (→ :class:`AxonInfo`) is everything
:class:`template.chain.mock.MockSubstrate` knows: head block, clock, subnets with their hyperparameters, neurons
(index = uid) and commitments, and account nonces. Scores are fractions in [0, 1] (the chain stores them as u16,
:func:`to_u16`); stake and emission are rao. The state is not versioned: there is one head state, no history.

:func:`state_to_dict` / :func:`state_from_dict` are the ``MockSubstrate.to_json`` / ``from_json`` document
(``{"format": STATE_FORMAT, ...}``, subnets as a list since JSON keys cannot be integers).

On bad input: :func:`state_from_dict` raises ``ValueError`` naming the problem for a document of another format or
version (``not a mock chain state (format ..., expected 1)``) and for a malformed one (``malformed mock chain state:
KeyError: ...``). The dataclasses themselves do not validate; the chain's writes do.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from bittensor.settings import U16_MAX
from bittensor.sp_core import ss58_encode

from template.chain.yuma import YumaParams

RAO_PER_TAO = 1_000_000_000
STATE_FORMAT = 1  # version of the to_json() document
ZERO_ACCOUNT = ss58_encode(bytes(32))  # what the chain shows for an unset account
YUMA_PARAMS = YumaParams()  # every subnet's epoch runs with the chain defaults (not part of the saved state)


def to_u16(fraction: float) -> int:
    """A fraction in [0, 1] as the chain stores it (clipped to the range first)."""
    return int(round(min(max(fraction, 0.0), 1.0) * U16_MAX))


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


__all__ = [
    "RAO_PER_TAO",
    "STATE_FORMAT",
    "YUMA_PARAMS",
    "ZERO_ACCOUNT",
    "AxonInfo",
    "ChainState",
    "NeuronState",
    "SubnetState",
    "state_from_dict",
    "state_to_dict",
    "to_u16",
]
