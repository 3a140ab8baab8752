"""Miner behaviours: what a miner trains on and what it publishes each round, chosen with ``--miner.behaviour``.

The default, :class:`Honest`, is plain DiLoCo: H inner steps on the windows assigned to this hotkey for the round,
then it publishes exactly the pseudo-gradient Δ it contributed to the all-reduce. The others are the attacks the
validator must defeat; the validator tests run them, and researchers use the same hook for new attacks or training
strategies (``--miner.behaviour my_module:MyBehaviour``, a subclass of :class:`MinerBehaviour`).

| name         | trains                              | publishes                                  |
|--------------|-------------------------------------|--------------------------------------------|
| honest       | its assigned windows, H steps       | its Δ                                      |
| freerider    | nothing                             | zeros                                      |
| noise        | nothing                             | random noise scaled to the last honest norm|
| scaled       | its assigned windows                | its Δ × ``factor`` (10)                     |
| stale        | its assigned windows                | the Δ it published ``lag`` (2) rounds ago   |
| overfitter   | one fixed batch, over and over      | its Δ                                      |
| copycat      | nothing                             | the group's averaged Δ̄ of the round, plus small noise |

A behaviour is two functions of values: :meth:`MinerBehaviour.plan` turns the engine's plain plan for a round into
what this miner trains (steps, windows), and :meth:`MinerBehaviour.publication` picks what to publish from the
round's outcome. It never touches the all-reduce protocol itself: what it trains is what it contributes there (so a
free-rider contributes a zero Δ with zero tokens), and the averager's own checks bound what it can do to others.
"""

from __future__ import annotations

import importlib
from collections import deque
from dataclasses import replace

import torch

from template.training.round import RoundOutcome, RoundPlan, Tensors


class MinerBehaviour:
    """Base class: honest DiLoCo. Override ``plan`` (what to train) and/or ``publication`` (what to publish)."""

    name = "honest"

    def plan(self, plan: RoundPlan) -> RoundPlan:
        """What to train this round, given the plain DiLoCo plan (H steps on the assigned windows)."""
        return plan

    def publication(self, outcome: RoundOutcome) -> Tensors | None:
        """The tensors to publish for ``outcome.round``: ``outcome.delta`` is what this miner contributed,
        ``outcome.averaged`` the group's Δ̄ (None when the all-reduce failed). None publishes nothing."""
        return outcome.delta


class Honest(MinerBehaviour):
    name = "honest"


def _trains_nothing(plan: RoundPlan) -> RoundPlan:
    return replace(plan, max_steps=0)


class FreeRider(MinerBehaviour):
    name = "freerider"

    def plan(self, plan: RoundPlan) -> RoundPlan:
        return _trains_nothing(plan)

    def publication(self, outcome: RoundOutcome) -> Tensors | None:
        return None if outcome.delta is None else [torch.zeros_like(t) for t in outcome.delta]


class Noise(MinerBehaviour):
    """Random Δ of an honest-looking norm (the norm of the group's average, per tensor)."""

    name = "noise"

    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def plan(self, plan: RoundPlan) -> RoundPlan:
        return _trains_nothing(plan)

    def publication(self, outcome: RoundOutcome) -> Tensors | None:
        reference = outcome.averaged if outcome.averaged is not None else outcome.delta
        if reference is None:
            return None
        noise = []
        for ref in reference:
            sample = torch.randn(ref.shape, generator=self._generator)
            noise.append(sample * (ref.norm() / sample.norm().clamp_min(1e-12)))
        return noise


class Scaled(MinerBehaviour):
    name = "scaled"

    def __init__(self, factor: float = 10.0) -> None:
        self.factor = factor

    def publication(self, outcome: RoundOutcome) -> Tensors | None:
        return None if outcome.delta is None else [t * self.factor for t in outcome.delta]


class Stale(MinerBehaviour):
    """Replays the Δ it computed ``lag`` rounds ago (honest until it has one)."""

    name = "stale"

    def __init__(self, lag: int = 2) -> None:
        self._history: deque[Tensors] = deque(maxlen=lag + 1)

    def publication(self, outcome: RoundOutcome) -> Tensors | None:
        if outcome.delta is None:
            return None
        self._history.append([t.clone() for t in outcome.delta])
        return self._history[0]


class Overfitter(MinerBehaviour):
    """Trains on one fixed batch — the first of its first round's assignment — every step of every round."""

    name = "overfitter"

    def __init__(self) -> None:
        self._batch: tuple[int, ...] | None = None

    def plan(self, plan: RoundPlan) -> RoundPlan:
        if self._batch is None:
            batch_size = len(plan.windows) // max(plan.max_steps, 1)
            self._batch = plan.windows[:batch_size]
        return replace(plan, windows=self._batch * plan.max_steps)


class Copycat(MinerBehaviour):
    """Does no work and publishes the group's Δ̄ (which every group member receives) with a little noise."""

    name = "copycat"

    def __init__(self, noise_scale: float = 1e-3, seed: int = 0) -> None:
        self.noise_scale = noise_scale
        self._generator = torch.Generator().manual_seed(seed)

    def plan(self, plan: RoundPlan) -> RoundPlan:
        return _trains_nothing(plan)

    def publication(self, outcome: RoundOutcome) -> Tensors | None:
        source = outcome.averaged if outcome.averaged is not None else outcome.delta
        if source is None:
            return None
        return [t + self.noise_scale * t.std().nan_to_num(0.0) * torch.randn(t.shape, generator=self._generator)
                for t in source]


BUILTIN = {cls.name: cls for cls in (Honest, FreeRider, Noise, Scaled, Stale, Overfitter, Copycat)}


def load_behaviour(spec: str) -> MinerBehaviour:
    """A built-in name (``honest``, ``copycat``, ...) or ``module:Class``; ValueError with the choices otherwise."""
    if spec in BUILTIN:
        return BUILTIN[spec]()
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"unknown behaviour {spec!r}: use one of {sorted(BUILTIN)} or module:Class")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot load behaviour {spec!r}: {err}") from None
    if not (isinstance(cls, type) and issubclass(cls, MinerBehaviour)):
        raise ValueError(f"{spec!r} is not a MinerBehaviour subclass")
    return cls()
