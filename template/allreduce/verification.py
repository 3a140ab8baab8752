"""In-round verification of every averaged segment before it reaches θ (DESIGN.md §12 item 1): each member drops an
owner's average that does not match what the owner itself claims to have averaged.

Why: a member cannot recompute an owner's average (it does not hold the other senders' segments), so an owner that
sent every member the same wrong average was convicted by validators after the round, with its wrong segments
already in every member's θ. Here the owner commits, inside the signed averaged segment, to a cheap fingerprint of
its inputs that every member can hold the average against.

How: with each averaged segment the owner sends, for each sender it included and each of a few random ±1
directions z (``codec.check_directions``), the *claim* ``c_i = f_i · ⟨x_i, z⟩``: the projection of that sender's
input as the owner's rule used it (``x_i`` after the value bound, ``f_i`` its norm-clip factor; :func:`claims`). The
owner's float64 mean ``m = Σ w_i f_i x_i / W`` then satisfies ``⟨m, z⟩ = Σ (w_i / W) c_i``, and every member checks
that ``⟨a, z⟩`` — ``a`` the average it decoded — equals that sum up to the codec's rounding (:class:`SegmentCheck`).
z comes from the round, the segment and the digest of the averaged bytes (:class:`Directions`), so it exists only
once the average is fixed, and is the same for every member: the same bytes give every member the same verdict, and
a refuted segment is written as zeros (no outer step for it) by every member alike — θ stays identical everywhere,
never a mix.

Tolerance: ``a − m`` is the codec's rounding, ε_j per value, with ‖ε‖₂ at most ``codec.average_error_norm(a)``
(plus :data:`ERROR_FLOOR` per value for the float64 arithmetic of the projections). For random signs Hoeffding's
inequality gives ``P(|⟨a − m, z⟩| > t·‖ε‖₂) ≤ 2·exp(−t²/2)``: with t = :data:`TOLERANCE_SIGMAS` = 8, below 3e-14
per direction for an honest average. A negated average misses by ``2·|⟨m, z⟩|``, about 2‖m‖₂: for fp16 ~500
times the tolerance (8·2^-11·‖m‖₂), so one direction lets it through with probability ~0.2 % and two with ~2.5e-6;
for int8 (rounding up to s/2, ~1/85 of a block's typical value) one misses ~4 % of the time, four ~3e-6.

An average the codec had to clamp (fp16 beyond ±65504, possible only with the sparse codec's float32-scaled
contributions) is not the mean either and is refuted like a wrong one; no honest pseudo-gradient comes near it.

Codecs that average each value over the senders that kept it (``mean_of_kept``, the sparse codec's default), where
``m_j = Σ w_i f_i x_ij / K_j`` with ``K_j`` the weight of the senders that kept value j: the owner projects each
input scaled per value by W / K (:func:`template.allreduce.reduction.kept_weight`), which makes
``m = Σ (w_i / W) f_i x'_i`` again, so members check those averages with the same formula. Those claims need the
weights K, which only the owner knows, so no sender could check its own; hence a second check with two more
statements per included sender: its *plain* claim ``c_i`` (unscaled, as for a dense codec) and ``d_i = ⟨a, z⟩`` over
the values it kept (:func:`kept_projections`). ``Σ w_i d_i = Σ_j K_j a_j z_j`` equals ``Σ w_i c_i`` up to the
rounding (``|⟨K·(a − m), z⟩| ≤ W·t·‖ε‖₂``, K ≤ W), which binds the average wherever some sender kept a value; where
none did it must be zero, so the average names, for each of its nonzeros, a sender that kept it (the codec's
attributed form). Members check both (:meth:`SegmentCheck._kept_refutation`); each sender checks its ``c_i``, its
``d_i`` and the values the average names it for (:mod:`template.allreduce.disputes`) — none needs K.

What it does not catch alone: an owner that lies in its claims as well. Each sender checks the claim of its own
input and disputes a false one (:mod:`template.allreduce.disputes`: the segment is then dropped by every member);
what is left is the owner's own input, whose claim no other member can check — unless the rule leaves it out of its
own segments (from ``OwnerRule.own_input_min_senders`` senders); below that, validators convict such an owner
afterwards by recomputing the segment (docs/validation.md, "known limits").
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from template.allreduce.codecs import CodecError, SegmentCodec, all_finite
from template.allreduce.messages import AveragedSegment

if TYPE_CHECKING:  # disputes builds on this module
    from template.allreduce.disputes import OwnInputCheck

__all__ = ["Admitted", "Directions", "SegmentCheck", "claims", "factored", "kept_projections", "projections",
           "round_context", "segment_context"]

logger = logging.getLogger(__name__)

TOLERANCE_SIGMAS = 8.0  # Hoeffding: an honest average fails with probability < 2·exp(−32) per direction
# per value, added to the codec's rounding: the float64 error of the projections, even summed in the worst order,
# stays below it for inputs up to ~10 in magnitude (pseudo-gradient values are ~1e-3); far below fp16's rounding
ERROR_FLOOR = 2.0**-24
SPARSE_SHARE = 0.25  # a vector with fewer nonzeros than this share of its values is projected at its nonzeros only
_DOMAIN = b"diloco/segment-check/v1\x00"


def round_context(scope: str, round: int, group_id: bytes) -> bytes:
    """What every member of one all-reduce derives the directions from, besides the segment and its bytes."""
    return hashlib.sha256(_DOMAIN + scope.encode() + b"\x00" + round.to_bytes(8, "little", signed=True)
                          + group_id).digest()


def segment_context(context: bytes, segment: int) -> bytes:
    return context + segment.to_bytes(8, "little")


class Directions:
    """``count`` random ±1 directions over ``numel`` values (z = 2b − 1 for bits b), drawn with SHAKE-256 from
    ``context`` (:func:`segment_context`) and ``digest``, the sha256 of the averaged bytes: the same bits on every
    machine and library version. Held packed; read whole (:meth:`bits`) or at a sparse vector's nonzeros only
    (:meth:`bits_at`: the sparse codec's segments are ~1M values of which a few % are nonzero)."""

    def __init__(self, context: bytes, digest: bytes, numel: int, count: int):
        seed = hashlib.sha256(context + digest).digest()
        row = -(-numel // 8)
        self.digest, self.numel, self.count = digest, numel, count
        self.packed = np.frombuffer(hashlib.shake_256(seed).digest(count * row), dtype=np.uint8).reshape(count, row)

    def bits(self) -> np.ndarray:
        """count × numel float64 0/1, most significant bit of each byte first."""
        return np.unpackbits(self.packed, axis=1, count=self.numel).astype(np.float64)

    def bits_at(self, positions: np.ndarray) -> np.ndarray:
        """count × len(positions) float64 0/1: :meth:`bits` at ``positions`` (int64)."""
        return ((self.packed[:, positions >> 3] >> (7 - (positions & 7)).astype(np.uint8)) & 1).astype(np.float64)


def projections(vectors: Sequence[torch.Tensor], directions: Directions) -> np.ndarray:
    """⟨v, z⟩ for each vector and direction (len(vectors) × count), in float64: 2⟨v, b⟩ − Σv, one product with the
    bits as they come (the ±1 form would cost two more passes). A vector with under :data:`SPARSE_SHARE` nonzeros is
    read at those only (each pass over a 1M-value segment costs ~5 ms here)."""
    out = np.empty((len(vectors), directions.count))
    whole = None  # the dense bits, made once for every dense vector
    for row, vector in zip(out, vectors, strict=True):
        values = vector.numpy()
        if _count_nonzero(values) < SPARSE_SHARE * values.size:
            positions = torch.nonzero(vector).reshape(-1).numpy()  # 1.5 × faster than numpy's flatnonzero here
            bits, values = directions.bits_at(positions), values[positions].astype(np.float64)
        else:
            whole = directions.bits() if whole is None else whole
            bits, values = whole, values.astype(np.float64)
        row[:] = _signed_sums(bits, values)
    return out


def _signed_sums(bits: np.ndarray, values: np.ndarray) -> np.ndarray:
    """⟨v, z⟩ for z = 2b − 1, as 2⟨v, b⟩ − Σv: one product with the 0/1 bits as they come (count × n) and ``values``
    (n, or n × columns: one result per column)."""
    return 2.0 * (bits @ values) - values.sum(axis=0)


def kept_projections(inputs: Sequence[torch.Tensor], average: torch.Tensor, directions: Directions,
                     kept: tuple[np.ndarray, float] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """For a mean over the kept values (module docstring), per input and direction, from one read of each input's
    nonzeros: its plain projection ⟨x, z⟩, the average's projection at those values (what the members' second check
    sums) and, with ``kept = (K, W)``, the projection of x scaled by W / K (the claims; K > 0 wherever x is nonzero:
    :func:`template.allreduce.reduction.kept_weight`), else None. Each len(inputs) × count, float64."""
    plain, masked = np.empty((len(inputs), directions.count)), np.empty((len(inputs), directions.count))
    scaled = None if kept is None else np.empty((len(inputs), directions.count))
    mean = average.numpy()
    for i, x in enumerate(inputs):
        positions = torch.nonzero(x).reshape(-1).numpy()
        bits = directions.bits_at(positions)
        rows = [x.numpy()[positions].astype(np.float64), mean[positions].astype(np.float64)]
        if kept is not None:
            rows.append(rows[0] * (kept[1] / kept[0][positions]))
        stacked = np.stack(rows, axis=1)
        sums = _signed_sums(bits, stacked)  # count × len(rows)
        plain[i], masked[i] = sums[:, 0], sums[:, 1]
        if scaled is not None:
            scaled[i] = sums[:, 2]
    return plain, masked, scaled


def _count_nonzero(values: np.ndarray) -> int:
    """How many values are not zero, counting −0.0 too (for float32 as int32: 5 × faster; a −0.0 read at the
    nonzeros adds 0 to a projection)."""
    return int(np.count_nonzero(values.view(np.int32) if values.dtype == np.float32 else values))


def claims(values: Sequence[torch.Tensor], factors: Sequence[float],
           directions: Directions) -> tuple[tuple[float, ...], ...]:
    """The owner's claims: per input (as its rule used it: ``values`` bounded, ``factors`` the norm clip), its
    projections on ``directions``."""
    return factored(projections(values, directions), factors)


def factored(rows: np.ndarray, factors: Sequence[float] | None = None) -> tuple[tuple[float, ...], ...]:
    """Rows of projections as an averaged segment states them: each scaled by its input's norm-clip factor, if any."""
    factors = [1.0] * len(rows) if factors is None else factors
    return tuple(tuple(float(p) * factor for p in row) for row, factor in zip(rows, factors, strict=True))


@dataclass(frozen=True)
class Admitted:
    """What a member makes of one averaged segment."""

    values: torch.Tensor  # what it writes: the decoded average, or zeros when refuted
    refuted: str  # why the average missed the owner's claims ("" when it did not)
    digest: bytes  # sha256 of the averaged bytes (the evidence's, and the directions' seed)
    disputed: str = ""  # why the owner's statement of our own input is false (template.allreduce.disputes)


class SegmentCheck:
    """A member's check of each averaged segment against the owner's claims (module docstring)."""

    def __init__(self, codec: SegmentCodec, context: bytes, weights: Sequence[float | None],
                 own: OwnInputCheck | None = None, left_out: Sequence[int | None] | None = None):
        """``weights``: per sender (group order), the weight an owner counts it with — the announced weight, capped
        (:func:`template.allreduce.reduction.weight_cap`); None for a sender whose announcement was malformed.
        ``own``: a sender's check of what owners state of its own input; ``left_out``: per member, its index among
        the senders when the rule leaves each owner's own input out of its segments (an average that includes it is
        refuted; None for an auxiliary member), else None."""
        self.codec, self.context, self.weights = codec, context, tuple(weights)
        self.own, self.left_out = own, left_out

    def directions(self, segment: int, data: bytes, numel: int) -> Directions:
        """The directions every member draws for ``segment`` averaged as ``data`` (``numel`` values)."""
        return Directions(segment_context(self.context, segment), hashlib.sha256(data).digest(), numel,
                          self.codec.check_directions)

    def admit(self, owner: int, segment: int, averaged: AveragedSegment, numel: int,
              decoded: torch.Tensor | None = None, drawn: Directions | None = None) -> Admitted:
        """What a member makes of ``owner``'s averaged segment (decoded here unless ``decoded`` is given);
        CodecError for an average that is not finite (the share fails: it is fetched from a groupmate, if any).
        ``drawn``: the directions of these very bytes when the caller has them (an owner checking its own average:
        its claims were made on them), else drawn here. Runs in a worker thread."""
        attributed = None  # a mean over the kept values, with whom it names per value: for our check as a sender
        if decoded is None and self.codec.mean_of_kept:
            attributed = self.codec.decode_attributed_average(averaged.data, numel)
            decoded = None if attributed is None else attributed.values
        if decoded is None:
            decoded = self.codec.decode_average(averaged.data, numel)
        if not all_finite(decoded):
            raise CodecError(f"owner {owner}'s average is not finite")
        if drawn is None:
            drawn = self.directions(segment, averaged.data, decoded.numel())
        refuted = self.refutation(averaged, decoded, drawn)
        if not refuted and self.left_out is not None and self.left_out[owner] in averaged.included:
            refuted = f"the average includes its owner's own input (left out from {len(self.weights)} senders)"
        if refuted:
            logger.warning("owner %d's segment %d is dropped by every member: %s", owner, segment, refuted)
            return Admitted(torch.zeros_like(decoded), refuted, drawn.digest)
        disputed = "" if self.own is None else self.own.disputed(segment, averaged, decoded, drawn, attributed)
        if disputed:
            logger.warning("owner %d's statement of our input in segment %d is false (%s): disputed", owner,
                           segment, disputed)
        return Admitted(decoded, "", drawn.digest, disputed)

    def refutation(self, averaged: AveragedSegment, decoded: torch.Tensor, drawn: Directions) -> str:
        """Why ``averaged`` (decoded: ``decoded``; ``drawn``: the directions of its bytes) cannot be the owner's mean
        of the inputs it claims; "" when it can."""
        count = self.codec.check_directions
        if len(averaged.claims) != len(averaged.included) or any(len(c) != count for c in averaged.claims):
            return "the average came without the owner's claims"
        weights = [self.weights[s] for s in averaged.included]
        if any(w is None or not w > 0 for w in weights):
            return "the average includes a sender that has no weight"
        total = math.fsum(weights)
        expected = [math.fsum(w / total * c[k] for w, c in zip(weights, averaged.claims, strict=True))
                    for k in range(count)]
        actual = projections([decoded], drawn)[0]
        rounding = self.codec.average_error_norm(decoded) + ERROR_FLOOR * decoded.numel() ** 0.5
        tolerance = TOLERANCE_SIGMAS * rounding
        gap = max(abs(float(a) - e) for a, e in zip(actual, expected, strict=True))
        if not gap <= tolerance:  # NaN claims fail too
            return f"the average misses the owner's own claims by {gap:.3g} (rounding allows {tolerance:.3g})"
        return self._kept_refutation(averaged, weights, tolerance) if self.codec.mean_of_kept else ""

    def _kept_refutation(self, averaged: AveragedSegment, weights: Sequence[float], tolerance: float) -> str:
        """A ``mean_of_kept`` codec's second check (module docstring): the plain claims against the projections at
        each sender's kept values, and a named sender per value; "" when it holds."""
        count, included = self.codec.check_directions, len(averaged.included)
        if any(len(rows) != included or any(len(row) != count for row in rows)
               for rows in (averaged.plain, averaged.masked)):
            return "the average came without the owner's plain claims and projections at each sender's kept values"
        if self.codec.attributed_groups(averaged.data) != included:
            return "the average does not name, for each of its values, an included sender that kept it"
        total = math.fsum(weights)
        gap = max(abs(math.fsum(w / total * (p[k] - m[k])
                                for w, p, m in zip(weights, averaged.plain, averaged.masked, strict=True)))
                  for k in range(count))
        if not gap <= tolerance:
            return (f"the owner's plain claims miss its projections at the kept values by {gap:.3g} (rounding allows "
                    f"{tolerance:.3g})")
        return ""
