"""Test doubles for the copy attack: a miner whose Δ leaks, and miners that re-publish the leaked Δ.

Only validator-permit holders may fetch a miner's publication, so copying someone's Δ needs a leak (a colluding
miner, or a validator that passes Δs on). ``LeakyHonest`` is an honest miner that leaks: one second after each
publication (a copier can only copy what was already published) it writes its Δ to ``$DILOCO_LEAK_DIR``.
``CopyLeaked`` trains nothing and publishes the leaked Δ of the round, exactly; ``CopyLeakedNoisy`` adds noise of
1e-3 × each tensor's std, so that the bytes differ. Used as ``--miner.behaviour tests.integration.copy_behaviours:X``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from template.base.behaviours import MinerBehaviour
from template.training.round import RoundOutcome, RoundPlan, Tensors

LEAK_WAIT_S = 8.0


def _leak_path(round: int) -> Path:
    return Path(os.environ["DILOCO_LEAK_DIR"]) / f"round-{round}.safetensors"


class LeakyHonest(MinerBehaviour):
    name = "honest"

    def publication(self, outcome: RoundOutcome) -> Tensors | None:
        delta = outcome.delta
        if delta is None:
            return None
        tensors = {str(i): t.contiguous().clone() for i, t in enumerate(delta)}

        def leak() -> None:
            path = _leak_path(outcome.round)
            tmp = path.with_name(path.name + ".tmp")
            save_file(tensors, str(tmp))
            os.replace(tmp, path)

        threading.Timer(1.0, leak).start()
        return delta


class CopyLeaked(MinerBehaviour):
    name = "copy-leaked"
    noise_scale = 0.0

    def plan(self, plan: RoundPlan) -> RoundPlan:
        return replace(plan, max_steps=0)

    def publication(self, outcome: RoundOutcome) -> Tensors | None:
        delta = outcome.delta
        if delta is None:
            return None
        path = _leak_path(outcome.round)
        deadline = time.monotonic() + LEAK_WAIT_S
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not path.exists():
            return delta  # nothing leaked this round: publish the zero Δ it has
        leaked = load_file(str(path))
        copied = [leaked[str(i)] for i in range(len(delta))]
        return [t + self.noise_scale * t.std() * torch.randn(t.shape) for t in copied]


class CopyLeakedNoisy(CopyLeaked):
    name = "copy-leaked-noisy"
    noise_scale = 1e-3
