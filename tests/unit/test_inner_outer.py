"""Inner AdamW training (loss falls, deadline, accumulation, NaN) and the outer Nesterov step (exact, deterministic)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from template.training.data import ByteTokenizer, DataAssignment, TokenCorpus, build_corpus
from template.training.inner import InnerConfig, InnerTrainer, NonFiniteLossError, evaluate
from template.training.model import build_model
from template.training.outer import OuterConfig, OuterOptimizer, load_into, stand_in_scale

REAL_TEXT = "stdlib"  # English prose every Python carries: no file outside the repository
SEQ_LEN = 64
BATCH = 4


@pytest.fixture(scope="module")
def corpus() -> TokenCorpus:
    return build_corpus(REAL_TEXT, ByteTokenizer(), SEQ_LEN)


@pytest.fixture(scope="module")
def assignment(corpus: TokenCorpus) -> DataAssignment:
    return DataAssignment(corpus.fingerprint, corpus.num_windows, run_seed=0)


def fast_config(**overrides: object) -> InnerConfig:
    return InnerConfig(**{"lr": 3e-3, "warmup_steps": 5, "total_steps": 200, **overrides})


# ---------------------------------------------------------------------------------------------------- inner


@pytest.mark.timeout(120)
def test_thirty_inner_steps_lower_the_heldout_loss(corpus: TokenCorpus, assignment: DataAssignment) -> None:
    model = build_model("tiny", 257, SEQ_LEN)
    heldout = list(corpus.batches(assignment.heldout_windows(0, 16), 8))
    before = evaluate(model, heldout, "cpu")
    trainer = InnerTrainer(model, fast_config(), "cpu")
    stats = trainer.train(corpus.batches(assignment.assigned_windows("peer", 0, 30 * BATCH), BATCH), max_steps=30)
    after = evaluate(model, heldout, "cpu")
    assert stats.steps == trainer.step == 30
    assert stats.tokens == 30 * BATCH * SEQ_LEN
    assert stats.last_loss is not None and stats.mean_loss is not None and stats.last_loss < stats.mean_loss
    assert before > 5.0 and after < before - 1.0, (before, after)


@pytest.mark.timeout(60)
def test_deadline_stops_training_early(corpus: TokenCorpus, assignment: DataAssignment) -> None:
    batches = list(corpus.batches(assignment.assigned_windows("peer", 0, 8), BATCH))
    trainer = InnerTrainer(build_model("tiny", 257, SEQ_LEN), fast_config(), "cpu")

    past = trainer.train(itertools.cycle(batches), max_steps=10, deadline=time.monotonic())
    assert past.steps == 0 and past.tokens == 0 and past.mean_loss is None and past.last_loss is None

    started = time.monotonic()
    stats = trainer.train(itertools.cycle(batches), max_steps=10**6, deadline=started + 0.5)
    elapsed = time.monotonic() - started
    assert 0 < stats.steps < 10**6
    assert elapsed < 0.5 + 5.0  # at most one step past the deadline, with slack for a busy 2-core machine
    assert trainer.step == stats.steps


def test_training_stops_when_batches_run_out_and_accumulates_micro_batches(
    corpus: TokenCorpus, assignment: DataAssignment
) -> None:
    batches = list(corpus.batches(assignment.assigned_windows("peer", 1, 7 * BATCH), BATCH))
    trainer = InnerTrainer(build_model("tiny", 257, SEQ_LEN), fast_config(grad_accum_steps=2), "cpu")
    stats = trainer.train(iter(batches), max_steps=100)
    assert stats.steps == 4  # 2 + 2 + 2 + 1 micro-batches
    assert stats.tokens == 7 * BATCH * SEQ_LEN


def test_schedule_warms_up_then_decays_by_cosine_to_the_floor() -> None:
    config = InnerConfig(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert config.lr_at(0) == pytest.approx(0.1) and config.lr_at(9) == pytest.approx(1.0)
    assert config.lr_at(10) == pytest.approx(1.0)
    assert config.lr_at(60) == pytest.approx(0.55)  # half way down the cosine
    assert config.lr_at(110) == pytest.approx(0.1) and config.lr_at(10_000) == pytest.approx(0.1)
    decay = [config.lr_at(s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(decay))


def test_non_finite_loss_raises_before_the_optimizer_step(corpus: TokenCorpus, assignment: DataAssignment) -> None:
    model = build_model("tiny", 257, SEQ_LEN)
    with torch.no_grad():
        model.get_input_embeddings().weight.fill_(float("nan"))
    norm_before = model.model.norm.weight.detach().clone()
    trainer = InnerTrainer(model, fast_config(), "cpu")
    with pytest.raises(NonFiniteLossError, match="inner step 0"):
        trainer.train(corpus.batches(assignment.assigned_windows("peer", 0, BATCH), BATCH), max_steps=1)
    assert trainer.step == 0
    assert torch.equal(model.model.norm.weight, norm_before)


def test_evaluate_restores_mode_and_refuses_no_batches() -> None:
    model = build_model("tiny", 257, SEQ_LEN).train()
    corpus = TokenCorpus.from_documents(["some words to evaluate on " * 20], ByteTokenizer(), SEQ_LEN)
    loss = evaluate(model, corpus.batches([0, 1], 2), "cpu")
    assert 5.0 < loss < 6.5 and model.training
    with pytest.raises(ValueError, match="no batches"):
        evaluate(model, [], "cpu")


# ---------------------------------------------------------------------------------------------------- outer


def random_deltas(model: torch.nn.Module, seed: int, scale: float = 1e-2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) * scale for p in model.parameters()]


def test_outer_step_with_lr_one_and_no_momentum_is_exactly_theta_minus_delta() -> None:
    model = build_model("tiny", 257, 32)
    outer = OuterOptimizer(model, OuterConfig(lr=1.0, momentum=0.0, nesterov=False))
    before = [t.clone() for t in outer.params()]
    delta = random_deltas(model, 0)
    outer.step(delta)
    for theta, old, d in zip(outer.params(), before, delta, strict=True):
        assert torch.equal(theta, old - d)


def test_two_outer_optimizers_given_the_same_delta_stay_bit_identical() -> None:
    model = build_model("tiny", 257, 32)
    a, b = OuterOptimizer(model, OuterConfig()), OuterOptimizer(model, OuterConfig())
    assert a.theta_hash() == b.theta_hash()
    for seed in range(3):
        delta = random_deltas(model, seed)
        a.step(delta)
        b.step([d.clone() for d in delta])
        assert a.theta_hash() == b.theta_hash()
    b.step(random_deltas(model, 99))
    a.step(random_deltas(model, 98))
    assert a.theta_hash() != b.theta_hash()


def test_nesterov_step_matches_the_formula() -> None:
    model = build_model("tiny", 257, 32)
    lr, mu = 0.7, 0.9
    outer = OuterOptimizer(model, OuterConfig(lr=lr, momentum=mu, nesterov=True))
    theta = [t.clone() for t in outer.params()]
    buffers = [torch.zeros_like(t) for t in theta]
    for seed in range(2):
        delta = random_deltas(model, seed)
        outer.step(delta)
        for i, d in enumerate(delta):
            buffers[i] = mu * buffers[i] + d
            theta[i] = theta[i] - lr * (d + mu * buffers[i])
    for got, want in zip(outer.params(), theta, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("config", [OuterConfig(), OuterConfig(lr=1.0, momentum=0.0, nesterov=False),
                                    OuterConfig(lr=0.5, momentum=0.8, nesterov=False)],
                         ids=["nesterov", "sgd", "heavy-ball"])
def test_lookahead_is_the_step_bit_for_bit_and_changes_nothing(config: OuterConfig) -> None:
    """The overlap's start point (diloco.py, eager update) is θ after the step a peer would take with its own
    contribution: the optimizer's own arithmetic, at the first step and later ones, leaving θ and momentum alone."""
    model = build_model("tiny", 257, 32)
    outer, twin = OuterOptimizer(model, config), OuterOptimizer(model, config)
    for seed in range(3):
        delta = random_deltas(model, seed)
        state = {k: v.clone() for k, v in outer.state_dict().items()}
        ahead = outer.lookahead(delta)
        assert outer.state_dict().keys() == state.keys()
        assert all(torch.equal(v, state[k]) for k, v in outer.state_dict().items())  # nothing changed
        scaled = zip(outer.lookahead(delta, 0.5), outer.lookahead([0.5 * d for d in delta]), strict=True)
        assert all(torch.equal(a, b) for a, b in scaled)  # the overlap's shrunk stand-in, scaled per parameter
        twin.step(delta)
        assert all(torch.equal(a, b) for a, b in zip(ahead, twin.params(), strict=True))
        outer.step(delta)


def test_stand_in_scale_fits_the_last_average_on_the_own_contribution() -> None:
    """The overlap's stand-in is the own contribution shrunk by ⟨Δ̄, c⟩ / ⟨c, c⟩ of the last round, within [0, 1]."""
    model = build_model("tiny", 257, 32)
    own_parts = random_deltas(model, 7)
    own = torch.cat([t.reshape(-1) for t in own_parts])
    other = random_deltas(model, 8)
    assert stand_in_scale(own, [0.5 * t for t in own_parts]) == pytest.approx(0.5, rel=1e-5)
    # the part of the average that is not along the own contribution does not count
    along = torch.dot(torch.cat([x.reshape(-1) for x in other]), own) / own.dot(own)  # other's share along own
    mixed = [0.25 * t + o - along * t for t, o in zip(own_parts, other, strict=True)]
    assert stand_in_scale(own, mixed) == pytest.approx(0.25, abs=1e-4)
    assert stand_in_scale(own, [-t for t in own_parts]) == 0.0  # an average against it: none of it
    assert stand_in_scale(own, [3 * t for t in own_parts]) == 1.0  # never more than the whole contribution
    assert stand_in_scale(own, None) == stand_in_scale(None, own_parts) == 1.0  # nothing landed: the plain eager
    assert stand_in_scale(torch.zeros_like(own), own_parts) == 1.0


def test_pseudo_gradient_from_a_start_point_other_than_theta() -> None:
    model = build_model("tiny", 257, 32)
    outer = OuterOptimizer(model, OuterConfig())
    start = outer.lookahead(random_deltas(model, 1))
    load_into(model, start)
    assert all(d.abs().max() == 0 for d in outer.pseudo_gradient(model, start))
    assert any(d.abs().max() > 0 for d in outer.pseudo_gradient(model))


def test_pseudo_gradient_and_load_into_after_inner_training(corpus: TokenCorpus, assignment: DataAssignment) -> None:
    model = build_model("tiny", 257, SEQ_LEN)
    outer = OuterOptimizer(model, OuterConfig())
    assert all(d.abs().max() == 0 for d in outer.pseudo_gradient(model))
    InnerTrainer(model, fast_config(), "cpu").train(
        corpus.batches(assignment.assigned_windows("peer", 0, 3 * BATCH), BATCH), max_steps=3
    )
    delta = outer.pseudo_gradient(model)
    assert all(d.device.type == "cpu" and d.dtype == torch.float32 for d in delta)
    for d, theta, p in zip(delta, outer.params(), model.parameters(), strict=True):
        assert torch.equal(d, theta - p.detach())
    assert sum(float(d.norm()) for d in delta) > 0
    outer.step(delta)
    outer.load_into(model)
    assert all(torch.equal(p, theta) for p, theta in zip(model.parameters(), outer.params(), strict=True))


def test_outer_state_round_trip_continues_identically() -> None:
    model = build_model("tiny", 257, 32)
    a = OuterOptimizer(model, OuterConfig())
    a.step(random_deltas(model, 0))
    b = OuterOptimizer(build_model("tiny", 257, 32, init_seed=5), OuterConfig())
    b.load_state_dict(a.state_dict())
    assert a.theta_hash() == b.theta_hash()
    a.step(random_deltas(model, 1))
    b.step(random_deltas(model, 1))
    assert a.theta_hash() == b.theta_hash()  # momentum came along too


def test_bad_deltas_are_refused_and_leave_theta_unchanged() -> None:
    model = build_model("tiny", 257, 32)
    outer = OuterOptimizer(model, OuterConfig())
    before = outer.theta_hash()
    delta = random_deltas(model, 0)
    with pytest.raises(ValueError, match="tensors"):
        outer.step(delta[:-1])
    with pytest.raises(ValueError, match="shape"):
        outer.step([delta[0].T.contiguous() if i == 0 else d for i, d in enumerate(delta)])
    delta[3][0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        outer.step(delta)
    assert outer.theta_hash() == before
    with pytest.raises(ValueError, match="momentum"):
        OuterConfig(momentum=0.0, nesterov=True)


@pytest.mark.timeout(120)
def test_two_in_process_peers_do_one_diloco_round_and_agree(corpus: TokenCorpus, assignment: DataAssignment) -> None:
    """θ_0 → each peer trains on its own windows → Δ̄ (token-weighted) → outer step: same θ_1 on both."""
    peers = []
    for key in ("peer-a", "peer-b"):
        model = build_model("tiny", 257, SEQ_LEN, init_seed=0)
        peers.append((key, model, InnerTrainer(model, fast_config(), "cpu"), OuterOptimizer(model, OuterConfig())))
    heldout = list(corpus.batches(assignment.heldout_windows(0, 16), 8))
    start_loss = evaluate(peers[0][1], heldout, "cpu")
    deltas, weights = [], []
    for key, model, inner, outer in peers:
        stats = inner.train(corpus.batches(assignment.assigned_windows(key, 0, 15 * BATCH), BATCH), max_steps=15)
        deltas.append(outer.pseudo_gradient(model))
        weights.append(stats.tokens)
    assert any(not torch.equal(x, y) for x, y in zip(*deltas, strict=True))  # different data, different Δ
    total = sum(weights)
    averaged = [sum(w * d[i] for w, d in zip(weights, deltas, strict=True)) / total for i in range(len(deltas[0]))]
    for _, model, _, outer in peers:
        outer.step(averaged)
        outer.load_into(model)
    assert peers[0][3].theta_hash() == peers[1][3].theta_hash()
    assert evaluate(peers[0][1], heldout, "cpu") < start_loss - 0.5
