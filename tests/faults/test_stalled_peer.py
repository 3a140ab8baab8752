"""Fault: a peer of the pseudo-gradient all-reduce stalls — alive, connected, but it stops reading and writing.

The staller is a separate process (its own session) that freezes itself *and* its DHT, averager and p2p daemon with
SIGSTOP at a chosen moment, so its TCP connections stay open and simply stop moving: the hardest kind of dead peer,
since nothing ever resets a connection. The other two peers run in this process. Every stage must end within the
configured timeouts; whatever succeeds holds identical bytes; a stalled peer that resumes gets a clean failure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from template.allreduce.averager import AveragingConfig, PseudoGradientAverager
from template.p2p.dht import DHTConfig, start_dht, visible_maddrs
from tests.integration.p2p_helpers import AVERAGER_CHILD_PREAMBLE

REPO = Path(__file__).resolve().parents[2]
SHAPES = [torch.Size([300_000]), torch.Size([300, 1000])]  # 600k float32 values: transfers are in flight a while
SMALL = [torch.Size([50_000])]  # where nothing is in flight when the peer stalls
WEIGHTS = [1.0, 3.0]

STALLER = AVERAGER_CHILD_PREAMBLE + textwrap.dedent(
    """
    when = json.loads(sys.stdin.readline())  # the test's round: scheduled time and deadline
    deltas = None if args["config"]["auxiliary"] else [torch.randn(s) for s in shapes]
    handle = averager.begin(deltas, 2.0, {"rank": "staller"}, when["scheduled"], when["deadline"])
    outcome = {}
    finisher = threading.Thread(target=lambda: outcome.update(result=averager.finish(handle, when["deadline"])))
    if args["stall_at"] == "matchmaking":
        while handle.control.stage.name != "LOOKING_FOR_GROUP" and time.time() < when["deadline"]:
            time.sleep(0.001)
        time.sleep(0.5)  # declared in the DHT and visible to the others, not yet in a group
    else:
        finisher.start()
        while handle.control.stage.name != "RUNNING_ALLREDUCE" and time.time() < when["deadline"]:
            time.sleep(0.001)
        # its groupmates may not have the leader's word yet (a full group begins at once, and this process may lead
        # it): frozen now, it would stall the group's formation, not its all-reduce — the test says when they run
        print("RUNNING", handle.control.stage.name, flush=True)
        sys.stdin.readline()
    print("STALLING", handle.control.stage.name, flush=True)
    os.killpg(0, signal.SIGSTOP)  # freezes this process, its DHT and averager processes and its p2p daemon
    resumed = time.time()
    if not finisher.is_alive() and "result" not in outcome:
        finisher.start()
    finisher.join(timeout=max(when["deadline"] - time.time(), 0) + 30)
    result = outcome.get("result")
    print("RESULT", json.dumps(None if result is None else {"ok": result.ok, "reason": result.reason,
                                                            "returned_after_resume_s": time.time() - resumed}),
          flush=True)
    averager.shutdown()
    dht.shutdown()
    """
)


def config(**overrides) -> AveragingConfig:
    settings = dict(
        prefix=f"stall{uuid.uuid4().hex[:10]}", target_group_size=3, min_group_size=2, matchmaking_time=2.5,
        # a silence of next_chunk_timeout gets a sender dropped: room for 2 loaded cores, short enough for a test
        request_timeout=1.0, allreduce_timeout=15.0, next_chunk_timeout=4.0, compression="none",
    )
    settings.update(overrides)
    return AveragingConfig(**settings)


def deltas(seed: int, shapes=SHAPES) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def digest(tensors) -> str:
    return hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in tensors)).hexdigest()


@pytest.fixture(scope="module")
def dhts():
    first = start_dht()
    nodes = [first, start_dht(DHTConfig(initial_peers=visible_maddrs(first)))]
    yield nodes
    for node in nodes:
        node.shutdown()


class Staller:
    """The stalling peer's process: start, wait until ready, let it run one round, freeze, resume, read its result."""

    def __init__(self, dhts, averaging: AveragingConfig, stall_at: str, shapes=SHAPES) -> None:
        args = dict(initial_peers=visible_maddrs(dhts[0]), shapes=[list(s) for s in shapes],
                    config=dataclasses.asdict(averaging), stall_at=stall_at)
        self.process = subprocess.Popen(
            [sys.executable, "-c", STALLER, json.dumps(args)], cwd=REPO, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, start_new_session=True,  # its own group: SIGSTOP freezes it all
        )

    def expect(self, prefix: str) -> str:
        line = self.process.stdout.readline()
        assert line.startswith(prefix), f"staller said {line!r}, expected {prefix} (exit code {self.process.poll()})"
        return line

    def play(self, scheduled: float, deadline: float) -> None:
        self.process.stdin.write(json.dumps(dict(scheduled=scheduled, deadline=deadline)) + "\n")
        self.process.stdin.flush()

    def freeze_once_running(self, handles, deadline: float) -> None:
        """Tell the staller (which runs its all-reduce) to freeze as soon as the others run theirs too: it may have
        led the group and set its stage before its "begin" reached them (measured: 1 run in 8, both others then
        looked for a group until their deadline). By the deadline at the latest."""
        while any(h.control.stage.name != "RUNNING_ALLREDUCE" and not h.control.done() for h in handles) \
                and time.time() < deadline:
            time.sleep(0.001)
        self.process.stdin.write("freeze\n")
        self.process.stdin.flush()

    def wait_stopped(self, timeout: float = 10) -> None:
        """Until the kernel reports the staller as stopped (state T), so the round surely runs against a frozen peer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if Path(f"/proc/{self.process.pid}/stat").read_text().split(") ")[1].startswith("T"):
                return
            time.sleep(0.01)
        raise AssertionError("the staller did not stop")

    def resume(self) -> dict | None:
        os.killpg(self.process.pid, signal.SIGCONT)
        return json.loads(self.expect("RESULT").split(" ", 1)[1])

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


def begin_all(peers, round_deltas, scheduled, deadline):
    triples = enumerate(zip(peers, round_deltas, WEIGHTS, strict=True))
    return [peer.begin(d, weight, {"rank": rank}, scheduled, deadline) for rank, (peer, d, weight) in triples]


def round_with_a_staller(dhts, whole: AveragingConfig, staller: Staller, seeds: tuple[int, int]):
    """Two averagers on ``dhts[0..1]`` run one round with ``staller``, which freezes once its all-reduce runs.
    Returns (their results, when it froze, when they returned, the round's deadline)."""
    with PseudoGradientAverager(dhts[0], SHAPES, whole) as a, PseudoGradientAverager(dhts[1], SHAPES, whole) as b:
        staller.expect("READY")
        scheduled = time.time() + whole.matchmaking_time + 1.0
        deadline = scheduled + whole.allreduce_timeout + 5
        staller.play(scheduled, deadline)
        handles = begin_all((a, b), [deltas(seed) for seed in seeds], scheduled, deadline)
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(p.finish, h, deadline) for p, h in zip((a, b), handles, strict=True)]
            assert "RUNNING_ALLREDUCE" in staller.expect("RUNNING")
            staller.freeze_once_running(handles, deadline)
            assert "RUNNING_ALLREDUCE" in staller.expect("STALLING")
            stalled_at = time.time()
            results = [future.result(timeout=deadline - time.time() + 10) for future in futures]
        return results, stalled_at, time.time(), deadline


def run_round(peers, round_deltas, scheduled, deadline):
    handles = begin_all(peers, round_deltas, scheduled, deadline)
    with ThreadPoolExecutor(len(peers)) as pool:
        futures = [pool.submit(peer.finish, handle, deadline) for peer, handle in zip(peers, handles, strict=True)]
        return [future.result(timeout=deadline - time.time() + 10) for future in futures]


def expected_mean(round_deltas):
    total = sum(WEIGHTS)
    pairs = list(zip(WEIGHTS, round_deltas, strict=True))
    return [sum(w * d[k].double() for w, d in pairs) / total for k in range(len(round_deltas[0]))]


@pytest.mark.timeout(120)
def test_a_peer_stalled_during_matchmaking_is_left_out_and_the_round_completes(dhts):
    averaging = config()
    staller = Staller(dhts, averaging, stall_at="matchmaking", shapes=SMALL)
    try:
        with PseudoGradientAverager(dhts[0], SMALL, averaging) as a, PseudoGradientAverager(dhts[1], SMALL,
                                                                                          averaging) as b:
            staller.expect("READY")
            scheduled = time.time() + averaging.matchmaking_time + 1.0
            deadline = scheduled + averaging.allreduce_timeout
            staller.play(scheduled, deadline)
            assert "LOOKING_FOR_GROUP" in staller.expect("STALLING")
            staller.wait_stopped()
            round_deltas = [deltas(0, SMALL), deltas(1, SMALL)]
            results = run_round([a, b], round_deltas, scheduled, deadline)
            finished = time.time()
        assert all(r.ok for r in results), [r.reason for r in results]
        assert all(r.group_size == 2 for r in results)  # formed without the frozen peer
        assert finished <= deadline + 1
        assert len({digest(r.averaged) for r in results}) == 1
        for got, want in zip(results[0].averaged, expected_mean(round_deltas), strict=True):
            assert float((got.double() - want).abs().max()) <= 1e-6
    finally:
        staller.close()


@pytest.mark.timeout(150)
def test_a_contributor_stalled_mid_allreduce_costs_one_round_within_the_timeouts(dhts):
    whole = config(min_group_size=3)  # the group cannot form without the peer that will stall
    staller = Staller(dhts, whole, stall_at="allreduce")
    try:
        first, stalled_at, first_done, deadline = round_with_a_staller(dhts, whole, staller, seeds=(2, 3))

        # the frozen peer owned a share of the vector that nobody can get: no survivor may claim success
        # with a patchwork average; they fail with a reason, within the all-reduce timeouts
        assert all(r.group_size == 3 for r in first if r.group_size), [r.group_size for r in first]
        assert not any(r.ok for r in first), "a survivor reported success without the frozen owner's share"
        reasons = [r.reason for r in first]
        assert all(r.startswith("partial all-reduce") or "deadline" in r for r in reasons), reasons
        assert first_done - stalled_at <= 2 * whole.next_chunk_timeout + whole.allreduce_timeout
        assert first_done <= deadline + 1

        # the next round on the same hosts, with the peer still frozen and its connections open, completes
        # without it (new averagers: hivemind fixes the minimum group size, and one prefix per host, at start)
        pair = dataclasses.replace(whole, prefix=whole.prefix + "next", min_group_size=2, target_group_size=2)
        with PseudoGradientAverager(dhts[0], SHAPES, pair) as c, PseudoGradientAverager(dhts[1], SHAPES, pair) as d:
            scheduled = time.time() + pair.matchmaking_time
            deadline = scheduled + pair.allreduce_timeout
            second_deltas = [deltas(4), deltas(5)]
            second = run_round([c, d], second_deltas, scheduled, deadline)
        assert all(r.ok and r.group_size == 2 for r in second), [(r.reason, r.group_size) for r in second]
        assert len({digest(r.averaged) for r in second}) == 1
        for got, want in zip(second[0].averaged, expected_mean(second_deltas), strict=True):
            assert float((got.double() - want).abs().max()) <= 1e-6

        thawed = staller.resume()
        assert thawed is not None and not thawed["ok"] and thawed["reason"]
    finally:
        staller.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("allreduce_timeout", [15.0, 8.0], ids=["ample", "chain_clocked"])
def test_a_validator_stalled_mid_allreduce_does_not_hold_the_miners_back(dhts, allreduce_timeout):
    """``chain_clocked``: the neurons cut the all-reduce to the round's phase, where 2 × next_chunk_timeout (how long
    an owner waits for groupmates to fetch its share) is the whole budget: the owners must stop waiting for the frozen
    validator before hivemind cancels their complete result (it cost the local network rounds)."""
    # the group cannot form without the validator that will stall
    whole = config(min_group_size=3, allreduce_timeout=allreduce_timeout)
    staller = Staller(dhts, dataclasses.replace(whole, auxiliary=True), stall_at="allreduce")
    try:
        results, stalled_at, done, deadline = round_with_a_staller(dhts, whole, staller, seeds=(6, 7))
        round_deltas = [deltas(6), deltas(7)]
        # the validator contributes nothing: the miners' average is complete without it (a failure says which owner's
        # share was missed and why, and who relayed what)
        assert all(r.ok and r.group_size == 3 for r in results), [
            (r.reason, r.group_size, r.evidence.failed_owners, r.evidence.recovered)
            for r in results]
        assert len({digest(r.averaged) for r in results}) == 1
        for got, want in zip(results[0].averaged, expected_mean(round_deltas), strict=True):
            assert float((got.double() - want).abs().max()) <= 1e-6
        # owners wait at most 2 x next_chunk_timeout for the frozen validator to fetch their share: the miners
        # finish within the all-reduce's own bounds, not whenever the validator comes back (chain_clocked: the owners
        # stop at 0.9 of the budget, then wait confirmation_time for the frozen validator's confirmation, and under
        # two loaded cores hivemind started one miner's all-reduce up to 3 s after the other's)
        bound = 2 * whole.next_chunk_timeout + whole.allreduce_timeout
        assert done - stalled_at <= bound + (whole.confirmation_time if 2 * allreduce_timeout <= bound else 0)
        assert done <= deadline + 1
    finally:
        staller.close()
