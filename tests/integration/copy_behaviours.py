"""Test doubles for the copy attack: a miner whose Δ leaks, and miners that contribute the leaked Δ as their own.

Only validator-permit holders may fetch a miner's publication, so copying someone's Δ needs a leak (a colluding
miner). Since a contribution is committed before the round's all-reduce, the leak has to happen before that too:
``LeakyHonest`` is an honest miner that writes its Δ to ``$DILOCO_LEAK_DIR`` the moment it has trained (before
committing it). ``CopyLeaked`` trains nothing, waits (bounded) for the leak of its round and contributes — hence
commits and publishes — the leaked Δ, exactly; ``CopyLeakedNoisy`` adds noise of 1e-3 × each tensor's std, so that
the bytes differ. Used as ``--miner.behaviour tests.integration.copy_behaviours:X``.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from template.base.behaviours import MinerBehaviour
from template.training.round import RoundPlan, Tensors

LEAK_WAIT_S = 3.0


def _leak_path(round: int) -> Path:
    return Path(os.environ["DILOCO_LEAK_DIR"]) / f"round-{round}.safetensors"


class LeakyHonest(MinerBehaviour):
    name = "honest"

    def contribution(self, round: int, delta: Tensors) -> Tensors:
        path = _leak_path(round)
        tmp = path.with_name(path.name + ".tmp")
        save_file({str(i): t.contiguous().clone() for i, t in enumerate(delta)}, str(tmp))
        os.replace(tmp, path)
        return delta


class CopyLeaked(MinerBehaviour):
    name = "copy-leaked"
    noise_scale = 0.0

    def plan(self, plan: RoundPlan) -> RoundPlan:
        return replace(plan, max_steps=0)

    def contribution(self, round: int, delta: Tensors) -> Tensors:
        path = _leak_path(round)
        deadline = time.monotonic() + LEAK_WAIT_S
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not path.exists():
            return delta  # nothing leaked this round: contribute the zero Δ it has
        leaked = load_file(str(path))
        copied = [leaked[str(i)] for i in range(len(delta))]
        return [t + self.noise_scale * t.std() * torch.randn(t.shape) for t in copied]


class CopyLeakedNoisy(CopyLeaked):
    name = "copy-leaked-noisy"
    noise_scale = 1e-3
