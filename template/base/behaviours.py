"""Miner behaviours: what a miner trains, contributes and publishes each round, chosen with ``--miner.behaviour``.

The default, :class:`Honest`, is plain DiLoCo: H inner steps on the windows assigned to this hotkey for the round,
then it contributes its pseudo-gradient Δ to the all-reduce and publishes exactly the bytes it contributed. The others
are the attacks the validator must defeat; the validator tests run them, and researchers use the same hooks for new
attacks or training strategies (``--miner.behaviour my_module:MyBehaviour``, a subclass of :class:`MinerBehaviour`).

| name           | trains                           | contributes to the all-reduce          | publishes              |
|----------------|----------------------------------|----------------------------------------|------------------------|
| honest         | its assigned windows, H steps    | its Δ                                  | what it contributed    |
| freerider      | nothing                          | zeros                                  | what it contributed    |
| noise          | nothing                          | noise of the last Δ̄'s norm             | what it contributed    |
| scaled         | its assigned windows             | its Δ × ``factor`` (10)                 | what it contributed    |
| stale          | its assigned windows             | its Δ of ``lag`` (2) rounds ago         | what it contributed    |
| replayer       | its first round only             | its first round's Δ, every round        | what it contributed    |
| overfitter     | one fixed batch, over and over   | its Δ                                  | what it contributed    |
| copycat        | nothing                          | the last Δ̄ it received, + small noise  | what it contributed    |
| noisy-average  | 1 inner step (claims its tokens) | the last Δ̄ it received + ``rel`` noise  | what it contributed    |
| stale-average  | 1 inner step                     | the Δ̄ of ``lag`` (2) rounds ago + noise | what it contributed    |
| partial        | ``fraction`` of its H steps      | its Δ                                  | what it contributed    |
| skips-one      | as honest                        | its Δ (zeros in its 3rd round: lost)   | what it contributed    |
| twofaced       | its assigned windows             | −Δ                                     | Δ                      |
| twofaced-zero  | its assigned windows             | ~0 (1e-6 × Δ), its tokens claimed       | Δ                      |
| equivocator    | its assigned windows             | segments other than those it committed | what it committed      |
| liar-reducer   | its assigned windows             | its Δ; as an owner, wrong averages     | what it contributed    |
| framer         | its assigned windows             | its Δ; as an owner, refuses a sender   | what it contributed    |
| liar-reducer-forged | its assigned windows        | its Δ; as an owner, wrong averages     | what it contributed    |
|                |                                  | and one claim forged to fit them       |                        |
| false-disputer | its assigned windows             | its Δ; disputes owners' true statements | what it contributed   |
|                |                                  | of its input                           |                        |
| concentrated   | its assigned windows             | its Δ with ``share`` (0.5) of its norm  | what it contributed    |
|                |                                  | moved into ``values`` (8) coordinates  |                        |

:attr:`MinerBehaviour.honest` marks the behaviours that do honest work (``honest``, ``skips-one``, and a plug-in that
sets it or subclasses :class:`Honest`): the local network's report judges the model and the rounds by those miners.

A behaviour is a few functions of values: :meth:`MinerBehaviour.plan` turns the engine's plain plan for a round into
what this miner trains (steps, windows); :meth:`MinerBehaviour.contribution` chooses what enters the all-reduce —
encoded once, committed by the hotkey and sent as exactly those bytes; :meth:`MinerBehaviour.publication` may publish
something other than the contribution (validators then see that the publication is not what went in);
:meth:`MinerBehaviour.after_round` sees each round's outcome. :attr:`MinerBehaviour.allreduce_faults` are
misbehaviours inside the all-reduce protocol (:class:`~template.allreduce.terms.AllReduceFaults`).
Since a contribution is committed before the round's average exists, no behaviour can contribute the current round's
Δ̄: copies can only be of what a miner has (an older Δ̄, a leaked Δ, its own old Δ).
"""

from __future__ import annotations

import importlib
from collections import deque
from dataclasses import replace

import torch

from template.allreduce.terms import AllReduceFaults
from template.training.round import RoundOutcome, RoundPlan, Tensors


class MinerBehaviour:
    """Base class: honest DiLoCo. Override what differs (module docstring)."""

    name = "honest"
    honest = False  # does honest work (the local network's report counts such miners as honest)
    allreduce_faults = AllReduceFaults()

    def plan(self, plan: RoundPlan) -> RoundPlan:
        """What to train this round, given the plain DiLoCo plan (H steps on the assigned windows)."""
        return plan

    def contribution(self, round: int, delta: Tensors) -> Tensors:
        """What enters round ``round``'s all-reduce, given this miner's Δ."""
        return delta

    def publication(self, outcome: RoundOutcome) -> Tensors | None:
        """Tensors to publish *instead of* the contribution (None: publish exactly what was contributed)."""
        return None

    def after_round(self, outcome: RoundOutcome) -> None:
        """Called with every round's outcome (for behaviours that remember)."""


class Honest(MinerBehaviour):
    name = "honest"
    honest = True


class SkipsOne(Honest):
    """Honest, but one of its all-reduces is lost (its ``skip``-th round, counted from 1): it trains that round as
    usual — its learning-rate schedule moves on, as a miner's does when its contribution is lost after training —
    but what enters the all-reduce is an empty Δ, and it holds the same θ as everyone after it. A round missed through
    nobody's proven fault, which should cost it about one round's credit, never more. (Training nothing that round
    instead also leaves its schedule a round behind everyone's for the rest of warm-up: measured, that cost it 23–65 %
    of its credit in each of the next three rounds.)"""

    name = "skips-one"

    def __init__(self, skip: int = 3) -> None:
        self.skip = skip
        self._contributed = 0

    def contribution(self, round: int, delta: Tensors) -> Tensors:
        self._contributed += 1
        return [torch.zeros_like(t) for t in delta] if self._contributed == self.skip else delta


def _trains_nothing(plan: RoundPlan) -> RoundPlan:
    return replace(plan, max_steps=0)


def _noise_like(tensors: Tensors, scale: float, generator: torch.Generator) -> Tensors:
    """Per tensor: random noise with ``scale`` × that tensor's norm."""
    noise = []
    for t in tensors:
        sample = torch.randn(t.shape, generator=generator)
        noise.append(sample * (scale * t.norm() / sample.norm().clamp_min(1e-12)))
    return noise


class _RemembersAverage(MinerBehaviour):
    """Keeps the last ``lag + 1`` averages Δ̄ it received (copies can only be of what a miner has); ``held_average``
    is the oldest of them — with ``lag`` 0, the last one — or None before the first."""

    lag = 0

    def __init__(self) -> None:
        self._averages: deque[Tensors] = deque(maxlen=self.lag + 1)

    def after_round(self, outcome: RoundOutcome) -> None:
        if outcome.averaged is not None:
            self._averages.append([t.clone() for t in outcome.averaged])

    @property
    def held_average(self) -> Tensors | None:
        return self._averages[0] if self._averages else None


class FreeRider(MinerBehaviour):
    name = "freerider"

    def plan(self, plan: RoundPlan) -> RoundPlan:
        return _trains_nothing(plan)

    def contribution(self, round: int, delta: Tensors) -> Tensors:
        return [torch.zeros_like(t) for t in delta]


class Noise(_RemembersAverage):
    """Random Δ of an honest-looking norm (the norm of the last Δ̄ it received, per tensor)."""

    name = "noise"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._generator = torch.Generator().manual_seed(seed)

    def plan(self, plan: RoundPlan) -> RoundPlan:
        return _trains_nothing(plan)

    def contribution(self, round: int, delta: Tensors) -> Tensors:
        reference = self.held_average if self.held_average is not None else [torch.ones_like(t) for t in delta]
        return _noise_like(reference, 1.0, self._generator)


class Scaled(MinerBehaviour):
    name = "scaled"

    def __init__(self, factor: float = 10.0) -> None:
        self.factor = factor

    def contribution(self, round: int, delta: Tensors) -> Tensors:
        return [t * self.factor for t in delta]


class Stale(MinerBehaviour):
    """Replays the Δ it computed ``lag`` rounds ago (honest until it has one)."""

    name = "stale"

    def __init__(self, lag: int = 2) -> None:
        self._history: deque[Tensors] = deque(maxlen=lag + 1)

    def contribution(self, round: int, delta: Tensors) -> Tensors:
        self._history.append([t.clone() for t in delta])
        return self._history[0]


class Replayer(MinerBehaviour):
    """Trains its first round, then re-sends that Δ every round without training: the lazy replay that a validator
    holding the sketch of any round it scored names as such. (:class:`Stale` replays Δs it never showed, which no
    sketch can match: the validator refuses those because its own model θ_r − Δ is worse than θ_r.)"""

    name = "replayer"

    def __init__(self) -> None:
        self._first: Tensors | None = None

    def plan(self, plan: RoundPlan) -> RoundPlan:
        return plan if self._first is None else _trains_nothing(plan)

    def contribution(self, round: int, delta: Tensors) -> Tensors:
        if self._first is None:
            self._first = [t.clone() for t in delta]
        return [t.clone() for t in self._first]


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


class Copycat(_RemembersAverage):
    """Does no work and contributes the last Δ̄ it received (the freshest average it can have) with a little noise."""

    name = "copycat"

    def __init__(self, noise_scale: float = 1e-3, seed: int = 0) -> None:
        super().__init__()
        self.noise_scale = noise_scale
        self._generator = torch.Generator().manual_seed(seed)

    def plan(self, plan: RoundPlan) -> RoundPlan:
        return _trains_nothing(plan)

    def contribution(self, round: int, delta: Tensors) -> Tensors:
        source = self.held_average if self.held_average is not None else delta
        return [t + self.noise_scale * t.std().nan_to_num(0.0) * torch.randn(t.shape, generator=self._generator)
                for t in source]


class _OneStepAverage(_RemembersAverage):
    """Runs one inner step, so that it takes part in the round with tokens, and contributes a Δ̄ it received plus
    Gaussian noise of ``rel`` × that Δ̄'s norm (per tensor): the cheap copier of the group's work. It uses the oldest
    of the last ``lag + 1`` averages it holds; its own one-step Δ until it has received one."""

    def __init__(self, rel: float = 0.15, seed: int = 0) -> None:
        if rel < 0:
            raise ValueError(f"{self.name}: the relative noise must be >= 0, not {rel}")
        super().__init__()
        self.rel = rel
        self._generator = torch.Generator().manual_seed(seed)

    def plan(self, plan: RoundPlan) -> RoundPlan:
        return replace(plan, max_steps=min(plan.max_steps, 1))

    def contribution(self, round: int, delta: Tensors) -> Tensors:
        source = self.held_average
        if source is None:
            return delta
        return [t + n for t, n in zip(source, _noise_like(source, self.rel, self._generator), strict=True)]


class NoisyAverage(_OneStepAverage):
    """The freshest Δ̄ it has (the previous round's: the current one does not exist when contributions are made)."""

    name = "noisy-average"


class StaleAverage(_OneStepAverage):
    """An older round's Δ̄ (``lag`` rounds before the freshest), to slip past replay checks of the latest average."""

    name = "stale-average"
    lag = 2


class Partial(MinerBehaviour):
    """Honest, but runs only ``fraction`` of the inner steps (at least one): its reward should shrink to match."""

    name = "partial"

    def __init__(self, fraction: float = 0.5) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"partial: the fraction of inner steps must be within (0, 1], not {fraction}")
        self.fraction = fraction

    def plan(self, plan: RoundPlan) -> RoundPlan:
        return replace(plan, max_steps=max(1, round(self.fraction * plan.max_steps)))


class _PublishesTheHonestDelta(MinerBehaviour):
    """Trains honestly and publishes its Δ, whatever it contributed."""

    def __init__(self) -> None:
        self._delta: Tensors | None = None

    def contribution(self, round: int, delta: Tensors) -> Tensors:
        self._delta = [t.clone() for t in delta]
        return self.poisoned(delta)

    def poisoned(self, delta: Tensors) -> Tensors:
        raise NotImplementedError

    def publication(self, outcome: RoundOutcome) -> Tensors | None:
        return self._delta


class TwoFaced(_PublishesTheHonestDelta):
    """Publishes its honest Δ, contributes −Δ (cancelling an honest miner's work in θ)."""

    name = "twofaced"

    def poisoned(self, delta: Tensors) -> Tensors:
        return [-t for t in delta]


class TwoFacedZero(_PublishesTheHonestDelta):
    """Publishes its honest Δ, contributes almost nothing while claiming its tokens."""

    name = "twofaced-zero"

    def poisoned(self, delta: Tensors) -> Tensors:
        return [1e-6 * t for t in delta]


class Equivocator(MinerBehaviour):
    """Commits to its honest Δ, then sends the owners of its segments other bytes (signing what it sends)."""

    name = "equivocator"
    allreduce_faults = AllReduceFaults(corrupt_segments=True)


class LiarReducer(MinerBehaviour):
    """Trains and contributes honestly; as the owner of segments, returns the negated average to every member."""

    name = "liar-reducer"
    allreduce_faults = AllReduceFaults(lie="all")


class SplitLiarReducer(MinerBehaviour):
    """As an owner, returns the true average to some members and a wrong one to the others (signing both)."""

    name = "liar-reducer-some"
    allreduce_faults = AllReduceFaults(lie="some")


class Framer(MinerBehaviour):
    """As an owner, refuses another sender's segments claiming it sent other bytes, with a forged proof."""

    name = "framer"
    allreduce_faults = AllReduceFaults(frame=True)


class ForgingLiarReducer(MinerBehaviour):
    """As an owner, returns the negated average to every member with every claim true but one, forged to fit: its own
    input's (which no other member holds) below 6 senders (``OwnerRule.own_input_min_senders``), another sender's from
    there (which that sender disputes)."""

    name = "liar-reducer-forged"
    allreduce_faults = AllReduceFaults(lie="forged-own")


class FalseDisputer(MinerBehaviour):
    """Trains and contributes honestly; as a sender, disputes every other owner's (true) statement of its input, so
    that every member drops those segments (the validator convicts it, never the owner)."""

    name = "false-disputer"
    allreduce_faults = AllReduceFaults(dispute=True)


class Concentrated(MinerBehaviour):
    """Trains honestly, then moves ``share`` of its Δ's squared norm into ``values`` coordinates of its largest tensor
    — the same coordinates, pushed the same way, every round — and scales the rest down so that the total norm stays
    its honest one: an edit of θ that no norm check sees, which would accumulate in θ at its token share every round
    (the attack behind :class:`template.allreduce.reduction.OwnerRule`'s value bound)."""

    name = "concentrated"

    def __init__(self, values: int = 8, share: float = 0.5) -> None:
        if values < 1 or not 0 < share < 1:
            raise ValueError(f"concentrated: need values >= 1 and a share within (0, 1), not {values} and {share}")
        self.values, self.share = values, share

    def contribution(self, round: int, delta: Tensors) -> Tensors:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in delta]))
        target = max(range(len(delta)), key=lambda i: delta[i].numel())
        edited = [t * (1 - self.share) ** 0.5 for t in delta]
        flat = edited[target].view(-1)
        count = min(self.values, flat.numel())
        flat[torch.linspace(0, flat.numel() - 1, count).long()] = norm * (self.share / count) ** 0.5
        return edited


BUILTIN = {cls.name: cls for cls in (Honest, FreeRider, Noise, Scaled, Stale, Replayer, Overfitter, Copycat,
                                      NoisyAverage, StaleAverage, Partial, TwoFaced, TwoFacedZero, Equivocator,
                                      LiarReducer, SplitLiarReducer, Framer, ForgingLiarReducer, FalseDisputer,
                                      SkipsOne, Concentrated)}
# the built-ins that take options, and which (``--miner.rel``, ``--miner.fraction``, ``--miner.values``, ...)
OPTIONS = {NoisyAverage: ("rel",), StaleAverage: ("rel",), Partial: ("fraction",), Concentrated: ("values", "share")}


def load_behaviour(spec: str, **options: float | int | None) -> MinerBehaviour:
    """A built-in name (``honest``, ``copycat``, ...) or ``module:Class``; ValueError with the choices otherwise.

    ``options`` (``rel``, ``fraction``, ``values``, ``share``) reach the built-ins that take them (:data:`OPTIONS`);
    None keeps their defaults.
    """
    if spec in BUILTIN:
        cls = BUILTIN[spec]
        return cls(**{name: options[name] for name in OPTIONS.get(cls, ()) if options.get(name) is not None})
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
