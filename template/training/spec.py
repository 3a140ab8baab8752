"""What every peer of one DiLoCo run must agree on: the :class:`RunSpec` and its fingerprint.

Two peers whose specs differ (model, sequence length, seeds, H, optimizers, overlap, corpus, vocabulary) would average
pseudo-gradients of different problems. The fingerprint is a hash of every such field: it names the run's averaging
groups (peers of different fingerprints never meet) and its checkpoints (a checkpoint of another run is ignored),
and :func:`template.training.joining.check_run_identity` compares the fields themselves, so that a misconfigured
peer stops at start with :class:`RunMismatchError` naming what differs instead of waiting for a group forever.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from template.training.data import TokenCorpus
from template.training.inner import InnerConfig
from template.training.outer import OuterConfig


class RunMismatchError(RuntimeError):
    """Another peer of the same run id trains a different model / data / settings."""


@dataclass(frozen=True)
class RunSpec:
    """Everything the peers of one run must agree on (its hash is the run fingerprint)."""

    run_id: str = "diloco"
    model: str = "tiny"
    seq_len: int = 128
    run_seed: int = 0
    init_seed: int = 0
    batch_size: int = 8  # sequences per inner step for the whole peer (split across its ranks)
    inner_steps: int = 50  # H
    heldout_fraction: float = 0.05
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    # round r's all-reduce runs while round r+1 trains, which takes its outer step when it lands (diloco.py): peers
    # of one run must agree, since it decides which θ every round starts from
    overlap: bool = False

    def __post_init__(self) -> None:
        if not self.run_id or "." in self.run_id:
            raise ValueError(f"run_id must be non-empty and contain no '.', got {self.run_id!r}")
        if self.inner_steps < 1 or self.batch_size < 1 or self.seq_len < 1:
            raise ValueError("inner_steps, batch_size and seq_len must be positive")

    def identity(self, corpus: TokenCorpus, vocab_size: int) -> dict[str, Any]:
        """The fields a peer compares with others, plain JSON/msgpack values."""
        fields = asdict(self)
        fields["inner"]["betas"] = list(self.inner.betas)
        return dict(fields, vocab_size=vocab_size, corpus=corpus.fingerprint, tokenizer=corpus.tokenizer_name)

    def fingerprint(self, corpus: TokenCorpus, vocab_size: int) -> str:
        return fingerprint_of(self.identity(corpus, vocab_size))


def fingerprint_of(identity: dict[str, Any]) -> str:
    """A short hash of a run's identity fields (any JSON-able dict; key order does not matter)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
