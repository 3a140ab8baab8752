"""Bad identities: deregistered hotkeys, a validator that loses its permit, a PeerID copied by another hotkey.

Who may fetch pseudo-gradients is decided per request from the latest metagraph sync (``permit_holders`` over
``peer_directory``), so every change on chain must show after the next sync. The chain is the in-memory mock behind
the real bittensor SDK (no sockets). Already covered elsewhere and not repeated here: an unregistered caller and a
registered caller without a permit are refused over the wire (tests/integration/test_publication.py), an
unregistered hotkey cannot commit a PeerID and two claims in one block cancel out (tests/unit/test_protocol.py).
"""

from __future__ import annotations

import hashlib
import logging

import base58
import bittensor as bt
import multihash
import pytest

from template.chain.mock import MockSubstrate
from template.chain.wallets import create_wallet
from template.p2p.identity import peer_directory
from template.p2p.publication import permit_holders
from tests.integration.p2p_helpers import commit_peer_id

NETUID = 6


def peer_id_for(seed: str) -> str:
    return base58.b58encode(multihash.encode(hashlib.sha256(seed.encode()).digest(), "sha2-256")).decode()


@pytest.fixture(scope="module")
def wallets(tmp_path_factory):
    path = tmp_path_factory.mktemp("wallets")
    return {name: create_wallet(name, "default", path) for name in ("validator", "miner", "newcomer", "copycat")}


@pytest.fixture
def chain(wallets):
    """A full subnet of two uids (no immunity): the validator (staked) and a miner, each bound to its PeerID."""
    mock = MockSubstrate()
    mock.create_subnet(NETUID, tempo=1000, max_uids=2, immunity_period=0, serving_rate_limit=0)
    with bt.Subtensor("local", substrate=mock) as sub:
        for name, stake in (("validator", 1000.0), ("miner", 0.0)):
            wallet = wallets[name]
            mock.register(NETUID, wallet.hotkey.ss58_address, wallet.coldkeypub.ss58_address, stake)
            commit_peer_id(sub, wallet, NETUID, peer_id_for(name))
        mock.advance_blocks(1)
        yield mock, sub


def decision(sub, peer_id: str):
    graph = sub.subnets.metagraph(NETUID)  # a fresh sync, as a miner does every round
    return permit_holders(lambda: peer_directory(graph))(peer_id)


def test_a_deregistered_validator_is_refused_after_the_next_sync(chain, wallets):
    mock, sub = chain
    assert decision(sub, peer_id_for("validator")).allowed
    newcomer = wallets["newcomer"]
    uid = mock.register(NETUID, newcomer.hotkey.ss58_address, newcomer.coldkeypub.ss58_address, 0.0)
    assert uid == 0  # the subnet was full: the validator's uid went to the newcomer
    refused = decision(sub, peer_id_for("validator"))
    assert not refused.allowed and "unknown peer" in refused.reason
    # the newcomer did not inherit the old binding; the deregistered hotkey cannot bind again
    assert peer_directory(sub.subnets.metagraph(NETUID)).by_hotkey(newcomer.hotkey.ss58_address) is None
    with pytest.raises(bt.ChainError):
        commit_peer_id(sub, wallets["validator"], NETUID, peer_id_for("validator-again"))
    assert decision(sub, peer_id_for("miner")).hotkey == wallets["miner"].hotkey.ss58_address  # others unaffected


def test_a_validator_that_loses_its_permit_is_refused_after_the_next_sync(chain, wallets):
    mock, sub = chain
    assert decision(sub, peer_id_for("validator")).allowed
    mock.set_stake(NETUID, wallets["validator"].hotkey.ss58_address, 0.0)
    refused = decision(sub, peer_id_for("validator"))
    assert not refused.allowed and "no validator permit" in refused.reason
    mock.set_stake(NETUID, wallets["validator"].hotkey.ss58_address, 10.0)
    assert decision(sub, peer_id_for("validator")).allowed


def test_a_copied_peer_id_stays_with_the_hotkey_that_committed_it_first(chain, wallets, caplog):
    mock, sub = chain
    roomy = NETUID + 1
    mock.create_subnet(roomy, tempo=1000, serving_rate_limit=0)
    for name, stake in (("validator", 1000.0), ("copycat", 0.0)):
        wallet = wallets[name]
        mock.register(roomy, wallet.hotkey.ss58_address, wallet.coldkeypub.ss58_address, stake)
    victim = peer_id_for("validator-host")
    commit_peer_id(sub, wallets["validator"], roomy, victim)
    mock.advance_blocks(1)
    commit_peer_id(sub, wallets["copycat"], roomy, victim)  # a later claim on the validator's PeerID

    caplog.set_level(logging.WARNING, logger="template.p2p.identity")
    directory = peer_directory(sub.subnets.metagraph(roomy))
    record = directory.get(victim)
    assert record is not None and record.hotkey == wallets["validator"].hotkey.ss58_address
    assert directory.by_hotkey(wallets["copycat"].hotkey.ss58_address) is None
    assert permit_holders(lambda: directory)(victim).allowed  # the copy did not cut the validator off
    assert any("also claimed later" in r.getMessage() for r in caplog.records)
