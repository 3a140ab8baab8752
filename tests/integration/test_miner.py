"""Two miner processes on the mock chain (served on 127.0.0.1), as an operator would run them.

They register axons and PeerIDs on chain, find each other through the metagraph alone, train the tiny model on the
chain's round clock, all-reduce and end the round with identical θ. A validator-permit holder fetches a miner's
pseudo-gradient over the authenticated RPC and its hotkey signature verifies; a registered hotkey without a permit is
refused. SIGTERM stops a miner cleanly and leaves a loadable checkpoint; an unregistered hotkey gets a clear message.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import bittensor as bt
import pytest
import torch

from template.allreduce.codecs import get_codec
from template.base.audit import read_publication
from template.base.miner import DIRECTORY_REFRESH_S
from template.base.neuron import AsyncRunner
from template.chain.mock import MockSubstrate
from template.chain.mock_server import MockChainServer
from template.chain.wallets import create_wallet
from template.p2p.dht import DHTConfig, start_dht
from template.p2p.identity import peer_directory
from template.p2p.publication import RefusedError, fetch_publication
from template.protocol import PROTOCOL_VERSION, FetchRequest
from template.training.checkpoint import load_latest_checkpoint
from tests.integration.neuron_processes import REPO, events, neuron_command, start_process, stop_process, wait_until
from tests.integration.p2p_helpers import commit_peer_id

NETUID = 2
SECONDS_PER_BLOCK = 0.5
BLOCKS_PER_ROUND = 24  # 12 s rounds: a few s of training, the rest for re-sync, matchmaking and a loaded machine


def miner_command(name: str, tmp: Path, url: str, *extra: str) -> list[str]:
    return neuron_command("miner", name, tmp, url, NETUID, BLOCKS_PER_ROUND, "--run.inner_steps", "10",
                          "--averaging.matchmaking_time", "3", *extra)


@pytest.mark.timeout(420)
def test_two_miners_train_together_publish_and_stop_cleanly(tmp_path):
    mock = MockSubstrate()
    mock.create_subnet(NETUID, tempo=1000, weights_rate_limit=2, serving_rate_limit=0)
    wallets = {name: create_wallet(name, "default", tmp_path / "wallets")
               for name in ("validator", "miner1", "miner2", "permitless", "outsider")}
    for name, stake in (("validator", 1000.0), ("miner1", 0.0), ("miner2", 0.0), ("permitless", 0.0)):
        mock.register(NETUID, wallets[name].hotkey.ss58_address, wallets[name].coldkeypub.ss58_address, stake)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    miners: dict[str, subprocess.Popen] = {}
    runner = AsyncRunner()
    dhts = []
    with MockChainServer(mock, seconds_per_block=SECONDS_PER_BLOCK) as server:
        try:
            unregistered = subprocess.run(miner_command("outsider", tmp_path, server.url), cwd=REPO, env=env,
                                          capture_output=True, text=True, timeout=120)
            assert unregistered.returncode == 2
            assert "is not registered on netuid 2" in unregistered.stderr
            assert "btcli subnets register" in unregistered.stderr

            for name in ("miner1", "miner2"):
                # overlapped (the default) a round is reported one round after it trained: rounds enough that both
                # still run, and serve, while the fetches below come after the first common round's report
                command = miner_command(name, tmp_path, server.url, "--neuron.max_rounds", "5")
                miners[name] = start_process(command, tmp_path / f"{name}.log", env)
            def first_common_round():
                """Both miners' reports of the first round both finished (a miner that became ready a round
                earlier than the other ran that round alone, and its all-reduce failed, as it must)."""
                rounds = [{e["round"]: e for e in events(tmp_path, n) if e["event"] == "round"} for n in miners]
                common = sorted(set(rounds[0]) & set(rounds[1]))
                return common and [r[common[0]] for r in rounds]

            first = wait_until(first_common_round, 240, "both miners to finish the same round")
            assert all(report["allreduce_ok"] and report["group_size"] == 2 for report in first), first
            assert first[0]["theta_hash"] == first[1]["theta_hash"]
            assert first[0]["base_theta_hash"] == first[1]["base_theta_hash"]

            # the metagraph alone tells who is who: axons and PeerID commitments of both miners
            sub = bt.Subtensor("local", substrate=mock)
            directory = peer_directory(sub.subnets.metagraph(NETUID))
            miner1 = directory.by_hotkey(wallets["miner1"].hotkey.ss58_address)
            assert miner1 is not None and directory.by_hotkey(wallets["miner2"].hotkey.ss58_address) is not None
            assert len(directory.bootstrap_maddrs()) == 2, [(r.uid, r.axon, r.peer_id) for r in directory]

            def caller(name: str, commit: bool = True):
                dht = start_dht(DHTConfig(initial_peers=directory.bootstrap_maddrs()))
                dhts.append(dht)
                if commit:  # only a registered hotkey can bind its PeerID on chain
                    commit_peer_id(sub, wallets[name], NETUID, str(dht.peer_id))
                return runner.run(dht.replicate_p2p())

            request = FetchRequest(PROTOCOL_VERSION, NETUID, first[0]["round"])

            def fetch_as(p2p):
                # a caller that just committed its PeerID is unknown until the miner re-reads the metagraph,
                # which an unknown caller triggers at most every DIRECTORY_REFRESH_S: ask again after that
                for attempt in range(3):
                    try:
                        return runner.run(fetch_publication(p2p, miner1.peer_id, request,
                                                            expected_hotkey=miner1.hotkey, timeout=30), timeout=60)
                    except RefusedError as err:
                        if "unknown peer" not in str(err) or attempt == 2:
                            raise
                        time.sleep(DIRECTORY_REFRESH_S + 0.5)

            publication = fetch_as(caller("validator"))
            assert publication.meta.round == first[0]["round"] and publication.meta.hotkey == miner1.hotkey
            assert publication.meta.base_theta_hash == first[0]["base_theta_hash"]
            assert publication.meta.tokens == first[0]["tokens"]
            # the publication is the contribution the miner committed to, and it decodes to a trained, finite Δ
            shapes = [torch.Size(shape) for shape in publication.meta.shapes]
            scope = publication.meta.commitment["scope"]
            assert scope.startswith(f"netuid{NETUID}/diloco_")  # commitments count on this subnet and run only
            read = read_publication(publication, get_codec("fp16"), shapes, scope, contributed=None)
            assert read.reason == "" and len(read.tensors) == len(publication.meta.names) > 10
            assert all(bool(torch.isfinite(t).all()) for t in read.tensors)
            assert all(bool(t.abs().sum() > 0) for t in read.tensors)  # it trained: Δ is not zero

            with pytest.raises(RefusedError, match="no validator permit"):
                fetch_as(caller("permitless"))
            with pytest.raises(RefusedError, match="unknown peer"):
                fetch_as(caller("outsider", commit=False))

            miners["miner2"].send_signal(signal.SIGTERM)
            assert miners["miner2"].wait(timeout=60) == 0
            assert any(e["event"] == "stopped" for e in events(tmp_path, "miner2"))
            checkpoint = load_latest_checkpoint(tmp_path / "miner2" / "checkpoints")
            assert checkpoint is not None and checkpoint.round >= first[1]["round"] + 1
        finally:
            for process in miners.values():
                stop_process(process)
            for dht in dhts:
                dht.shutdown()
            runner.close()


@pytest.mark.timeout(420)
def test_a_two_rank_torchrun_miner_trains_with_a_single_process_miner(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun ships with torch"
    mock = MockSubstrate()
    mock.create_subnet(NETUID, tempo=1000, weights_rate_limit=2, serving_rate_limit=0)
    wallets = {name: create_wallet(name, "default", tmp_path / "wallets") for name in ("node", "single")}
    for wallet in wallets.values():
        mock.register(NETUID, wallet.hotkey.ss58_address, wallet.coldkeypub.ss58_address, 0.0)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    launchers = {"node": [torchrun, "--standalone", "--nproc_per_node", "2"], "single": [sys.executable]}
    miners: dict[str, subprocess.Popen] = {}
    with MockChainServer(mock, seconds_per_block=SECONDS_PER_BLOCK) as server:
        try:
            for name, launcher in launchers.items():
                command = miner_command(name, tmp_path, server.url, "--neuron.max_rounds", "3")[1:]
                miners[name] = start_process([*launcher, *command], tmp_path / f"{name}.log", env)
            for name, process in miners.items():
                assert process.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        finally:
            for process in miners.values():
                stop_process(process)
    node, single = events(tmp_path, "node"), events(tmp_path, "single")
    assert next(e for e in node if e["event"] == "ready")["ranks"] == 2
    node_rounds = {e["round"]: e for e in node if e["event"] == "round"}
    single_rounds = {e["round"]: e for e in single if e["event"] == "round"}
    # torchrun's start takes longer: when a round boundary falls between the two "ready"s, the first to be ready runs
    # its first round alone (seen in 1 of 4 runs, 2026-12-06) and the other its last; every other round is common
    common = sorted(set(node_rounds) & set(single_rounds))
    assert len(node_rounds) == len(single_rounds) == 3 and len(common) >= 2, (node_rounds, single_rounds)
    for r in common:
        report = node_rounds[r]
        assert report["allreduce_ok"] and single_rounds[r]["allreduce_ok"] and report["group_size"] == 2
        assert report["theta_hash"] == single_rounds[r]["theta_hash"]
        assert report["tokens"] == single_rounds[r]["tokens"]  # the node's two ranks each trained half of each batch
