"""Yuma Consensus epoch of the mock chain, checked against small cases computed by hand.

Each hand case writes its arithmetic in comments: normalized active stake S, row-normalized weights W,
consensus C (stake-weighted median at kappa = 0.5), clipped weights, ranks, bonds, dividends, emission.
"""

from __future__ import annotations

import numpy as np
import pytest

from template.chain.yuma import YumaParams, YumaResult, yuma_epoch

E = 1_000_000_000  # rao per epoch in most cases


def run(stake, weights, permit, bonds=None, emission=E, params=None, active=None) -> YumaResult:
    n = len(stake)
    return yuma_epoch(
        np.asarray(stake, dtype=np.float64),
        np.asarray(weights, dtype=np.float64).reshape(n, n),
        np.asarray(permit, dtype=bool),
        np.zeros((n, n)) if bonds is None else bonds,
        emission,
        params or YumaParams(),
        None if active is None else np.asarray(active, dtype=bool),
    )


def assert_well_formed(result: YumaResult, n: int) -> None:
    for name in ("ranks", "trust", "consensus", "incentive", "dividends", "validator_trust"):
        vector = getattr(result, name)
        assert vector.dtype == np.float64 and vector.shape == (n,), name
        assert np.all(np.isfinite(vector)) and np.all((vector >= 0) & (vector <= 1)), name
    assert result.emission.dtype == np.int64 and result.emission.shape == (n,)
    assert np.all(result.emission >= 0)
    assert result.bonds.dtype == np.float64 and result.bonds.shape == (n, n)
    assert np.all(np.isfinite(result.bonds))


def test_one_validator_two_miners():
    # uid0 validator (stake 100), uids 1, 2 miners; uid0 sets raw weights 3 and 1 → W0 = [0, .75, .25].
    # S = [1, 0, 0]; the only voter sets consensus C = [0, .75, .25]; nothing is clipped.
    # ranks = S·W = [0, .75, .25] (sum 1) → incentive [0, .75, .25]; trust = ranks/preranks = [0, 1, 1];
    # validator trust = Σ clipped row 0 = 1.
    # ΔB = W̄∘S column-normalized: row 0 = [0, 1, 1]; B_old = 0 → EMA .1·ΔB → normalized [0, 1, 1].
    # dividends: D0 = 1·.75 + 1·.25 = 1 → [1, 0, 0].
    # emission: miners 500_000_000 → 375_000_000 / 125_000_000; validator 500_000_000.
    r = run([100, 0, 0], [[0, 3, 1], [0, 0, 0], [0, 0, 0]], [True, False, False])
    assert_well_formed(r, 3)
    np.testing.assert_allclose(r.consensus, [0, 0.75, 0.25])
    np.testing.assert_allclose(r.incentive, [0, 0.75, 0.25])
    np.testing.assert_allclose(r.ranks, r.incentive)
    np.testing.assert_allclose(r.trust, [0, 1, 1])
    np.testing.assert_allclose(r.validator_trust, [1, 0, 0])
    np.testing.assert_allclose(r.dividends, [1, 0, 0])
    np.testing.assert_allclose(r.bonds, [[0, 1, 1], [0, 0, 0], [0, 0, 0]])
    assert r.emission.tolist() == [500_000_000, 375_000_000, 125_000_000]
    assert int(r.emission.sum()) == E


def test_miner_share_changes_the_split():
    # Same case with miner_share = .25: miners 250_000_000 → .75/.25 = 187_500_000 / 62_500_000,
    # validator 750_000_000.
    r = run([100, 0, 0], [[0, 3, 1], [0, 0, 0], [0, 0, 0]], [True, False, False], params=YumaParams(miner_share=0.25))
    assert r.emission.tolist() == [750_000_000, 187_500_000, 62_500_000]


def test_minority_outlier_weight_is_clipped_to_consensus():
    # Validators uid0 (stake 3) and uid1 (stake 1), miners uid2, uid3. S = [.75, .25, 0, 0].
    # W0 = [0, 0, .6, .4]; W1 = [0, 0, .2, .8] (uid1 over-weights uid3).
    # Consensus at kappa .5: col2 sorted high→low: .6 (cum stake .75 ≥ .5) → C2 = .6;
    #                        col3: .8 (cum .25), .4 (cum 1.0 ≥ .5) → C3 = .4.
    # Clipped: W̄0 = [.6, .4], W̄1 = [.2, .4] (.8 → .4). Validator trust: [1.0, .6].
    # Preranks: P2 = .75·.6 + .25·.2 = .5; P3 = .75·.4 + .25·.8 = .5.
    # Ranks: R2 = .5; R3 = .75·.4 + .25·.4 = .4 → trust [1, .8]; incentive [.5/.9, .4/.9] = [5/9, 4/9].
    # ΔB col2: [.45, .05] → [.9, .1]; col3: [.3, .1] → [.75, .25]; first epoch B = ΔB.
    # Dividends: D0 = .9·5/9 + .75·4/9 = 1/2 + 1/3 = 5/6; D1 = .1·5/9 + .25·4/9 = 1/18 + 2/18 = 1/6.
    # Emission 1_000_000: miners 500_000·5/9 = 277_777.8 and 222_222.2 → floors 277_777 + 222_222,
    # one rao left → larger remainder (uid2) → 277_778 / 222_222.
    # Validators 500_000·5/6 = 416_666.7 and 83_333.3 → 416_666 + 83_333, one left → uid0 → 416_667 / 83_333.
    weights = np.zeros((4, 4))
    weights[0, 2:] = [0.6, 0.4]
    weights[1, 2:] = [0.2, 0.8]
    r = run([3, 1, 0, 0], weights, [True, True, False, False], emission=1_000_000)
    assert_well_formed(r, 4)
    np.testing.assert_allclose(r.consensus, [0, 0, 0.6, 0.4])
    np.testing.assert_allclose(r.validator_trust, [1.0, 0.6, 0, 0])
    np.testing.assert_allclose(r.trust, [0, 0, 1.0, 0.8])
    np.testing.assert_allclose(r.incentive, [0, 0, 5 / 9, 4 / 9])
    np.testing.assert_allclose(r.bonds[:2, 2:], [[0.9, 0.75], [0.1, 0.25]])
    np.testing.assert_allclose(r.dividends, [5 / 6, 1 / 6, 0, 0])
    assert r.emission.tolist() == [416_667, 83_333, 277_778, 222_222]


def test_disagreeing_minority_validator_earns_nothing():
    # uid0 (stake 3) weights only uid2; uid1 (stake 1) weights only uid3. S = [.75, .25].
    # C2: 1 (cum .75 ≥ .5) → 1. C3: 1 (cum .25), 0 (cum 1) → 0: uid1's weight on uid3 is clipped to 0.
    # Incentive [0, 0, 1, 0]; validator trust [1, 0]; ΔB col2 = [1, 0] → dividends [1, 0].
    # Emission 1000: uid2 gets the 500 miner rao, uid0 the 500 validator rao, uid1 and uid3 nothing.
    weights = np.zeros((4, 4))
    weights[0, 2] = 1.0
    weights[1, 3] = 1.0
    r = run([3, 1, 0, 0], weights, [True, True, False, False], emission=1000)
    np.testing.assert_allclose(r.consensus, [0, 0, 1, 0])
    np.testing.assert_allclose(r.validator_trust, [1, 0, 0, 0])
    np.testing.assert_allclose(r.trust, [0, 0, 1, 0])
    np.testing.assert_allclose(r.incentive, [0, 0, 1, 0])
    np.testing.assert_allclose(r.dividends, [1, 0, 0, 0])
    assert r.emission.tolist() == [500, 0, 500, 0]


def test_bonds_ema_over_epochs():
    # Validators uid0 (stake 3), uid1 (stake 1), miners uid2, uid3; a = 1 − .9 = .1.
    # Epoch 1: both weight only uid2. C2 = 1; ΔB col2 = [.75, .25]; B_old = 0 → B col2 = [.75, .25].
    #          Incentive uid2 = 1 → dividends [.75, .25]; emission 1000: 500 → uid2, 375 / 125.
    # Epoch 2: uid1 moves to uid3. C2 = 1 (uid0 holds .75), C3 = 0 → uid1's row is clipped to zero.
    #          ΔB col2 = [1, 0]; B col2 = .1·[1, 0] + .9·[.75, .25] = [.775, .225] (sums to 1).
    #          Dividends [.775, .225]; validators' 500 rao: 387.5 / 112.5 → floors 387 + 112, the one rao
    #          left ties on remainder .5 → lower uid → 388 / 112.
    # Epoch 3: same weights. B col2 = .1·[1, 0] + .9·[.775, .225] = [.7975, .2025].
    both_on_2 = np.zeros((4, 4))
    both_on_2[0, 2] = both_on_2[1, 2] = 1.0
    split = np.zeros((4, 4))
    split[0, 2] = split[1, 3] = 1.0
    stake, permit = [3, 1, 0, 0], [True, True, False, False]

    first = run(stake, both_on_2, permit, emission=1000)
    np.testing.assert_allclose(first.bonds[:, 2], [0.75, 0.25, 0, 0])
    np.testing.assert_allclose(first.dividends, [0.75, 0.25, 0, 0])
    assert first.emission.tolist() == [375, 125, 500, 0]

    second = run(stake, split, permit, bonds=first.bonds, emission=1000)
    np.testing.assert_allclose(second.bonds[:, 2], [0.775, 0.225, 0, 0])
    np.testing.assert_allclose(second.bonds[:, 3], 0.0)
    np.testing.assert_allclose(second.dividends, [0.775, 0.225, 0, 0])
    assert second.emission.tolist() == [388, 112, 500, 0]

    third = run(stake, split, permit, bonds=second.bonds, emission=1000)
    np.testing.assert_allclose(third.bonds[:, 2], [0.7975, 0.2025, 0, 0])


def test_bonds_in_any_column_scale_give_the_same_epoch():
    # The chain stores bonds column max-upscaled; the epoch column-normalizes them first, so scaling a
    # column of the previous bonds changes nothing.
    weights = np.zeros((4, 4))
    weights[0, 2:] = [0.6, 0.4]
    weights[1, 2:] = [0.2, 0.8]
    first = run([3, 1, 0, 0], weights, [True, True, False, False])
    upscaled = first.bonds / first.bonds.max(axis=0, keepdims=True).clip(min=1e-300)
    from_normalized = run([3, 1, 0, 0], weights, [True, True, False, False], bonds=first.bonds)
    from_upscaled = run([3, 1, 0, 0], weights, [True, True, False, False], bonds=upscaled)
    np.testing.assert_allclose(from_upscaled.bonds, from_normalized.bonds)
    np.testing.assert_allclose(from_upscaled.dividends, from_normalized.dividends)


def test_miner_no_one_weights_gets_nothing():
    # uid0 validator weights uid1 and uid2 equally; uid3 gets no weight.
    # Incentive [0, .5, .5, 0]; consensus, trust and emission of uid3 are 0.
    # Emission 1001: miners get floor(1001·.5) = 500 → 250 / 250; the validator gets 501.
    r = run([1, 0, 0, 0], [[0, 1, 1, 0]] + [[0, 0, 0, 0]] * 3, [True, False, False, False], emission=1001)
    np.testing.assert_allclose(r.incentive, [0, 0.5, 0.5, 0])
    assert r.consensus[3] == 0 and r.trust[3] == 0 and r.incentive[3] == 0
    assert r.emission.tolist() == [501, 250, 250, 0]


def test_validator_without_permit_is_ignored():
    # uid0 (permit, stake 1) weights uid2; uid1 (no permit, stake 1000) weights uid3.
    # uid1's row is dropped and its stake does not count: S = [1, 0, 0, 0].
    # Incentive [0, 0, 1, 0]; uid1 has no validator trust, no bonds, no dividends, no emission.
    weights = np.zeros((4, 4))
    weights[0, 2] = 1.0
    weights[1, 3] = 1.0
    r = run([1, 1000, 0, 0], weights, [True, False, False, False], emission=1000)
    np.testing.assert_allclose(r.incentive, [0, 0, 1, 0])
    np.testing.assert_allclose(r.validator_trust, [1, 0, 0, 0])
    np.testing.assert_allclose(r.dividends, [1, 0, 0, 0])
    assert not r.bonds[1].any()
    assert r.emission.tolist() == [500, 0, 500, 0]


def test_bonds_of_a_uid_without_permit_are_cleared():
    # uid1 held bonds (previous epoch) but has no permit now: the chain clears its bond row.
    old = np.zeros((3, 3))
    old[0, 2] = old[1, 2] = 0.5
    r = run([1, 1, 0], [[0, 0, 1], [0, 0, 1], [0, 0, 0]], [True, False, False], bonds=old)
    np.testing.assert_allclose(r.bonds[:, 2], [1, 0, 0])
    np.testing.assert_allclose(r.dividends, [1, 0, 0])


def test_self_weight_is_masked():
    # uid0 sets raw [1, 1] (itself and uid1); the diagonal is masked → W0 = [0, 1].
    # Incentive [0, 1]: the validator cannot pay itself incentive; it earns dividends instead.
    r = run([1, 0], [[1, 1], [0, 0]], [True, False], emission=10)
    np.testing.assert_allclose(r.incentive, [0, 1])
    np.testing.assert_allclose(r.dividends, [1, 0])
    assert r.emission.tolist() == [5, 5]


def test_inactive_stake_is_not_counted():
    # Same disagreement as above (uid0 stake 3 → uid2, uid1 stake 1 → uid3), but uid0 is inactive:
    # S = [0, 1]. uid1 alone sets consensus: C3 = 1, C2 = 0 → incentive [0, 0, 0, 1], dividends [0, 1].
    weights = np.zeros((4, 4))
    weights[0, 2] = 1.0
    weights[1, 3] = 1.0
    r = run([3, 1, 0, 0], weights, [True, True, False, False], emission=1000, active=[False, True, True, True])
    np.testing.assert_allclose(r.incentive, [0, 0, 0, 1])
    np.testing.assert_allclose(r.dividends, [0, 1, 0, 0])
    assert r.emission.tolist() == [0, 500, 0, 500]


def test_no_weights_pays_validators_by_active_stake():
    # Nobody set weights: incentive and dividends are 0, so the chain pays the whole emission to
    # validators in proportion to active stake: S = [.75, .25] → 750 / 250; miners get nothing.
    r = run([3, 1, 5], np.zeros((3, 3)), [True, True, False], emission=1000)
    assert_well_formed(r, 3)
    assert not r.incentive.any() and not r.dividends.any() and not r.bonds.any()
    assert r.emission.tolist() == [750, 250, 0]


def test_no_validators_pays_by_stake():
    # No permits → no active stake → the chain falls back to everyone's normalized stake [.25, .25, .5].
    r = run([1, 1, 2], [[0, 1, 0], [1, 0, 0], [0, 0, 0]], [False, False, False], emission=1000)
    assert_well_formed(r, 3)
    assert not r.incentive.any() and not r.consensus.any()
    assert r.emission.tolist() == [250, 250, 500]


def test_no_stake_pays_nothing():
    # Nobody to pay in proportion to anything: every uid gets 0 (documented exception to the exact sum).
    r = run([0, 0], [[0, 1], [0, 0]], [True, False], emission=1000)
    assert_well_formed(r, 2)
    assert r.emission.tolist() == [0, 0]


def test_single_uid_gets_everything():
    # n = 1: its only weight is a self-weight, masked → no incentive → fallback by stake → all to uid0.
    r = run([5], [[1]], [True], emission=123)
    assert_well_formed(r, 1)
    assert r.emission.tolist() == [123]


def test_empty_subnet():
    r = yuma_epoch(np.zeros(0), np.zeros((0, 0)), np.zeros(0, dtype=bool), np.zeros((0, 0)), 1000)
    assert_well_formed(r, 0)
    assert r.emission.sum() == 0


def test_inputs_are_not_modified():
    stake = np.array([3.0, 1.0, 0.0])
    weights = np.array([[1.0, 0.0, 2.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    bonds = np.array([[0.0, 0.0, 1.0], [0.0, 0.0, 0.5], [0.3, 0.0, 0.0]])
    permit = np.array([True, True, False])
    copies = [a.copy() for a in (stake, weights, bonds, permit)]
    yuma_epoch(stake, weights, permit, bonds, 1000)
    for original, copy in zip((stake, weights, bonds, permit), copies, strict=True):
        np.testing.assert_array_equal(original, copy)


@pytest.mark.parametrize("seed", range(40))
def test_random_subnets_keep_the_invariants(seed):
    # Random sizes, sparse weights, odd emissions (up to the int64 limit): exact sums, values in [0, 1],
    # bond columns summing to 1 or 0, and no payment to a uid with neither incentive nor dividends.
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    stake = rng.exponential(1000, n) * (rng.random(n) < 0.8)
    weights = rng.random((n, n)) * (rng.random((n, n)) < 0.5)
    permit = rng.random(n) < 0.5
    active = rng.random(n) < 0.9
    emission = int(rng.integers(0, 2**63 - 1)) if seed % 4 == 0 else int(rng.integers(0, 10_000))
    bonds = np.zeros((n, n))
    for _ in range(2):
        r = yuma_epoch(stake, weights, permit, bonds, emission, YumaParams(), active)
        assert_well_formed(r, n)
        bonds = r.bonds
        column_sums = bonds.sum(axis=0)
        assert np.all(np.isclose(column_sums, 1.0) | (column_sums == 0))
        assert not bonds[~permit].any()
        if stake.any():
            assert int(r.emission.sum()) == emission
        if r.incentive.any():
            assert not r.emission[(r.incentive == 0) & (r.dividends == 0)].any()


@pytest.mark.parametrize("kappa", [0.0, 0.3, 0.5, 0.7, 1.0])
def test_consensus_matches_its_definition(kappa):
    # Brute force over the definition: C_j is the largest weight x given to j such that validators giving
    # j at least x hold at least kappa of the active stake (up to float rounding of the stake sums).
    rng = np.random.default_rng(int(kappa * 10))
    for _ in range(30):
        n = 6
        stake = rng.integers(0, 4, n).astype(np.float64)
        permit = np.arange(n) < 4
        weights = rng.integers(0, 3, (n, n)).astype(np.float64)
        np.fill_diagonal(weights, 0.0)
        r = yuma_epoch(stake, weights, permit, np.zeros((n, n)), 0, YumaParams(kappa=kappa))
        voter_stake = np.where(permit, stake, 0.0)
        if voter_stake.sum() == 0:
            assert not r.consensus.any()
            continue
        voter_stake /= voter_stake.sum()
        rows = weights.sum(axis=1, keepdims=True)
        w = np.divide(weights, rows, out=np.zeros_like(weights), where=rows > 0)
        for j in range(n):
            voters = voter_stake > 0
            candidates = [x for x in w[voters, j] if voter_stake[w[:, j] >= x].sum() >= kappa - 1e-12]
            assert r.consensus[j] == pytest.approx(max(candidates))


@pytest.mark.parametrize(
    "call",
    [
        lambda: yuma_epoch(np.ones(2), np.ones((2, 3)), np.ones(2, bool), np.zeros((2, 2)), 1),
        lambda: yuma_epoch(np.ones(2), np.ones((2, 2)), np.ones(3, bool), np.zeros((2, 2)), 1),
        lambda: yuma_epoch(np.array([1.0, -1.0]), np.ones((2, 2)), np.ones(2, bool), np.zeros((2, 2)), 1),
        lambda: yuma_epoch(np.ones(2), np.array([[0, np.nan], [0, 0]]), np.ones(2, bool), np.zeros((2, 2)), 1),
        lambda: yuma_epoch(np.ones(2), np.ones((2, 2)), np.ones(2, bool), np.zeros((2, 2)), -1),
        lambda: YumaParams(kappa=1.5),
    ],
)
def test_bad_inputs_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_fractional_emission_raises_type_error():
    with pytest.raises(TypeError):
        yuma_epoch(np.ones(2), np.ones((2, 2)), np.ones(2, bool), np.zeros((2, 2)), 1.5)
