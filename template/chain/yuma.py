"""Yuma Consensus epoch for the in-memory mock chain: weights → incentive, dividends, emission.

The mock chain calls :func:`yuma_epoch` every ``tempo`` blocks so that a test can watch validator
weights turn into miner incentive, validator dividends and rao emission the way a real subnet does.

Chain rules followed (subtensor ``pallets/subtensor/src/epoch/run_epoch.rs``, the original Yuma with a
bonds EMA, i.e. ``Yuma3On = false``, liquid alpha off, ``bonds_penalty = 1`` which is the chain default):

1. Active stake: stake normalized, stake of inactive uids and of uids without a validator permit set to
   zero, normalized again (``S``).
2. Weights: rows of uids without a permit are dropped, the diagonal (self-weights) is masked, each row is
   normalized to sum 1 (an all-zero row stays zero) (``W``).
3. Preranks ``P_j = Σ_i S_i W_ij``.
4. Consensus ``C_j`` = stake-weighted median of column j at ``kappa``: the largest weight that validators
   holding at least ``kappa`` of the active stake gave to j or more (validators with zero active stake
   take no part). Weights are clipped: ``W̄_ij = min(W_ij, C_j)``.
5. Validator trust ``VT_i = Σ_j W̄_ij``; ranks ``R_j = Σ_i S_i W̄_ij``; trust ``T_j = R_j / P_j``
   (0 where ``P_j = 0``); ranks are normalized and incentive ``I = R`` (the chain stores normalized ranks,
   so ``ranks`` equals ``incentive`` in this version of Yuma, as on the chain).
6. Bonds: previous bonds column-normalized (``Σ_i B_ij = 1``, an all-zero column stays zero);
   ``ΔB_ij = W̄_ij S_i`` column-normalized; ``B = a ΔB + (1 − a) B_old`` with ``a = 1 − bonds_moving_average``,
   column-normalized again (so a miner's first bonds equal ΔB, and bonds to a miner nobody weights any
   more keep their proportions). Dividends ``D_i = Σ_j B_ij I_j``, normalized.
7. Emission: the chain divides ``I`` and ``D`` by ``Σ I + Σ D``, which pays miners and validators half each;
   here the split is ``miner_share`` (default 0.5, the chain's split). If one side has nothing to pay, its
   part goes to the other (as the chain's division by the combined sum does). If nobody has incentive
   (no weights, only self-weights, nothing survived), the whole emission goes to validators in proportion
   to active stake; if there is no active stake either, in proportion to all uids' stake (the chain's
   fallback). If no uid has any stake, nothing is paid: every uid gets 0 and the sum is 0, not
   ``emission_rao`` (the only case, together with ``n = 0``, where the sum differs).

Simplifications (where the mock differs from subtensor):

- Float64 instead of the chain's I32F32 fixed point and u16 storage: values agree to ~1e-5, not bit for bit.
  The consensus comparison with ``kappa`` allows 1e-12 of float rounding.
- Permits are an input: the chain recomputes them (top-k stake) each epoch and clears the bonds of a uid
  that lost its permit; here bond rows of uids without a permit are zeroed on input and output.
- Bonds are returned column-normalized; the chain stores them column max-upscaled as u16. The next epoch
  column-normalizes either form, so the results are the same.
- Not modelled: weights set before a uid's (re)registration (the chain drops them) and bonds to a uid
  registered since the last tempo (the chain masks them); the caller clears row and column of a uid when
  it is replaced. Also not modelled: the stake threshold, commit-reveal masking, the subnet owner's
  self-weight exception (all self-weights are masked), liquid alpha, Yuma3, mechanism ids, the owner cut
  and the alpha/TAO emission pipeline of ``run_coinbase``.

On failure: :func:`yuma_epoch` is a pure function. It never mutates its inputs, raises ``ValueError``
before computing anything when an input has the wrong shape, a negative or non-finite value, or a
parameter is out of range (``TypeError`` when ``emission_rao`` is not an integer), and otherwise returns
finite values (no NaN, even for n = 0, n = 1, no
validators, or all-zero weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

# Float slack when comparing cumulative stake with kappa (the chain compares exact fixed-point values).
_KAPPA_SLACK = 1e-12
# Shares are turned into integers of this scale so that rao are apportioned with exact integer arithmetic.
_SHARE_SCALE = 1 << 52
_MAX_RAO = (1 << 63) - 1


@dataclass(frozen=True)
class YumaParams:
    """Subnet hyperparameters the epoch uses (chain defaults in floats)."""

    kappa: float = 0.5  # consensus majority threshold (stake fraction)
    bonds_moving_average: float = 0.9  # EMA: B_new = (1-a)*B_old + a*ΔB with a = 1 - bonds_moving_average
    miner_share: float = 0.5  # fraction of the epoch's emission paid as incentive (rest as dividends)

    def __post_init__(self) -> None:
        for name in ("kappa", "bonds_moving_average", "miner_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"YumaParams.{name} must be in [0, 1], got {value!r}")


@dataclass
class YumaResult:
    """Per-uid outputs of one epoch; vectors are float64 in [0, 1] except ``emission`` (int64 rao)."""

    ranks: np.ndarray
    trust: np.ndarray
    consensus: np.ndarray
    incentive: np.ndarray
    dividends: np.ndarray
    validator_trust: np.ndarray
    emission: np.ndarray  # int64 rao per uid
    bonds: np.ndarray  # float64 (n, n), column-normalized, carried to the next epoch


def yuma_epoch(
    stake: np.ndarray,
    weights: np.ndarray,
    validator_permit: np.ndarray,
    bonds: np.ndarray,
    emission_rao: int,
    params: YumaParams = YumaParams(),
    active: np.ndarray | None = None,
) -> YumaResult:
    """Run one Yuma Consensus epoch (see the module docstring for the rules and simplifications).

    ``stake``: (n,) non-negative stake per uid, any unit. ``weights``: (n, n) raw non-negative weights, row i
    set by uid i. ``validator_permit``: (n,) bool. ``bonds``: (n, n) previous bonds (zeros at first).
    ``emission_rao``: rao to distribute this epoch. ``active``: optional (n,) bool, inactive stake is ignored.
    """
    stake, weights, permit, bonds, active = _checked_inputs(stake, weights, validator_permit, bonds, active)
    if isinstance(emission_rao, bool) or not isinstance(emission_rao, (int, np.integer)):
        raise TypeError(f"emission_rao must be an integer number of rao, got {emission_rao!r}")
    emission_rao = int(emission_rao)
    if not 0 <= emission_rao <= _MAX_RAO:
        raise ValueError(f"emission_rao must be in [0, 2**63), got {emission_rao}")
    n = stake.shape[0]

    stake_share = _normalize(stake)
    active_stake = _normalize(stake_share * (active & permit))

    weights[~permit, :] = 0.0
    np.fill_diagonal(weights, 0.0)
    w = _row_normalize(weights)

    preranks = active_stake @ w
    consensus = _weighted_median_cols(active_stake, w, params.kappa)
    clipped = np.minimum(w, consensus[np.newaxis, :])
    validator_trust = clipped.sum(axis=1)
    raw_ranks = active_stake @ clipped
    trust = np.divide(raw_ranks, preranks, out=np.zeros(n), where=preranks > 0)
    incentive = _normalize(raw_ranks)

    alpha = 1.0 - params.bonds_moving_average
    bonds[~permit, :] = 0.0
    bonds_delta = _col_normalize(clipped * active_stake[:, np.newaxis])
    new_bonds = _col_normalize(alpha * bonds_delta + (1.0 - alpha) * _col_normalize(bonds))
    dividends = _normalize(new_bonds @ incentive)

    emission = _emission(emission_rao, params.miner_share, incentive, dividends, active_stake, stake_share)
    return YumaResult(
        ranks=_unit(incentive),
        trust=_unit(trust),
        consensus=_unit(consensus),
        incentive=_unit(incentive),
        dividends=_unit(dividends),
        validator_trust=_unit(validator_trust),
        emission=emission,
        bonds=new_bonds,
    )


def _checked_inputs(
    stake: np.ndarray,
    weights: np.ndarray,
    validator_permit: np.ndarray,
    bonds: np.ndarray,
    active: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Copy inputs to float64/bool arrays (the caller's arrays are never written) and reject wrong shapes,
    negatives and non-finite values."""
    stake = np.array(stake, dtype=np.float64)
    if stake.ndim != 1:
        raise ValueError(f"stake must be a vector, got shape {stake.shape}")
    n = stake.shape[0]
    weights = _square_copy("weights", weights, n)
    bonds = _square_copy("bonds", bonds, n)
    permit = np.array(validator_permit, dtype=bool)
    active = np.ones(n, dtype=bool) if active is None else np.array(active, dtype=bool)
    if permit.shape != (n,) or active.shape != (n,):
        raise ValueError(f"validator_permit and active must have shape ({n},)")
    for name, array in (("stake", stake), ("weights", weights), ("bonds", bonds)):
        if not np.all(np.isfinite(array)) or np.any(array < 0):
            raise ValueError(f"{name} must be finite and non-negative")
    return stake, weights, permit, bonds, active


def _square_copy(name: str, matrix: np.ndarray, n: int) -> np.ndarray:
    copy = np.array(matrix, dtype=np.float64)
    if n == 0 and copy.size == 0:
        return copy.reshape(0, 0)
    if copy.shape != (n, n):
        raise ValueError(f"{name} must have shape ({n}, {n}), got {copy.shape}")
    return copy


def _normalize(x: np.ndarray) -> np.ndarray:
    """``x / Σx``; an all-zero vector stays zero (the chain's ``inplace_normalize``)."""
    total = x.sum()
    return x / total if total > 0 else np.zeros_like(x)


def _row_normalize(m: np.ndarray) -> np.ndarray:
    sums = m.sum(axis=1, keepdims=True)
    return np.divide(m, sums, out=np.zeros_like(m), where=sums > 0)


def _col_normalize(m: np.ndarray) -> np.ndarray:
    sums = m.sum(axis=0, keepdims=True)
    return np.divide(m, sums, out=np.zeros_like(m), where=sums > 0)


def _weighted_median_cols(active_stake: np.ndarray, w: np.ndarray, kappa: float) -> np.ndarray:
    """Per column: the largest weight ``c`` such that validators with weight ≥ ``c`` hold ≥ kappa of the stake.

    Only validators with active stake vote (a validator that set no weight votes 0 for every column); with
    none, consensus is 0 everywhere, so every weight is clipped away. Equals the chain's
    ``weighted_median_col`` (stake-weighted quantile at ``1 − kappa``).
    """
    voters = active_stake > 0
    if not voters.any():
        return np.zeros(w.shape[1])
    scores = w[voters]
    voter_stake = _normalize(active_stake[voters])
    order = np.argsort(-scores, axis=0, kind="stable")
    cumulative = np.cumsum(voter_stake[order], axis=0)
    first_majority = np.argmax(cumulative >= kappa - _KAPPA_SLACK, axis=0)
    return np.take_along_axis(scores, order, axis=0)[first_majority, np.arange(w.shape[1])]


def _emission(
    emission_rao: int,
    miner_share: float,
    incentive: np.ndarray,
    dividends: np.ndarray,
    active_stake: np.ndarray,
    stake_share: np.ndarray,
) -> np.ndarray:
    """Split ``emission_rao`` into miner and validator pools and pay each pool by its shares, exactly."""
    if not incentive.any() and not dividends.any():
        fallback = active_stake if active_stake.any() else stake_share
        return _apportion(emission_rao, fallback)
    miner_pool = int(Fraction(miner_share) * emission_rao)  # exact: float rounding could exceed emission_rao
    if not dividends.any():
        miner_pool = emission_rao
    elif not incentive.any():
        miner_pool = 0
    return _apportion(miner_pool, incentive) + _apportion(emission_rao - miner_pool, dividends)


def _apportion(pool: int, shares: np.ndarray) -> np.ndarray:
    """Split ``pool`` rao in proportion to ``shares`` so that the parts sum to ``pool`` exactly.

    Largest-remainder method in integer arithmetic: each uid gets the floor of its quota, and the rao left
    over go one each to the largest remainders (ties to the lower uid). A zero share never gets rao; all
    zero shares pay nothing.
    """
    out = np.zeros(shares.shape[0], dtype=np.int64)
    top = float(shares.max()) if shares.size else 0.0
    if pool == 0 or top <= 0:
        return out
    units = [round(s / top * _SHARE_SCALE) for s in shares.tolist()]
    total = sum(units)
    quotas = [divmod(pool * u, total) for u in units]
    out[:] = [whole for whole, _ in quotas]
    left_over = pool - int(out.sum())
    by_remainder = sorted(range(len(units)), key=lambda i: (-quotas[i][1], i))
    out[by_remainder[:left_over]] += 1
    return out


def _unit(x: np.ndarray) -> np.ndarray:
    """Clamp float rounding (e.g. 1 + 1e-16) so reported vectors lie in [0, 1]."""
    return np.clip(x, 0.0, 1.0)
