"""Checkpoints: round trip without pickle, retention, corrupt/half-written fallbacks, and typed write errors."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest
import torch

from template.training import checkpoint as ckpt
from template.training.checkpoint import (
    CheckpointError,
    flatten_state,
    load_latest_checkpoint,
    save_checkpoint,
    unflatten_state,
)
from template.training.data import ByteTokenizer, TokenCorpus
from template.training.inner import InnerConfig, InnerTrainer
from template.training.model import build_model
from template.training.outer import OuterConfig, OuterOptimizer


def tensors_for(round: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(round)
    return {"theta.0": torch.randn(4, 3, generator=gen), "theta.1": torch.randn(5, generator=gen)}


def test_flatten_state_round_trips_through_json() -> None:
    state = {
        "step": 12,
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 2)}, 1: {"exp_avg": torch.zeros(3)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1], "fused": None}],
        },
        "__odd": "key",
    }
    tensors, skeleton = flatten_state("inner", state)
    assert set(tensors) == {
        "inner.optimizer.state.0.step",
        "inner.optimizer.state.0.exp_avg",
        "inner.optimizer.state.1.exp_avg",
    }
    restored = unflatten_state(json.loads(json.dumps(skeleton)), tensors)
    assert restored["step"] == 12 and restored["__odd"] == "key"
    assert set(restored["optimizer"]["state"]) == {0, 1}  # int keys survive JSON
    assert restored["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert torch.equal(restored["optimizer"]["state"][0]["exp_avg"], torch.ones(2, 2))
    with pytest.raises(TypeError, match="without pickle"):
        flatten_state("x", {"bad": object()})


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "ckpts", 7, tensors_for(7), {"theta_hash": "abc", "peers": ["a", "b"]})
    assert path.name == "ckpt-00000007.json"
    loaded = load_latest_checkpoint(tmp_path / "ckpts")
    assert loaded is not None and loaded.round == 7 and loaded.path == path
    assert loaded.metadata == {"theta_hash": "abc", "peers": ["a", "b"]}
    assert all(torch.equal(loaded.tensors[k], v) for k, v in tensors_for(7).items())
    assert load_latest_checkpoint(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert load_latest_checkpoint(tmp_path / "empty") is None


def test_tensors_sharing_storage_are_saved(tmp_path: Path) -> None:
    shared = torch.arange(6.0)
    save_checkpoint(tmp_path, 0, {"embed": shared, "lm_head": shared, "view": shared[:3]}, {})
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None
    assert torch.equal(loaded.tensors["lm_head"], shared) and torch.equal(loaded.tensors["view"], shared[:3])


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    for round in range(5):
        save_checkpoint(tmp_path, round, tensors_for(round), {"round": round}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["ckpt-00000003.json", "ckpt-00000004.json"]
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.round == 4


def test_corrupt_latest_falls_back_to_previous(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_checkpoint(tmp_path, 1, tensors_for(1), {})
    save_checkpoint(tmp_path, 2, tensors_for(2), {})
    manifest = json.loads((tmp_path / "ckpt-00000002.json").read_text())
    tensor_file = tmp_path / manifest["tensors_file"]
    data = bytearray(tensor_file.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the tensor bytes: safetensors alone would not notice
    tensor_file.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.round == 1
    assert torch.equal(loaded.tensors["theta.0"], tensors_for(1)["theta.0"])
    assert "ckpt-00000002.json" in caplog.text and "sha256" in caplog.text


def test_half_written_checkpoint_is_ignored_and_cleaned_up(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, tensors_for(1), {})
    # What a crash leaves: a truncated manifest of a newer round, a stray temporary, an unreferenced tensor file.
    (tmp_path / "ckpt-00000002.json").write_text('{"format": 1, "round": 2, "tensors_fi')
    (tmp_path / ".ckpt-tmp-abc.safetensors").write_bytes(b"partial")
    (tmp_path / "ckpt-00000003-000000000000.safetensors").write_bytes(b"orphan")
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.round == 1
    save_checkpoint(tmp_path, 4, tensors_for(4), {}, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert ".ckpt-tmp-abc.safetensors" not in names and "ckpt-00000003-000000000000.safetensors" not in names
    assert load_latest_checkpoint(tmp_path).round == 4


def test_a_save_after_falling_back_becomes_the_latest(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 3, tensors_for(3), {}, keep=1)
    save_checkpoint(tmp_path, 5, tensors_for(5), {}, keep=2)
    manifest = json.loads((tmp_path / "ckpt-00000005.json").read_text())
    (tmp_path / manifest["tensors_file"]).write_bytes(b"rotten")  # round 5 unusable: peers resume from 3
    assert load_latest_checkpoint(tmp_path).round == 3
    save_checkpoint(tmp_path, 4, tensors_for(4), {}, keep=1)
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["ckpt-00000004.json"]
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.round == 4
    assert torch.equal(loaded.tensors["theta.1"], tensors_for(4)["theta.1"])


def test_unwritable_directory_raises_checkpoint_error(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("in the way")  # works as root too, where chmod would not stop a write
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(not_a_dir / "ckpts", 1, tensors_for(1), {})
    assert info.value.path == not_a_dir / "ckpts" / "ckpt-00000001.json"
    assert str(not_a_dir) in str(info.value)


def test_disk_full_leaves_the_previous_checkpoint_untouched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_checkpoint(tmp_path, 1, tensors_for(1), {"ok": True})
    before = sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir())

    def full_disk(tensors: dict[str, torch.Tensor], filename: str) -> None:
        Path(filename).write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    with pytest.raises(CheckpointError, match="No space left"):
        save_checkpoint(tmp_path, 2, tensors_for(2), {})
    assert sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir()) == before
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.round == 1 and loaded.metadata == {"ok": True}


def test_training_state_resumes_bit_identically_from_a_checkpoint(tmp_path: Path) -> None:
    """Inner AdamW + step and outer θ + momentum go through a checkpoint; the next step matches exactly."""
    corpus = TokenCorpus.from_documents(["All the world's a stage. " * 80], ByteTokenizer(), 32)
    config = InnerConfig(lr=3e-3, warmup_steps=2)

    def make() -> tuple[torch.nn.Module, InnerTrainer, OuterOptimizer]:
        model = build_model("tiny", 257, 32, init_seed=3)
        return model, InnerTrainer(model, config, "cpu"), OuterOptimizer(model, OuterConfig())

    model, inner, outer = make()
    inner.train(corpus.batches([0, 1, 2, 3], 2), max_steps=2)
    outer.step(outer.pseudo_gradient(model))
    outer.load_into(model)

    inner_tensors, inner_skeleton = flatten_state("inner", inner.state_dict())
    save_checkpoint(tmp_path, 1, {**inner_tensors, **outer.state_dict()}, {"inner": inner_skeleton})

    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None
    model2, inner2, outer2 = make()
    outer2.load_state_dict({k: v for k, v in loaded.tensors.items() if not k.startswith("inner.")})
    outer2.load_into(model2)
    inner2.load_state_dict(unflatten_state(loaded.metadata["inner"], loaded.tensors))
    assert inner2.step == 2 and outer2.theta_hash() == outer.theta_hash()

    for trainer in (inner, inner2):
        trainer.train(corpus.batches([4, 5], 2), max_steps=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
