"""sr25519 signatures of hotkeys (or any sr25519 keypair): signing bytes, checking them, and signers for the all-reduce.

Kept apart from :mod:`template.p2p.identity` (which reads the chain's PeerID commitments) so that the training engine
can sign its contributions without reaching the chain layer. :func:`verify` and :func:`verify_signature` return False
— never raise — for any malformed address, signature or payload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bittensor.sp_core import Keypair
from bittensor.sp_core import verify as sr25519_verify

__all__ = ["KeypairSigner", "ephemeral_signer", "sign", "verify", "verify_signature"]


def sign(keypair, payload: bytes) -> str:
    """A hex sr25519 signature of ``payload`` by ``keypair`` (e.g. ``wallet.hotkey``)."""
    return bytes(keypair.sign(payload)).hex()


def verify(hotkey_ss58: str, payload: bytes, signature_hex: str) -> bool:
    """True iff ``signature_hex`` is ``hotkey_ss58``'s signature of ``payload``; False for anything malformed."""
    if not (isinstance(hotkey_ss58, str) and isinstance(payload, bytes) and isinstance(signature_hex, str)):
        return False
    try:
        signature = bytes.fromhex(signature_hex)
        return bool(sr25519_verify(payload, signature, hotkey_ss58))
    except Exception:  # bad hex, bad address, wrong signature length: the binding raises ValueError today
        return False


def verify_signature(key: str, message: bytes, signature: bytes) -> bool:
    """:func:`verify` for a raw-bytes signature (the all-reduce's form)."""
    return isinstance(signature, bytes) and verify(key, message, signature.hex())


@dataclass(frozen=True)
class KeypairSigner:
    """A keypair as the signer of all-reduce contributions: ``key`` is its ss58 address, ``sign`` raw bytes."""

    keypair: Any

    @property
    def key(self) -> str:
        return self.keypair.ss58_address

    def sign(self, message: bytes) -> bytes:
        return bytes(self.keypair.sign(message))


def ephemeral_signer() -> KeypairSigner:
    """A fresh sr25519 key for a peer that has no hotkey (the engine's peers outside a subnet)."""
    return KeypairSigner(Keypair.create_from_mnemonic(Keypair.generate_mnemonic()))
