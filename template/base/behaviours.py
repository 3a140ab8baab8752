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

A behaviour never touches the all-reduce protocol itself: what it trains is what it contributes there (so a
free-rider contributes a zero Δ with zero tokens), and the averager's own checks bound what it can do to others.
"""

from __future__ import annotations

import importlib
from collections import deque

import torch

from template.training.diloco import DiLoCoPeer

Tensors = list[torch.Tensor]


class MinerBehaviour:
    """Base class: honest DiLoCo. Override ``configure`` (what to train) and/or ``submission`` (what to publish)."""

    name = "honest"

    def configure(self, peer: DiLoCoPeer) -> None:
        """Called once, before the first round: set ``peer.window_selector`` / ``peer.max_inner_steps``."""

    def submission(self, round: int, delta: Tensors, averaged: Tensors | None) -> Tensors:
        """The tensors to publish for ``round``; ``delta`` is what this miner contributed, ``averaged`` the group's Δ̄
        (None when the all-reduce failed)."""
        return delta


class Honest(MinerBehaviour):
    name = "honest"


class FreeRider(MinerBehaviour):
    name = "freerider"

    def configure(self, peer: DiLoCoPeer) -> None:
        peer.max_inner_steps = 0

    def submission(self, round: int, delta: Tensors, averaged: Tensors | None) -> Tensors:
        return [torch.zeros_like(t) for t in delta]


class Noise(MinerBehaviour):
    """Random Δ of an honest-looking norm (the norm of the group's average, per tensor)."""

    name = "noise"

    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def configure(self, peer: DiLoCoPeer) -> None:
        peer.max_inner_steps = 0

    def submission(self, round: int, delta: Tensors, averaged: Tensors | None) -> Tensors:
        reference = averaged if averaged is not None else delta
        noise = []
        for ref in reference:
            sample = torch.randn(ref.shape, generator=self._generator)
            noise.append(sample * (ref.norm() / sample.norm().clamp_min(1e-12)))
        return noise


class Scaled(MinerBehaviour):
    name = "scaled"

    def __init__(self, factor: float = 10.0) -> None:
        self.factor = factor

    def submission(self, round: int, delta: Tensors, averaged: Tensors | None) -> Tensors:
        return [t * self.factor for t in delta]


class Stale(MinerBehaviour):
    """Replays the Δ it computed ``lag`` rounds ago (honest until it has one)."""

    name = "stale"

    def __init__(self, lag: int = 2) -> None:
        self._history: deque[Tensors] = deque(maxlen=lag + 1)

    def submission(self, round: int, delta: Tensors, averaged: Tensors | None) -> Tensors:
        self._history.append([t.clone() for t in delta])
        return self._history[0]


class Overfitter(MinerBehaviour):
    """Trains on one fixed batch of its round-0 assignment, every step of every round."""

    name = "overfitter"

    def configure(self, peer: DiLoCoPeer) -> None:
        batch = peer.assigned_windows(0)[: peer.spec.batch_size]
        peer.window_selector = lambda round: batch * peer.spec.inner_steps


class Copycat(MinerBehaviour):
    """Does no work and publishes the group's Δ̄ (which every group member receives) with a little noise."""

    name = "copycat"

    def __init__(self, noise_scale: float = 1e-3, seed: int = 0) -> None:
        self.noise_scale = noise_scale
        self._generator = torch.Generator().manual_seed(seed)

    def configure(self, peer: DiLoCoPeer) -> None:
        peer.max_inner_steps = 0

    def submission(self, round: int, delta: Tensors, averaged: Tensors | None) -> Tensors:
        source = averaged if averaged is not None else delta
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
