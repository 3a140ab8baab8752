"""Scores over time → weights, and which miners to score next. Persisted atomically, restored on restart.

**A round's score.** The scorer (:mod:`template.validation.round`) hands each scored miner's *quality*: its credit
beyond the best free update, × coverage × share (0 when a check failed or nothing was fetched). Per scored round each
quality becomes a *relative* score ``q_i / max(max_j q_j, floor)``, where ``floor`` is ``best_floor`` (1) × a moving
average of earlier rounds' best scores (weight ``typical_alpha`` = 0.3 on the newest): each round is measured against
the larger of its own best and what the best typically earns, so rounds early in training (large gains) and later
(smaller gains) count about alike, while a round in which nobody's update helped much — a round of little signal,
whose credits are mostly evaluation noise, or one in which every good miner was missing — hands out little to anyone
instead of letting noise decide who is "the best".
Measured on the local network (docs/validation.md): with the floor at 0.1 × the typical best one such round (best
credit 0.019 nats against ~0.1 typical; honest credits 0.019, 0.006 and −0.010) made three honest miners' weights
1.38× apart; at 1 × the typical best, 1.20×. The typical best follows the rounds' bests quickly (α 0.3) because
credit falls 5–10× over the first rounds of training: averaged slowly (α 0.1) it lagged so far behind that late rounds
paid a fraction of early ones, and a miner whose contribution was lost in an early round kept 0.81–0.85 of an honest
miner's weight; replayed on the same rounds with α 0.3, 0.88–0.90 (fairness benchmark, docs/benchmarks.md §5b).

**Over rounds: linear pay.** The relative scores are averaged per miner with an exponential moving average::

    ema_i ← (1 − α)·ema_i + α·relative_i          (α = ema_alpha, for the miners scored this round)

and weights are ``ema_i ** power`` normalized to sum to 1, with ``power`` 1 by default: pay is proportional to the
credit accumulated over the last ~1/α rounds. With α = 0.1 a round missed without anyone's proven fault (a timeout, a
partial all-reduce) counts as a round without credit, never as a conviction: a miner that missed 1 of its first 10
rounds holds 85–95 % of the weight of one that missed none (85 % when the missed round is the newest), and the
difference fades as more rounds follow. A power > 1 would turn evaluation noise between equal miners into a large
difference in pay (α = 0.5 and power 2.5, the earlier defaults, paid two honest miners 91 % / 9 %); it is no longer
needed to hide copiers, whose credit beyond the free update is ~0 in every round (docs/validation.md, measured).

The one exception to "a round without credit": a miner whose own end-of-round model was *significantly* worse than
θ_r (:mod:`template.validation.scoring`) forfeits what it had accumulated — it showed that it does not train as it
claims, and its earlier credit (an overfitter's small step helps early in training) is not trusted.

Scores are keyed by hotkey, not uid: a uid that is re-registered by another hotkey starts from zero.

On failure: :meth:`ScoreBook.save` writes a temporary file, fsyncs it and renames it over the old one, so a crash
leaves either the previous or the new book; :meth:`ScoreBook.load` refuses a file it cannot parse (ValueError naming
it) instead of silently starting over; a book of an earlier format (with evidence fields) is read without them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # version 2 books also kept each miner's evidence, version 1 books did not


@dataclass(frozen=True)
class RewardConfig:
    ema_alpha: float = 0.1
    power: float = 1.0
    best_floor: float = 1.0  # × the moving average of the rounds' best scores
    typical_alpha: float = 0.3  # weight of the newest round's best in that moving average

    def __post_init__(self) -> None:
        if not (0 < self.ema_alpha <= 1 and self.power > 0 and 0 <= self.best_floor <= 1
                and 0 < self.typical_alpha <= 1):
            raise ValueError(f"invalid reward settings: {self}")


@dataclass
class MinerScore:
    ema: float = 0.0
    last_round: int = -1  # the last round this miner was scored for (-1: never)
    last_score: float = 0.0  # its relative score then
    last_reason: str = ""
    rounds_scored: int = 0

    @classmethod
    def of(cls, document: Mapping[str, object]) -> MinerScore:
        """A saved miner (fields of earlier formats that are no longer kept are dropped)."""
        return cls(**{name: document[name] for name in cls.__dataclass_fields__ if name in document})


@dataclass
class ScoreBook:
    config: RewardConfig = field(default_factory=RewardConfig)
    miners: dict[str, MinerScore] = field(default_factory=dict)
    last_round: int = -1  # the newest round scored
    last_weights_block: int = -1
    typical_best: float = 0.0  # moving average of each round's best score (0 until the first positive one)

    def update(self, round: int, scores: Mapping[str, float], reasons: Mapping[str, str] | None = None,
               forfeit: Iterable[str] = ()) -> None:
        """Fold in the qualities (≥ 0) of the miners scored for ``round``; the miners in ``forfeit`` lose what they
        had accumulated first (their own model showed, significantly, that they do not train as they claim)."""
        for hotkey in forfeit:
            self.miners.setdefault(hotkey, MinerScore()).ema = 0.0
        if any(not (value >= 0) for value in scores.values()):
            raise ValueError("round scores must be >= 0")
        best = max(scores.values(), default=0.0)
        alpha = self.config.ema_alpha
        reference = max(best, self.config.best_floor * self.typical_best)
        if best > 0:
            follow = self.config.typical_alpha
            self.typical_best = best if self.typical_best == 0 else (1 - follow) * self.typical_best + follow * best
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
            miners = {str(k): MinerScore.of(v) for k, v in document["miners"].items()}
            return cls(config, miners, int(document["last_round"]), int(document["last_weights_block"]),
                       float(document["typical_best"]))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"cannot read the score file {path}: {err}; move it away to start from zero") from None
