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
   Σ (w/W)·claim holds for both means.

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
from template.allreduce.verification import Directions, claims

# A sender's weight (tokens) counts at most this many times the lower median of the group's announced weights.
WEIGHT_CAP_MULTIPLE = 4.0


@dataclass(frozen=True)
class OwnerRule:
    """How far one contribution may reach (module docstring, steps 2 and 3); None or 0 turns a bound off. Every
    owner of a run and every validator auditing it must use the same rule: the audit recomputes its bytes."""

    norm_clip_multiple: float | None = 3.0
    value_bound_multiple: float | None = 3.0

    def __post_init__(self) -> None:
        for name in ("norm_clip_multiple", "value_bound_multiple"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be None or a finite number >= 0, not {value}")


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
    # the directions the claims were made on (seeded by the digest of ``data``); not part of the result's value
    drawn: Directions | None = field(default=None, compare=False, repr=False)


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

    norms = [float(torch.linalg.vector_norm(values, dtype=torch.float64)) for _, values, _ in valid]
    factors = [1.0] * len(valid)
    clipped: list[tuple[int, float]] = []
    if rule.norm_clip_multiple:
        bound = rule.norm_clip_multiple * lower_median(norms)
        for i, norm in enumerate(norms):
            if norm > bound:
                factors[i] = bound / norm
                clipped.append((valid[i][0], factors[i]))
    values, bounded = _bounded_values([v for _, v, _ in valid], factors, rule.value_bound_multiple)
    weights = [w for _, _, w in valid]
    total = sum(weights)
    kept = kept_weight(values, weights) if codec.mean_of_kept else None
    data = codec.encode_average(weighted_mean(values, weights, factors, kept=kept).to(torch.float32))
    made: tuple[tuple[float, ...], ...] = ()
    drawn = None
    if claims_context is not None:
        drawn = Directions(claims_context, hashlib.sha256(data).digest(), numel, codec.check_directions)
        made = claims(values, factors, drawn, None if kept is None else (kept.numpy(), math.fsum(weights)))
    return ReducedSegment(data, tuple(s for s, _, _ in valid), total, tuple(dropped), tuple(clipped),
                          tuple((valid[i][0], count) for i, count in bounded), made, drawn)


def _bounded_values(values: list[torch.Tensor], factors: list[float],
                    multiple: float | None) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Step 3 of the rule: each contribution with a value whose clipped magnitude exceeds :func:`value_bound`,
    clamped to it (in its own unclipped scale, so that the mean's arithmetic is unchanged for everyone else), and
    (index, how many values were clamped) for each such contribution."""
    largest = [float(v.abs().max()) * f if v.numel() else 0.0 for v, f in zip(values, factors, strict=True)]
    bound = value_bound(largest, multiple)
    bounded: list[tuple[int, int]] = []
    for i, (peak, factor) in enumerate(zip(largest, factors, strict=True)):
        if peak > bound:
            limit = bound / factor
            bounded.append((i, int(values[i].abs().gt(limit).sum())))
            values[i] = values[i].clamp(-limit, limit)
    return values, bounded
