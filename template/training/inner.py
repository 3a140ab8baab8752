"""The inner loop of DiLoCo: AdamW steps on one peer's own data, and held-out evaluation.

The learning-rate schedule (linear warmup, then cosine to ``min_lr_ratio``) runs over the global inner
step count, which — with the AdamW moments — survives rounds and checkpoints (``state_dict``), so a
peer resumes exactly where it stopped. Batches carry labels that are already shifted (see
``TokenCorpus``), so the loss here does not shift again.

Failure behaviour: a non-finite loss or gradient norm raises ``NonFiniteLossError`` *before* the
optimizer step, so the parameters and AdamW moments are those of the last good step; ``train`` stops
early (and returns what it did) when the batches run out or ``time.monotonic()`` passes the deadline,
checked before every step.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from template.training.model import autocast_context

Batch = tuple[torch.Tensor, torch.Tensor]


class NonFiniteLossError(RuntimeError):
    """The loss or gradient of an inner step was NaN/inf; the optimizer step was not applied."""


@dataclass(frozen=True)
class InnerConfig:
    """AdamW and its schedule. Defaults suit the tiny preset; bigger models want a lower ``lr``."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # matrices only; norms and biases are not decayed
    warmup_steps: int = 50
    total_steps: int = 10_000  # length of the cosine; later steps stay at the minimum
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    grad_accum_steps: int = 1  # micro-batches per optimizer step

    def __post_init__(self) -> None:
        if self.grad_accum_steps < 1 or self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(f"invalid inner schedule: {self}")

    def lr_at(self, step: int) -> float:
        """Learning rate of global inner step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)


@dataclass(frozen=True)
class InnerStats:
    """What one ``train`` call did. Losses are ``None`` when no step ran."""

    steps: int
    tokens: int  # input tokens processed: the peer's weight in the all-reduce
    mean_loss: float | None
    last_loss: float | None
    seconds: float


def causal_lm_loss(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``labels[:, t]`` is the token that follows ``input_ids[:, t]``."""
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))


class InnerTrainer:
    def __init__(self, model: torch.nn.Module, config: InnerConfig, device: str | torch.device) -> None:
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.step = 0  # global inner step: drives the schedule across rounds
        decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": config.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=config.lr_at(0),
            betas=config.betas,
            eps=config.eps,
        )

    def train(self, batches: Iterable[Batch], max_steps: int, deadline: float | None = None) -> InnerStats:
        """Up to ``max_steps`` optimizer steps, each over ``grad_accum_steps`` micro-batches."""
        started = time.monotonic()
        self.model.train()
        batch_iter = iter(batches)
        losses: list[float] = []
        tokens = 0
        while len(losses) < max_steps:
            if deadline is not None and time.monotonic() >= deadline:
                break
            micro_batches = list(itertools.islice(batch_iter, self.config.grad_accum_steps))
            if not micro_batches:
                break
            losses.append(self._optimizer_step(micro_batches))
            tokens += sum(input_ids.numel() for input_ids, _ in micro_batches)
        return InnerStats(
            steps=len(losses),
            tokens=tokens,
            mean_loss=sum(losses) / len(losses) if losses else None,
            last_loss=losses[-1] if losses else None,
            seconds=time.monotonic() - started,
        )

    def _optimizer_step(self, micro_batches: list[Batch]) -> float:
        lr = self.config.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for input_ids, labels in micro_batches:
            with autocast_context(self.device):
                loss = causal_lm_loss(self.model, input_ids.to(self.device), labels.to(self.device))
            (loss / len(micro_batches)).backward()
            total += loss.detach() / len(micro_batches)
        loss_value = float(total)
        if not math.isfinite(loss_value):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"inner step {self.step}: loss is {loss_value}")
        if self.config.grad_clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip))
            if not math.isfinite(norm):
                self.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteLossError(f"inner step {self.step}: gradient norm is {norm}")
        self.optimizer.step()
        self.step += 1
        return loss_value

    def state_dict(self) -> dict[str, Any]:
        """AdamW moments and the global step (torch's nested dict; ``checkpoint.flatten_state`` stores it)."""
        return {"step": self.step, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.optimizer.load_state_dict(state["optimizer"])


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch], device: str | torch.device) -> float:
    """Token-weighted mean loss over ``batches``; restores the model's train/eval mode afterwards."""
    device = torch.device(device)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for input_ids, labels in batches:
            with autocast_context(device):
                loss = causal_lm_loss(model, input_ids.to(device), labels.to(device))
            total += float(loss) * labels.numel()
            count += labels.numel()
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluate() got no batches")
    return total / count
