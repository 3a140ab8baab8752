"""Bad input on the command line: unknown flags and presets, out-of-range numbers, missing or garbage data files,
missing wallets, unknown networks, tokenizers and behaviours.

Each command-line case runs the real entry point (``neurons/miner.py`` or ``python -m template.training.peer``) as an
operator would and must end with exit code 2 and one clear line naming what is wrong (the last line on stderr), never
a traceback. One process per distinct code path (each costs seconds of imports); the variants of a garbage data file
are checked in-process on the loader the entry points call. Nothing here reaches a network: the Hugging Face hub is
offline, and every miner case is refused before it would contact a chain.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from template.chain.wallets import create_wallet
from template.training.data import ByteTokenizer, build_corpus

REPO = Path(__file__).resolve().parents[2]
PEER = [sys.executable, "-m", "template.training.peer", "--peer-key", "p0"]
MINER = [sys.executable, "neurons/miner.py"]


def cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (command, what the error line must say)."""
    garbage = tmp / "garbage.jsonl"
    garbage.write_text('{"text": "fine"}\nthis line is not JSON\n')
    wallet = ["--wallet.name", "operator", "--wallet.path", str(tmp / "wallets")]
    return {
        "peer: missing data path": (PEER + ["--data", str(tmp / "nowhere" / "*.txt")], "matches no file"),
        "peer: garbage jsonl": (PEER + ["--data", str(garbage)], f"{garbage}:2: not a JSON record"),
        "peer: unknown tokenizer": (PEER + ["--tokenizer", "no-such-org/no-such-tokenizer"],
                                    "tokenizer 'no-such-org/no-such-tokenizer' could not be loaded"),
        "miner: unknown flag": (MINER + ["--netuid", "1", "--bogus"], "unrecognized arguments: --bogus"),
        "miner: unknown preset": (MINER + ["--netuid", "1", "--run.preset", "huge"], "invalid choice: 'huge'"),
        "miner: negative netuid": (MINER + ["--netuid", "-1", *wallet], "argument --netuid: must be >= 0, got -1"),
        "miner: missing wallet": (MINER + ["--netuid", "1", "--wallet.name", "nobody", "--wallet.path",
                                           str(tmp / "wallets")], "no hotkey file at"),
        "miner: unknown network": (MINER + ["--netuid", "1", *wallet, "--subtensor.network", "mars"],
                                   "unknown network 'mars'"),
        "miner: unknown behaviour": (MINER + ["--netuid", "1", *wallet, "--miner.behaviour", "nonsense"],
                                     "unknown behaviour 'nonsense'"),
        "miner: sparse settings for fp16": (MINER + ["--netuid", "1", *wallet, "--averaging.sparse_k", "128"],
                                            "sparse codec's settings (sparse_k) apply only to compression 'sparse'"),
        "peer: outer momentum 1": (PEER + ["--outer-momentum", "1"], "the outer step needs lr > 0 and 0 <= momentum"),
    }


@pytest.mark.timeout(300)
def test_bad_flags_and_files_end_with_exit_code_2_and_one_clear_line(tmp_path):
    create_wallet("operator", "default", tmp_path / "wallets")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    table = cases(tmp_path)

    def run(command: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)

    with ThreadPoolExecutor(3) as pool:
        results = dict(zip(table, pool.map(run, [command for command, _ in table.values()]), strict=True))
    failures = []
    for name, (_, expected) in table.items():
        result = results[name]
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        clear = expected in last and "error" in last.lower()
        if result.returncode != 2 or "Traceback" in result.stderr or not clear:
            failures.append(f"{name}: exit {result.returncode}, last line {last!r}\n{result.stderr[-1500:]}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"text": "fine"}\nthis line is not JSON\n', r"garbage.jsonl:2: not a JSON record"),
        (b'{"text": "fine"}\n\xff\xfe\x00garbage\n', r"garbage.jsonl: not UTF-8 text"),
        (b'{"text": "fine"}\n{"body": "no text field"}\n', r"garbage.jsonl:2: no string field 'text'"),
        (b'{"text": "fine"}\n["a", "list"]\n', r"garbage.jsonl:2: no string field 'text'"),
    ],
)
def test_garbage_data_files_are_refused_naming_the_file_and_line(tmp_path, content, message):
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        build_corpus(str(garbage), ByteTokenizer(), seq_len=8)


@pytest.mark.timeout(300)
def test_neurons_on_a_live_chain_refuse_bad_data_a_missing_permit_and_an_unreachable_chain(tmp_path):
    """Errors found after the neuron reached the chain (its data, its permit) or while reaching it: exit code 2 and
    one clear line, no traceback."""
    from template.chain.mock import MockSubstrate
    from template.chain.mock_server import MockChainServer

    mock = MockSubstrate()
    mock.create_subnet(1, tempo=100, serving_rate_limit=0)
    # a hotkey per neuron that reaches the chain: two processes of one hotkey race for its nonce at startup (one
    # run in many: "nonce 2 rejected: the account's next nonce is 3" ended the no-permit validator with a traceback)
    for name in ("miner", "validator", "validator-no-permit"):
        wallet = create_wallet(name, "default", tmp_path / "wallets")
        mock.register(1, wallet.hotkey.ss58_address, wallet.coldkeypub.ss58_address, 0.0)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    with socket.socket() as probe:  # a port nothing listens on: bound once, then closed
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    with MockChainServer(mock, seconds_per_block=0.5) as server:

        def neuron(script: str, name: str, network: str, *extra: str) -> list[str]:
            return [sys.executable, f"neurons/{script}.py", "--netuid", "1", "--wallet.name", name,
                    "--wallet.path", str(tmp_path / "wallets"), "--subtensor.network", network,
                    "--neuron.full_path", str(tmp_path / name), "--wandb.off", *extra]

        table = {
            "miner: data path missing": (neuron("miner", "miner", server.url, "--run.data", str(tmp_path / "x.txt")),
                                         "matches no file"),
            "validator: data path missing": (neuron("validator", "validator", server.url, "--neuron.allow_no_permit",
                                                    "--run.data", str(tmp_path / "x.txt")), "matches no file"),
            "validator: no permit": (neuron("validator", "validator-no-permit", server.url), "has no validator permit"),
            "miner: chain unreachable": (neuron("miner", "miner", f"mock://127.0.0.1:{closed_port}"),
                                         "cannot reach the chain at mock://127.0.0.1:"),
        }
        with ThreadPoolExecutor(len(table)) as pool:
            runs = {name: pool.submit(subprocess.run, command, cwd=REPO, env=env, capture_output=True, text=True,
                                      timeout=240) for name, (command, _) in table.items()}
            results = {name: future.result() for name, future in runs.items()}
    for name, (_, message) in table.items():
        result = results[name]
        last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
        assert result.returncode == 2, (name, result.returncode, result.stderr[-2000:])
        assert message in last and last.startswith("error:"), (name, last)
        assert "Traceback" not in result.stderr, (name, result.stderr[-2000:])
