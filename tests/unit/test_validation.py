"""The validator's scoring parts without processes: integrity checks, copy/replay detection, loss gains, the score
book, and one whole round scored from real (tiny-model) pseudo-gradients of honest and cheating miners."""

from __future__ import annotations

import copy

import pytest
import torch

from template.training.data import DataAssignment, TokenCorpus, build_corpus, load_tokenizer
from template.training.inner import InnerConfig, InnerTrainer
from template.training.model import build_model
from template.training.outer import OuterConfig, OuterOptimizer
from template.validation.integrity import (
    IntegrityConfig,
    Sketch,
    Submission,
    check_norm,
    check_tensors,
    cosine,
    find_copies,
    find_replays,
    reference_norm,
    total_norm,
)
from template.validation.rewards import RewardConfig, RoundScore, ScoreBook
from template.validation.round import Candidate, RoundContext, RoundScorer
from template.validation.scoring import LossProbe, ScoringConfig, WindowSampler, loss_gains, update_losses

SHAPES = [torch.Size([4, 3]), torch.Size([5])]


def tensors(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(shape, generator=generator) for shape in SHAPES]


# --- integrity ---------------------------------------------------------------------------------------------------


def test_check_tensors_names_the_problem():
    assert check_tensors(tensors(0), SHAPES) is None
    assert "2 tensors" not in (check_tensors(tensors(0)[:1], SHAPES) or "") and check_tensors(tensors(0)[:1], SHAPES)
    wrong = [torch.zeros(3, 4), torch.zeros(5)]
    assert "shape (3, 4)" in check_tensors(wrong, SHAPES)
    nan = tensors(0)
    nan[1][2] = float("nan")
    assert "NaN" in check_tensors(nan, SHAPES)
    assert "not a float" in check_tensors([torch.zeros(4, 3, dtype=torch.int64), torch.zeros(5)], SHAPES)


def test_norm_bounds_use_the_lower_median_of_the_round():
    config = IntegrityConfig()
    assert reference_norm([0.0, 1.0, 1.2, 50.0]) == 1.2
    assert reference_norm([1.0, 2.0]) == 1.0  # lower median: one inflated Δ cannot lift the reference
    assert reference_norm([0.0]) is None
    assert check_norm(1.1, 1.0, config) is None
    assert "over 3x" in check_norm(10.0, 1.0, config)
    assert "empty update" in check_norm(0.0, 1.0, config)
    assert "empty update" in check_norm(1.0, None, config)
    assert total_norm([torch.tensor([3.0]), torch.tensor([4.0])]) == pytest.approx(5.0)


def test_sketch_cosine_tracks_the_full_vector():
    shapes = [torch.Size([300, 200]), torch.Size([1000])]
    sketch = Sketch(shapes, 4096, seed=7)
    a = [torch.randn(s) for s in shapes]
    noisy = [t + 1e-3 * t.std() * torch.randn(t.shape) for t in a]
    other = [torch.randn(s) for s in shapes]
    assert sketch.size == 4096 and sketch.of(a).shape == (4096,)
    assert cosine(sketch.of(a), sketch.of(noisy)) > 0.999
    assert abs(cosine(sketch.of(a), sketch.of(other))) < 0.1
    assert torch.equal(Sketch(shapes, 4096, seed=7).of(a), sketch.of(a))  # the same seed picks the same coordinates


def test_find_copies_trusts_a_decisive_paired_test_then_the_earlier_signature():
    v = torch.randn(64)
    original = Submission("orig", v, published_at_block=100)
    early_copy = Submission("early", v + 1e-4 * torch.randn(64), published_at_block=99)
    trained_by = {"orig": 1.0, "early": -1.0, "late": -1.0, "same": -1.0, "twin": 1.0}

    def paired(strength: float):
        return lambda a, b: strength * (trained_by[a.hotkey] - trained_by[b.hotkey]) / 2

    # a leaked copy signed a block earlier than its victim: a decisive paired test still names the copier
    assert find_copies([early_copy, original], 0.995, paired(3.0)) == {"early": "orig"}
    # an indecisive one leaves it to the block
    later = Submission("late", v + 1e-4 * torch.randn(64), published_at_block=103)
    assert find_copies([later, original], 0.995, paired(0.5)) == {"late": "orig"}
    assert find_copies([early_copy, original], 0.995, paired(0.5)) == {"orig": "early"}
    same_block = Submission("same", v.clone(), published_at_block=100)
    assert find_copies([original, same_block], 0.995, paired(0.5)) == {"same": "orig"}  # then its sign
    twin = Submission("twin", v.clone(), published_at_block=100)
    assert find_copies([original, twin], 0.995, paired(1.0)) == {"orig": "twin", "twin": "orig"}
    unrelated = Submission("other", torch.randn(64), published_at_block=90)
    assert find_copies([original, unrelated], 0.995, paired(3.0)) == {}
    # a twin that announced no tokens declared it trained nothing: it is the copy, whatever the rest says
    idle = Submission("idle", v.clone(), published_at_block=90, announced_tokens=False)
    assert find_copies([idle, original], 0.995, paired(-3.0)) == {"idle": "orig"}
    assert find_replays(v, [("x of round 3", torch.randn(64)), ("y of round 2", v)], 0.995) == "y of round 2"
    assert find_replays(v, [("x", torch.randn(64))], 0.995) is None


# --- the score book ----------------------------------------------------------------------------------------------


def test_score_book_smooths_relative_scores_and_sharpens_weights():
    book = ScoreBook(RewardConfig(ema_alpha=0.5, power=2.0))  # power 2 for round numbers
    book.update(0, {"a": 2.0, "b": 1.0, "c": 0.0})
    assert book.miners["a"].ema == pytest.approx(0.5) and book.miners["b"].ema == pytest.approx(0.25)
    weights = book.weights({"a": 1, "b": 2, "c": 3})
    assert set(weights) == {1, 2} and sum(weights.values()) == pytest.approx(1.0)
    assert weights[1] == pytest.approx(0.8)  # 0.5² / (0.5² + 0.25²)
    # a cheater's lucky round fades: three zero rounds later it holds < 1 % against an honest miner
    book = ScoreBook(RewardConfig())
    book.update(0, {"honest": 1.0, "cheater": 1.0})
    for r in (1, 2, 3):
        book.update(r, {"honest": 1.0, "cheater": 0.0})
    assert book.weights({"honest": 0, "cheater": 1})[1] < 0.01


def test_score_book_floor_stops_a_hair_from_taking_full_credit():
    book = ScoreBook(RewardConfig())
    book.update(0, {"honest": 2.0, "noise": 0.0})
    book.update(1, {"noise": 0.004})  # the honest miner was not scored this round
    assert book.miners["noise"].ema < 0.02
    assert book.miners["honest"].ema == pytest.approx(0.5)


def test_score_book_rotation_persistence_and_forgetting(tmp_path):
    book = ScoreBook(RewardConfig())
    book.update(3, {"a": 1.0, "b": 0.5})
    assert book.choose(["a", "b", "c", "d"], round=4, limit=2)[:2] == sorted(["c", "d"], key=lambda h: book.choose(
        ["c", "d"], round=4, limit=0).index(h))  # never-scored miners first
    assert set(book.choose(["a", "b", "c"], round=4, limit=0)) == {"a", "b", "c"}
    book.last_weights_block = 77
    path = tmp_path / "scores.json"
    book.save(path)
    loaded = ScoreBook.load(path, RewardConfig())
    assert loaded.miners == book.miners and loaded.last_weights_block == 77 and loaded.typical_best == 1.0
    loaded.forget_except(["a"])
    assert set(loaded.miners) == {"a"}
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the score file"):
        ScoreBook.load(path, RewardConfig())
    assert ScoreBook.load(tmp_path / "missing.json", RewardConfig()).miners == {}
    with pytest.raises(ValueError):
        book.update(5, {"a": -1.0})


def test_credit_gates_quality_by_evidence_accumulated_over_rounds():
    ungated = ScoreBook(RewardConfig())  # the default: the evidence is accumulated and reported, quality is paid
    assert ungated.credit(0, {"copier": RoundScore(5.0, (0.0, 0.002))})["copier"] == 5.0
    assert ungated.miners["copier"].z == 0.0
    book = ScoreBook(RewardConfig(evidence_decay=0.5, evidence_gate=True, gate_start=1.0, gate_width=2.0))
    steady = RoundScore(1.0, (0.02, 0.01))  # z = 2 in one round
    assert book.credit(0, {"honest": steady})["honest"] == pytest.approx(0.5)  # gate((2 - 1) / 2)
    # evidence adds up (Stouffer, decayed): S = 0.5·2 + 2, Q = 0.25 + 1 → z = 2·1.5/√1.25 = 2.68
    assert book.credit(1, {"honest": steady})["honest"] == pytest.approx((2 * 1.5 / 1.25 ** 0.5 - 1) / 2)
    for r in (2, 3):
        credit = book.credit(r, {"honest": steady})["honest"]
    assert credit == 1.0
    # a copy has no evidence: z stays ~0 and it earns nothing, however large its quality
    for r in range(4):
        assert book.credit(r, {"copier": RoundScore(5.0, (0.0, 0.002))})["copier"] == 0.0
    # each round counts as one standardized observation: a very precise round of no evidence yet, or a large but
    # noisy one, does not bury the good rounds that follow
    for first in ((-0.0008, 0.002), (-0.14, 0.1)):
        late = ScoreBook(RewardConfig(evidence_decay=0.5, evidence_gate=True, gate_start=1.0, gate_width=2.0))
        late.credit(0, {"late": RoundScore(1.0, first)})
        credits = [late.credit(r, {"late": steady})["late"] for r in (1, 2, 3)]
        assert credits[-1] > 0.7, (first, credits)
    # a failed check clears the evidence: the next good round starts over
    book.credit(4, {"honest": RoundScore(0.0, None, "copy of x's Δ")})
    assert book.miners["honest"].z == 0.0 and book.miners["honest"].last_reason == "copy of x's Δ"
    assert book.credit(5, {"honest": steady})["honest"] == pytest.approx(0.5)


def test_a_book_of_the_previous_format_loads_without_evidence(tmp_path):
    path = tmp_path / "scores.json"
    path.write_text('{"version": 1, "config": {}, "last_round": 3, "last_weights_block": 9, "typical_best": 0.5, '
                    '"miners": {"a": {"ema": 0.4, "last_round": 3, "last_score": 1.0, "last_reason": "", '
                    '"rounds_scored": 2}}}')
    book = ScoreBook.load(path, RewardConfig())
    assert book.miners["a"].ema == 0.4 and book.miners["a"].z == 0.0 and book.last_round == 3
    book.save(path)
    assert ScoreBook.load(path, RewardConfig()).miners == book.miners


# --- one round, scored from real pseudo-gradients ------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_round():
    """θ_r of a tiny model after a warm-up, and the Δs of two honest miners that trained 15 steps each on their own
    assigned windows of tiny Shakespeare-like text (the built-in corpus, truncated for speed)."""
    torch.manual_seed(0)
    seq, batch, steps = 32, 8, 15
    tokenizer = load_tokenizer("bytes")
    corpus: TokenCorpus = build_corpus("builtin", tokenizer, seq, max_tokens=200_000)
    assignment = DataAssignment(corpus.fingerprint, corpus.num_windows, run_seed=0)
    model = build_model("tiny", tokenizer.vocab_size, seq, init_seed=0)
    outer = OuterOptimizer(model, OuterConfig())
    deltas = {}
    for hotkey in ("honest-a", "honest-b"):
        local = copy.deepcopy(model)
        trainer = InnerTrainer(local, InnerConfig(lr=3e-3, warmup_steps=1), "cpu")
        trainer.train(corpus.batches(assignment.assigned_windows(hotkey, 0, steps * batch), batch), steps)
        deltas[hotkey] = outer.pseudo_gradient(local)
    theta = [t.clone() for t in outer.params()]
    averaged = [(a + b) / 2 for a, b in zip(deltas["honest-a"], deltas["honest-b"], strict=True)]
    probe = LossProbe(model, corpus, batch, "cpu")
    sampler = WindowSampler(assignment, steps * batch, seed=123)
    return theta, deltas, averaged, probe, sampler


def test_loss_measures_reward_a_real_update_punish_noise_and_see_no_evidence_in_a_copy(trained_round):
    theta, deltas, averaged, probe, sampler = trained_round
    config = ScoringConfig()
    assigned, every_assigned = sampler.assigned("honest-a", 0, 16)
    unassigned = [w for w in sampler.unassigned(0, 16) if w not in every_assigned][:16]
    windows = [*assigned, *unassigned]
    baseline = update_losses(probe, theta, None, windows, 1.0)
    reference = update_losses(probe, theta, deltas["honest-b"], windows, 1.0)  # another miner's update

    def measure(delta):
        return loss_gains(update_losses(probe, theta, delta, windows, 1.0), reference, baseline, assigned, unassigned,
                          config)

    honest = measure(deltas["honest-a"])
    noisy = measure([torch.randn_like(t) * t.norm() / t.numel() ** 0.5 for t in deltas["honest-a"]])
    copy_of_reference = measure(deltas["honest-b"])
    assert honest.general > 0.1 and noisy.general < 0.05 * honest.general
    assert copy_of_reference.evidence == 0.0 and copy_of_reference.z == 0.0  # floor: no significance from nothing
    assert honest.evidence_se >= config.evidence_floor and copy_of_reference.evidence_se == config.evidence_floor


def test_a_round_scores_honest_miners_and_refuses_each_cheater_with_a_reason(trained_round):
    theta, deltas, averaged, probe, sampler = trained_round
    shapes = [t.shape for t in theta]
    scorer = RoundScorer(probe, sampler, shapes, integrity=IntegrityConfig(), scoring=ScoringConfig(),
                         sketch_seed=5)
    h = "a" * 64

    def candidate(hotkey, uid, tensors, block=105, **kwargs):
        return Candidate(hotkey, uid, tensors, h, block, **kwargs)

    a, b = deltas["honest-a"], deltas["honest-b"]
    nan = [t.clone() for t in a]
    nan[0][0] = float("inf")
    candidates = [
        candidate("honest-a", 1, a, coverage=1.0, share_of_average=0.5),
        candidate("honest-b", 2, b, coverage=1.0, share_of_average=0.5),
        candidate("freerider", 3, [torch.zeros_like(t) for t in a], coverage=0.0),
        candidate("scaled", 4, [10 * t for t in b], coverage=1.0, share_of_average=0.0),
        candidate("copy-exact", 5, [t.clone() for t in a], block=107, coverage=0.0),
        candidate("copy-noisy", 6, [t + 1e-3 * t.std() * torch.randn(t.shape) for t in b], block=108),
        candidate("copycat-average", 7, [t + 1e-3 * t.std() * torch.randn(t.shape) for t in averaged]),
        candidate("nan", 8, nan),
        Candidate("unreachable", 9, None, fetch_error="FetchTimeoutError: took longer than 20s"),
        Candidate("wrong-base", 10, a, "b" * 64, 105),
        candidate("backdated", 11, b, block=42),
        Candidate("twofaced", 13, None, refused="it published other bytes than it contributed to the all-reduce"),
    ]
    context = RoundContext(0, theta, h, averaged, first_block=100, last_block=110)
    verdicts = {v.hotkey: v for v in scorer.score(context, candidates)}
    assert verdicts["honest-a"].quality > 0 and verdicts["honest-b"].quality > 0, verdicts
    assert verdicts["honest-a"].reason == verdicts["honest-b"].reason == ""
    expected = {
        "freerider": "empty update", "scaled": "over 3x", "copy-exact": "copy of honest-a",
        "copy-noisy": "copy of honest-b", "copycat-average": "average", "nan": "NaN or inf",
        "unreachable": "not fetched", "wrong-base": "trained from θ", "backdated": "outside the round's window",
    }
    assert verdicts["twofaced"].reason == "it published other bytes than it contributed to the all-reduce"
    assert verdicts["twofaced"].quality == 0.0 and verdicts["twofaced"].round_score().evidence is None
    for hotkey, fragment in expected.items():
        assert verdicts[hotkey].quality == 0.0 and fragment in verdicts[hotkey].reason, verdicts[hotkey]
        assert verdicts[hotkey].round_score().evidence is None

    # next round: re-publishing round 0's Δ (own or anyone's) is a replay
    replay = scorer.score(RoundContext(1, theta, h, None, 100, 200), [candidate("stale", 12, a, block=150)])[0]
    assert replay.quality == 0.0 and "replays the Δ of honest-a of round 0" in replay.reason


def test_quality_counts_only_what_reached_the_average_and_time_limits_are_reported(trained_round, tmp_path):
    theta, deltas, averaged, probe, sampler = trained_round
    scorer = RoundScorer(probe, sampler, [t.shape for t in theta], integrity=IntegrityConfig(),
                         scoring=ScoringConfig(), sketch_seed=5)
    h = "c" * 64
    both = [Candidate("present", 1, deltas["honest-a"], h, 5, coverage=1.0),
            Candidate("absent", 2, deltas["honest-a"], h, 5, coverage=0.0)]
    context = RoundContext(0, theta, h, None, 0, 10)
    # identical Δs signed at the same block: the one whose assigned data it helps less is the copier
    reasons = sorted(v.reason for v in scorer.score(context, both))
    assert reasons[0] == "" and reasons[1] in ("copy of present's Δ", "copy of absent's Δ"), reasons
    scorer.history.clear()
    present = scorer.score(context, [Candidate("m", 1, deltas["honest-b"], h, 5, coverage=1.0)])[0]
    scorer.history.clear()
    half = scorer.score(context, [Candidate("m", 1, deltas["honest-b"], h, 5, coverage=0.5)])[0]
    scorer.history.clear()
    absent = scorer.score(context, [Candidate("m", 1, deltas["honest-b"], h, 5, coverage=0.0)])[0]
    scorer.history.clear()
    unknown = scorer.score(context, [Candidate("m", 1, deltas["honest-b"], h, 5, coverage=None)])[0]
    assert present.quality > 0 and unknown.quality == pytest.approx(present.quality, rel=1e-6)
    assert half.quality == pytest.approx(0.5 * present.quality, rel=1e-6) and absent.quality == 0.0
    late = scorer.score(RoundContext(1, theta, h, None, 0, 10),
                        [Candidate("late", 4, averaged, h, 5)], out_of_time=lambda: True)
    assert late[0].reason == "not evaluated in time" and late[0].quality == 0.0
    path = tmp_path / "sketches.safetensors"
    scorer.save_history(path)
    restored = RoundScorer(probe, sampler, [t.shape for t in theta], integrity=IntegrityConfig(),
                           scoring=ScoringConfig(), sketch_seed=5)
    restored.load_history(path)
    assert set(restored.history) == set(scorer.history) and restored.history
