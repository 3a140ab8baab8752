"""The chain facade and scripts/check_registration.py against the mock chain served on 127.0.0.1.

The server runs in this process (its own threads, a real TCP socket); the script runs as a separate process, so the
registration check crosses a process boundary the way an operator's shell does.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import bittensor as bt
import pytest

from template.chain.client import ChainClient, NetworkConfigError, NotRegisteredError, RetryPolicy, open_subtensor
from template.chain.mock import MockSubstrate
from template.chain.mock_server import MockChainServer
from template.chain.wallets import create_wallet

REPO = Path(__file__).resolve().parents[2]
NETUID = 3


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A served mock chain with one subnet: a staked validator and two miners; plus an unregistered outsider."""
    wallet_dir = tmp_path_factory.mktemp("wallets")
    mock = MockSubstrate()
    mock.create_subnet(NETUID, tempo=10, weights_rate_limit=2, serving_rate_limit=0)
    names = ("validator", "miner1", "miner2", "outsider")
    wallets = {name: create_wallet(name, "default", wallet_dir) for name in names}
    for name, stake in (("validator", 500.0), ("miner1", 0.0), ("miner2", 0.0)):
        mock.register(NETUID, wallets[name].hotkey.ss58_address, wallets[name].coldkeypub.ss58_address, stake_tao=stake)
    mock.advance_blocks(2)  # registration counts as a weights update: wait out one rate limit
    with MockChainServer(mock, seconds_per_block=0) as server:
        yield server, mock, wallets, wallet_dir


def test_client_reads_metagraph_and_uids_through_the_real_sdk(chain):
    server, _, wallets, _ = chain
    client = ChainClient.connect(server.url, NETUID)
    graph = client.metagraph()
    assert graph.hotkeys == [wallets[n].hotkey.ss58_address for n in ("validator", "miner1", "miner2")]
    assert client.require_uid(wallets["miner2"].hotkey.ss58_address, graph) == 2
    assert client.uid_of(wallets["outsider"].hotkey.ss58_address, graph) is None
    with pytest.raises(NotRegisteredError, match="btcli subnets register --netuid 3"):
        client.require_uid(wallets["outsider"].hotkey.ss58_address, graph)
    assert client.block() >= 2


def test_client_serves_axon_and_sets_weights(chain):
    server, mock, wallets, _ = chain
    client = ChainClient.connect(server.url, NETUID)
    client.serve_axon(wallets["miner1"], "127.0.0.1", 40123)
    assert client.metagraph().neuron(1).axon == "127.0.0.1:40123"

    client.set_weights(wallets["validator"], {1: 3.0, 2: 1.0}, version_key=0)
    rows = dict(client.subtensor.weights.weights(NETUID))
    weights = dict(rows[0])
    assert set(weights) == {1, 2} and weights[1] > weights[2]
    # setting again at once breaks the chain's rate limit: a typed chain error, no retry, state unchanged
    with pytest.raises(bt.ChainError) as excinfo:
        client.set_weights(wallets["validator"], {2: 1.0}, version_key=0)
    assert excinfo.value.code == bt.ErrorCode.RATE_LIMITED
    assert dict(dict(client.subtensor.weights.weights(NETUID))[0]) == weights


def test_client_commits_a_text_once_and_reads_the_block_time(chain):
    server, mock, wallets, _ = chain
    client = ChainClient.connect(server.url, NETUID)
    assert client.block_time() == mock.block_time_sync()
    wallet, hotkey = wallets["miner2"], wallets["miner2"].hotkey.ss58_address
    client.set_commitment(wallet, "dl1:some-text")
    nonce = mock.account_next_index_sync(hotkey)
    client.set_commitment(wallet, "dl1:some-text")  # the chain holds it already: nothing submitted
    assert mock.account_next_index_sync(hotkey) == nonce
    assert client.subtensor.read("commitment", netuid=NETUID, hotkey_ss58=hotkey).data == "dl1:some-text"
    with pytest.raises(bt.ChainError):
        client.set_commitment(wallets["outsider"], "dl1:some-text")  # not registered: refused, not retried
    with pytest.raises(ValueError, match="at most 128 bytes"):
        client.set_commitment(wallet, "x" * 129)


@pytest.mark.parametrize("operation", ["sync metagraph", "set commitment"])
def test_client_retries_transport_errors_then_raises(operation, tmp_path, caplog):
    with socket.socket() as probe:  # a loopback port with nothing listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = ChainClient(open_subtensor(f"mock://127.0.0.1:{port}"), NETUID,
                         retry=RetryPolicy(attempts=3, base_delay_s=0.01))
    caplog.set_level(logging.WARNING, logger="template.chain.client")
    with pytest.raises(bt.RpcConnectionError):
        if operation == "sync metagraph":
            client.metagraph()
        else:
            client.set_commitment(create_wallet("committer", "default", tmp_path), "dl1:some-text")
    retries = [r for r in caplog.records if r.getMessage().startswith(f"{operation} failed")]
    assert len(retries) == 2  # three attempts: two retries, then the last error reaches the caller


@pytest.mark.parametrize("network", ["mars", "mock://", "mock://127.0.0.1:notaport", "mock://10.0.0.8:9944"])
def test_wrong_network_strings_are_refused_with_the_accepted_forms(network):
    with pytest.raises(NetworkConfigError):
        open_subtensor(network)


def _check_registration(server, wallet_dir, wallet_name, *extra):
    return subprocess.run(
        [sys.executable, "scripts/check_registration.py", "--subtensor.network", server.url, "--netuid", str(NETUID),
         "--wallet.name", wallet_name, "--wallet.hotkey", "default", "--wallet.path", str(wallet_dir), *extra],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=dict(os.environ),
    )


@pytest.mark.timeout(300)
def test_check_registration_script(chain):
    server, _, wallets, wallet_dir = chain
    registered = _check_registration(server, wallet_dir, "miner2")
    assert registered.returncode == 0, registered.stderr
    assert f"hotkey {wallets['miner2'].hotkey.ss58_address} is uid 2 on netuid {NETUID}" in registered.stdout

    outsider = _check_registration(server, wallet_dir, "outsider")
    assert outsider.returncode == 1
    assert "NOT registered" in outsider.stdout and "btcli subnets register" in outsider.stdout

    missing_wallet = _check_registration(server, wallet_dir, "nobody")
    assert missing_wallet.returncode == 2 and "no hotkey file" in missing_wallet.stderr

    wrong_network = subprocess.run(
        [sys.executable, "scripts/check_registration.py", "--subtensor.network", "mars", "--netuid", "1",
         "--wallet.name", "miner2", "--wallet.path", str(wallet_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert wrong_network.returncode == 2 and "unknown network 'mars'" in wrong_network.stderr
