"""A round between its training and its outcome: the correction on arrival's pieces (an average landed between two
chunks of inner steps, θ_local moved by the stand-in's error) and the rule for taking an outer step."""

from __future__ import annotations

import itertools

import torch

from template.allreduce.averager import AveragingConfig, AveragingResult
from template.training.data import ByteTokenizer, DataAssignment, build_corpus
from template.training.distributed import NodeGroup
from template.training.inner import InnerConfig, InnerTrainer
from template.training.model import build_model
from template.training.outer import OuterConfig, OuterOptimizer, load_into, move_start
from template.training.round import RoundPlan
from template.training.round_state import (
    Arrival,
    Landing,
    Stats,
    Trained,
    matchmaking_window,
    may_apply,
    train_in_chunks,
)

SEQ_LEN, BATCH = 64, 4


def trainer_and_batches():
    corpus = build_corpus("stdlib", ByteTokenizer(), SEQ_LEN)
    windows = DataAssignment(corpus.fingerprint, corpus.num_windows, run_seed=0).assigned_windows("peer", 0, 8)
    model = build_model("tiny", 257, SEQ_LEN)
    trainer = InnerTrainer(model, InnerConfig(lr=3e-3, warmup_steps=5, total_steps=100), "cpu")
    return model, trainer, itertools.cycle(list(corpus.batches(windows, BATCH)))


def test_an_average_that_lands_is_taken_once_between_two_chunks_and_training_goes_on() -> None:
    model, trainer, batches = trainer_and_batches()
    asked, landed_at = [], []
    progress = []
    arrival = Arrival(ready=lambda: asked.append(1) or len(asked) >= 4,  # finished by the fourth look (step 3)
                      land=lambda steps: landed_at.append(steps) or Landing(steps, None, (True, "")))
    stats = train_in_chunks(trainer, NodeGroup(), batches, 30, None, lambda p: progress.append(p.step), 0, arrival)
    assert stats.steps == 30  # landing costs no step
    assert landed_at == [3] and arrival.landed == Landing(3, None, (True, ""))
    assert len(asked) == 4  # never asked again once landed
    assert progress == [1, 2, 3, 13, 23, 30]  # one step at a time while it had not landed, then chunks of 10

    never = Arrival(ready=lambda: False, land=lambda steps: Landing(steps, None, (True, "")))
    assert train_in_chunks(trainer, NodeGroup(), batches, 20, None, None, 1, never).steps == 20
    assert never.landed is None  # it lands after training, as the plain eager update


def test_a_moved_start_trains_on_from_the_true_theta_and_its_delta_is_the_progress() -> None:
    """θ_local += G − S: the progress made from S is kept, and Δ measured from G afterwards is that progress."""
    model, trainer, batches = trainer_and_batches()
    outer = OuterOptimizer(model, OuterConfig())
    start = [t + 0.01 * torch.randn_like(t) for t in outer.params()]  # S: the stand-in's guess, off G
    load_into(model, start)
    trainer.train(batches, 5)
    progress = outer.pseudo_gradient(model, start)  # S − θ_local
    move_start(model, start, outer.params())
    moved = outer.pseudo_gradient(model)  # G − θ_local, after the move
    assert all(torch.allclose(m, p, atol=1e-6) for m, p in zip(moved, progress, strict=True))
    assert any(float(p.abs().max()) > 1e-4 for p in progress)


def result(ok: bool = True, onto: dict[str, str] | None = None, weights: dict[str, float] | None = None,
           reason: str = "") -> AveragingResult:
    onto = onto or {"a": "G", "b": "G"}
    return AveragingResult(ok, [torch.zeros(1)] if ok else None, {p: {"onto": h} for p, h in onto.items()},
                           len(onto), 1.0, 0, reason, weights=weights or dict.fromkeys(onto, 1.0))


def test_the_outer_step_is_taken_only_on_the_theta_the_groups_majority_holds() -> None:
    assert may_apply(result(), "G", 2) == (True, "")
    assert may_apply(None, "G", 2) == (False, "no averager")
    assert may_apply(result(ok=False, reason="a part is missing"), "G", 2) == (False, "a part is missing")
    assert not may_apply(result(weights={"a": 1.0, "b": 0.0}), "G", 2)[0]  # a trainer with a validator alone
    split = result(onto={"a": "G", "b": "G", "c": "H"}, weights={"a": 1.0, "b": 1.0, "c": 1.5})
    assert may_apply(split, "G", 2) == (True, "") and may_apply(split, "H", 2)[0] is False


def test_free_running_overlapped_peers_gather_the_slowest_groupmates_round_longer_than_the_others() -> None:
    def trained(finish_by: float | None) -> Trained:
        plan = RoundPlan(round=3, windows=(0,), max_steps=1, finish_by=finish_by)
        return Trained(plan, "θ", None, Stats(steps=50, tokens=800, mean_loss=2.0, seconds=10.0), None, None, 0.0)

    def after(*trained_s) -> AveragingResult:
        group = {f"p{i}": dict(peer_key=f"p{i}", trained_s=s) for i, s in enumerate(trained_s)}
        return AveragingResult(True, None, group, len(group), 1.0, 0, "")

    config = AveragingConfig(matchmaking_time=5.0)
    free = trained(finish_by=None)
    assert matchmaking_window(config, free, overlapped=True) == 15.0  # no group yet: its own round
    assert matchmaking_window(config, free, overlapped=True, after=after(9.0, 14.5)) == 19.5  # the slowest member's
    # what a member says counts up to 4 rounds of this peer's, and only as a finite float
    assert matchmaking_window(config, free, overlapped=True, after=after(1e9, float("nan"), "60", None)) == 45.0
    assert matchmaking_window(config, free, overlapped=False, after=after(14.5)) == 5.0  # blocking: a barrier
    clocked = trained(finish_by=1e10)  # chain-clocked: every peer starts looking at the same block
    assert matchmaking_window(config, clocked, overlapped=True, after=after(14.5)) == 5.0
