"""The reducer's rule for one segment, as a pure function: what a part owner computes, and what a validator recomputes.

Given the contributions that reached the owner for one segment (already checked against their senders' signed roots),
:func:`reduce_segment`

1. drops contributions whose bytes do not decode, whose values are not finite, or whose weight differs from the
   weight the sender announced at matchmaking;
2. clips each remaining contribution's L2 norm to ``rule.norm_clip_multiple`` × the *lower* median of their norms
   (the lower median, so that in a group of two an inflated Δ is clipped to the honest one's scale), and caps each
   sender's weight at :data:`WEIGHT_CAP_MULTIPLE` × the lower median of the weights announced at matchmaking
   (:func:`weight_cap`: a peer announcing 1e300 tokens would otherwise set the direction of the average alone);
3. bounds every value: no (clipped) contribution's value may exceed ``rule.value_bound_multiple`` × the lower median
   of the contributions' largest magnitudes in this segment (:func:`value_bound`); a larger one is clamped to it and
   its sender is named in ``bounded``. The norm clip alone lets a contribution of an honest norm put most of it into
   a few coordinates, which then move θ far beyond what training moves any coordinate, every round. Measured on
   real DiLoCo rounds (``benchmarks.influence``, docs/benchmarks.md §8), an honest contribution's largest value is at
   most ~1.6 × the lower median of its group's largest values, so 3 × bounds any one sender's pull on a coordinate to
   about what honest training does without ever touching honest work;
4. takes the weighted mean, accumulated in float64 in a fixed order (the senders' order in the group), and encodes
   it once with the codec's ``encode_average``. For a codec whose ``mean_of_kept`` is set (``sparse`` by default),
   each value is the mean over the senders that kept it (nonzero) rather than over all of them;
5. for an owner in the round, projects every input it averaged (as averaged: bounded, clip factor applied) on
   random directions drawn from the averaged bytes: the *claims* every member holds the average against
   (:mod:`template.allreduce.verification`). For a ``mean_of_kept`` codec an input is projected after scaling each
   value by W / K (K: the weight of the senders that kept it, :func:`kept_weight`), so the members' one formula
   Σ (w/W)·claim holds for both means; as no sender knows K, the owner adds each input's plain projections and the
   average's projections at the values it kept, and the average names the first sender that kept each of its
   values (the codec's attributed form). With the claims go each input's norm and largest magnitude (the rule's
   whole freedom, :class:`ReducedSegment`), from which each sender redoes steps 2–5 for its own input
   (:mod:`template.allreduce.disputes`).

The owner's own input is not among the inputs when the group has at least ``OwnerRule.own_input_min_senders``
senders (the runner leaves it out): then every input of an average is one its sender can check.

Every step is deterministic, so the same inputs give the same bytes on any machine: the owner sends those bytes to
every member (all members hold bit-identical Δ̄), and a validator holding every contributor's publication recomputes
them bit for bit (:mod:`template.base.audit`), which is what checks an owner's own share of its segment — the one
contribution that never crosses the wire. Nothing here knows about hivemind or networks.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from template.allreduce.codecs import CodecError, SegmentCodec, all_finite
from template.allreduce.messages import InputStatement
from template.allreduce.verification import Directions, claims, factored, kept_projections

# A sender's weight (tokens) counts at most this many times the lower median of the group's announced weights.
WEIGHT_CAP_MULTIPLE = 4.0


@dataclass(frozen=True)
class OwnerRule:
    """How far one contribution may reach (module docstring, steps 2 and 3); None or 0 turns a bound off. Every
    owner of a run and every validator auditing it must use the same rule: the audit recomputes its bytes."""

    norm_clip_multiple: float | None = 3.0
    value_bound_multiple: float | None = 3.0
    # from this many senders in a group, an owner leaves its own input out of its segments' averages, so that every
    # input of an average is checked by its sender (template.allreduce.disputes); 0: never. 6: the smallest group
    # where dropping 1/N of each segment's inputs costs < 1 % of held-out loss (docs/benchmarks.md §10: +0.6 % and
    # +0.85 % at 6 senders, +1.2–1.7 % at 4, +4 % at 3)
    own_input_min_senders: int = 6

    def __post_init__(self) -> None:
        for name in ("norm_clip_multiple", "value_bound_multiple"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be None or a finite number >= 0, not {value}")
        count = self.own_input_min_senders
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"own_input_min_senders must be an integer >= 0, not {count!r}")

    def leaves_out_owner(self, senders: int) -> bool:
        """Whether, in a group of ``senders`` senders, each owner averages its segments without its own input."""
        return 0 < self.own_input_min_senders <= senders

    def left_out(self, members: Sequence, senders: Sequence) -> tuple[int | None, ...] | None:
        """Per member (group order), the sender index of the input it leaves out of its own segments (None for an
        auxiliary member); None when the group is too small for the rule to leave any out."""
        if not self.leaves_out_owner(len(senders)):
            return None
        index = {peer: s for s, peer in enumerate(senders)}
        return tuple(index.get(peer) for peer in members)


@dataclass(frozen=True)
class SegmentInput:
    """One sender's encoded bytes for one segment, with the weight it sent along."""

    sender: int  # index among the group's senders (the order of the group)
    data: bytes
    weight: float


@dataclass(frozen=True)
class ReducedSegment:
    data: bytes  # encode_average of the mean: the same bytes for every member
    included: tuple[int, ...]  # senders whose contribution is in the mean, in order
    weight: float  # their total (capped) weight
    dropped: tuple[tuple[int, str], ...]  # (sender, why) for contributions that did not count
    clipped: tuple[tuple[int, float], ...]  # (sender, factor) for contributions whose norm was clipped
    bounded: tuple[tuple[int, int], ...] = ()  # (sender, how many of its values) for contributions clamped in step 3
    claims: tuple[tuple[float, ...], ...] = ()  # per included sender, step 5 (empty when not asked for)
    # per included sender, what the rule's bounds were computed from: its input's L2 norm and largest magnitude
    # (float64, before clipping), so that a sender can redo the rule for its own input (template.allreduce.disputes)
    norms: tuple[float, ...] = ()
    peaks: tuple[float, ...] = ()
    # mean_of_kept codecs, made with the claims: per included sender, its plain (unscaled) claims and the average's
    # projections at the values it kept (template.allreduce.verification)
    plain: tuple[tuple[float, ...], ...] = ()
    masked: tuple[tuple[float, ...], ...] = ()
    # the directions the claims were made on (seeded by the digest of ``data``); not part of the result's value
    drawn: Directions | None = field(default=None, compare=False, repr=False)
    decoded: torch.Tensor | None = field(default=None, compare=False, repr=False)  # data decoded (made with claims)

    def statement(self, position: int) -> InputStatement:
        """What the ``position``-th included input really gives, as its sender checks it (made with the claims)."""
        return InputStatement(self.norms[position], self.peaks[position], (self.plain or self.claims)[position],
                              self.masked[position] if self.masked else ())


class NoValidContribution(ValueError):
    """Not one contribution to a segment counted: the segment cannot be averaged."""


def lower_median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def weight_cap(announced: Sequence[float | None]) -> float:
    """The most weight any sender counts with: WEIGHT_CAP_MULTIPLE × the lower median of the positive weights
    announced at matchmaking (the same for every owner: everyone sees the same announcements)."""
    positive = [w for w in announced if w is not None and math.isfinite(w) and w > 0]
    return WEIGHT_CAP_MULTIPLE * lower_median(positive) if positive else math.inf


def value_bound(largest: Sequence[float], multiple: float | None) -> float:
    """The most any value may weigh in a segment: ``multiple`` × the lower median of the senders' largest magnitudes
    (those above 0: a sender that sent nothing must not pull the bound to 0); inf when off or nothing is positive."""
    positive = [m for m in largest if m > 0]
    return multiple * lower_median(positive) if multiple and positive else math.inf


def weighted_mean(values: Sequence[torch.Tensor], weights: Sequence[float], factors: Sequence[float] | None = None,
                  *, kept: torch.Tensor | None = None) -> torch.Tensor:
    """The owner's arithmetic, in float64, accumulated in the given (senders') order: Σ w·f·x / Σ w per value; with
    ``kept`` (:func:`kept_weight` of the same values and weights: a ``mean_of_kept`` codec), Σ w·f·x / kept, 0 where
    nobody kept the value. ``factors`` scale the values (norm clipping), not the weights."""
    factors = [1.0] * len(values) if factors is None else factors
    accumulator = torch.zeros(values[0].numel(), dtype=torch.float64)
    if kept is None:
        total = sum(weights)
        for x, weight, factor in zip(values, weights, factors, strict=True):
            accumulator.add_(x, alpha=weight * factor / total)  # float32 values promote into the float64 sum
        return accumulator
    for x, weight, factor in zip(values, weights, factors, strict=True):
        accumulator.add_(x, alpha=weight * factor)
    return torch.where(kept > 0, accumulator / kept.clamp_min(math.ulp(0.0)), 0.0)


def kept_weight(values: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Per value, in float64: K = Σ w over the senders whose value there is nonzero (kept by a sparse codec)."""
    kept = torch.zeros(values[0].numel(), dtype=torch.float64)
    for x, weight in zip(values, weights, strict=True):
        kept.add_(x.ne(0).to(torch.float64), alpha=weight)  # the same sum as promoting the bools, 25 % faster
    return kept


def reduce_segment(inputs: Sequence[SegmentInput], numel: int, codec: SegmentCodec,
                   announced: Sequence[float | None], rule: OwnerRule, cap: float,
                   claims_context: bytes | None = None) -> ReducedSegment:
    """The owner's rule (module docstring). ``announced[s]`` is sender s's weight from matchmaking (None when its
    announcement was malformed); raises NoValidContribution when nothing counts. With ``claims_context``
    (:func:`template.allreduce.verification.segment_context`) the owner's claims are made too (step 5)."""
    valid: list[tuple[int, torch.Tensor, float]] = []
    dropped: list[tuple[int, str]] = []
    for item in sorted(inputs, key=lambda i: i.sender):
        try:
            values = codec.decode(item.data, numel)
        except CodecError as err:
            dropped.append((item.sender, f"undecodable: {err}"))
            continue
        expected = announced[item.sender]
        if expected is None or not math.isfinite(item.weight) or item.weight != expected:
            dropped.append((item.sender, f"weight {item.weight} differs from the announced weight {expected}"))
        elif not all_finite(values):
            dropped.append((item.sender, "non-finite values"))
        elif item.weight > 0:
            valid.append((item.sender, values, min(item.weight, cap)))
    if not valid:
        raise NoValidContribution("no valid contribution")

    norms = [input_norm(values) for _, values, _ in valid]
    peaks = [input_peak(values) for _, values, _ in valid]
    factors = clip_factors(norms, rule.norm_clip_multiple)
    clipped = [(valid[i][0], f) for i, f in enumerate(factors) if f != 1.0]
    values, bounded = _bounded_values([v for _, v, _ in valid], peaks, factors, rule.value_bound_multiple)
    weights = [w for _, _, w in valid]
    total = sum(weights)
    kept = kept_weight(values, weights) if codec.mean_of_kept else None
    mean = weighted_mean(values, weights, factors, kept=kept).to(torch.float32)
    if kept is None:
        data = codec.encode_average(mean)
    else:
        data = codec.encode_attributed_average(mean, values)
    made: tuple[tuple[float, ...], ...] = ()
    plain: tuple[tuple[float, ...], ...] = ()
    masked: tuple[tuple[float, ...], ...] = ()
    drawn = decoded = None
    if claims_context is not None:
        drawn = Directions(claims_context, hashlib.sha256(data).digest(), numel, codec.check_directions)
        decoded = codec.decode_average(data, numel)
        if kept is None:
            made = claims(values, factors, drawn)
        else:
            rows = kept_projections(values, decoded, drawn, (kept.numpy(), math.fsum(weights)))
            plain, masked, made = factored(rows[0], factors), factored(rows[1]), factored(rows[2], factors)
    return ReducedSegment(data, tuple(s for s, _, _ in valid), total, tuple(dropped), tuple(clipped),
                          tuple((valid[i][0], count) for i, count in bounded), made, tuple(norms), tuple(peaks),
                          plain, masked, drawn, decoded)


def input_norm(values: torch.Tensor) -> float:
    """An input's L2 norm as the rule reads it (float64)."""
    return float(torch.linalg.vector_norm(values, dtype=torch.float64))


def input_peak(values: torch.Tensor) -> float:
    """An input's largest magnitude (0 for an empty one)."""
    return float(values.abs().max()) if values.numel() else 0.0


def clip_factors(norms: Sequence[float], multiple: float | None) -> list[float]:
    """Step 2's norm clip: per input, the factor its values are scaled by (1 unless its norm exceeds ``multiple`` ×
    the lower median of ``norms``)."""
    if not multiple:
        return [1.0] * len(norms)
    bound = multiple * lower_median(norms)
    return [bound / norm if norm > bound else 1.0 for norm in norms]


def bounded_input(values: torch.Tensor, peak: float, factor: float, bound: float) -> torch.Tensor | None:
    """Step 3 for one input: its values clamped so that, scaled by ``factor``, none exceeds ``bound`` (in its own
    unclipped scale, so the mean's arithmetic is unchanged for everyone else); None when none does."""
    if peak * factor <= bound:
        return None
    limit = bound / factor
    return values.clamp(-limit, limit)


def _bounded_values(values: list[torch.Tensor], peaks: list[float], factors: list[float],
                    multiple: float | None) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Step 3 of the rule: each contribution with a value whose clipped magnitude exceeds :func:`value_bound`,
    clamped to it (:func:`bounded_input`), and (index, how many values were clamped) for each such contribution."""
    bound = value_bound([p * f for p, f in zip(peaks, factors, strict=True)], multiple)
    bounded: list[tuple[int, int]] = []
    for i, (peak, factor) in enumerate(zip(peaks, factors, strict=True)):
        clamped = bounded_input(values[i], peak, factor, bound)
        if clamped is not None:
            bounded.append((i, int(values[i].abs().gt(bound / factor).sum())))
            values[i] = clamped
    return values, bounded
