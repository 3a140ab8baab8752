"""How much GPU memory (and host RAM) one miner needs to train a model preset with DiLoCo, per component.

``python -m template.tools.memory --preset 1b --gpu-gb 24`` prints a table (or ``--json``) and exits 0 when the
configuration fits the GPU, 1 when it does not. Nothing is allocated: the estimate is arithmetic on the preset's
shape (``ModelSpec``), so it runs anywhere in milliseconds.

What the estimate follows, and why each term is there (bytes; P = parameters, T = micro_batch × seq_len tokens):

- GPU state: fp32 master weights 4P, fp32 gradients 4P, AdamW ``exp_avg`` + ``exp_avg_sq`` 8P (``InnerTrainer``).
- Activations: the peak, over the phases of one forward+backward, of the tensors autograd keeps plus the buffers
  alive at that moment, derived tensor by tensor for transformers' ``LlamaDecoderLayer`` (see
  :func:`activation_peak`). The HF Llama residual stream and its RMSNorms stay fp32 under bf16 autocast (the
  embedding output is fp32), only linear/attention outputs become bf16; the logits and cross-entropy cost
  12·T·V bytes at the start of backward (fp32 log-softmax output, its gradient and the incoming gradient).
  Under autocast, the bf16 copies of the weights (2 bytes per linear weight) live as long as the autocast cache
  or the saved tensors hold them: a fixed cost of ~2P during the forward pass that dominates at small batches.
- The optimizer step runs after the activations are freed: on CUDA, AdamW's foreach path allocates one fp32 copy
  of the matrix parameters (``exp_avg_sq.sqrt()``), so the step needs 4P more; the larger of the two counts.
- CUDA context and allocator fragmentation: a fixed allowance plus a fraction of the allocated peak (stated in
  :data:`ASSUMPTIONS`, not measured here: this project's CI has no GPU).
- Host RAM: θ_r and the Nesterov momentum (8P, ``OuterOptimizer``), the averager's shared fp32 buffers (4P,
  ``PseudoGradientAverager``), and the transients of a round boundary: Δ, the averaged copy Δ̄ and the outer
  step's gradient copies (12P), or, when a checkpoint is written, the clones it makes of θ_r, the momentum and
  the AdamW moments (16P) while Δ and Δ̄ are still referenced (8P).

Failure behaviour: invalid arguments raise ``ValueError`` (the CLI turns them into an argparse error, exit 2);
an unknown preset raises ``KeyError`` naming the known ones. The estimator has no other failure mode.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from template.training.model import MODEL_PRESETS, ModelSpec, get_spec

GIB = 2**30
FP32, BF16 = 4, 2
CUDA_CONTEXT_BYTES = 1 * GIB  # CUDA context, cuBLAS/cuDNN workspaces, kernels: outside the caching allocator
FRAGMENTATION = 0.05  # caching-allocator blocks reserved but not allocated, as a fraction of the allocated peak
MAX_SEARCHED_MICRO_BATCH = 1 << 16

ASSUMPTIONS: tuple[str, ...] = (
    "one GPU, one training process (no DDP/FSDP sharding); GB on the command line means GiB (2^30 bytes)",
    "fp32 master weights, fp32 gradients and AdamW exp_avg + exp_avg_sq in fp32 (16 bytes per parameter)",
    "AdamW on CUDA takes its foreach path: the step allocates one fp32 copy of the matrix parameters "
    "(exp_avg_sq.sqrt()); activations are freed by then, so the larger of the two is counted",
    "attention runs in a fused SDPA kernel (flash / memory-efficient / cuDNN; needs an Ampere or newer GPU for "
    "bf16): it keeps q, k, v, the output and the log-sum-exp, never the seq x seq matrix",
    "transformers' Llama keeps its residual stream and RMSNorms in fp32 under bf16 autocast; linear and "
    "attention outputs are bf16; each linear that reads a fp32 tensor keeps its own bf16 copy of it",
    "autocast keeps a bf16 copy of every linear weight (2 bytes per weight) during the forward pass (its cache) "
    "and, without activation checkpointing, until each layer's backward",
    "activation checkpointing (non-reentrant, per decoder layer) keeps each layer's fp32 input and recomputes "
    "one layer at a time during backward",
    "the loss is cross-entropy over fp32 logits: 12 x batch x seq x vocab bytes at the start of backward "
    "(log-softmax output, its gradient and the incoming gradient), 8-10 during the forward pass",
    "with tied embeddings (small), the LM head's fp32 weight gradient is held until the embedding's is added to it",
    f"CUDA context + fragmentation allowance: {CUDA_CONTEXT_BYTES / GIB:.1f} GiB + {FRAGMENTATION:.0%} of the "
    "allocated peak (an allowance, not a measurement); it also has to cover kernel workspaces (cuBLAS, flash "
    "backward) and, with gradient accumulation, one weight-sized gradient temporary per later micro-batch",
    "the activation terms are checked byte for byte against forward+backward on CPU (torch 2.13, transformers "
    "5.x, CPU bf16 autocast standing in for CUDA's); nothing here was measured on a GPU",
    "host RAM: theta_r + Nesterov momentum (8 bytes/param) and the averaging buffers (4 bytes/param) stay; a "
    "round boundary adds Delta, the averaged copy and the outer-step gradients (12 bytes/param); writing a "
    "checkpoint adds clones of theta_r, momentum and AdamW moments (16) while Delta and its average are still "
    "held (8); the Python/torch/hivemind processes and the data pipeline are not counted",
)


@dataclass(frozen=True)
class ActivationPeak:
    """The moment of a forward+backward that holds the most activation memory, and what is alive then."""

    phase: str  # "forward end", "loss backward" or "layer backward"
    activations: int  # bytes of activation tensors (saved tensors, buffers, inputs, logits)
    weight_copies: int  # bytes of bf16 weight copies made by autocast, alive at the same moment


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per component. GPU fields are on the accelerator, ``cpu_*`` fields in host RAM."""

    preset: str
    vocab_size: int
    seq_len: int
    micro_batch: int
    activation_checkpointing: bool
    autocast_bf16: bool
    checkpoint_to_disk: bool
    gpu_gb: float
    num_parameters: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    activation_phase: str
    autocast_weight_copies: int
    optimizer_step_transient: int
    cuda_overhead: int
    gpu_total: int
    fits: bool
    max_micro_batch: int  # 0 when not even one sequence fits
    cpu_outer_state: int
    cpu_averaging_buffers: int
    cpu_round_transients: int
    cpu_checkpoint_transients: int
    cpu_total: int


@dataclass(frozen=True)
class _Shape:
    """The dimensions the byte counts need, derived once from a ``ModelSpec``."""

    hidden: int
    kv: int  # width of k and v: kv heads × head dim
    intermediate: int
    layers: int
    heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, spec: ModelSpec, vocab_size: int) -> _Shape:
        head_dim = spec.hidden_size // spec.num_heads
        return cls(
            hidden=spec.hidden_size,
            kv=(spec.num_kv_heads or spec.num_heads) * head_dim,
            intermediate=spec.intermediate_size,
            layers=spec.num_layers,
            heads=spec.num_heads,
            head_dim=head_dim,
            vocab=vocab_size,
        )

    @property
    def layer_linear_weights(self) -> int:
        """q, k, v, o and the three MLP projections of one decoder layer (no biases in the presets)."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv + 3 * h * self.intermediate

    @property
    def linear_weights(self) -> int:
        """Every weight a linear layer reads: all layers plus the LM head (tied or not, it is read as a linear)."""
        return self.layers * self.layer_linear_weights + self.vocab * self.hidden


def parameter_count(preset: str | ModelSpec, vocab_size: int) -> int:
    """Parameters of ``build_model(preset, vocab_size, ...)``, tied embeddings counted once."""
    spec = get_spec(preset)
    shape = _Shape.of(spec, vocab_size)
    norms = (2 * shape.layers + 1) * shape.hidden
    embeddings = shape.vocab * shape.hidden * (1 if spec.tie_embeddings else 2)
    return shape.layers * shape.layer_linear_weights + norms + embeddings


def _matrix_parameter_count(preset: str | ModelSpec, vocab_size: int) -> int:
    """The parameters ``InnerTrainer`` puts in its weight-decay group (dim >= 2): all but the RMSNorm weights."""
    shape = _Shape.of(get_spec(preset), vocab_size)
    return parameter_count(preset, vocab_size) - (2 * shape.layers + 1) * shape.hidden


def activation_peak(
    preset: str | ModelSpec,
    *,
    vocab_size: int,
    seq_len: int,
    micro_batch: int,
    activation_checkpointing: bool,
    autocast_bf16: bool,
) -> ActivationPeak:
    """The activation peak of one forward+backward of ``causal_lm_loss`` on a micro-batch.

    Bytes per token of one decoder layer (h hidden, kv = k/v width, i intermediate, a = 2 under bf16 autocast,
    4 otherwise), each term a tensor autograd saves:

    - input RMSNorm: its fp32 input x (4h) and normalised x (4h); the normed output read by q, k, v: one fp32
      tensor (4h), or under autocast one bf16 copy per linear (3 × 2h);
    - attention: q and k after RoPE (a·h + a·kv; the fp32 cos/sin promote them, autocast casts them back for
      SDPA), v (a·kv), the SDPA output (a·h; already in the layout o_proj reads) and its log-sum-exp (4·heads);
    - post-attention RMSNorm: the fp32 residual (4h) and normalised x (4h); the output read by gate and up:
      4h, or 2 × 2h under autocast;
    - MLP: gate output, SiLU output, up output and their product (4 × a·i);
    - two per-token rsqrt scalars (8).

    The head keeps the final RMSNorm's input and normalised x (8h + 4) and the LM head's input (a·h). The loss
    holds 10·V (bf16 logits, their fp32 copy, the log-softmax output) or 8·V (fp32) bytes per token at the end
    of the forward pass, and 12·V at the start of backward. Inside a layer's backward, the incoming fp32
    gradient (4h) and two MLP-sized gradients (2·a·i) exist on top of what the layer saved.

    With activation checkpointing only each layer's fp32 input (4h) is kept; backward recomputes one layer at
    a time, with its bf16 weight copies under autocast. Without it, every layer's tensors stay until backward.

    With tied embeddings, autograd holds the LM head's fp32 V×h weight gradient from the LM head's backward to
    the end of backward, where it is summed with the embedding's into the one gradient (untied, each becomes its
    parameter's gradient at once): one more weight-sized buffer during the layers' backward.
    """
    if micro_batch < 1 or seq_len < 1 or vocab_size < 1:
        raise ValueError(f"micro_batch, seq_len and vocab_size must be positive, got {micro_batch}, {seq_len}, "
                         f"{vocab_size}")
    s = _Shape.of(get_spec(preset), vocab_size)
    h, kv, i, V, L = s.hidden, s.kv, s.intermediate, s.vocab, s.layers
    a = BF16 if autocast_bf16 else FP32
    qkv_input = 3 * BF16 * h if autocast_bf16 else FP32 * h
    mlp_input = 2 * BF16 * h if autocast_bf16 else FP32 * h
    layer = (
        8 * h + qkv_input  # input RMSNorm
        + a * (2 * h + 2 * kv) + FP32 * s.heads  # q, k, v, SDPA output, log-sum-exp
        + 8 * h + mlp_input  # post-attention RMSNorm
        + 4 * a * i  # MLP
        + 2 * FP32  # rsqrt of both norms
    )
    layer_input = FP32 * h
    head = 8 * h + FP32 + a * h
    layer_backward_extra = FP32 * h + 2 * a * i
    logits_forward = (10 if autocast_bf16 else 8) * V
    logits_backward = 12 * V

    weights_all = BF16 * s.linear_weights if autocast_bf16 else 0
    weights_lm_head = BF16 * V * h if autocast_bf16 else 0
    weights_layer = BF16 * s.layer_linear_weights if autocast_bf16 else 0

    tied_grad = FP32 * V * h if get_spec(preset).tie_embeddings else 0
    # (phase, bytes per token, bytes per micro-batch besides RoPE and weight copies, bf16 weight copies)
    if activation_checkpointing:
        kept = L * layer_input
        phases = [
            ("forward end", kept + head + logits_forward, 0, weights_all),  # the autocast cache holds every copy
            ("loss backward", kept + head + logits_backward, 0, weights_lm_head),
            ("layer backward", kept - layer_input + layer + layer_backward_extra, tied_grad, weights_layer),
        ]
    else:
        kept = L * layer
        phases = [
            ("forward end", kept + head + logits_forward, 0, weights_all),
            ("loss backward", kept + head + logits_backward, 0, weights_all),
            ("layer backward", kept + layer_backward_extra, tied_grad, weights_all - weights_lm_head),
        ]
    tokens = micro_batch * seq_len
    rope = 2 * FP32 * seq_len * s.head_dim  # cos and sin, broadcast over the batch
    per_token_inputs = 2 * 8  # int64 input ids and labels
    name, per_token, per_batch, weights = max(phases, key=lambda p: tokens * p[1] + p[2] + p[3])
    return ActivationPeak(name, tokens * (per_token + per_token_inputs) + per_batch + rope, weights)


def estimate_memory(
    preset: str | ModelSpec,
    *,
    vocab_size: int,
    seq_len: int,
    micro_batch: int,
    activation_checkpointing: bool,
    autocast_bf16: bool,
    gpu_gb: float,
    checkpoint_to_disk: bool = True,
) -> MemoryEstimate:
    """Per-component GPU and host memory of a DiLoCo miner training ``preset`` on one GPU of ``gpu_gb`` GiB."""
    if gpu_gb <= 0:
        raise ValueError(f"gpu_gb must be positive, got {gpu_gb}")

    def gpu_bytes(batch: int) -> tuple[int, int, ActivationPeak]:
        """(allocated peak, total with the CUDA allowance, activation peak) at micro-batch ``batch``."""
        peak = activation_peak(preset, vocab_size=vocab_size, seq_len=seq_len, micro_batch=batch,
                               activation_checkpointing=activation_checkpointing, autocast_bf16=autocast_bf16)
        allocated = state + max(peak.activations + peak.weight_copies, step_transient)
        return allocated, allocated + CUDA_CONTEXT_BYTES + int(FRAGMENTATION * allocated), peak

    spec = get_spec(preset)
    n = parameter_count(spec, vocab_size)
    state = 4 * n * FP32  # parameters, gradients, AdamW's two moments
    step_transient = FP32 * _matrix_parameter_count(spec, vocab_size)
    budget = gpu_gb * GIB
    allocated, total, peak = gpu_bytes(micro_batch)
    max_batch = _largest_fitting(lambda b: gpu_bytes(b)[1] <= budget)

    round_transients = 3 * FP32 * n
    # clones of θ_r, momentum and both AdamW moments, while Δ and Δ̄ are still referenced
    checkpoint_transients = (4 + 2) * FP32 * n if checkpoint_to_disk else 0
    cpu_outer, cpu_buffers = 2 * FP32 * n, FP32 * n
    return MemoryEstimate(
        preset=spec.name,
        vocab_size=vocab_size,
        seq_len=seq_len,
        micro_batch=micro_batch,
        activation_checkpointing=activation_checkpointing,
        autocast_bf16=autocast_bf16,
        checkpoint_to_disk=checkpoint_to_disk,
        gpu_gb=gpu_gb,
        num_parameters=n,
        parameters=FP32 * n,
        gradients=FP32 * n,
        optimizer_state=2 * FP32 * n,
        activations=peak.activations,
        activation_phase=peak.phase,
        autocast_weight_copies=peak.weight_copies,
        optimizer_step_transient=step_transient,
        cuda_overhead=total - allocated,
        gpu_total=total,
        fits=total <= budget,
        max_micro_batch=max_batch,
        cpu_outer_state=cpu_outer,
        cpu_averaging_buffers=cpu_buffers,
        cpu_round_transients=round_transients,
        cpu_checkpoint_transients=checkpoint_transients,
        cpu_total=cpu_outer + cpu_buffers + max(round_transients, checkpoint_transients),
    )


def _largest_fitting(fits) -> int:
    """The largest micro-batch for which ``fits`` holds (memory grows with the batch), 0 if none."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= MAX_SEARCHED_MICRO_BATCH and fits(high):
        low, high = high, high * 2
    high = min(high, MAX_SEARCHED_MICRO_BATCH + 1)  # fits(low), and not fits(high) unless capped
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def format_table(est: MemoryEstimate) -> str:
    def row(label: str, nbytes: int, note: str = "") -> str:
        return f"  {label:<52}{nbytes / GIB:>9.2f}  {note}".rstrip()

    on = {True: "on", False: "off"}
    working = est.activations + est.autocast_weight_copies
    larger = "activations" if working >= est.optimizer_step_transient else "optimizer step"
    lines = [
        f"preset {est.preset}: {est.num_parameters:,} parameters, vocab {est.vocab_size}, seq {est.seq_len}, "
        f"micro-batch {est.micro_batch}, activation checkpointing {on[est.activation_checkpointing]}, "
        f"bf16 autocast {on[est.autocast_bf16]}",
        f"  {'GPU':<52}{'GiB':>9}",
        row("parameters (fp32)", est.parameters),
        row("gradients (fp32)", est.gradients),
        row("AdamW state (2 x fp32)", est.optimizer_state),
        row(f"activations (peak at {est.activation_phase})", est.activations),
        row("autocast bf16 weight copies (same moment)", est.autocast_weight_copies),
        row("optimizer step temporaries (foreach AdamW)", est.optimizer_step_transient,
            f"not at the same time as activations: the {larger} count"),
        row(f"CUDA context + fragmentation ({FRAGMENTATION:.0%})", est.cuda_overhead),
        row("GPU total", est.gpu_total, f"of {est.gpu_gb:g} GiB: fits {'yes' if est.fits else 'no'}"),
        f"  max micro-batch that fits: {est.max_micro_batch} (at seq {est.seq_len})",
        f"  {'CPU (host RAM)':<52}{'GiB':>9}",
        row("outer theta_r + Nesterov momentum (fp32)", est.cpu_outer_state),
        row("averaging buffers (fp32)", est.cpu_averaging_buffers),
        row("round boundary: Delta, averaged Delta, outer grads", est.cpu_round_transients),
        row("checkpoint write: clones + Delta still held", est.cpu_checkpoint_transients,
            "the larger of the two transients counts"),
        row("CPU total (peak)", est.cpu_total),
    ]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m template.tools.memory",
        description="Estimate the GPU memory (per component) and host RAM a DiLoCo miner needs to train a model "
                    "preset on one GPU. Exit status: 0 if it fits the GPU, 1 if it does not.",
        epilog="assumptions:\n" + "\n".join(f"  - {a}" for a in ASSUMPTIONS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", choices=sorted(MODEL_PRESETS), default="1b", help="model preset (default: 1b)")
    parser.add_argument("--gpu-gb", type=float, default=24.0,
                        help="GPU memory in GiB as the card reports it (nvidia-smi MiB / 1024); default 24")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per training sequence (default 1024)")
    parser.add_argument("--micro-batch", type=int, default=4,
                        help="sequences per forward/backward on the GPU (default 4); accumulating gradients "
                             "over several micro-batches adds (almost) nothing")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="tokenizer vocabulary (default: the size the preset was designed for)")
    parser.add_argument("--no-checkpointing", action="store_true",
                        help="estimate without activation checkpointing (place_model turns it on for CUDA)")
    parser.add_argument("--no-autocast", action="store_true",
                        help="estimate plain fp32 compute instead of bf16 autocast (autocast_context on CUDA)")
    parser.add_argument("--no-disk-checkpoint", action="store_true",
                        help="the miner writes no checkpoints (removes their host-RAM transient)")
    parser.add_argument("--json", action="store_true", help="print the estimate and the assumptions as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    vocab = args.vocab_size if args.vocab_size is not None else get_spec(args.preset).default_vocab_size
    try:
        est = estimate_memory(args.preset, vocab_size=vocab, seq_len=args.seq_len, micro_batch=args.micro_batch,
                              activation_checkpointing=not args.no_checkpointing,
                              autocast_bf16=not args.no_autocast, gpu_gb=args.gpu_gb,
                              checkpoint_to_disk=not args.no_disk_checkpoint)
    except ValueError as e:
        parser.error(str(e))
    if args.json:
        print(json.dumps({**asdict(est), "assumptions": list(ASSUMPTIONS)}, indent=1))
    else:
        print(format_table(est))
    return 0 if est.fits else 1


if __name__ == "__main__":
    sys.exit(main())
