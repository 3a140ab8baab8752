"""Faults around checkpoints: a writer SIGKILLed mid-save, a full disk, an unwritable directory.

Each fault runs in a separate process, because each one is about the process: a SIGKILL leaves whatever was on disk
at that instant, ``RLIMIT_FSIZE`` makes the kernel refuse writes past a size the way a full disk does (EFBIG), and an
unprivileged process cannot write a read-only directory (root ignores permission bits, so that child gives up
the capabilities that let it). After every fault the directory must still hold the newest checkpoint that was
committed before it, complete and verified by ``load_latest_checkpoint``.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from template.training.checkpoint import CheckpointError, load_latest_checkpoint, save_checkpoint

REPO = Path(__file__).resolve().parents[2]
VALUES = 4_000_000  # 16 MB of float32 per checkpoint: a save takes long enough to be caught in the middle
KILLS = 6


def expected_tensors(round: int, values: int = VALUES) -> dict[str, torch.Tensor]:
    """What round ``round`` holds: every value derived from the round, so a torn or mixed file cannot pass."""
    return {
        "theta": torch.full((values,), float(round)),
        "momentum": torch.arange(1024, dtype=torch.float32) + round,
    }


def assert_complete(checkpoint, values: int = VALUES) -> None:
    assert checkpoint is not None
    expected = expected_tensors(checkpoint.round, values)
    assert set(checkpoint.tensors) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(checkpoint.tensors[name], tensor), f"round {checkpoint.round}: {name} is not intact"
    assert checkpoint.metadata == {"round": checkpoint.round, "note": "x" * 64}


SAVER = textwrap.dedent(
    """
    import sys, torch
    from template.training.checkpoint import save_checkpoint
    directory, first, values = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for round in range(first, first + 10_000):
        tensors = {"theta": torch.full((values,), float(round)),
                   "momentum": torch.arange(1024, dtype=torch.float32) + round}
        save_checkpoint(directory, round, tensors, {"round": round, "note": "x" * 64}, keep=2)
        print(round, flush=True)
    """
)


def strays(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".ckpt-tmp-"))


@pytest.mark.timeout(120)
def test_a_writer_killed_mid_save_never_loses_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "checkpoints"
    rng = random.Random(1234)
    mid_write_kills = 0
    for kill in range(KILLS):
        latest = load_latest_checkpoint(directory)
        first = latest.round + 1 if latest is not None else 0  # a restarted miner carries on from its checkpoint
        saver = subprocess.Popen([sys.executable, "-c", SAVER, str(directory), str(first), str(VALUES)],
                                 cwd=REPO, stdout=subprocess.PIPE, text=True)
        try:
            committed = int(saver.stdout.readline())  # at least one save of this process has committed
            if kill % 2 == 0:  # at a random moment ...
                time.sleep(rng.uniform(0.0, 0.4))
            else:  # ... or as soon as a new save has started writing its temporary file
                deadline = time.monotonic() + 10
                while not strays(directory) and time.monotonic() < deadline:
                    time.sleep(0.001)
        finally:
            saver.send_signal(signal.SIGKILL)
            saver.wait(timeout=10)
        committed = max([committed, *(int(line) for line in saver.stdout.read().split())])
        saver.stdout.close()
        mid_write_kills += bool(strays(directory))

        checkpoint = load_latest_checkpoint(directory)
        assert_complete(checkpoint)
        assert checkpoint.round >= committed  # nothing that was reported saved is lost
    assert mid_write_kills >= 1, "no kill landed in the middle of a save: the test did not test anything"
    print(f"\n{mid_write_kills}/{KILLS} SIGKILLs landed in the middle of a save")

    # the next save (by a restarted writer) removes what the killed ones left behind
    latest = load_latest_checkpoint(directory)
    save_checkpoint(directory, latest.round + 1, expected_tensors(latest.round + 1, 8), {"round": latest.round + 1,
                                                                                           "note": "x" * 64}, keep=2)
    assert strays(directory) == []
    assert len(list(directory.glob("ckpt-*.json"))) == 2 and len(list(directory.glob("ckpt-*.safetensors"))) == 2
    assert_complete(load_latest_checkpoint(directory), values=8)


FULL_DISK = textwrap.dedent(
    """
    import json, resource, signal, sys, torch
    from template.training.checkpoint import CheckpointError, load_latest_checkpoint, save_checkpoint
    directory = sys.argv[1]
    save_checkpoint(directory, 1, {"theta": torch.full((1000,), 1.0)}, {"round": 1})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # no file may grow past 1 MiB: the disk is "full"
    outcome = {}
    try:
        save_checkpoint(directory, 2, {"theta": torch.full((1_000_000,), 2.0)}, {"round": 2})
        outcome["error"] = None
    except CheckpointError as error:
        outcome["error"] = str(error)
    latest = load_latest_checkpoint(directory)
    outcome["latest_round"] = latest.round
    outcome["latest_ok"] = bool(torch.equal(latest.tensors["theta"], torch.full((1000,), 1.0)))
    print(json.dumps(outcome), flush=True)
    """
)


@pytest.mark.timeout(60)
def test_a_full_disk_gives_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "checkpoints"
    result = subprocess.run([sys.executable, "-c", FULL_DISK, str(directory)], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome["error"] is not None and str(directory / "ckpt-00000002.json") in outcome["error"]
    assert "File too large" in outcome["error"]  # EFBIG, as the kernel reports it
    assert outcome["latest_round"] == 1 and outcome["latest_ok"]
    assert strays(directory) == []  # the half-written temporary was removed
    assert [p.name for p in directory.glob("ckpt-*.json")] == ["ckpt-00000001.json"]


UNWRITABLE = textwrap.dedent(
    """
    import json, os, sys, torch
    from template.training.checkpoint import CheckpointError, load_latest_checkpoint, save_checkpoint
    directory = sys.argv[1]
    outcome = {}
    try:
        save_checkpoint(directory, 2, {"theta": torch.full((10,), 2.0)}, {"round": 2})
        outcome["error"] = None
    except CheckpointError as error:
        outcome["error"] = str(error)
    latest = load_latest_checkpoint(directory)
    outcome["latest_round"] = latest.round
    outcome["latest_ok"] = bool(torch.equal(latest.tensors["theta"], torch.full((10,), 1.0)))
    print(json.dumps(outcome), flush=True)
    """
)


def without_permission_override() -> None:
    """In the child, before exec: root loses CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH, so permission bits apply to it
    as to any unprivileged user (a no-op for a non-root test runner, to whom they apply anyway)."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: gone from the bounding set, hence at exec
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


@pytest.mark.timeout(60)
def test_an_unwritable_directory_gives_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "checkpoints"
    save_checkpoint(directory, 1, {"theta": torch.full((10,), 1.0)}, {"round": 1})
    os.chmod(directory, 0o555)  # readable, not writable
    try:
        result = subprocess.run([sys.executable, "-c", UNWRITABLE, str(directory)], cwd=REPO, capture_output=True,
                                text=True, timeout=60, preexec_fn=without_permission_override)
    finally:
        os.chmod(directory, 0o755)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome["error"] is not None and "PermissionError" in outcome["error"]
    assert str(directory / "ckpt-00000002.json") in outcome["error"]
    assert outcome["latest_round"] == 1 and outcome["latest_ok"]
    assert sorted(p.name for p in directory.iterdir() if p.suffix == ".json") == ["ckpt-00000001.json"]


def test_a_run_directory_that_cannot_exist_gives_a_clear_error(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the run directory should be")
    with pytest.raises(CheckpointError, match="not-a-directory") as excinfo:
        save_checkpoint(blocker / "checkpoints", 1, {"theta": torch.zeros(3)}, {})
    assert isinstance(excinfo.value.__cause__, OSError)
    assert load_latest_checkpoint(blocker / "checkpoints") is None  # and reading it is not an error either
