"""The DiLoCo engine between real processes on 127.0.0.1: lockstep rounds, a crash and a rejoin, a resumed checkpoint,
a 2-rank torchrun peer, and a misconfigured peer that must fail fast.

Every peer is ``python -m template.training.peer`` (tiny model, short rounds); the tests read the JSON events the peers
print. Bounded everywhere: each wait has a deadline and every process is stopped in ``finally``.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from template.p2p.simulated_link import LinkSpec, SimulatedNetwork
from template.training.run import PeerProcess, wait_for_event

REPO = Path(__file__).resolve().parents[2]
FAST_LINK_MBIT, SLOW_LINK_MBIT = 1000.0, 0.1  # the simulated links of the kill test (a loopback test knob)
# Small and fast on 2 cores: ~0.1 s per inner step, a few seconds per round.
FAST = ["--seq-len", "64", "--batch-size", "8", "--torch-threads", "1", "--heldout-batches", "2"]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1")


def _run_launcher(tmp_path: Path, *args: str, timeout: float = 480) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "template.training.run", "--out", str(tmp_path), *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, env=_env(),
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no summary (rc={result.returncode}): {result.stderr[-3000:]}"
    return json.loads(lines[-1]) | {"returncode": result.returncode, "stderr": result.stderr}


def _rounds_of(events: list[dict], peer: str) -> list[dict]:
    return [e for e in events if e["event"] == "round" and e["peer_key"] == peer]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["--no-overlap", "--overlap"])
def test_three_peers_train_in_lockstep_and_heldout_loss_falls(tmp_path, mode):
    """Blocking and overlapped (round r's all-reduce lands during round r+1): the same θ on every peer every round.
    Overlapped rounds are long enough for each average to land while the next round trains, and be corrected there."""
    steps = 40 if mode == "--overlap" else 15
    summary = _run_launcher(tmp_path, "--peers", "3", "--rounds", "3", "--inner-steps", str(steps),
                            "--matchmaking-time", "8", mode, *FAST)
    assert summary["returncode"] == 0, summary["stderr"][-3000:]
    assert summary["passed"] and summary["identical"] and summary["finished"]
    rounds = summary["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    for r in rounds:
        assert r["allreduce_ok"] == 3 and r["group_size"] == 3 and r["identical"], r
        # butterfly: each peer sends about 2(N-1)/N of the fp16 vector (1.87M params * 2 bytes)
        assert 0.9 * 2 * 2 / 3 * 1.87e6 * 2 < r["bytes_sent_per_peer"] < 1.2 * 2 * 2 / 3 * 1.87e6 * 2
    losses = [r["heldout_loss"] for r in rounds]
    assert losses[0] > losses[1] > losses[2], losses
    assert len(set(summary["final_theta_hashes"].values())) == 1
    landed = [r["landed_after_steps"] for r in rounds]
    if mode == "--overlap":  # rounds 0 and 1 land while the next round trains (or after it: a slow group), the last
        # one after training; a landing in the round was taken on every peer alike (θ identical above)
        during = [at for r in landed[:2] for at in r.values() if at is not None]
        assert during and all(0 <= at < steps for at in during), landed
        assert all(at is None for at in landed[2].values()), landed
    else:
        assert all(at is None for r in landed for at in r.values()), landed


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["--no-overlap", "--overlap"])
def test_a_killed_peer_does_not_stop_the_others_and_rejoins_from_their_state(tmp_path, mode):
    """With the sparse codec, whose error feedback is state of its own: the rejoining peer starts it from zero.

    Blocking, p2 is SIGKILLed while it trains round 1. Overlapped, while round 0's all-reduce runs in the background:
    every peer sits behind a simulated link (a loopback test knob) and every link drops to 0.1 Mbit/s once p2 trains
    round 0, so that round 0's segments (0.05–0.3 MB per peer) are still on the wire when p2 dies, ~2 s into round 1
    (6 of 6 runs: the survivors received 43.9 or 56.1 % of round 0's average and both refused it; at 1 Mbit/s the
    all-reduce had usually ended before the kill: 1 of 16 runs, at 0.25 Mbit/s 4 of 5)."""
    common = ["--rounds", "7", "--inner-steps", "15", "--matchmaking-time", "6", "--expected-peers", "3", *FAST,
              "--compression", "sparse", mode]
    events: queue.Queue = queue.Queue()
    seen: list[dict] = []
    network = SimulatedNetwork(LinkSpec(FAST_LINK_MBIT))

    def until(predicate, timeout):
        def record(event):
            seen.append(event)
            return predicate(event)
        return wait_for_event(events, record, timeout)

    def start(peer: str, link_name: str, *flags: str) -> PeerProcess:
        link = network.add_peer(link_name)
        return PeerProcess(peer, [*common, "--checkpoint-dir", str(tmp_path / peer), *flags, "--host-maddr",
                                  link.host_maddr, "--announce-maddr", link.announce_maddr], tmp_path, _env(), events)

    def progress(round: int):
        return lambda e: e["event"] == "progress" and e["peer_key"] == "p2" and e["round"] == round

    peers: dict[str, PeerProcess] = {}
    try:
        peers["p0"] = start("p0", "p0")
        bootstrap = until(lambda e: e["event"] == "listening", 120)["maddrs"]
        for name in ("p1", "p2"):
            peers[name] = start(name, name, "--initial-peers", *bootstrap)
        until(progress(0), 240)
        if mode == "--overlap":  # slow round 0's all-reduce down, so that p2 dies in the middle of it
            for name in peers:
                network.set_rate(name, SLOW_LINK_MBIT)
        until(progress(1), 240)
        peers["p2"].kill()
        for name in ("p0", "p1"):
            network.set_rate(name, FAST_LINK_MBIT)
        killed_at_round = 1

        # the survivors finish round 1 without p2, in one group of two, with identical θ
        until(lambda e: e["event"] == "round" and e["round"] == 1 and
              {x["peer_key"] for x in seen if x["event"] == "round" and x["round"] == 1} >= {"p0", "p1"}, 180)
        survivors = [e for e in seen if e["event"] == "round" and e["round"] <= 1 and e["peer_key"] != "p2"]
        survivors_r1 = [e for e in survivors if e["round"] == 1]
        assert all(e["allreduce_ok"] and e["group_size"] == 2 for e in survivors_r1), survivors_r1
        assert len({e["theta_hash"] for e in survivors_r1}) == 1
        # round 0 (in flight when p2 died, overlapped): both survivors took it, or both refused it
        assert len({(e["allreduce_ok"], e["theta_hash"]) for e in survivors if e["round"] == 0}) == 1, survivors

        # p2 restarts from the same checkpoint directory (at full speed) and catches up through the live peers' state
        peers["p2"] = start("p2", "p2-restarted", "--initial-peers", *bootstrap)
        ready = until(lambda e: e["event"] == "ready" and e["peer_key"] == "p2", 180)
        assert ready["restored"].startswith("peer state") and ready["round"] > killed_at_round, ready
        assert ready["feedback_norm"] == 0.0, ready  # what it had not sent belongs to the state it left behind
        finished: set[str] = set()

        def all_finished(event: dict) -> bool:
            if event["event"] in ("done", "error"):
                finished.add(event["peer_key"])
            return finished >= {"p0", "p1", "p2"}

        until(all_finished, 400)
    finally:
        for peer in peers.values():
            peer.stop()
        network.close()
        while not events.empty():
            seen.append(events.get())

    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in seen))  # kept for a failure's look
    history = [(e["peer_key"], e["round"], e["allreduce_ok"], e["group_size"], e["reason"][:120])
               for e in seen if e["event"] == "round"]  # every round as each peer saw it: in any failure's message
    assert not [e for e in seen if e["event"] == "error"], history
    hashes_by_round: dict[int, set[str]] = {}
    for e in seen:
        if e["event"] == "round" and e["allreduce_ok"]:
            hashes_by_round.setdefault(e["round"], set()).add(e["theta_hash"])
    assert all(len(h) == 1 for h in hashes_by_round.values()), (hashes_by_round, history)  # no two θ after any round
    rejoined = [e for e in _rounds_of(seen, "p2") if e["round"] > killed_at_round and e["allreduce_ok"]]
    assert rejoined and all(e["group_size"] == 3 for e in rejoined), history


@pytest.mark.timeout(300)
def test_a_restarted_peer_resumes_from_its_checkpoint(tmp_path):
    first = _run_launcher(tmp_path, "--peers", "1", "--rounds", "2", "--inner-steps", "8", *FAST)
    assert first["passed"], first["stderr"][-2000:]
    second = _run_launcher(tmp_path, "--peers", "1", "--rounds", "3", "--inner-steps", "8", *FAST)
    assert second["passed"], second["stderr"][-2000:]
    assert second["restored"] == {"peer0": "checkpoint round 2"}
    assert [r["round"] for r in second["rounds"]] == [2]  # rounds 0 and 1 are not redone
    assert second["rounds"][0]["heldout_loss"] < first["rounds"][0]["heldout_loss"]


@pytest.mark.timeout(420)
def test_a_two_rank_torchrun_peer_trains_with_a_single_process_peer(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun ships with torch"
    # overlapped (the default), round 0's average lands while round 1 trains: both ranks correct θ_local at once
    steps = 30
    common = ["--rounds", "2", "--inner-steps", str(steps), "--matchmaking-time", "6", "--expected-peers", "2", *FAST]
    events: queue.Queue = queue.Queue()
    node = single = None
    collected: list[dict] = []
    try:
        node = PeerProcess("node", common, tmp_path, _env(), events,
                           launcher=[torchrun, "--standalone", "--nproc_per_node", "2", "-m"])
        bootstrap = wait_for_event(events, lambda e: e["event"] in ("listening", "error"), 180)
        assert bootstrap["event"] == "listening", bootstrap
        single = PeerProcess("single", [*common, "--initial-peers", *bootstrap["maddrs"]], tmp_path, _env(), events)
        done: set[str] = set()

        def finished(event):
            collected.append(event)
            if event["event"] in ("done", "error", "exit"):
                done.add(event["peer_key"])
            return done >= {"node", "single"}

        wait_for_event(events, finished, 360)
    finally:
        for process in (single, node):
            if process is not None:
                process.stop()
    assert not [e for e in collected if e["event"] == "error"], collected
    finals = {e["peer_key"]: e["theta_hash"] for e in collected if e["event"] == "done"}
    assert set(finals) == {"node", "single"} and len(set(finals.values())) == 1
    node_rounds = _rounds_of(collected, "node")
    assert [r["round"] for r in node_rounds] == [0, 1] and all(r["allreduce_ok"] for r in node_rounds)
    # the node's two ranks each trained half of every batch: the node reports the whole batch's tokens
    assert all(r["tokens"] == steps * 8 * 64 for r in node_rounds)
    assert 0 <= node_rounds[0]["landed_after_steps"] < steps, node_rounds[0]


@pytest.mark.timeout(300)
def test_a_peer_with_other_settings_fails_fast_and_says_what_differs(tmp_path):
    events: queue.Queue = queue.Queue()
    first = other = None
    try:
        sparse = ["--compression", "sparse"]
        first = PeerProcess("first", ["--rounds", "1", "--expected-peers", "2", *FAST, *sparse], tmp_path, _env(),
                            events)
        maddrs = wait_for_event(events, lambda e: e["event"] == "listening", 120)["maddrs"]
        mismatched = [*FAST, *sparse, "--sparse-k", "128", "--seq-len", "32", "--rounds", "1", "--initial-peers",
                      *maddrs]
        other = PeerProcess("other", mismatched, tmp_path, _env(), events)
        error = wait_for_event(events, lambda e: e["peer_key"] == "other" and e["event"] in ("error", "ready"), 180)
        assert other.process.wait(timeout=60) == 2
    finally:
        for process in (other, first):
            if process is not None:
                process.stop()
    assert error["event"] == "error" and "RunMismatchError" in error["error"]
    assert "seq_len: ours=32 theirs=64" in error["error"]
    assert 'codec: ours="sparse/' in error["error"] and "k=128" in error["error"] and "k=64" in error["error"]
