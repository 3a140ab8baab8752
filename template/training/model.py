"""Model presets and device helpers: the causal LM every peer trains, built from a config with no download.

Every peer of a run must start from the same θ_0, so ``build_model`` seeds its own RNG (``init_seed``)
inside ``torch.random.fork_rng``: two processes that build the same preset with the same seed get
bit-identical parameters, and the caller's global RNG is left as it was.

Failure behaviour: nothing here touches the network except ``load_pretrained`` (a plain
``from_pretrained``); an unknown preset raises ``KeyError`` naming the known ones.

``transformers`` is imported where a model is built, not with this module: importing it takes ~2.5 s of CPU (it
pulls in ``torch.distributed.tensor`` and ``torch._dynamo``), which every process that imports the neurons' config
paid — ``--help``, a refused flag, the mock chain, the local network's supervisor — though none of them builds a
model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedModel

BYTE_VOCAB_SIZE = 257  # ByteTokenizer: 256 byte values + EOS


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-style decoder; ``vocab_size``/``seq_len`` come from the tokenizer and run config."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    num_kv_heads: int | None = None  # None: plain multi-head attention (kv heads = heads)
    tie_embeddings: bool = False
    default_vocab_size: int = BYTE_VOCAB_SIZE  # the vocabulary the preset was sized for
    rope_theta: float = 10_000.0

    def llama_config(self, vocab_size: int, seq_len: int) -> LlamaConfig:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads or self.num_heads,
            max_position_embeddings=seq_len,
            tie_word_embeddings=self.tie_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            use_cache=False,  # training only; the KV cache also conflicts with activation checkpointing
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )


MODEL_PRESETS: dict[str, ModelSpec] = {
    # ~1.9 M parameters with the byte vocabulary: tests and the local network.
    "tiny": ModelSpec("tiny", hidden_size=192, num_layers=4, num_heads=4, intermediate_size=512),
    # ~124 M parameters with a GPT-2-sized vocabulary (tied embeddings, like GPT-2 small).
    "small": ModelSpec(
        "small",
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        intermediate_size=2048,
        tie_embeddings=True,
        default_vocab_size=50_257,
    ),
    # ~1.1 B parameters, TinyLlama's shape (grouped-query attention): one 24 GB GPU with bf16 autocast
    # and activation checkpointing.
    "1b": ModelSpec(
        "1b",
        hidden_size=2048,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        intermediate_size=5632,
        default_vocab_size=32_000,
    ),
}


def get_spec(preset: str | ModelSpec) -> ModelSpec:
    if isinstance(preset, ModelSpec):
        return preset
    try:
        return MODEL_PRESETS[preset]
    except KeyError:
        raise KeyError(f"unknown model preset {preset!r}; known presets: {sorted(MODEL_PRESETS)}") from None


def build_model(
    preset: str | ModelSpec,
    vocab_size: int,
    seq_len: int,
    *,
    init_seed: int = 0,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """A freshly initialised float32 ``LlamaForCausalLM``, identical on every peer for the same ``init_seed``.

    ``device="meta"`` builds the module without allocating storage, to count a big preset's parameters.
    """
    from transformers import LlamaForCausalLM

    config = get_spec(preset).llama_config(vocab_size, seq_len)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(init_seed)
        model = LlamaForCausalLM(config)
    return model.float().train()


def load_pretrained(name: str) -> PreTrainedModel:
    """A published causal LM by Hugging Face name (downloads unless cached); float32 master weights."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Parameters counted once each (tied embeddings count once), on any device including meta."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def place_model(
    model: PreTrainedModel, device: str | torch.device, *, activation_checkpointing: bool | None = None
) -> PreTrainedModel:
    """Moves ``model`` to ``device`` (keeping float32 master weights) and sets activation checkpointing.

    ``activation_checkpointing=None`` turns it on for CUDA only: on a GPU memory is what limits the model
    size, on a CPU the recompute would only cost time.
    """
    device = torch.device(device)
    model.to(device)
    if activation_checkpointing is None:
        activation_checkpointing = device.type == "cuda"
    if activation_checkpointing:
        # transformers 5 renamed the method; 4.x only has the old name.
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def autocast_context(device: str | torch.device) -> contextlib.AbstractContextManager[object]:
    """bf16 autocast on CUDA (float32 master weights stay untouched); plain float32 elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
