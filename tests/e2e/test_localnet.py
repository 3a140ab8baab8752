"""The local network command end to end, as a newcomer runs it: mock chain, validator and two miners as real
processes on 127.0.0.1, the tiny model, two rounds. It must exit 0 with a report whose checks all hold, and leave no
process behind — also when interrupted with Ctrl-C (SIGINT) and when a child dies.

Leftovers are found by the run marker every child inherits in its environment (hivemind's p2pd daemons included).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from template.allreduce.codecs import get_codec
from template.allreduce.contribution import encoded_sizes
from template.localnet import RUN_MARKER_ENV
from template.training.data import ByteTokenizer
from template.training.model import build_model, count_parameters

REPO = Path(__file__).resolve().parents[2]


def localnet(out: Path, *flags: str) -> list[str]:
    # 15 s rounds: overlapped (fp16's default) a miner trains until grace (3 s) before a round's end, about as long
    # as blocking 20 s rounds let it (until matchmaking + grace before the end)
    return [sys.executable, "-m", "template.localnet", "--out", str(out), "--miners", "2", "--rounds", "2",
            "--blocks-per-round", "30", *flags]


def leftovers(out: Path) -> list[str]:
    """Live processes whose environment carries this run's marker."""
    marker = f"{RUN_MARKER_ENV}={out}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ")[:200]
                found.append(f"{proc.name}: {command!r}")
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def assert_nothing_left(out: Path) -> None:
    deadline = time.monotonic() + 10
    while (left := leftovers(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left


def contribution_bytes(codec: str) -> int:
    """The exact bytes of one miner's contribution (and publication) of the tiny model with ``codec``'s defaults."""
    numel = count_parameters(build_model("tiny", ByteTokenizer.vocab_size, 64))
    return sum(encoded_sizes(get_codec(codec), numel))


def last_scored(out: Path) -> list[dict]:
    """What the validator's last ``scored`` event says of each miner (uid, score, reason, fetched bytes)."""
    events = [json.loads(line) for line in (out / "validator.events").read_text().splitlines() if line.strip()]
    scored = [e for e in events if e.get("event") == "scored"]
    return [{k: row.get(k) for k in ("uid", "score", "reason", "fetched_bytes")} for row in scored[-1]["miners"]]


def miner_rounds(out: Path) -> list[dict]:
    """Every ``round`` event of every miner."""
    return [event for path in out.glob("miner*.events") for line in path.read_text().splitlines() if line.strip()
            if (event := json.loads(line)).get("event") == "round"]


def first_round_reported(out: Path) -> bool:
    return bool(miner_rounds(out))


@pytest.mark.timeout(600)
def test_two_miners_and_a_validator_train_set_weights_and_pass_the_checks(tmp_path):
    out = tmp_path / "run"
    started = time.monotonic()
    done = subprocess.run(localnet(out), cwd=REPO, capture_output=True, text=True, timeout=560)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert_nothing_left(out)

    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is True
    assert report["checks"] == dict(loss_fell=True, models_identical=True, weights_on_chain=True)
    rounds = report["rounds"]
    assert len(rounds) >= 2 and rounds[-1]["heldout_loss"] < rounds[0]["heldout_loss"]
    # overlapped (the default): each round's all-reduce ran while the next round trained, and was over when that
    # training ended, so training never stood still for it (blocking, it waits for the whole all-reduce)
    assert report["run"]["overlap"] is True
    reported = miner_rounds(out)
    assert len(reported) >= 4 and all(event["allreduce_wait_s"] < 0.5 for event in reported), reported
    assert all(len(row["theta_hashes"]) == 1 and row["group_size"] >= 2 and row["bytes_per_peer"] > 0
               for row in rounds)
    neurons = report["neurons"]
    assert [(row["uid"], row["role"], row["behaviour"]) for row in neurons] == [
        (0, "validator", None), (1, "miner", "honest"), (2, "miner", "honest")]
    assert all(row["hotkey"].startswith("5") for row in neurons)
    assert any(row["incentive"] > 0 and row["weight"] > 0 for row in neurons if row["role"] == "miner")
    assert report["weights_set"] and any(entry["ok"] for entry in report["weights_set"])
    # the validator fetched each miner's whole contribution: fp16, two bytes per parameter
    fetched = [row["fetched_bytes"] for row in neurons if row["role"] == "miner"]
    assert fetched == [contribution_bytes("fp16")] * 2, last_scored(out)

    for name in ("loss.png", "weights.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    page = (out / "report.html").read_text()
    assert 'src="loss.png"' in page and 'src="weights.png"' in page and "PASSED" in page
    for name in ("chain", "validator", "miner1", "miner2"):
        assert (out / f"{name}.log").stat().st_size > 0
    assert "round" in output and "PASSED" in done.stdout and str(out / "report.html") in done.stdout
    print(f"local network e2e: {time.monotonic() - started:.0f}s")


@pytest.mark.timeout(600)
def test_a_sparse_network_trains_scores_and_fetches_a_fiftieth_of_fp16(tmp_path):
    """``--compression sparse``: the same checks pass, θ is identical on every miner each round, and the validator
    scores publications that are the sparse contributions (their exact size, under 1/50 of fp16's). The rounds
    block: the sparse codec's default (design change 22), so the neurons' blocking path runs here too."""
    out = tmp_path / "run"
    done = subprocess.run(localnet(out, "--compression", "sparse"), cwd=REPO, capture_output=True, text=True,
                          timeout=560)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert_nothing_left(out)
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is True and all(report["checks"].values()), report["checks"]
    assert all(len(row["theta_hashes"]) == 1 and row["allreduce_ok"] == row["miners"] == 2 for row in report["rounds"])
    miners = [row for row in report["neurons"] if row["role"] == "miner"]
    sparse = contribution_bytes("sparse")
    assert [row["fetched_bytes"] for row in miners] == [sparse] * 2 and sparse < contribution_bytes("fp16") / 50
    assert any(row["incentive"] > 0 and row["weight"] > 0 for row in miners)
    # an honest sparse miner is never refused (its contribution carries error feedback: docs/validation.md)
    scored = [event for event in map(json.loads, (out / "validator.events").read_text().splitlines())
              if event["event"] == "scored"]
    rows = [row for event in scored for row in event["miners"]]
    assert len(rows) >= 2 and all(row["reason"] == "" for row in rows), rows
    assert any(event["paid"] and any(row["score"] > 0 for row in event["miners"]) for event in scored), scored
    # every average over the kept values is checked in the round against its owner's claims: no honest one dropped
    rounds = [event for event in miner_rounds(out) if event["allreduce_ok"]]
    assert len(rounds) >= 4 and all(event["segments_refuted"] == 0 for event in rounds), rounds
    assert report["run"]["overlap"] is False  # it waited for every all-reduce:
    assert all(event["allreduce_wait_s"] == event["allreduce_s"] > 0 for event in rounds), rounds


@pytest.mark.timeout(400)
def test_ctrl_c_stops_every_process(tmp_path):
    out = tmp_path / "run"
    # short rounds: the first one ends sooner (whether the miners agree does not matter here); blocking (fp16's other
    # mode, --no-run.overlap) runs to its first reported round
    command = localnet(out, "--rounds", "50", "--blocks-per-round", "16", "--no-overlap")
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not first_round_reported(out) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        assert process.poll() is None, process.communicate()[0][-4000:]
        assert first_round_reported(out), "no miner finished a round in 300 s"
        rounds = miner_rounds(out)
        assert all(event["allreduce_wait_s"] == event["allreduce_s"] for event in rounds), rounds  # it waited
        assert leftovers(out)  # the marker does find the running network
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:  # only if the assertion above failed: do not leave the network running
            os.killpg(process.pid, signal.SIGINT)
            process.communicate(timeout=60)
    assert process.returncode == 130, output[-4000:]
    assert "interrupted" in output
    assert_nothing_left(out)


@pytest.mark.timeout(300)
def test_a_child_that_dies_stops_the_network_with_its_name_and_log(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run(localnet(out, "--data", str(tmp_path / "no-such-corpus.txt")), cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "exited with code" in done.stderr and "no-such-corpus.txt" in done.stderr, done.stderr[-4000:]
    assert not (out / "report.json").exists()
    assert_nothing_left(out)
