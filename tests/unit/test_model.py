"""Model presets: sizes from config (the 1b never allocated), determinism of θ_0, forward/backward, devices."""

from __future__ import annotations

import warnings

import pytest
import torch

from template.training.inner import causal_lm_loss
from template.training.model import (
    MODEL_PRESETS,
    ModelSpec,
    autocast_context,
    build_model,
    count_parameters,
    place_model,
)


def expected_parameters(spec: ModelSpec, vocab: int) -> int:
    """Llama parameter count written out from the architecture, independently of transformers."""
    h, kv_heads = spec.hidden_size, spec.num_kv_heads or spec.num_heads
    kv_dim = kv_heads * (h // spec.num_heads)
    attention = h * h * 2 + h * kv_dim * 2  # q, o; k, v (no biases)
    mlp = 3 * h * spec.intermediate_size  # gate, up, down
    per_layer = attention + mlp + 2 * h  # two RMSNorm weights
    embeddings = vocab * h * (1 if spec.tie_embeddings else 2)
    return embeddings + spec.num_layers * per_layer + h  # + final norm


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [("tiny", 1.5e6, 2.5e6), ("small", 110e6, 135e6), ("1b", 1.0e9, 1.2e9)],
)
def test_preset_sizes_counted_on_meta_device(preset: str, low: float, high: float) -> None:
    spec = MODEL_PRESETS[preset]
    model = build_model(preset, spec.default_vocab_size, seq_len=2048, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing allocated
    n = count_parameters(model)
    assert n == expected_parameters(spec, spec.default_vocab_size)
    assert low <= n <= high


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="tiny"):
        build_model("huge", 257, 32)


def test_same_seed_gives_identical_weights_and_leaves_global_rng_alone() -> None:
    rng_before = torch.get_rng_state()
    a = build_model("tiny", 257, 32, init_seed=7)
    b = build_model("tiny", 257, 32, init_seed=7)
    c = build_model("tiny", 257, 32, init_seed=8)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters(), strict=True))
    assert all(p.dtype == torch.float32 for p in a.parameters())


def test_tiny_forward_and_backward() -> None:
    model = build_model("tiny", 257, 32)
    input_ids = torch.randint(0, 257, (4, 32), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=input_ids).logits
    assert logits.shape == (4, 32, 257)
    loss = causal_lm_loss(model, input_ids, torch.roll(input_ids, -1, dims=1))
    assert torch.isfinite(loss) and 5.0 < loss.item() < 6.5  # ≈ ln(257) at initialisation
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_activation_checkpointing_recomputes_the_same_gradients() -> None:
    input_ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(input_ids, -1, dims=1)
    grads = []
    for checkpointing in (False, True):
        model = place_model(build_model("tiny", 257, 32), "cpu", activation_checkpointing=checkpointing)
        flags = [getattr(m, "gradient_checkpointing", False) for m in model.modules()]
        assert any(flags) == checkpointing
        causal_lm_loss(model, input_ids, labels).backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, recomputed in zip(*grads, strict=True):
        torch.testing.assert_close(plain, recomputed, rtol=1e-5, atol=1e-6)


def test_activation_checkpointing_defaults_off_on_cpu() -> None:
    model = place_model(build_model("tiny", 257, 32), "cpu")
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_autocast_is_bf16_on_cuda_and_off_on_cpu() -> None:
    with autocast_context("cpu"):
        assert not torch.is_autocast_enabled("cpu")
        assert torch.ones(2, 2).matmul(torch.ones(2, 2)).dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # constructing a CUDA autocast on a CPU-only machine warns
        cuda_context = autocast_context("cuda")
    assert isinstance(cuda_context, torch.autocast)
    assert cuda_context.fast_dtype == torch.bfloat16
