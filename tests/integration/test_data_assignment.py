"""A validator in another process must recompute a miner's data exactly: same corpus, same windows.

Each subprocess gets a different ``PYTHONHASHSEED``, so any accidental use of Python's salted ``hash()``
in the corpus fingerprint or the assignment would show up as a mismatch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from template.training.data import ByteTokenizer, DataAssignment, build_corpus

REPO = Path(__file__).parents[2]
PEERS = ["5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY", "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty"]
ROUNDS = [0, 1, 17]

RECOMPUTE = """
import json, sys
from template.training.data import ByteTokenizer, DataAssignment, build_corpus
source, seq_len, seed, peers, rounds = json.loads(sys.argv[1])
corpus = build_corpus(source, ByteTokenizer(), seq_len)
assignment = DataAssignment(corpus.fingerprint, corpus.num_windows, seed)
print(json.dumps({
    "fingerprint": corpus.fingerprint,
    "assigned": {f"{p}/{r}": assignment.assigned_windows(p, r, 32) for p in peers for r in rounds},
    "heldout": {str(r): assignment.heldout_windows(r, 8, salt="v") for r in rounds},
}))
"""


def compute_here(source: str, seq_len: int, seed: int) -> dict[str, object]:
    corpus = build_corpus(source, ByteTokenizer(), seq_len)
    assignment = DataAssignment(corpus.fingerprint, corpus.num_windows, seed)
    return {
        "fingerprint": corpus.fingerprint,
        "assigned": {f"{p}/{r}": assignment.assigned_windows(p, r, 32) for p in PEERS for r in ROUNDS},
        "heldout": {str(r): assignment.heldout_windows(r, 8, salt="v") for r in ROUNDS},
    }


def compute_in_subprocess(source: str, seq_len: int, seed: int, hash_seed: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", RECOMPUTE, json.dumps([source, seq_len, seed, PEERS, ROUNDS])],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("source", "seq_len"), [("builtin", 128), ("stdlib", 64)])
def test_assignment_recomputed_in_other_processes_matches(source: str, seq_len: int) -> None:
    expected = compute_here(source, seq_len, seed=2024)
    for hash_seed in ("1", "4242"):
        assert compute_in_subprocess(source, seq_len, 2024, hash_seed) == expected
    assigned = expected["assigned"]
    assert isinstance(assigned, dict)
    assert assigned[f"{PEERS[0]}/0"] != assigned[f"{PEERS[1]}/0"]
