"""Launching miner and validator processes on the mock chain for tests: command lines, process groups, events."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 64  # every test neuron's --run.seq_len


def neuron_command(script: str, name: str, tmp: Path, url: str, netuid: int, blocks_per_round: int,
                   *extra: str) -> list[str]:
    """``neurons/<script>.py`` for wallet ``name``, state and events under ``tmp``, the tiny model at ``SEQ_LEN``."""
    return [sys.executable, f"neurons/{script}.py", "--netuid", str(netuid), "--wallet.name", name,
            "--wallet.hotkey", "default", "--wallet.path", str(tmp / "wallets"), "--subtensor.network", url,
            "--neuron.full_path", str(tmp / name), "--neuron.blocks_per_round", str(blocks_per_round),
            "--neuron.events_file", str(tmp / f"{name}.events"), "--neuron.torch_threads", "1",
            "--run.seq_len", str(SEQ_LEN), "--wandb.off", *extra]


def events(tmp: Path, name: str) -> list[dict]:
    path = tmp / f"{name}.events"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def start_process(command: list[str], log: Path, env: dict) -> subprocess.Popen:
    """Its own process group, so that ``stop_process`` also reaches the hivemind processes it forked."""
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "a"),
                            start_new_session=True)


def stop_process(process: subprocess.Popen) -> None:
    stop_processes([process])


def stop_processes(processes: list[subprocess.Popen], grace_s: float = 60.0) -> None:
    """SIGTERM to all (a clean stop), up to ``grace_s`` in total for them to exit, then SIGKILL of every process
    group: no process may outlive the test."""
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def require_alive(processes: dict[str, subprocess.Popen], tmp: Path) -> None:
    """Fail at once, with the end of its log, when a neuron that should be running has exited."""
    for name, process in processes.items():
        if process.poll() is not None:
            log = tmp / f"{name}.log"
            tail = log.read_text()[-3000:] if log.exists() else ""
            raise AssertionError(f"{name} exited with code {process.returncode}:\n{tail}")
