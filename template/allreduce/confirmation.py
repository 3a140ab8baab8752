"""The members' confirmation after an all-reduce: do all members hold the same signed shares of every owner?

Every member posts, under one DHT key per group, the certificates (:class:`~template.allreduce.evidence.
OwnerCertificate`) it received from each owner, and reads the others' until every member posted, the confirmation
time passed, or the caller's deadline. Two *validly signed* certificates of one owner that differ prove that it sent
different members different bytes (or averaged against other commitments): every member that sees them refuses the
round, and the owner is named. A claim that does not verify is ignored, so nobody can frame an owner here.

What happens when a peer disappears: a member that never posts is simply not waited for past the confirmation time;
a DHT failure while posting skips the confirmation (the round is not refused on a hiccup).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from template.allreduce.contribution import Verifier
from template.allreduce.evidence import AllReduceEvidence
from template.allreduce.messages import certificate_bytes

__all__ = ["confirm_shares"]

logger = logging.getLogger(__name__)

CONFIRMATION_TTL_S = 120.0  # how long members' confirmation records live in the DHT
CONFIRMATION_POLL_S = 0.2  # the longest pause between two reads of the members' confirmations
CONFIRMATION_FIRST_POLL_S = 0.01  # the first pause; each next one doubles up to CONFIRMATION_POLL_S


def confirm_shares(dht: hivemind.DHT, key: str, own_subkey: str, evidence: AllReduceEvidence, group_id: bytes,
                   gathered: Mapping[str, Any], terms: Mapping[str, Any], verify: Verifier,
                   until: float) -> tuple[int, ...]:
    """Post our certificates under ``key``, compare with the other members' until ``until`` (time.time()); return the
    owners (member indices) with two different valid certificates (module docstring)."""
    ours = {str(owner): certificate.claim() for owner, certificate in evidence.certificates.items()}
    try:
        dht.store(key, ours, expiration_time=get_dht_time() + CONFIRMATION_TTL_S, subkey=own_subkey)
    except Exception as err:  # a DHT hiccup must not fail the round: we just do not confirm
        logger.warning("could not post our confirmation: %r", err)
        return ()
    keys = _owner_keys(evidence, gathered)
    # members finish within milliseconds of each other: poll soon, then back off (the same reads, fewer waits)
    pause = CONFIRMATION_FIRST_POLL_S
    while True:
        found = dht.get(key, latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        seen: dict[int, set[tuple[str, str]]] = {}
        for entry in entries.values():
            record = getattr(entry, "value", None)
            for owner, claim in (record.items() if isinstance(record, dict) else []):
                index = _valid_certificate(owner, claim, keys, evidence, terms, group_id, verify)
                if index is not None:
                    seen.setdefault(index, set()).add((claim[0], claim[1]))
        conflicts = tuple(sorted(owner for owner, claims in seen.items() if len(claims) > 1))
        if conflicts:
            logger.warning("owners %s signed different shares for different members: round refused", list(conflicts))
            return conflicts
        if len(entries) >= len(gathered) or time.time() >= until:
            return ()
        time.sleep(pause)
        pause = min(2 * pause, CONFIRMATION_POLL_S)


def _owner_keys(evidence: AllReduceEvidence, gathered: Mapping[str, Any]) -> dict[int, str]:
    """owner (member index) -> the key that signs its certificates: the key of its commitment."""
    keys = {}
    for index, peer in enumerate(gathered):
        data = gathered[peer]
        commitment = data.get("commitment") if isinstance(data, dict) else None
        if peer in evidence.senders and isinstance(commitment, dict) and isinstance(commitment.get("key"), str):
            keys[index] = commitment["key"]
    return keys


def _valid_certificate(owner: Any, claim: Any, keys: dict[int, str], evidence: AllReduceEvidence,
                       terms: Mapping[str, Any], group_id: bytes, verify: Verifier) -> int | None:
    """``owner``'s member index if ``claim`` ([digest, commitments, signature] in hex, from another member) is its
    valid signature of its share; None otherwise."""
    try:
        index = int(owner)
        digest, commitments, signature = (bytes.fromhex(part) for part in claim)
        start, stop = evidence.ranges[index]
        message = certificate_bytes(terms["scope"], terms["round"], group_id, index, start, stop, digest, commitments)
    except (TypeError, ValueError, IndexError, KeyError):
        return None
    key = keys.get(index)
    return index if key is not None and verify(key, message, signature) else None
