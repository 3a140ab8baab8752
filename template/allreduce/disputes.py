"""A sender's check of what an owner stated about the sender's own input, and the signed dispute when it is false.

Why: every member holds an owner's average against the owner's claims (:mod:`template.allreduce.verification`), but
those claims are the owner's word: an owner that sends every member the same wrong average can forge the claims to
fit it. The one member that can check the claim of an input is its sender — it holds the input. So every owner
states, with each averaged segment, per included sender the input's norm and largest magnitude as its rule read
them (:class:`~template.allreduce.messages.AveragedSegment`); each sender redoes the rule for its own input from
those (the clip factor from everyone's norms, the value bound from everyone's peaks: the owner's whole freedom) and
projects it on the segment's directions (:class:`OwnInputCheck`). Anything that differs is a *dispute*: the sender
signs it (:func:`dispute_bytes`) and posts it with the members' confirmation
(:mod:`template.allreduce.confirmation`), and every member that reads a validly signed dispute writes that segment
as zeros — the same verdict everywhere, as a refuted segment.

Who pays: a dispute cannot be judged in the round (only the owner and the sender hold the input), so a segment is
dropped on a signed dispute — of a sender that disputes one owner only that round (:func:`counted_disputes`) — and
the validator judges it afterwards from the signed inputs it recomputes the
segment from (:func:`template.base.audit.audit_allreduce`): the owner when its statement was false, the sender when
it was true — a sender cannot frame an owner, only lose its pay (and that segment's step) trying.

What it leaves: the owner's own input, which no other member holds, can still absorb a lie — unless the rule leaves
it out of its own segment (:attr:`template.allreduce.reduction.OwnerRule.own_input_min_senders`: from 6 senders,
where it costs < 1 % of held-out loss, docs/benchmarks.md §10); then every claim of the average is checked by
the one that holds the input. For codecs that average over the senders that kept each value (``mean_of_kept``),
where each input's weight per value depends on who else kept it (known only to the owner), a sender also checks
the average's projections at the values it kept and that the average names it only for values it kept
(:mod:`template.allreduce.verification`); neither needs those weights.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping, Sequence

import torch

from template.allreduce.codecs import AttributedAverage, CodecError, SegmentCodec
from template.allreduce.messages import AveragedSegment, InputStatement
from template.allreduce.reduction import (
    OwnerRule,
    bounded_input,
    clip_factors,
    input_norm,
    input_peak,
    value_bound,
)
from template.allreduce.verification import Directions, claims, factored, kept_projections

__all__ = ["OwnInputCheck", "counted_disputes", "dispute_bytes", "mismatch", "true_statement"]

# a sender's disputes count only while they name the segments of at most this many owners in one round: a sender
# whose input two owners misstate is met only by owners that collude, and a false disputer could otherwise drop every
# other owner's segments each round (measured: 11 of 15 segments of every round on a local network of 4 miners)
MAX_OWNERS_DISPUTED = 1
NORM_REL_TOLERANCE = 1e-9  # float64 norms of the same values: equal up to the summation order of another machine
CLAIM_TOLERANCE = 1e-9  # × √n × the input's norm (|⟨x, z⟩| ≤ √n‖x‖₂): far above float64's error, far below a lie
_DISPUTE = b"diloco/claim-dispute/v1\x00"


def mismatch(said: InputStatement, true: InputStatement, numel: int) -> str:
    """Why ``said`` is not ``true`` ("" when it is, up to float64's rounding on another machine)."""
    if not math.isclose(said.norm, true.norm, rel_tol=NORM_REL_TOLERANCE, abs_tol=1e-300):
        return f"its norm was stated as {said.norm!r}, it is {true.norm!r}"
    if said.peak != true.peak:
        return f"its largest magnitude was stated as {said.peak!r}, it is {true.peak!r}"
    scale = max(true.norm, *map(abs, true.masked)) if true.masked else true.norm
    tolerance = CLAIM_TOLERANCE * math.sqrt(max(numel, 1)) * scale + 1e-300
    for what, stated, actual in (("projections", said.claims, true.claims),
                                 ("projections of the average at its kept values", said.masked, true.masked)):
        if len(stated) != len(actual) or not all(abs(a - b) <= tolerance for a, b in zip(stated, actual, strict=True)):
            return f"its {what} were stated as {stated}, they are {actual}"
    return ""


def true_statement(codec: SegmentCodec, rule: OwnerRule, averaged: AveragedSegment, position: int,
                   values: torch.Tensor, drawn: Directions, average: torch.Tensor | None = None) -> InputStatement:
    """What the owner's rule makes of the ``position``-th included input, ``values`` (decoded), given what the owner
    stated of the others' norms and peaks: the clip factor, the value bound and the projections — and, for a
    ``mean_of_kept`` codec, the projections of ``average`` (the decoded average) at the values it kept."""
    norm, peak = input_norm(values), input_peak(values)
    norms, peaks = list(averaged.norms), list(averaged.peaks)
    norms[position], peaks[position] = norm, peak
    factors = clip_factors(norms, rule.norm_clip_multiple)
    bound = value_bound([p * f for p, f in zip(peaks, factors, strict=True)], rule.value_bound_multiple)
    factor = factors[position]
    clamped = bounded_input(values, peak, factor, bound)
    used = values if clamped is None else clamped
    if not codec.mean_of_kept:
        return InputStatement(norm, peak, claims([used], [factor], drawn)[0])
    assert average is not None, "a mean over the kept values is checked against the average"
    plain, masked, _ = kept_projections([used], average, drawn)  # a clamped value stays kept: the same positions
    return InputStatement(norm, peak, factored(plain, [factor])[0], factored(masked)[0])


class OwnInputCheck:
    """A sender's check of each owner's statement of the sender's own input (module docstring)."""

    def __init__(self, codec: SegmentCodec, rule: OwnerRule, sender: int, segments: Sequence[bytes],
                 own_range: tuple[int, int], false: bool = False):
        """``sender``: this member's index among the group's senders; ``segments``: its encoded contribution;
        ``own_range``: the segments it owns (it does not dispute itself); ``false``: dispute every other owner's
        statement, true or not (``AllReduceFaults.dispute``, a framer: tests only)."""
        self.codec, self.rule, self.sender, self.segments = codec, rule, sender, tuple(segments)
        self.own_range, self.false = own_range, false

    def disputed(self, segment: int, averaged: AveragedSegment, average: torch.Tensor, drawn: Directions,
                 attributed: AttributedAverage | None = None) -> str:
        """Why the owner's statement of our input in ``segment`` (``average``: the decoded average) is false — or,
        for a ``mean_of_kept`` codec, why the average names us for a value we did not keep (``attributed``: the
        average as decoded with whom it names, decoded here when not given); "" when it holds, or when the segment
        is not ours to check (we are not in it, or we own it)."""
        start, stop = self.own_range
        if self.sender not in averaged.included or start <= segment < stop:
            return ""
        if self.false:
            return "AllReduceFaults.dispute: a false dispute"
        position = averaged.included.index(self.sender)
        said = averaged.statement(position)
        if said is None:
            return "the average came without the owner's statement of our input"
        try:
            values = self.codec.decode(self.segments[segment], average.numel())
        except CodecError as err:  # our own bytes always decode; say so rather than fail the share
            return f"our own segment does not decode: {err}"
        if self.codec.mean_of_kept:
            if attributed is None:
                attributed = self.codec.decode_attributed_average(averaged.data, average.numel())
            if attributed is None:  # members refute it before asking us; say so if one did not
                return "the average does not name a sender for each of its values"
            unkept = int(values[attributed.named(position)].eq(0).sum())
            if unkept:
                return f"the average names us for {unkept} values we did not keep"
        return mismatch(said, true_statement(self.codec, self.rule, averaged, position, values, drawn, average),
                        average.numel())


def dispute_bytes(scope: str, round: int, group_id: bytes, segment: int, digest: bytes) -> bytes:
    """What a sender signs to dispute ``segment`` of one group, averaged as the bytes of sha256 ``digest``."""
    encoded = scope.encode()
    return b"".join((_DISPUTE, struct.pack("<H", len(encoded)), encoded, struct.pack("<Q", round),
                     struct.pack("<H", len(group_id)), group_id, struct.pack("<Q", segment), digest))


def counted_disputes(disputes: Iterable[tuple[int, int]], owner_of: Mapping[int, int]) -> dict[int, int]:
    """segment -> the sender whose dispute drops it, from (segment, sender) pairs and each segment's owner: a sender
    that disputes the segments of more than :data:`MAX_OWNERS_DISPUTED` owners counts for none; of the rest, the
    lowest sender per segment. The same pairs give every member the same segments."""
    pairs = sorted(set(disputes))
    owners: dict[int, set[int]] = {}
    for segment, sender in pairs:
        owners.setdefault(sender, set()).add(owner_of[segment])
    counted: dict[int, int] = {}
    for segment, sender in pairs:
        if len(owners[sender]) <= MAX_OWNERS_DISPUTED:
            counted.setdefault(segment, sender)
    return counted
