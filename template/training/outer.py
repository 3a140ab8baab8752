"""The outer loop of DiLoCo: the global parameters θ_r and their Nesterov-momentum SGD step.

θ_r and the momentum buffer live on the CPU in float32, so they cost no accelerator memory and every
peer runs the same CPU arithmetic: given the same averaged pseudo-gradient Δ̄, two peers that held the
same θ_r and momentum compute bit-identical θ_{r+1} (``theta_hash`` proves it between machines).

Failure behaviour: ``step`` checks Δ̄ (count, shapes, finiteness) before touching anything and raises
``ValueError`` on a mismatch, leaving θ_r and the momentum unchanged; ``load_state_dict`` validates
the whole state before copying any of it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OuterConfig:
    """DiLoCo paper defaults: lr 0.7, Nesterov momentum 0.9."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        if self.nesterov and self.momentum <= 0:
            raise ValueError("Nesterov needs momentum > 0; pass nesterov=False for plain SGD")


# Plain SGD at lr 1.0: θ − Δ̄. The outer step of a sparse run: values a sender kept arrive whole (the sparse codec's
# ``mean_of="kept"``) and what it left waits in its decaying error feedback, which stands in for the outer momentum
# (SparseLoCo); Nesterov 0.9 on top overshot and diverged (docs/benchmarks.md §7). And of an overlapped run (every
# codec): each average lands during the next round, on top of each peer's own contribution as a stand-in, and
# momentum on a stale step overshoots — Nesterov 0.7/0.9 ended 16 % above the blocking run, plain SGD 1.7 % (§3a).
PLAIN_OUTER = OuterConfig(lr=1.0, momentum=0.0, nesterov=False)


def outer_step(lr: float, momentum: float) -> OuterConfig:
    """The outer step for ``lr`` and ``momentum``: Nesterov when there is momentum, plain SGD when it is 0."""
    return OuterConfig(lr=lr, momentum=momentum, nesterov=momentum > 0)


def default_outer(codec_name: str, overlap: bool = False) -> OuterConfig:
    """The outer step a run with this codec takes unless told otherwise: :data:`PLAIN_OUTER` for ``sparse`` and for
    overlapped runs, Nesterov 0.7/0.9 otherwise."""
    return PLAIN_OUTER if codec_name == "sparse" or overlap else OuterConfig()


def default_overlap(codec_name: str) -> bool:
    """Whether a run with this codec overlaps its all-reduces unless told otherwise: yes for the dense codecs, no for
    ``sparse``. Overlapped, the eager update starts each round from the peer's own contribution standing in for the
    average in flight; a sparse contribution (its top 1.6 % of values) stands in for the average far worse than a
    dense one: held-out loss +14.9 % above blocking with the sparse codec against +3.1 % with fp16
    (docs/benchmarks.md §1a; tiny, 4 workers, H = 50, 30 rounds), more than overlap's utilization gains back."""
    return codec_name != "sparse"


def stand_in_scale(own: torch.Tensor | None, average: list[torch.Tensor] | None) -> float:
    """How much of a peer's own contribution stands in for the average still in flight (overlap: the eager update of
    ``diloco.py``): the least-squares fit of the last average that landed on the peer's own contribution to that
    round, ⟨Δ̄, c⟩ / ⟨c, c⟩, clamped to [0, 1]; 1 when there is none. One peer's contribution is a noisy estimate of
    the group's average; the fit shrinks it by as much as the last round's average followed it (0.87 after round 1,
    0.33 at round 29 on docs/benchmarks.md §1a's benchmark, where it cut the held-out loss's gap to blocking from
    +5.0 % to +3.1 %). Only a peer's own start point depends on it, never the shared θ."""
    if own is None or average is None:
        return 1.0
    dot = norm = 0.0
    for mine, part in zip(torch.split(own, [t.numel() for t in average]), average, strict=True):  # no full copy
        mine, part = mine.to(torch.float32), part.reshape(-1).to(torch.float32)
        dot, norm = dot + float(torch.dot(part, mine)), norm + float(torch.dot(mine, mine))
    return min(1.0, max(0.0, dot / norm)) if norm > 0 else 1.0


class OuterOptimizer:
    """Holds θ_r as CPU float32 tensors in ``model.parameters()`` order, with ``torch.optim.SGD`` over them."""

    def __init__(self, model: torch.nn.Module, config: OuterConfig) -> None:
        self.config = config
        self._theta = [p.detach().to("cpu", torch.float32, copy=True) for p in model.parameters()]
        self._sgd = torch.optim.SGD(
            self._theta, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov, foreach=False
        )

    def params(self) -> list[torch.Tensor]:
        """θ_r itself (not a copy): read it, do not write it."""
        return self._theta

    @torch.no_grad()
    def pseudo_gradient(self, model: torch.nn.Module, start: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Δ = θ_r − θ_local (or ``start`` − θ_local, when the round started elsewhere), CPU float32, one tensor per
        parameter in ``model.parameters()`` order."""
        local = list(model.parameters())
        self._check_shapes(local, "model parameters")
        base = self._theta if start is None else start
        return [theta - p.detach().to("cpu", torch.float32) for theta, p in zip(base, local, strict=True)]

    @torch.no_grad()
    def lookahead(self, delta: list[torch.Tensor], scale: float = 1.0) -> list[torch.Tensor]:
        """θ after :meth:`step` with ``scale`` × ``delta``, computed on new tensors: θ and the momentum are not changed.

        The same arithmetic as torch's SGD step (``foreach=False``): buf' = μ·buf + Δ (Δ when there is no buf yet),
        g = Δ + μ·buf' with Nesterov (buf' without), θ' = θ − lr·g. One parameter's temporaries at a time (the
        scale too: no scaled copy of the whole Δ).
        """
        self._check_shapes(delta, "lookahead delta")
        lr, momentum = self.config.lr, self.config.momentum
        stepped = []
        for theta, d in zip(self._theta, delta, strict=True):
            d = d.detach().to("cpu", torch.float32).mul(scale)
            if momentum:
                buffer = self._sgd.state.get(theta, {}).get("momentum_buffer")
                buffer = d.clone() if buffer is None else buffer.mul(momentum).add_(d)
                d = d.add(buffer, alpha=momentum) if self.config.nesterov else buffer
            stepped.append(theta.add(d, alpha=-lr))
        return stepped

    @torch.no_grad()
    def step(self, averaged_delta: list[torch.Tensor]) -> None:
        """θ_{r+1} = SGD(θ_r, grad=Δ̄): with lr 1 and no momentum this is exactly θ_r − Δ̄."""
        self._check_shapes(averaged_delta, "averaged delta")
        for i, delta in enumerate(averaged_delta):
            if not bool(torch.isfinite(delta).all()):
                raise ValueError(f"averaged delta {i} has non-finite values; outer step refused")
        for theta, delta in zip(self._theta, averaged_delta, strict=True):
            theta.grad = delta.detach().to("cpu", torch.float32, copy=True)
        self._sgd.step()
        for theta in self._theta:
            theta.grad = None

    def load_into(self, model: torch.nn.Module) -> None:
        """Copies θ_r into the model's parameters in place (any device or dtype; optimizer state stays attached)."""
        self._check_shapes(list(model.parameters()), "model parameters")
        load_into(model, self._theta)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat tensors only: ``theta.{i}`` and, once a momentum step ran, ``momentum.{i}`` (copies)."""
        state = {f"theta.{i}": theta.clone() for i, theta in enumerate(self._theta)}
        for i, theta in enumerate(self._theta):
            buffer = self._sgd.state.get(theta, {}).get("momentum_buffer")
            if buffer is not None:
                state[f"momentum.{i}"] = buffer.clone()
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        thetas = [state.get(f"theta.{i}") for i in range(len(self._theta))]
        if any(t is None for t in thetas) or len([k for k in state if k.startswith("theta.")]) != len(thetas):
            raise ValueError(f"outer state must hold theta.0 … theta.{len(self._theta) - 1}")
        self._check_shapes(thetas, "loaded theta")
        momenta = {i: state[f"momentum.{i}"] for i in range(len(self._theta)) if f"momentum.{i}" in state}
        for i, buffer in momenta.items():
            if buffer.shape != self._theta[i].shape:
                raise ValueError(f"momentum.{i} has shape {tuple(buffer.shape)}, θ has {tuple(self._theta[i].shape)}")
        for i, theta in enumerate(self._theta):
            theta.copy_(thetas[i])
            if i in momenta:
                self._sgd.state[theta]["momentum_buffer"] = momenta[i].to("cpu", torch.float32, copy=True)
            else:
                self._sgd.state.pop(theta, None)

    def theta_hash(self) -> str:
        """sha256 over the shape and raw float32 bytes of each θ tensor, in order."""
        digest = hashlib.sha256()
        for theta in self._theta:
            digest.update(repr(tuple(theta.shape)).encode())
            digest.update(theta.contiguous().numpy())  # buffer protocol: no byte copy
        return digest.hexdigest()

    def _check_shapes(self, tensors: list[torch.Tensor], what: str) -> None:
        if len(tensors) != len(self._theta):
            raise ValueError(f"{what}: {len(tensors)} tensors, θ has {len(self._theta)}")
        for i, (t, theta) in enumerate(zip(tensors, self._theta, strict=True)):
            if t.shape != theta.shape:
                raise ValueError(f"{what} {i}: shape {tuple(t.shape)}, θ has {tuple(theta.shape)}")


@torch.no_grad()
def move_start(model: torch.nn.Module, start: list[torch.Tensor], to: list[torch.Tensor]) -> None:
    """θ_local += ``to`` − ``start``: the model trained on from ``start`` now trains on as if it had started from ``to``
    (the correction on arrival: the stand-in's error moves it; the inner optimizer's state stays as it is)."""
    for p, s, t in zip(model.parameters(), start, to, strict=True):
        p.add_((t - s).to(p.device, p.dtype))


@torch.no_grad()
def load_into(model: torch.nn.Module, tensors: list[torch.Tensor]) -> None:
    """Copies ``tensors`` (``model.parameters()`` order and shapes) into the model's parameters in place."""
    for p, tensor in zip(model.parameters(), tensors, strict=True):
        p.copy_(tensor)
