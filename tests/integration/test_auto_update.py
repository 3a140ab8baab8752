"""The auto-updater (``scripts/auto_update.py``) against a local bare git repository as the remote.

The repository under test is copied (``template/``, ``neurons/``) into a fresh git repository whose commits are the
"releases"; it is pushed to a bare repository, and the operator's checkout is a clone of that. Nothing leaves the
machine. The neuron runs from the checkout (``PYTHONPATH`` points at it, so an update really changes the code that
runs); the install step is ``python -m compileall`` (the real ``pip install -e .`` would repoint the test
environment's own install at the temporary checkout).

1. A real miner on the mock chain: a version bump is pulled and the miner restarts between rounds — the round in
   progress when the update was asked for is finished and reported, and the restarted miner resumes from the
   checkpoint of that round (no round lost); then a broken release (it exits at start) is rolled back to the last
   good commit, which runs again from the same checkpoint.
2. A stub neuron (a few lines that honour SIGUSR1) for the updater's other paths, in seconds: commits that do not
   change the version are not pulled, a failed install rolls back and that release is not tried again, a checkout
   with local commits is not overwritten, and SIGTERM stops the neuron and the updater.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from template.chain.mock import MockSubstrate
from template.chain.mock_server import MockChainServer
from template.chain.wallets import create_wallet
from template.localnet import RUN_MARKER_ENV
from tests.e2e.test_localnet import leftovers
from tests.integration.neuron_processes import REPO, events, neuron_command, wait_until

UPDATER = REPO / "scripts" / "auto_update.py"
NETUID = 5
SECONDS_PER_BLOCK = 0.5
BLOCKS_PER_ROUND = 24
STUB_NEURON = '''"""A stand-in neuron: writes a line per start and per clean stop to argv[1]; SIGUSR1 = stop."""
import re, signal, sys, time
from pathlib import Path

version = re.search(r'__version__ = "([^"]+)"', Path("template/__init__.py").read_text()).group(1)
asked = []
signal.signal(signal.SIGUSR1, lambda *_: asked.append(1))
with open(sys.argv[1], "a") as out:
    out.write(f"start {version}\\n")
for _ in range(1200):  # two minutes at most
    time.sleep(0.1)
    if asked:
        with open(sys.argv[1], "a") as out:
            out.write(f"stop {version}\\n")
        sys.exit(0)
'''


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-c", "user.name=release", "-c", "user.email=release@localhost", *args], cwd=repo,
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def set_version(seed: Path, version: str) -> None:
    path = seed / "template" / "__init__.py"
    path.write_text(re.sub(r'^__version__ = "[^"]+"', f'__version__ = "{version}"', path.read_text(), flags=re.M))


def make_repositories(tmp: Path, version: str, extra: dict[str, str] | None = None) -> tuple[Path, Path]:
    """(seed, checkout): the releases' repository (pushes to a bare ``remote.git``) and the operator's clone."""
    seed = tmp / "seed"
    for part in ("template", "neurons"):
        shutil.copytree(REPO / part, seed / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name, text in (extra or {}).items():
        (seed / name).write_text(text)
    set_version(seed, version)
    git(seed, "init", "--quiet", "-b", "main")
    git(seed, "add", "-A")
    git(seed, "commit", "--quiet", "-m", version)
    git(tmp, "clone", "--quiet", "--bare", str(seed), str(tmp / "remote.git"))
    git(seed, "remote", "add", "origin", str(tmp / "remote.git"))
    git(tmp, "clone", "--quiet", str(tmp / "remote.git"), str(tmp / "checkout"))
    return seed, tmp / "checkout"


def publish(seed: Path, version: str | None, message: str, change=None) -> str:
    """Commit (a new version, and/or ``change(seed)``) and push to the remote; the commit's hash."""
    if version is not None:
        set_version(seed, version)
    if change is not None:
        change(seed)
    git(seed, "commit", "--quiet", "-am", message)
    git(seed, "push", "--quiet", "origin", "main")
    return git(seed, "rev-parse", "HEAD")


def add_file(name: str, text: str):
    """A change for :func:`publish`: a new file, added to git."""

    def change(repo: Path) -> None:
        (repo / name).write_text(text)
        git(repo, "add", name)

    return change


def start_updater(tmp: Path, checkout: Path, log: Path, neuron: list[str], *flags: str) -> subprocess.Popen:
    """The updater, its output in ``log``; it and all it starts carry ``tmp`` as the run marker (see leftovers)."""
    command = [sys.executable, str(UPDATER), "--repo", str(checkout),
               "--install", f"{sys.executable} -m compileall -q template neurons", *flags, "--", *neuron]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(checkout), **{RUN_MARKER_ENV: str(tmp)})
    return subprocess.Popen(command, cwd=checkout, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)


def stop_updater(updater: subprocess.Popen, tmp: Path) -> tuple[int, list[str]]:
    """SIGTERM (as pm2 stop); its exit code and the processes it left behind (killed then: nothing outlives the
    test)."""
    if updater.poll() is None:
        updater.send_signal(signal.SIGTERM)
    try:
        code = updater.wait(timeout=90)
    except subprocess.TimeoutExpired:
        updater.kill()
        code = updater.wait(timeout=30)
    deadline = time.monotonic() + 10
    while (left := leftovers(tmp)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for entry in left:
        try:
            os.kill(int(entry.split(":")[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return code, left


def logged_at(log: Path, text: str) -> float:
    """When the updater logged the first line containing ``text`` (its lines start ``auto-update DATE TIME,ms``)."""
    line = next(line for line in log.read_text().splitlines() if line.startswith("auto-update") and text in line)
    return datetime.strptime(" ".join(line.split()[1:3]), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def kinds(tmp: Path, name: str, *wanted: str) -> list[dict]:
    return [e for e in events(tmp, name) if e["event"] in wanted]


@pytest.mark.timeout(600)
def test_a_release_restarts_the_miner_between_rounds_and_a_broken_one_rolls_back(tmp_path):
    seed, checkout = make_repositories(tmp_path, "1.0.0")
    mock = MockSubstrate()
    mock.create_subnet(NETUID, tempo=1000, weights_rate_limit=2, serving_rate_limit=0)
    wallet = create_wallet("miner1", "default", tmp_path / "wallets")
    mock.register(NETUID, wallet.hotkey.ss58_address, wallet.coldkeypub.ss58_address, 0.0)
    log = tmp_path / "updater.log"
    with MockChainServer(mock, seconds_per_block=SECONDS_PER_BLOCK) as server:
        miner = neuron_command("miner", "miner1", tmp_path, server.url, NETUID, BLOCKS_PER_ROUND,
                               "--run.inner_steps", "10", "--averaging.matchmaking_time", "3")
        updater = start_updater(tmp_path, checkout, log, miner, "--every", "0.02", "--healthy-after", "12",
                                "--stop-timeout", "120", "--stop-grace", "20")
        try:
            def alive() -> None:
                assert updater.poll() is None, log.read_text()[-4000:]

            def training() -> list[dict]:
                alive()
                return kinds(tmp_path, "miner1", "progress")

            training_round = wait_until(training, 240, "the miner to train its first round")[0]["round"]
            bump = publish(seed, "1.0.1", "release 1.0.1")  # while that round trains
            readies = wait_until(lambda: alive() or len(kinds(tmp_path, "miner1", "ready")) >= 2 and
                                 kinds(tmp_path, "miner1", "ready"), 240, "the restart on 1.0.1")
            assert git(checkout, "rev-parse", "HEAD") == bump
            asked_at = logged_at(log, "to stop after the round in progress")
            history = events(tmp_path, "miner1")
            before = history[:history.index(readies[1])]
            reported = [e for e in before if e["event"] == "round"]
            # the stop was asked while that round was under way; it ran to its end (inner steps, all-reduce,
            # checkpoint) and was reported, and the miner stopped before the next one
            assert [e["round"] for e in reported] == [training_round], reported
            assert reported[0]["time"] > asked_at and reported[0]["inner_steps"] > 0
            assert max(e["time"] for e in before if e["event"] == "progress") < reported[0]["time"]
            assert before[-1]["event"] == "stopped"
            assert readies[1]["restored"] == f"checkpoint round {training_round + 1}"  # resumes where it stopped

            good = bump
            broken = publish(seed, "1.0.2", "release 1.0.2 (broken)",
                             change=add_file("neurons/miner.py", 'raise SystemExit("this release is broken")\n'))
            wait_until(lambda: alive() or "ROLLED BACK" in log.read_text(), 240, "the roll-back")
            readies = wait_until(lambda: alive() or len(kinds(tmp_path, "miner1", "ready")) >= 3 and
                                 kinds(tmp_path, "miner1", "ready"), 240, "the miner back on 1.0.1")
            assert git(checkout, "rev-parse", "HEAD") == good
            assert "this release is broken" in log.read_text()
            rolled_back = next(line for line in log.read_text().splitlines() if "ROLLED BACK" in line)
            assert good[:12] in rolled_back and broken[:12] in rolled_back and "1.0.2" in rolled_back
            history = events(tmp_path, "miner1")
            last = [e for e in history[:history.index(readies[2])] if e["event"] == "round"][-1]
            assert readies[2]["restored"] == f"checkpoint round {last['round'] + 1}"
            assert json.loads((checkout / ".git" / "auto_update.json").read_text())["bad"] == [broken]
            alive()
        finally:
            code, left = stop_updater(updater, tmp_path)
    assert code == 0 and not left, (left, log.read_text()[-4000:])


@pytest.mark.timeout(180)
def test_the_updater_pulls_only_releases_rolls_back_a_failed_install_and_leaves_local_commits_alone(tmp_path):
    seed, checkout = make_repositories(tmp_path, "2.0.0", {"neurons/stub.py": STUB_NEURON})
    starts = tmp_path / "starts.txt"
    log = tmp_path / "updater.log"
    stub = [sys.executable, "neurons/stub.py", str(starts)]
    updater = start_updater(tmp_path, checkout, log, stub, "--every", "0.005", "--healthy-after", "1",
                            "--stop-timeout", "20")

    def lines() -> list[str]:
        assert updater.poll() is None, log.read_text()[-4000:]
        return starts.read_text().splitlines() if starts.exists() else []

    try:
        wait_until(lambda: lines() == ["start 2.0.0"], 60, "the stub to start")
        same_version = publish(seed, None, "not a release", change=add_file("neurons/note.txt", "a note\n"))
        release = publish(seed, "2.1.0", "release 2.1.0")
        wait_until(lambda: lines()[-1:] == ["start 2.1.0"], 60, "the update to 2.1.0")
        assert lines() == ["start 2.0.0", "stop 2.0.0", "start 2.1.0"]  # asked to stop, stopped cleanly, restarted
        assert git(checkout, "rev-parse", "HEAD") == release != same_version

        bad = publish(seed, "2.2.0", "release 2.2.0, which does not compile",
                      change=add_file("template/broken_module.py", "def oops(:\n"))
        wait_until(lambda: "ROLLED BACK" in log.read_text(), 60, "the roll-back of a failed install")
        wait_until(lambda: lines()[-1:] == ["start 2.1.0"] and len(lines()) == 5, 60, "the stub back on 2.1.0")
        assert lines()[3:] == ["stop 2.1.0", "start 2.1.0"]  # 2.2.0 never started
        assert git(checkout, "rev-parse", "HEAD") == release and "did not install" in log.read_text()
        assert json.loads((checkout / ".git" / "auto_update.json").read_text())["bad"] == [bad]
        time.sleep(2)  # several more checks of the remote: the failed release is not tried again
        assert log.read_text().count("new release 2.2.0") == 1 and len(lines()) == 5

        (checkout / "LOCAL.txt").write_text("an operator's own commit\n")
        git(checkout, "add", "LOCAL.txt")
        git(checkout, "commit", "--quiet", "-m", "local change")
        local = git(checkout, "rev-parse", "HEAD")
        publish(seed, "2.3.0", "release 2.3.0")
        wait_until(lambda: "not a fast-forward" in log.read_text(), 60, "the updater to notice the local commit")
        assert git(checkout, "rev-parse", "HEAD") == local and len(lines()) == 5  # nothing pulled, nothing restarted
    finally:
        code, left = stop_updater(updater, tmp_path)
    assert code == 0 and not left, (left, log.read_text()[-4000:])
    assert "stopping the neuron" in log.read_text()
