"""The mock chain's own rules: subnets, registration, validator permits and the epoch, behind the test helpers.

:class:`SubnetHelpers` is a mixin of :class:`template.chain.mock.MockSubstrate` (which owns ``self.state`` and the
re-entrant ``self._lock``). Its public methods are the synchronous helpers that build and run a chain
(``create_subnet``, ``register``, ``set_stake``, ``advance_blocks``, ``set_seconds_per_block``); its internals are
the rules those helpers run, after subtensor ``pallets/subtensor``:

- Registration sets ``LastUpdate`` to the registration block, so a new hotkey waits ``weights_rate_limit`` blocks
  before its first weights (unless it registered at block 0).
- Epochs: the current chain's stateful schedule, an epoch runs when ``block >= LastEpochBlock + tempo`` (so
  ``advance_blocks(tempo)`` runs exactly one); ``LastEpochBlock`` starts at the subnet's creation block. The epoch is
  :func:`template.chain.yuma.yuma_epoch` on the stake, the weights (a weight set before its target uid was
  (re)registered is dropped, as on chain), the permits and the previous bonds; it stores incentive, dividends, trust,
  consensus, ranks, validator trust, bonds, the emission of the epoch (``emission_per_block_rao`` × blocks since the
  last epoch), and adds each uid's emission to its alpha stake.
- Validator permits: the top ``max_allowed_validators`` uids by stake among those with non-zero stake (ties to the lower
  uid), recomputed after every epoch, registration and :meth:`SubnetHelpers.set_stake` (the chain recomputes them only
  in the epoch; recomputing at registration lets a freshly staked validator set weights at once).
- Registration on a full subnet replaces the non-immune uid with the lowest pruning score (oldest registration, then
  lowest uid, on ties); when every uid is still immune it raises ``NoNeuronIdAvailable``. A hotkey belongs to one
  coldkey on every subnet (``NonAssociatedColdKey``). ``create_subnet`` with an owner registers the owner hotkey as
  uid 0, as ``register_network`` does.

On bad input: every helper validates completely before it changes anything, so a refused call leaves the state exactly
as it was. Bad arguments raise ``ValueError`` naming them; a refusal by the chain state raises ``bt.ChainError`` with
the chain's error name (``SubnetNotExists``, ``NonAssociatedColdKey``, ``NoNeuronIdAvailable``,
``HotKeyNotRegisteredInSubNet``) or, for a netuid already taken, code ``ALREADY_EXISTS``.
"""

from __future__ import annotations

import math
from typing import Any

import bittensor as bt
import numpy as np
from bittensor.result import ErrorCode
from bittensor.settings import GLOBAL_MAX_SUBNET_COUNT, U16_MAX
from bittensor.sp_core import ss58_decode

from template.chain.mock_errors import chain_error
from template.chain.mock_state import (
    RAO_PER_TAO,
    YUMA_PARAMS,
    ZERO_ACCOUNT,
    ChainState,
    NeuronState,
    SubnetState,
    to_u16,
)
from template.chain.yuma import yuma_epoch

MAX_ADVANCE = 100_000  # blocks per advance_blocks call: bounds how long one call holds the lock
_GREEK = "αβγδεζηθικλμνξοπρστυφχψω"


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_address(what: str, value: Any) -> None:
    try:
        ss58_decode(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be an ss58 address, got {value!r}") from None


class SubnetHelpers:
    """The test helpers and the rules they run (registration, permits, epochs); mixed into ``MockSubstrate``."""

    state: ChainState

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
                max_weights_limit=to_u16(max_weights_limit), weights_version_key=weights_version_key,
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
            params=YUMA_PARAMS,
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


__all__ = ["MAX_ADVANCE", "SubnetHelpers"]
