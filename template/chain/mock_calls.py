"""The extrinsics the mock chain dispatches, checked as subtensor (``pallets/subtensor``) checks them.

:class:`ExtrinsicCalls` is a mixin of :class:`template.chain.mock.MockSubstrate` (which owns ``self.state``, the
re-entrant ``self._lock`` and ``block_hash_sync``). :meth:`ExtrinsicCalls.apply_extrinsic` includes a call in the head
block and returns the receipt as the SDK's RPC backend would; the calls modelled are:

- ``SubtensorModule.set_weights``/``set_mechanism_weights``: the chain's checks in the chain's order, each failing
  with the chain's error name (``WeightVecNotEqualSize``, ``SubnetNotExists``, ``UidsLengthExceedUidsInSubNet``,
  ``HotKeyNotRegisteredInSubNet``, ``IncorrectWeightVersionKey``, ``SettingWeightsTooFast``,
  ``NeuronNoValidatorPermit``, ``DuplicateUids``, ``UidVecContainInvalidOne``, ``WeightVecLengthIsLow``,
  ``MaxWeightExceeded``). Weights are stored upscaled so that the row's largest is ``U16_MAX``. Commit-reveal is off.
- ``SubtensorModule.serve_axon``: checks registration, ip type, ip value, the serving rate limit and the port as the
  chain does, except that loopback addresses are accepted (the chain refuses 127.0.0.1; a local network lives on it).
- ``Commitments.set_commitment``: registered hotkeys only, at most :data:`MAX_COMMITMENT_FIELDS` fields, each a
  ``Data`` variant (``Raw0``..``Raw128`` or a 32-byte hash); no timelocked commitments.

On failure: every call validates completely before it changes anything, so a rejected call leaves the state exactly
as it was. A chain-side rejection comes back as a failed ``bt.ExtrinsicResult`` whose ``error`` is a ``bt.ChainError``
with the chain's error name and code; the nonce is consumed, as on chain. A wrong explicit nonce is refused before
inclusion (``Stale``/``Future``, nothing consumed). Malformed parameters are a failed result with a ``bt.ChainError``
of code ``invalid_argument``; a value that is not a generated call at all, or a call the mock does not model, raises
``bt.ChainError`` (``invalid_argument`` / ``DISABLED``, listing the calls supported).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import bittensor as bt
from bittensor.settings import U16_MAX

from template.chain.mock_errors import chain_error, invalid_argument, unsupported
from template.chain.mock_state import AxonInfo, ChainState

MAX_COMMITMENT_FIELDS = 3  # the runtime's Commitments::MaxFields
MAX_RAW_COMMITMENT_BYTES = 128  # Data::Raw0..Raw128
POOL_REJECTIONS = ("Stale", "Future", "BadProof")  # refused before inclusion: no nonce consumed
_HASH_VARIANTS = ("BlakeTwo256", "Sha256", "Keccak256", "ShaThree256")


class ExtrinsicCalls:
    """The call table, its dispatch and the call handlers; mixed into ``MockSubstrate``."""

    state: ChainState

    def _call_table(self) -> dict[tuple[str, str], Callable[[str, dict], list]]:
        return {
            ("SubtensorModule", "set_mechanism_weights"): self._call_set_weights,
            ("SubtensorModule", "set_weights"): self._call_set_weights,
            ("SubtensorModule", "serve_axon"): self._call_serve_axon,
            ("Commitments", "set_commitment"): self._call_set_commitment,
        }

    def compose_sync(self, call: Any) -> Any:
        """A generated ``Call`` stays as it is (``(module, function, params)``); unknown calls are refused here."""
        module, function, _params = _split_call(call)
        if (module, function) not in self._calls:
            raise unsupported(f"call {module}.{function}", (f"{m}.{f}" for m, f in self._calls))
        return call

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

    # --- call handlers (validate everything, then apply) ---------------------------------------------------------

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
    "MAX_COMMITMENT_FIELDS",
    "MAX_RAW_COMMITMENT_BYTES",
    "POOL_REJECTIONS",
    "ExtrinsicCalls",
    "finish_receipt",
]
