"""Integrity checks on published pseudo-gradients: well-formed, a plausible size, not a copy, not a replay.

These checks are cheap and run before any loss is computed. Each returns a short reason string (or None when the
submission passes), so the validator can log and report *why* a miner got nothing.

- :func:`check_tensors`: one tensor per parameter, the model's shapes, finite values.
- :func:`check_norm`: a Δ much smaller than the round's typical Δ is no work (a free-rider publishes zeros); one much
  larger is an attempt to dominate (a Δ scaled ×10). The reference is the *lower median* of the round's norms, so
  that a minority of inflated submissions cannot move it.
- :class:`Sketch` and :func:`find_copies`: near-identical Δs between miners of the same round (the later publisher
  is the copier), a Δ that replays an earlier round's Δ (its own or anyone's), and a Δ that is just the group's
  average Δ̄ re-published. Vectors are compared through a sketch — the values at a fixed random sample of
  coordinates, drawn from the validator's private seed — so the history a validator keeps is small (a few thousand
  floats per submission) whatever the model size, and a copier cannot tell which coordinates to perturb.

Nothing here knows about hivemind or the chain: it looks at tensors and numbers it is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Tensors = Sequence[torch.Tensor]


@dataclass(frozen=True)
class IntegrityConfig:
    """Thresholds of the integrity checks (see the module docstring for why each exists)."""

    max_norm_multiple: float = 3.0  # a Δ above this × the round's lower-median norm is refused
    min_norm_fraction: float = 1e-3  # a Δ below this × the reference norm is "no work"
    copy_cosine: float = 0.995  # sketches at least this similar are the same Δ (honest pairs measured ≤ 0.98)
    sketch_size: int = 4096

    def __post_init__(self) -> None:
        if not (self.max_norm_multiple > 1 and 0 <= self.min_norm_fraction < 1 and 0 < self.copy_cosine <= 1):
            raise ValueError(f"invalid integrity thresholds: {self}")
        if self.sketch_size < 16:
            raise ValueError("sketch_size must be at least 16")


def check_tensors(tensors: Tensors, shapes: Sequence[torch.Size]) -> str | None:
    """None if ``tensors`` has the model's layout and only finite values, else why not."""
    if len(tensors) != len(shapes):
        return f"{len(tensors)} tensors, the model has {len(shapes)}"
    for index, (tensor, shape) in enumerate(zip(tensors, shapes, strict=True)):
        if tensor.shape != shape:
            return f"tensor {index} has shape {tuple(tensor.shape)}, expected {tuple(shape)}"
        if not tensor.is_floating_point():
            return f"tensor {index} is {tensor.dtype}, not a float"
        if not bool(torch.isfinite(tensor).all()):
            return f"tensor {index} holds NaN or inf"
    return None


def total_norm(tensors: Tensors) -> float:
    """L2 norm of all tensors taken as one vector (float64 accumulation)."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def reference_norm(norms: Sequence[float]) -> float | None:
    """The lower median of the positive norms, or None when there are none."""
    positive = sorted(n for n in norms if n > 0)
    return positive[(len(positive) - 1) // 2] if positive else None


def check_norm(norm: float, reference: float | None, config: IntegrityConfig) -> str | None:
    """None if ``norm`` is within [min_norm_fraction, max_norm_multiple] × ``reference``, else why not."""
    if reference is None or norm <= config.min_norm_fraction * reference:
        return "empty update (norm ~0): no training"
    if norm > config.max_norm_multiple * reference:
        return f"norm {norm:.3g} is over {config.max_norm_multiple:g}x the round's reference {reference:.3g}"
    return None


class Sketch:
    """The values of a Δ at ``size`` coordinates drawn once from ``seed`` (the validator's secret)."""

    def __init__(self, shapes: Sequence[torch.Size], size: int, seed: int) -> None:
        numels = [math.prod(shape) for shape in shapes]
        total = sum(numels)
        generator = torch.Generator().manual_seed(seed)
        flat = torch.randperm(total, generator=generator)[: min(size, total)].sort().values
        offsets = torch.tensor([0, *numels]).cumsum(0)
        tensor_index = torch.searchsorted(offsets, flat, right=True) - 1
        self._picks = [(i, flat[tensor_index == i] - offsets[i]) for i in range(len(shapes))]
        self._picks = [(i, local) for i, local in self._picks if local.numel()]
        self.size = int(flat.numel())

    def of(self, tensors: Tensors) -> torch.Tensor:
        return torch.cat([tensors[i].reshape(-1)[local].float() for i, local in self._picks])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    denominator = float(a.norm()) * float(b.norm())
    return float(a @ b) / denominator if denominator > 0 else 0.0


@dataclass(frozen=True)
class Submission:
    """What copy detection needs to know of one miner's Δ in one round."""

    hotkey: str
    sketch: torch.Tensor
    published_at_block: int
    announced_tokens: bool = True  # it announced a token weight > 0 to the round's group (it claims to have trained)


# |z| of the paired test (find_copies) from which it alone decides which of two near-copies is the original.
COPY_DECISIVE_Z = 2.0


def find_copies(submissions: Sequence[Submission], threshold: float,
                paired_z: Callable[[Submission, Submission], float]) -> dict[str, str]:
    """``{copier: original}`` for every pair of near-identical submissions of one round.

    First, a miner that announced no tokens to the round's group declared that it trained nothing: it cannot be
    the author of an update its twin announced tokens for. Then ``paired_z(a, b)``, the significance of the shared
    update helping a's assigned data more than b's (positive: a trained it), which a copier cannot fake, since the Δ
    it copied was trained on someone else's assignment: when it is decisive (``COPY_DECISIVE_Z``) it decides.
    Otherwise the earlier signature does — a copy that leaked before the original was committed can be signed as
    early as the original, or a block earlier, which is why the block comes after the paired test — then the sign of
    ``paired_z``. When nothing tells them apart, both are flagged.
    """
    copies: dict[str, str] = {}
    for i, a in enumerate(submissions):
        for b in submissions[i + 1:]:
            if cosine(a.sketch, b.sketch) < threshold:
                continue
            if a.announced_tokens != b.announced_tokens:
                original, copier = (a, b) if a.announced_tokens else (b, a)
                copies.setdefault(copier.hotkey, original.hotkey)
                continue
            z = paired_z(a, b)
            if abs(z) >= COPY_DECISIVE_Z:
                original, copier = (a, b) if z > 0 else (b, a)
            elif a.published_at_block != b.published_at_block:
                original, copier = (a, b) if a.published_at_block < b.published_at_block else (b, a)
            elif z != 0:
                original, copier = (a, b) if z > 0 else (b, a)
            else:
                copies[a.hotkey], copies[b.hotkey] = b.hotkey, a.hotkey
                continue
            copies.setdefault(copier.hotkey, original.hotkey)
    return copies


def find_replays(sketch: torch.Tensor, history: Sequence[tuple[str, torch.Tensor]], threshold: float) -> str | None:
    """The label of the first earlier Δ (``(label, sketch)``) that ``sketch`` repeats, or None."""
    for label, earlier in history:
        if cosine(sketch, earlier) >= threshold:
            return label
    return None
