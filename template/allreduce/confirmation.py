"""The members' confirmation after an all-reduce: do all members hold the same signed shares of every owner?

Every member posts, under one DHT key per group, the certificates (:class:`~template.allreduce.evidence.
OwnerCertificate`) it received from each owner and, as a sender, its signed disputes of owners' statements of its
input (:mod:`template.allreduce.disputes`), and reads the others' until every member posted, the confirmation time
passed, or the caller's deadline. Two *validly signed* certificates of one owner that differ prove that it sent
different members different bytes (or averaged against other commitments): every member that sees them refuses the
round, and the owner is named. A validly signed dispute of a segment by a sender that the segment includes drops
that segment on every member that reads it (zeros, as a refuted one), unless its sender disputes more owners than
one (:func:`template.allreduce.disputes.counted_disputes`); who lied is judged by validators afterwards.
A claim or dispute that does not verify is ignored, so nobody can frame an owner or a sender here.

What happens when a peer disappears: a member that never posts is simply not waited for past the confirmation time;
a DHT failure while posting skips the confirmation (the round is not refused on a hiccup). A member that stops
reading before a late member's record arrives misses its disputes (and conflicts): that member then applies a segment
the others drop — the one way θ can differ after a confirmed round, and only beside a false statement or dispute.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from template.allreduce.contribution import Verifier
from template.allreduce.disputes import dispute_bytes
from template.allreduce.evidence import AllReduceEvidence, Dispute
from template.allreduce.messages import certificate_bytes

__all__ = ["Confirmation", "confirm_shares"]

logger = logging.getLogger(__name__)

CONFIRMATION_TTL_S = 120.0  # how long members' confirmation records live in the DHT
CONFIRMATION_POLL_S = 0.2  # the longest pause between two reads of the members' confirmations
CONFIRMATION_FIRST_POLL_S = 0.01  # the first pause; each next one doubles up to CONFIRMATION_POLL_S


@dataclass(frozen=True)
class Confirmation:
    """What the members' records showed: owners with two different valid certificates (member indices), and the
    validly signed disputes, ordered by segment and sender."""

    conflicts: tuple[int, ...] = ()
    disputes: tuple[Dispute, ...] = ()


def confirm_shares(dht: hivemind.DHT, key: str, own_subkey: str, evidence: AllReduceEvidence, group_id: bytes,
                   gathered: Mapping[str, Any], terms: Mapping[str, Any], verify: Verifier, until: float,
                   disputes: Mapping[int, bytes] | None = None) -> Confirmation:
    """Post our certificates and ``disputes`` (segment -> our signature of :func:`~template.allreduce.disputes.
    dispute_bytes`, as the sender we are) under ``key``, compare with the other members' until ``until``
    (time.time()) (module docstring)."""
    ours = dict(certificates={str(owner): certificate.claim() for owner, certificate in evidence.certificates.items()},
                disputes={str(segment): signature.hex() for segment, signature in (disputes or {}).items()})
    try:
        dht.store(key, ours, expiration_time=get_dht_time() + CONFIRMATION_TTL_S, subkey=own_subkey)
    except Exception as err:  # a DHT hiccup must not fail the round: we just do not confirm
        logger.warning("could not post our confirmation: %r", err)
        return Confirmation()
    keys = _signing_keys(evidence, gathered)
    owner_keys = {index: keys[peer] for index, peer in enumerate(gathered) if peer in keys}
    # members finish within milliseconds of each other: poll soon, then back off (the same reads, fewer waits)
    pause = CONFIRMATION_FIRST_POLL_S
    checked: dict[tuple[str, str, str], Dispute | None] = {}  # each posted dispute's signature is verified once
    while True:
        found = dht.get(key, latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        seen: dict[int, set[tuple[str, str]]] = {}
        disputed: list[Dispute] = []
        for poster, entry in entries.items():
            record = getattr(entry, "value", None)
            record = record if isinstance(record, dict) else {}
            certificates, posted = record.get("certificates"), record.get("disputes")
            for owner, claim in (certificates.items() if isinstance(certificates, dict) else []):
                index = _valid_certificate(owner, claim, owner_keys, evidence, terms, group_id, verify)
                if index is not None:
                    seen.setdefault(index, set()).add((claim[0], claim[1]))
            for segment, signature in (posted.items() if isinstance(posted, dict) else []):
                if not isinstance(signature, str) or not isinstance(poster, str):
                    continue
                if (poster, segment, signature) not in checked:
                    checked[poster, segment, signature] = _valid_dispute(poster, segment, signature, keys, evidence,
                                                                         terms, group_id, verify)
                if (dispute := checked[poster, segment, signature]) is not None:
                    disputed.append(dispute)
        conflicts = tuple(sorted(owner for owner, claims in seen.items() if len(claims) > 1))
        disputes = tuple(sorted(disputed, key=lambda d: (d.segment, d.sender)))
        if conflicts:
            logger.warning("owners %s signed different shares for different members: round refused", list(conflicts))
            return Confirmation(conflicts, disputes)
        if len(entries) >= len(gathered) or time.time() >= until:
            if disputes:
                logger.warning("senders disputed the owners' statements of their inputs: %s",
                               [(d.segment, d.sender) for d in disputes])
            return Confirmation((), disputes)
        time.sleep(pause)
        pause = min(2 * pause, CONFIRMATION_POLL_S)


def _signing_keys(evidence: AllReduceEvidence, gathered: Mapping[str, Any]) -> dict[str, str]:
    """sender peer id -> the key that signs its certificates and disputes: the key of its commitment."""
    keys = {}
    for peer, data in gathered.items():
        commitment = data.get("commitment") if isinstance(data, dict) else None
        if peer in evidence.senders and isinstance(commitment, dict) and isinstance(commitment.get("key"), str):
            keys[peer] = commitment["key"]
    return keys


def _valid_dispute(poster: Any, segment: Any, signature: Any, keys: dict[str, str], evidence: AllReduceEvidence,
                   terms: Mapping[str, Any], group_id: bytes, verify: Verifier) -> Dispute | None:
    """The dispute when ``signature`` (hex) is the valid dispute, by the sender that posted it (``poster``: the
    record's subkey, its peer id), of ``segment`` as we received it, and the segment includes that sender; None
    otherwise. Anyone may post under any subkey: the signature is what counts."""
    try:
        index, signature = int(segment), bytes.fromhex(signature)
        record = evidence.segments[index]
        sender = evidence.senders.index(poster)
        message = dispute_bytes(terms["scope"], terms["round"], group_id, index, record.digest)
    except (TypeError, ValueError, KeyError):
        return None
    key = keys.get(poster)
    if key is None or sender not in record.included or not verify(key, message, signature):
        return None
    return Dispute(index, sender, signature)


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
