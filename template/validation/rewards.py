"""Scores over time → weights, and which miners to score next. Persisted atomically, restored on restart.

**Credit for a round.** The scorer (:mod:`template.validation.round`) hands each scored miner's *quality* (its
general improvement × participation, 0 when a check failed) and its *evidence* of having trained on its assigned data
(``e`` nats with standard error ``se``: :mod:`template.validation.scoring`). One round's evidence on a small sample is
noisy, so each round's significance ``e/se`` is accumulated per miner (Stouffer's method), older rounds decaying by
``evidence_decay`` (λ)::

    S_i ← λ·S_i + e/se          Q_i ← λ²·Q_i + 1          z_i = S_i / √Q_i

Each round counts as one standardized observation: neither a round of large but noisy gains (the first rounds from a
random model) nor a very precise round of no memorization yet (they are also early) outweighs the rest, as weighting
the raw evidence, or its precision, measurably did.
A failed check clears the miner's accumulated evidence, and the round's credit is the quality *gated* by it::

    s_i = quality_i × clip((z_i − gate_start) / gate_width, 0, 1)

A miner earns for improving the shared model only once it has shown, with significance, that it trains on its own
data: a copier of someone's Δ, of Δ̄ or of an old round — however much noise it adds — has z ≈ N(0, 1) and earns
(almost) nothing, and a miner that trains a fraction f of its assignment shows about f of the evidence and a smaller
improvement. Subnet 38 and Templar gate the same way (a smoothed binary "assigned gain > random gain" indicator
times a rating); here the gate is a significance test accumulated over rounds (docs/validation.md, measured).

**Over rounds.** Per scored round, each scored miner's credit ``s_i`` becomes a *relative* score
``s_i / max(max_j s_j, floor)`` — so rounds early in training (large gains) and late (small gains) count alike, and
so do rounds in which only a subset was scored. ``floor`` is ``best_floor`` × a moving average of earlier rounds'
best scores: in a round where every good miner was missing, a cheater whose update happened to help by a hair does
not become "the best" and take full credit. The relative scores are smoothed per miner by an exponential moving
average::

    ema_i ← (1 − α)·ema_i + α·relative_i          (α = ema_alpha, for the miners scored this round)

and weights are ``ema_i ** power`` normalized to sum to 1. ``power`` > 1 concentrates the reward on miners that are
good *consistently*: one lucky round of a cheater fades fast (α = 0.5, power 2.5: a full-score round followed by
three zero rounds leaves 0.1 % of an honest miner's weight), while honest miners, whose averages differ by up to ~25 %
(their Δs help unequally from round to round), stay within a factor of two of each other's weight.

Scores are keyed by hotkey, not uid: a uid that is re-registered by another hotkey starts from zero.

On failure: :meth:`ScoreBook.save` writes a temporary file, fsyncs it and renames it over the old one, so a crash
leaves either the previous or the new book; :meth:`ScoreBook.load` refuses a file it cannot parse (ValueError naming
it) instead of silently starting over; a book of the previous format (without evidence) is read with no evidence.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 books had no evidence


@dataclass(frozen=True)
class RewardConfig:
    ema_alpha: float = 0.5
    power: float = 2.5
    best_floor: float = 0.1  # × the moving average of the rounds' best scores
    evidence_decay: float = 0.8  # λ: weight of a miner's earlier rounds in its accumulated evidence
    # Off by default: at the scale the tests and the local network run (a 2M-parameter model, 20 inner steps, each
    # window seen once) the evidence of an honest miner is ~1 standard error per round, and the gate measurably
    # zeroed honest miners (docs/validation.md); turn it on (--validator.evidence_gate) where models memorize.
    evidence_gate: bool = False
    gate_start: float = 1.0  # accumulated z at which a miner starts to earn
    gate_width: float = 2.0  # ... and how much more z it needs to earn in full

    def __post_init__(self) -> None:
        if not (0 < self.ema_alpha <= 1 and self.power > 0 and 0 <= self.best_floor <= 1):
            raise ValueError(f"invalid reward settings: {self}")
        if not (0 <= self.evidence_decay < 1 and self.gate_width > 0):
            raise ValueError(f"invalid evidence settings: {self}")

    def gate(self, z: float) -> float:
        return min(1.0, max(0.0, (z - self.gate_start) / self.gate_width))


@dataclass(frozen=True)
class RoundScore:
    """One miner's round as the scorer saw it: quality (≥ 0) and, when it passed every check, (evidence, its se)."""

    quality: float
    evidence: tuple[float, float] | None
    reason: str = ""


@dataclass
class MinerScore:
    ema: float = 0.0
    last_round: int = -1  # the last round this miner was scored for (-1: never)
    last_score: float = 0.0  # its relative score then
    last_reason: str = ""
    rounds_scored: int = 0
    evidence: float = 0.0  # S: the decayed sum of the rounds' significances
    evidence_precision: float = 0.0  # Q: the decayed sum of their squared weights

    @property
    def z(self) -> float:
        return significance(self.evidence, self.evidence_precision)

    def folded(self, evidence: float, se: float, decay: float) -> tuple[float, float]:
        """(S, Q) once a round's evidence ± se is folded in."""
        return decay * self.evidence + evidence / se, decay * decay * self.evidence_precision + 1.0


def significance(evidence: float, precision: float) -> float:
    return evidence / precision ** 0.5 if precision > 0 else 0.0


@dataclass
class ScoreBook:
    config: RewardConfig = field(default_factory=RewardConfig)
    miners: dict[str, MinerScore] = field(default_factory=dict)
    last_round: int = -1  # the newest round scored
    last_weights_block: int = -1
    typical_best: float = 0.0  # moving average of each round's best score (0 until the first positive one)

    def credit(self, round: int, results: Mapping[str, RoundScore]) -> dict[str, float]:
        """Fold the round's evidence into each miner's, gate its quality by it, and :meth:`update` with the
        resulting round scores, which are returned (hotkey → credit ≥ 0)."""
        decay = self.config.evidence_decay
        scores = {}
        for hotkey, result in results.items():
            record = self.miners.setdefault(hotkey, MinerScore())
            if result.evidence is None:
                record.evidence = record.evidence_precision = 0.0
            else:
                record.evidence, record.evidence_precision = record.folded(*result.evidence, decay)
            scores[hotkey] = result.quality * (self.config.gate(record.z) if self.config.evidence_gate else 1.0)
        self.update(round, scores, {hotkey: result.reason for hotkey, result in results.items()})
        return scores

    def update(self, round: int, scores: Mapping[str, float], reasons: Mapping[str, str] | None = None) -> None:
        """Fold in the round scores (≥ 0) of the miners scored for ``round``."""
        if any(not (value >= 0) for value in scores.values()):
            raise ValueError("round scores must be >= 0")
        best = max(scores.values(), default=0.0)
        alpha = self.config.ema_alpha
        reference = max(best, self.config.best_floor * self.typical_best)
        if best > 0:
            self.typical_best = best if self.typical_best == 0 else (1 - alpha) * self.typical_best + alpha * best
        for hotkey, value in scores.items():
            record = self.miners.setdefault(hotkey, MinerScore())
            relative = value / reference if reference > 0 else 0.0
            record.ema = (1 - alpha) * record.ema + alpha * relative
            record.last_round, record.last_score = round, relative
            record.last_reason = (reasons or {}).get(hotkey, "")
            record.rounds_scored += 1
        self.last_round = max(self.last_round, round)

    def forget_except(self, hotkeys: Iterable[str]) -> None:
        """Drop miners that are no longer registered (their uid may go to someone else)."""
        keep = set(hotkeys)
        self.miners = {hotkey: record for hotkey, record in self.miners.items() if hotkey in keep}

    def weights(self, uid_of: Mapping[str, int]) -> dict[int, float]:
        """``{uid: weight}`` summing to 1 over registered miners with a positive score; {} when nobody has one."""
        raw = {uid_of[hotkey]: record.ema ** self.config.power
               for hotkey, record in self.miners.items() if hotkey in uid_of and record.ema > 0}
        total = sum(raw.values())
        return {uid: value / total for uid, value in sorted(raw.items())} if total > 0 else {}

    def choose(self, candidates: Iterable[str], round: int, limit: int) -> list[str]:
        """Up to ``limit`` miners to score (0 = all): those scored least recently first, ties in an order that
        changes every round (so a fixed limit rotates fairly through a large network)."""
        def order(hotkey: str) -> tuple[int, str]:
            record = self.miners.get(hotkey)
            tie = hashlib.sha256(f"{round}|{hotkey}".encode()).hexdigest()
            return (record.last_round if record else -1, tie)

        ranked = sorted(set(candidates), key=order)
        return ranked if limit <= 0 else ranked[:limit]

    # -- persistence ---------------------------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(dict(version=FORMAT_VERSION, config=asdict(self.config), last_round=self.last_round,
                               last_weights_block=self.last_weights_block, typical_best=self.typical_best,
                               miners={k: asdict(v) for k, v in sorted(self.miners.items())}), indent=1)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(self.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, config: RewardConfig) -> ScoreBook:
        """The saved book (with today's ``config``), or an empty one if there is no file."""
        path = Path(path)
        if not path.exists():
            return cls(config)
        try:
            document = json.loads(path.read_text())
            if document.get("version") not in READABLE_VERSIONS:
                raise ValueError(f"format version {document.get('version')!r}, expected one of {READABLE_VERSIONS}")
            miners = {str(k): MinerScore(**v) for k, v in document["miners"].items()}
            return cls(config, miners, int(document["last_round"]), int(document["last_weights_block"]),
                       float(document["typical_best"]))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"cannot read the score file {path}: {err}; move it away to start from zero") from None
