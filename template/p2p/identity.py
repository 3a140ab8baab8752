"""Who is who between neurons: which hotkey owns which libp2p PeerID, and hotkey signatures over bytes.

The binding is an on-chain commitment made *by the hotkey* on the subnet (``Commitments.set_commitment``): the chain
checks the extrinsic's signature, so a commitment read back from the metagraph is attested by that hotkey, and libp2p
authenticates the PeerID of every connection. Together they let an RPC handler map the remote PeerID it sees to a
registered hotkey without any extra handshake. The committed value is ``"dl1:<PeerID base58>"`` in one ``Raw`` field
(the Commitments pallet's ``Data::Raw0..Raw128``: at most :data:`MAX_COMMITMENT_BYTES` bytes; a PeerID is 46–52
characters). A hotkey has one commitment per subnet, so committing replaces any earlier one of that hotkey.

This module never talks to the chain: a neuron commits through the chain facade,
``chain.set_commitment(wallet, commitment_value(peer_id))`` (:meth:`template.chain.client.ChainClient.set_commitment`,
which retries transport errors and skips a value the chain already holds), and reads commitments from its metagraph.

On failure: :func:`commitment_value` raises ValueError for anything but a PeerID; :func:`peer_directory` never raises
on chain content: malformed or sealed commitments are skipped, and a PeerID claimed by more than one hotkey belongs
to the hotkey that committed it first (the others' claims are ignored, logged). A PeerID is a fresh key's hash that
nobody knows before its owner starts its host, so a copycat can only commit it later; letting every claim cancel the
others instead would let any registered hotkey cut a validator or miner off the network by copying its PeerID.
Claims committed in the same block are all dropped, since nobody can tell which is honest. :func:`verify` returns
False — never raises — for any malformed address, signature or payload.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import base58
import bittensor as bt
import multihash

from template.chain.client import MAX_COMMITMENT_BYTES
from template.p2p.keys import sign, verify

__all__ = [
    "COMMITMENT_PREFIX",
    "MAX_COMMITMENT_BYTES",
    "PeerDirectory",
    "PeerRecord",
    "commitment_value",
    "is_peer_id",
    "parse_commitment",
    "peer_directory",
    "sign",
    "verify",
]

log = logging.getLogger(__name__)

COMMITMENT_PREFIX = "dl1:"  # bump the digit when the value's format changes
# libp2p: small keys (ed25519, secp256k1) are inlined with the identity hash, RSA keys are hashed with sha2-256.
_PEER_ID_HASHES = (multihash.Func.identity, multihash.Func.sha2_256)


def is_peer_id(text: object) -> bool:
    """True for the canonical base58 form of a libp2p PeerID (a valid identity or sha2-256 multihash)."""
    if not isinstance(text, str) or not 1 <= len(text) <= MAX_COMMITMENT_BYTES - len(COMMITMENT_PREFIX):
        return False
    try:
        raw = base58.b58decode(text)
        digest = multihash.decode(raw)
    except ValueError:  # bad base58 character, inconsistent multihash length, unknown code
        return False
    return base58.b58encode(raw).decode() == text and digest.func in _PEER_ID_HASHES


def commitment_value(peer_id: str) -> str:
    """The commitment text binding ``peer_id`` to the committing hotkey; ValueError for a non-PeerID."""
    if not is_peer_id(peer_id):
        raise ValueError(f"{peer_id!r} is not a libp2p PeerID in base58")
    return COMMITMENT_PREFIX + peer_id


def parse_commitment(value: object) -> str | None:
    """The PeerID in a commitment value, or None when the value is not one of ours (or is malformed)."""
    if not isinstance(value, str) or not value.startswith(COMMITMENT_PREFIX):
        return None
    peer_id = value[len(COMMITMENT_PREFIX) :]
    return peer_id if is_peer_id(peer_id) else None


@dataclass(frozen=True)
class PeerRecord:
    """A registered neuron whose hotkey committed a PeerID. ``axon`` is ``"ip:port"`` or None when not served."""

    peer_id: str
    uid: int
    hotkey: str
    validator_permit: bool
    axon: str | None


class PeerDirectory:
    """PeerID → :class:`PeerRecord` for one metagraph snapshot (build a new one after each sync)."""

    def __init__(self, records: list[PeerRecord]):
        self._by_peer = {record.peer_id: record for record in records}
        self._by_hotkey = {record.hotkey: record for record in records}
        if len(self._by_peer) != len(records) or len(self._by_hotkey) != len(records):
            raise ValueError("a directory holds each PeerID and each hotkey at most once")

    def get(self, peer_id: str) -> PeerRecord | None:
        return self._by_peer.get(str(peer_id))

    def by_hotkey(self, hotkey: str) -> PeerRecord | None:
        return self._by_hotkey.get(hotkey)

    def __contains__(self, peer_id: object) -> bool:
        return str(peer_id) in self._by_peer

    def __iter__(self) -> Iterator[PeerRecord]:
        return iter(self._by_peer.values())

    def __len__(self) -> int:
        return len(self._by_peer)

    def bootstrap_maddrs(self, exclude_hotkey: str | None = None) -> list[str]:
        """``/ip4/IP/tcp/PORT/p2p/PEERID`` (or ``/ip6/...``) for every neuron that serves an axon, sorted by uid.

        A miner serves its hivemind listen address as its axon, so these are DHT bootstrap peers straight from the
        chain. Axons that do not parse as ``ip:port`` with a usable address are skipped. A neuron leaves out its own
        hotkey: until it commits its new PeerID, the chain still shows the axon of its previous run, which no longer
        answers (dialling it cost a restarted neuron that was alone ~4 s of failed DHT starts), and once it has, the
        record is itself (a PeerID that two hotkeys claim is in no directory).
        """
        maddrs = []
        for record in sorted(self, key=lambda r: r.uid):
            if record.axon is None or record.hotkey == exclude_hotkey:
                continue
            endpoint = _parse_axon(record.axon)
            if endpoint is None:
                log.debug("uid %d: unusable axon %r", record.uid, record.axon)
                continue
            ip, port = endpoint
            family = "ip4" if ip.version == 4 else "ip6"
            maddrs.append(f"/{family}/{ip}/tcp/{port}/p2p/{record.peer_id}")
        return maddrs


def _parse_axon(axon: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int] | None:
    host, sep, port_text = axon.rpartition(":")
    if not sep or not port_text.isdigit():
        return None
    try:
        ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None
    port = int(port_text)
    if ip.is_unspecified or not 0 < port < 65536:
        return None
    return ip, port


def peer_directory(metagraph: bt.Metagraph) -> PeerDirectory:
    """The directory of registered neurons that committed a well-formed PeerID; a PeerID claimed by several hotkeys
    belongs to the earliest commitment (none of them when the earliest ones share a block)."""
    claims: dict[str, list[tuple[int, PeerRecord]]] = defaultdict(list)
    for neuron in metagraph.neurons:
        commitment = metagraph.commitments.get(neuron.uid)
        value = None if commitment is None else commitment.value
        peer_id = parse_commitment(value)
        if peer_id is None:
            if value is not None:
                log.debug("uid %d: commitment %r is not a PeerID binding", neuron.uid, value[:80])
            continue
        record = PeerRecord(peer_id, neuron.uid, neuron.hotkey, bool(neuron.validator_permit), neuron.axon)
        claims[peer_id].append((commitment.block, record))
    records = []
    for peer_id, claimants in claims.items():
        first_block = min(block for block, _ in claimants)
        first = [record for block, record in claimants if block == first_block]
        if len(first) > 1:
            log.warning("PeerID %s is claimed by uids %s in the same block: ignoring every claim", peer_id,
                        [r.uid for r in first])
            continue
        if len(claimants) > 1:
            log.warning("PeerID %s, committed by uid %d at block %d, is also claimed later by uids %s: ignored",
                        peer_id, first[0].uid, first_block, [r.uid for _, r in claimants if r is not first[0]])
        records.append(first[0])
    return PeerDirectory(records)
