"""The memory estimator (template.tools.memory) checked against what torch really allocates for the tiny preset.

Parameters, gradients and AdamW moments are summed from a real model after one ``InnerTrainer`` step and must
match exactly. Activation memory is measured by :class:`_LiveBytes`, a ``TorchDispatchMode`` that sees every
tensor an aten op creates during forward+backward and notices (through a weak storage reference) when its
storage is freed; the peak of those live bytes, leaving out the parameters and gradients that are still alive
at the end, is what ``activation_peak`` estimates. It must agree within ``TOLERANCE`` for two (batch, seq,
vocab) settings of the tiny preset and one grouped-query, tied-embedding model, with and without activation
checkpointing, in fp32 and under bf16 autocast (CPU autocast has the same cast rules as CUDA for what matters
here: linear and SDPA in bf16, RMSNorm and loss in fp32; on this torch the estimate is byte-exact or within 0.1%).
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from template.tools.memory import ASSUMPTIONS, activation_peak, estimate_memory, main, parameter_count
from template.training.inner import InnerConfig, InnerTrainer, causal_lm_loss
from template.training.model import MODEL_PRESETS, ModelSpec, build_model, count_parameters, place_model

TOLERANCE = 0.10  # measured vs. estimated activation peak; the derivation is tensor-by-tensor, so 10% is ample


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created by aten ops while the mode is active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._clock = 0  # one tick per op
        self._live: dict[int, tuple[StorageWeakRef, int, int]] = {}  # storage id -> (ref, bytes, born at)
        self._dead: list[tuple[int, int, int]] = []  # (bytes, born at, freed at)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._clock += 1
        self._sweep()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())  # a weak ref also keeps the id from being reused
                if ref.cdata not in self._live:
                    self._live[ref.cdata] = (ref, t.untyped_storage().nbytes(), self._clock)
        return out

    def _sweep(self) -> None:
        for key in [key for key, (ref, _, _) in self._live.items() if ref.expired()]:
            _, nbytes, born = self._live.pop(key)
            self._dead.append((nbytes, born, self._clock))

    def peak(self, leave_out: list[torch.Tensor]) -> int:
        """Peak live bytes, not counting storages still alive now that belong to ``leave_out``."""
        self._clock += 1
        self._sweep()
        excluded = {StorageWeakRef(t.untyped_storage()).cdata for t in leave_out}
        intervals = self._dead + [(n, born, self._clock + 1) for key, (_, n, born) in self._live.items()
                                  if key not in excluded]
        change = [0] * (self._clock + 2)
        for nbytes, born, freed in intervals:
            change[born] += nbytes
            change[freed] -= nbytes
        peak = live = 0
        for delta in change:
            live += delta
            peak = max(peak, live)
        return peak


def _tiny_batch(vocab: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab, (batch, seq), generator=generator),
            torch.randint(0, vocab, (batch, seq), generator=generator))


def _estimate(preset: str = "tiny", **overrides):
    kwargs = dict(vocab_size=MODEL_PRESETS[preset].default_vocab_size, seq_len=1024, micro_batch=1,
                  activation_checkpointing=True, autocast_bf16=True, gpu_gb=24.0)
    return estimate_memory(preset, **{**kwargs, **overrides})


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
@pytest.mark.parametrize("vocab", [None, 1000])
def test_parameter_count_matches_the_meta_built_model(preset: str, vocab: int | None) -> None:
    vocab = vocab or MODEL_PRESETS[preset].default_vocab_size
    model = build_model(preset, vocab, 128, device="meta")
    assert parameter_count(preset, vocab) == count_parameters(model)
    est = _estimate(preset, vocab_size=vocab)
    assert est.num_parameters == count_parameters(model)
    assert est.parameters == est.gradients == 4 * est.num_parameters
    assert est.optimizer_state == 8 * est.num_parameters


@pytest.mark.timeout(60)
def test_parameter_gradient_and_adamw_bytes_match_a_real_model_after_one_step() -> None:
    vocab, seq, batch = 257, 32, 2
    model = build_model("tiny", vocab, seq)
    trainer = InnerTrainer(model, InnerConfig(warmup_steps=1), "cpu")
    assert trainer.train([_tiny_batch(vocab, batch, seq)], max_steps=1).steps == 1

    parameters = list(model.parameters())
    param_bytes = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in parameters}.values())
    grad_bytes = sum(p.grad.nbytes for p in parameters)
    # AdamW's per-parameter ``step`` counters are 0-d tensors (4 bytes, on the CPU unless capturable): not counted
    moment_bytes = sum(s["exp_avg"].nbytes + s["exp_avg_sq"].nbytes for s in trainer.optimizer.state.values())
    assert len(trainer.optimizer.state) == len(parameters)

    est = _estimate(vocab_size=vocab, seq_len=seq, micro_batch=batch)
    assert (est.parameters, est.gradients, est.optimizer_state) == (param_bytes, grad_bytes, moment_bytes)


@pytest.mark.timeout(60)
def test_optimizer_step_temporaries_match_foreach_adamw() -> None:
    vocab, seq, batch = 257, 32, 2
    model = build_model("tiny", vocab, seq)
    trainer = InnerTrainer(model, InnerConfig(warmup_steps=1), "cpu")
    trainer.train([_tiny_batch(vocab, batch, seq)], max_steps=1)  # creates the AdamW moments
    for group in trainer.optimizer.param_groups:
        group["foreach"] = True  # what AdamW picks on CUDA; the CPU default is the per-tensor loop
    causal_lm_loss(model, *_tiny_batch(vocab, batch, seq)).backward()
    with _LiveBytes() as tracker:
        trainer.optimizer.step()
    measured = tracker.peak(leave_out=[])
    estimated = _estimate(vocab_size=vocab, seq_len=seq, micro_batch=batch).optimizer_step_transient
    assert measured == pytest.approx(estimated, rel=TOLERANCE), (measured, estimated)


# The tiny preset at two sizes, and a tiny model with the 1b's grouped-query attention and the small preset's tied
# embeddings, so that every branch of the estimate is measured.
GQA_TIED = ModelSpec("tiny-gqa-tied", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=384, tie_embeddings=True)
SETTINGS = [("tiny", 1, 64, 257), ("tiny", 2, 48, 1024), (GQA_TIED, 2, 48, 1024)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec,batch,seq,vocab", SETTINGS, ids=["tiny-1x64", "tiny-2x48-v1024", "gqa-tied-2x48"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_activation_peak_matches_measured_forward_backward(
    spec: str | ModelSpec, batch: int, seq: int, vocab: int, checkpointing: bool, bf16: bool
) -> None:
    model = place_model(build_model(spec, vocab, seq), "cpu", activation_checkpointing=checkpointing)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with _LiveBytes() as tracker:
        input_ids, labels = _tiny_batch(vocab, batch, seq)
        with autocast:
            loss = causal_lm_loss(model, input_ids, labels)
        loss.backward()
        del loss
    parameters = list(model.parameters())
    assert all(p.grad is not None for p in parameters)
    measured = tracker.peak(leave_out=parameters + [p.grad for p in parameters])

    peak = activation_peak(spec, vocab_size=vocab, seq_len=seq, micro_batch=batch,
                           activation_checkpointing=checkpointing, autocast_bf16=bf16)
    estimated = peak.activations + peak.weight_copies
    assert measured == pytest.approx(estimated, rel=TOLERANCE), (measured, estimated, peak.phase)
    assert (peak.weight_copies > 0) == bf16


def test_1b_fits_a_24_gb_gpu_at_seq_1024_with_checkpointing_and_bf16() -> None:
    est = _estimate("1b", seq_len=1024, micro_batch=1, gpu_gb=24.0)
    assert est.fits and est.max_micro_batch >= 1
    assert _estimate("1b", micro_batch=est.max_micro_batch, gpu_gb=24.0).fits
    assert not _estimate("1b", micro_batch=est.max_micro_batch + 1, gpu_gb=24.0).fits
    without = _estimate("1b", micro_batch=1, activation_checkpointing=False, gpu_gb=24.0)
    assert without.max_micro_batch < est.max_micro_batch
    assert est.cpu_outer_state == 8 * est.num_parameters and est.cpu_averaging_buffers == 4 * est.num_parameters
    assert est.cpu_total == (12 + 24) * est.num_parameters
    assert _estimate("1b", checkpoint_to_disk=False).cpu_total == (12 + 12) * est.num_parameters


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("bf16", [False, True])
def test_memory_grows_with_batch_and_sequence(preset: str, checkpointing: bool, bf16: bool) -> None:
    def est(**kw):
        return _estimate(preset, **{"activation_checkpointing": checkpointing, "autocast_bf16": bf16, **kw})

    for key, values in (("micro_batch", [1, 2, 4, 8, 64]), ("seq_len", [64, 128, 512, 1024, 4096])):
        fixed = {"seq_len": 512} if key == "micro_batch" else {"micro_batch": 2}
        series = [est(**fixed, **{key: v}) for v in values]
        activations = [e.activations + e.autocast_weight_copies for e in series]
        assert activations == sorted(set(activations)), (key, activations)  # strictly increasing
        totals = [e.gpu_total for e in series]
        assert totals == sorted(totals)
    assert est(micro_batch=10**6).gpu_total > est(micro_batch=1).gpu_total
    fitting = [est(gpu_gb=gb).max_micro_batch for gb in (4, 8, 16, 24, 48, 80)]
    assert fitting == sorted(fitting)
    assert est(activation_checkpointing=not checkpointing).activations != est().activations
    if not checkpointing:
        assert est(activation_checkpointing=True).activations < est().activations


def test_cli_prints_a_table_or_json_and_exits_by_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preset", "1b", "--gpu-gb", "24", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    expected = _estimate("1b", micro_batch=4, gpu_gb=24.0)
    assert report["fits"] is True and report["max_micro_batch"] == expected.max_micro_batch
    assert report["gpu_total"] == expected.gpu_total and report["assumptions"] == list(ASSUMPTIONS)

    assert main(["--preset", "1b", "--gpu-gb", "16", "--seq-len", "2048", "--no-checkpointing"]) == 1
    table = capsys.readouterr().out
    assert "fits no" in table and "GPU total" in table and "CPU total" in table and "max micro-batch" in table

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--preset", "--gpu-gb", "--seq-len", "--micro-batch", "--vocab-size", "--no-checkpointing",
                 "--no-autocast", "--no-disk-checkpoint", "--json", "assumptions"):
        assert flag in help_text
    with pytest.raises(SystemExit) as exited:
        main(["--micro-batch", "0"])
    assert exited.value.code == 2
