"""The mock chain server as its own process, used by other processes through the real bittensor SDK.

One server process (manual blocks) serves the whole module; each test works on its own subnet so the tests do not
share state. A second, short-lived server checks the block clock, the state file and a clean SIGTERM exit.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import bittensor as bt
import pytest

from template.chain.mock import MockSubstrate
from template.chain.mock_server import MockChainServer, RemoteMockSubstrate, parse_mock_url

REPO = Path(__file__).resolve().parents[2]
TEMPO = 10
RATE_LIMIT = 5


def _env(tmp: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["BTCLI_TOKEN_SYMBOLS_CACHE"] = str(tmp / "token_symbols.json")
    return env


def start_server(tmp: Path, *args: str, timeout: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start ``python -m template.chain.mock_server --port 0 ...`` and return it with the URL from its ready line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "template.chain.mock_server", "--port", "0", *args],
        cwd=REPO, env=_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("mock chain listening on "):
                return proc, line.split()[-1]
            seen.append(line)
            if not line and proc.poll() is not None:
                break
    stop_server(proc)
    raise RuntimeError(f"mock chain server did not start: {''.join(seen)}")


def stop_server(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mockchain")


@pytest.fixture(scope="module")
def server_url(workdir):
    proc, url = start_server(workdir, "--seconds-per-block", "0")
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(autouse=True)
def _token_symbol_cache(workdir, monkeypatch):
    monkeypatch.setenv("BTCLI_TOKEN_SYMBOLS_CACHE", str(workdir / "token_symbols.json"))


@pytest.fixture(scope="module")
def wallets(workdir):
    out = {}
    for name in ("validator", "miner1", "miner2", "miner3", "outsider"):
        wallet = bt.Wallet(name, "default", path=str(workdir / "wallets"))
        wallet.create_new_coldkey(use_password=False, overwrite=True, suppress=True)
        wallet.create_new_hotkey(use_password=False, overwrite=True, suppress=True)
        out[name] = wallet
    return out


def setup_subnet(url: str, netuid: int, wallets: dict) -> RemoteMockSubstrate:
    """1 validator (uid 0, staked) + 3 miners on a fresh subnet, through the helpers of the remote client."""
    chain = RemoteMockSubstrate(url)
    chain.create_subnet(netuid, TEMPO, weights_rate_limit=RATE_LIMIT)
    for name, stake in (("validator", 1000.0), ("miner1", 0.0), ("miner2", 0.0), ("miner3", 0.0)):
        wallet = wallets[name]
        chain.register(netuid, wallet.hotkey.ss58_address, wallet.coldkeypub.ss58_address, stake_tao=stake)
    chain.advance_blocks(RATE_LIMIT)  # as on chain, registering counts as a weight update: wait one rate limit
    return chain


def subnet_state(chain: RemoteMockSubstrate, netuid: int) -> dict:
    """One subnet's whole state as the server holds it."""
    state = json.loads(chain.to_json())
    return next(s for s in state["subnets"] if s["netuid"] == netuid)


VALIDATOR_SCRIPT = textwrap.dedent("""
    import json, sys
    import bittensor as bt
    from template.chain.mock_server import RemoteMockSubstrate
    url, wallet_path, netuid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    wallet = bt.Wallet("validator", "default", path=wallet_path)
    sub = bt.Subtensor("local", substrate=RemoteMockSubstrate(url))
    result = sub.execute(bt.SetWeights(netuid=netuid, weights={1: 1.0, 2: 1.0}, version_key=0), wallet)
    print(json.dumps({"success": result.success, "message": result.message, "id": result.extrinsic_id}))
""")


@pytest.mark.timeout(60)
def test_a_validator_process_sets_weights_that_become_incentive(server_url, wallets, workdir):
    netuid = 1
    chain = setup_subnet(server_url, netuid, wallets)
    run = subprocess.run(
        [sys.executable, "-c", VALIDATOR_SCRIPT, server_url, str(workdir / "wallets"), str(netuid)],
        cwd=REPO, env=_env(workdir), capture_output=True, text=True, timeout=45,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["success"], report["message"]

    with bt.Subtensor("local", substrate=RemoteMockSubstrate(server_url)) as sub:
        weights = sub.weights.weights(netuid)
        assert set(weights[0]) == {1, 2}
        chain.advance_blocks(TEMPO)
        graph = sub.subnets.metagraph(netuid)
    validator, miner1, miner2, miner3 = graph.neurons
    assert miner1.incentive > 0 and miner2.incentive > 0
    assert miner3.incentive == 0
    assert validator.dividends > 0
    assert miner1.emission.rao > 0 and miner3.emission.rao == 0


@pytest.mark.timeout(60)
def test_bad_writes_are_refused_and_change_nothing(server_url, wallets):
    netuid = 2
    chain = setup_subnet(server_url, netuid, wallets)
    with bt.Subtensor("local", substrate=RemoteMockSubstrate(server_url)) as sub:
        before = chain.to_json()
        with pytest.raises(bt.ChainError) as unregistered:
            sub.execute(bt.SetWeights(netuid=netuid, weights={1: 1.0}), wallets["outsider"])
        assert unregistered.value.code is bt.ErrorCode.NOT_REGISTERED
        assert chain.to_json() == before

        assert sub.execute(bt.SetWeights(netuid=netuid, weights={1: 1.0}), wallets["validator"]).success
        after_first = subnet_state(chain, netuid)
        with pytest.raises(bt.ChainError) as too_often:
            sub.execute(bt.SetWeights(netuid=netuid, weights={3: 1.0}), wallets["validator"])
        assert too_often.value.code is bt.ErrorCode.RATE_LIMITED
        call = bt.calls.SubtensorModule.set_mechanism_weights(netuid=netuid, mecid=0, dests=[3], weights=[65535],
                                                              version_key=0)
        raw = sub.submit_call(call, wallets["validator"], signer="hotkey")
        assert raw.error.name == "SettingWeightsTooFast" and raw.error.code is bt.ErrorCode.RATE_LIMITED
        assert subnet_state(chain, netuid) == after_first
        assert sub.weights.weights(netuid) == {0: {1: 1.0}}


class ForgedSigner:
    """Claims the validator's hotkey address but signs with another key."""

    crypto_type = 1

    def __init__(self, claimed: bt.Wallet, actual: bt.Wallet):
        self.ss58_address = claimed.hotkey.ss58_address
        self.public_key = claimed.hotkey.public_key
        self._actual = actual.hotkey

    def sign(self, payload: bytes) -> bytes:
        return self._actual.sign(payload)


@pytest.mark.timeout(60)
def test_a_forged_signature_is_rejected(server_url, wallets):
    netuid = 3
    chain = setup_subnet(server_url, netuid, wallets)
    with bt.Subtensor("local", substrate=RemoteMockSubstrate(server_url)) as sub:
        before = chain.to_json()
        forged = sub.execute(bt.SetWeights(netuid=netuid, weights={1: 1.0}), ForgedSigner(wallets["validator"],
                                                                                            wallets["outsider"]))
        assert not forged.success and forged.error.name == "BadProof"
        assert chain.to_json() == before  # not even the nonce moved
        honest = sub.execute(bt.SetWeights(netuid=netuid, weights={1: 1.0}), wallets["validator"])
        assert honest.success


def _raw_exchange(url: str, payload: bytes, header: bytes | None = None) -> tuple[dict | None, bool]:
    """Send raw bytes; return the decoded reply (None if none) and whether the server then closed the socket."""
    host, port = parse_mock_url(url)
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall((header if header is not None else struct.pack(">I", len(payload))) + payload)
        reply_header = sock.recv(4)
        reply = None
        if len(reply_header) == 4:
            (length,) = struct.unpack(">I", reply_header)
            body = b""
            while len(body) < length:
                chunk = sock.recv(length - len(body))
                if not chunk:
                    break
                body += chunk
            reply = json.loads(body)
        sock.settimeout(0.3)  # a closed socket answers at once; an open one stays silent
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
        return reply, closed


@pytest.mark.timeout(60)
def test_malformed_requests_get_clear_errors_and_the_server_keeps_serving(server_url, wallets):
    netuid = 4
    chain = setup_subnet(server_url, netuid, wallets)
    before = chain.to_json()

    reply, closed = _raw_exchange(server_url, b"\x00\xffnot json{")
    assert reply["error"]["type"] == "BadRequest" and "JSON" in reply["error"]["message"] and not closed
    reply, _ = _raw_exchange(server_url, b"[1, 2]")
    assert reply["error"]["type"] == "BadRequest"
    reply, _ = _raw_exchange(server_url, json.dumps({"method": "steal_all_tao", "params": {}}).encode())
    assert reply["error"]["type"] == "BadRequest" and "unknown method" in reply["error"]["message"]
    reply, _ = _raw_exchange(server_url, json.dumps({"method": "register", "params": {"netuid": 4}}).encode())
    assert reply["error"]["type"] == "BadRequest" and "wrong arguments" in reply["error"]["message"]
    reply, closed = _raw_exchange(server_url, b"", header=struct.pack(">I", 512 << 20))  # announces 512 MiB
    assert reply["error"]["type"] == "RequestTooLarge" and closed

    host, port = parse_mock_url(server_url)
    with socket.create_connection((host, port), timeout=10) as sock:  # hang up in the middle of a request
        sock.sendall(struct.pack(">I", 1000) + b'{"method": "advance')

    with pytest.raises(bt.ChainError) as missing:  # chain errors keep their name across the wire
        chain.register(99, wallets["miner1"].hotkey.ss58_address, wallets["miner1"].coldkeypub.ss58_address)
    assert missing.value.name == "SubnetNotExists" and missing.value.code is bt.ErrorCode.SUBNET_NOT_EXISTS
    with pytest.raises(ValueError):
        chain.advance_blocks(-1)

    assert chain.to_json() == before
    with bt.Subtensor("local", substrate=RemoteMockSubstrate(server_url)) as sub:
        graph = sub.subnets.metagraph(netuid)  # still serving, state intact
    assert graph.hotkeys[0] == wallets["validator"].hotkey.ss58_address and len(graph) == 4


def test_wrong_network_strings_are_refused(server_url, wallets):
    netuid = 5
    chain = setup_subnet(server_url, netuid, wallets)
    before = chain.to_json()
    for url in ("mock://", "mock://127.0.0.1", "mock://127.0.0.1:notaport", "mock://127.0.0.1:70000",
                "mock://10.0.0.7:9944", "mock://example.com:9944", "ws://127.0.0.1:9944"):
        with pytest.raises(ValueError):
            parse_mock_url(url)
        with pytest.raises(ValueError):
            RemoteMockSubstrate(url)
    assert parse_mock_url("mock://localhost:9946") == ("127.0.0.1", 9946)
    with pytest.raises(ValueError, match="loopback"):
        MockChainServer(MockSubstrate(), host="0.0.0.0")
    with pytest.raises(ValueError, match="loopback"):
        RemoteMockSubstrate("192.168.1.10", 9944)
    assert chain.to_json() == before
    with bt.Subtensor("local", substrate=RemoteMockSubstrate(server_url)) as sub:  # the server is unaffected
        assert sub.subnets.metagraph(netuid).hotkeys[0] == wallets["validator"].hotkey.ss58_address


@pytest.mark.timeout(60)
def test_nothing_listening_is_a_connection_error(workdir):
    with socket.socket() as probe:  # a free port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(bt.RpcConnectionError):
        RemoteMockSubstrate("127.0.0.1", port, timeout=2).advance_blocks(1)


@pytest.mark.timeout(60)
def test_clock_state_file_and_clean_shutdown(workdir, wallets):
    state_file = workdir / "chain-state.json"
    proc, url = start_server(workdir, "--seconds-per-block", "0.05", "--state-file", str(state_file))
    try:
        setup_subnet(url, 1, wallets)
        deadline = time.monotonic() + 20
        with bt.Subtensor("local", substrate=RemoteMockSubstrate(url)) as sub:
            first_epoch = sub.subnets.metagraph(1).network_registered_at + TEMPO
            graph = sub.subnets.metagraph(1)
            while graph.last_step < first_epoch and time.monotonic() < deadline:
                time.sleep(0.05)
                graph = sub.subnets.metagraph(1)
        assert graph.last_step >= first_epoch  # the clock produced the blocks and the epoch ran on its own
        assert graph.neuron(0).emission.rao > 0
    finally:
        assert stop_server(proc) == 0  # SIGTERM: clean exit
    saved = json.loads(state_file.read_text())
    assert saved["block"] >= graph.block

    proc, url = start_server(workdir, "--seconds-per-block", "0", "--state-file", str(state_file))
    try:
        chain = RemoteMockSubstrate(url)
        restored = json.loads(chain.to_json())
        assert restored["block"] == saved["block"]
        hotkeys = [n["hotkey"] for n in restored["subnets"][0]["neurons"]]
        assert hotkeys == [wallets[n].hotkey.ss58_address for n in ("validator", "miner1", "miner2", "miner3")]
    finally:
        assert stop_server(proc) == 0


@pytest.mark.timeout(30)
def test_a_stalled_request_is_dropped_and_others_are_served_meanwhile():
    with MockChainServer(MockSubstrate(), seconds_per_block=0, request_timeout=0.5) as server:
        host, port = parse_mock_url(server.url)
        with socket.create_connection((host, port), timeout=5) as stalled:
            stalled.sendall(b"\x00\x00")  # half a length prefix, then nothing
            started = time.monotonic()
            assert RemoteMockSubstrate(server.url).advance_blocks(1) == 1  # served while the other one stalls
            assert stalled.recv(1) == b""  # the server hangs up on the stalled request
            assert 0.3 < time.monotonic() - started < 5
        assert RemoteMockSubstrate(server.url).advance_blocks(1) == 2
