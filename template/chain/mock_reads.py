"""The mock chain's storage items, storage maps and runtime APIs: what the SDK's reads see.

:class:`StorageReads` is a mixin of :class:`template.chain.mock.MockSubstrate` (which owns ``self.state``, the lock,
the read entry points ``query_sync``/``query_map_sync``/``runtime_call_sync`` and block pinning). It builds the
``(module, item) -> fn(params)`` tables those entry points dispatch on (:meth:`StorageReads._storage_tables`) and
answers each read from the plain :class:`~template.chain.mock_state.ChainState`, encoded as the chain encodes it:
u16 fractions for scores, rao for stake and emission, axons as dicts, vectors indexed by uid. The runtime APIs are
``SubnetInfoRuntimeApi.get_metagraph`` (the ``Metagraph`` record ``subnets.metagraph`` decodes) and
``get_next_epoch_start_block``.

Reads of a subnet or uid that does not exist return the chain's defaults (empty vectors, zero account, ``None``), as
the chain does. On bad input: a key list of the wrong length or an integer key of another type raises
``bt.ChainError`` (code ``invalid_argument``) naming the item and the keys it takes. Items outside the tables are
refused by the entry points in :mod:`template.chain.mock` (code ``DISABLED``, listing what is supported).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

from bittensor.settings import GLOBAL_MAX_SUBNET_COUNT

from template.chain.mock_errors import invalid_argument
from template.chain.mock_state import (
    YUMA_PARAMS,
    ZERO_ACCOUNT,
    AxonInfo,
    ChainState,
    NeuronState,
    SubnetState,
    to_u16,
)


def _blank_subnet(netuid: int) -> SubnetState:
    """What storage reads see for a netuid that does not exist: the chain's defaults (empty vectors, zero account)."""
    return SubnetState(netuid, 360, ZERO_ACCOUNT, ZERO_ACCOUNT, "", "", 0, 0)


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


class StorageReads:
    """The read tables and their handlers; mixed into ``MockSubstrate``, called with its lock held."""

    state: ChainState

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
            "Kappa": lambda s: to_u16(YUMA_PARAMS.kappa),
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
            "Rank": lambda s: [to_u16(n.rank) for n in s.neurons],
            "Trust": lambda s: [to_u16(n.trust) for n in s.neurons],
            "Consensus": lambda s: [to_u16(n.consensus) for n in s.neurons],
            "Incentive": lambda s: [to_u16(n.incentive) for n in s.neurons],
            "Dividends": lambda s: [to_u16(n.dividends) for n in s.neurons],
            "ValidatorTrust": lambda s: [to_u16(n.validator_trust) for n in s.neurons],
            "PruningScores": lambda s: [to_u16(n.pruning_score) for n in s.neurons],
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
        return [(dest, to_u16(value)) for dest, value in neuron.bonds]

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
            "kappa": to_u16(YUMA_PARAMS.kappa),
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
            "pruning_score": [to_u16(n.pruning_score) for n in neurons],
            "last_update": [n.last_update for n in neurons],
            "emission": [n.emission_rao for n in neurons],
            "dividends": [to_u16(n.dividends) for n in neurons],
            "incentives": [to_u16(n.incentive) for n in neurons],
            "consensus": [to_u16(n.consensus) for n in neurons],
            "trust": [to_u16(n.trust) for n in neurons],
            "rank": [to_u16(n.rank) for n in neurons],
            "block_at_registration": [n.block_at_registration for n in neurons],
            "alpha_stake": [n.alpha_stake_rao for n in neurons],
            "tao_stake": [0 for _ in neurons],
            "total_stake": [n.alpha_stake_rao for n in neurons],
        }


__all__ = ["StorageReads"]
