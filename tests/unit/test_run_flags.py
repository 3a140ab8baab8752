"""The run and all-reduce flags: the sparse codec's settings and the outer step each codec defaults to."""

from __future__ import annotations

import argparse

import pytest

from template.allreduce.codecs import SparseSettings
from template.allreduce.contribution import codec_descriptor
from template.base.config import add_neuron_args
from template.training.cli import PRESET_COMPRESSION, averaging_flags_from, codec_from, run_spec_from
from template.training.model import MODEL_PRESETS
from template.training.outer import PLAIN_OUTER, OuterConfig
from template.training.peer import build_parser


def parse(*flags: str):
    return build_parser().parse_args(["--peer-key", "p0", *flags])


def codec_of(*flags: str):
    return codec_from(averaging_flags_from(parse(*flags)))


def test_the_sparse_settings_come_from_the_flags_and_change_the_run_identity():
    codec = codec_of("--compression", "sparse", "--sparse-chunk", "2048", "--sparse-k", "128", "--sparse-bits", "4")
    assert codec.settings == SparseSettings(chunk=2048, k=128, bits=4)
    assert codec_of("--compression", "sparse").settings == SparseSettings()
    # the descriptor is part of the run identity that peers compare at start (RunMismatchError names it)
    assert codec_descriptor(codec) != codec_descriptor(codec_of("--compression", "sparse"))


def test_sparse_settings_for_a_dense_codec_or_invalid_ones_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="sparse_k.*only to compression 'sparse'"):
        codec_of("--sparse-k", "128")
    with pytest.raises(ValueError, match="bits"):
        codec_of("--compression", "sparse", "--sparse-bits", "0")
    with pytest.raises(ValueError, match="k must be"):
        codec_of("--compression", "sparse", "--sparse-k", "5000")


def test_the_outer_step_defaults_to_the_codecs_and_zero_momentum_is_plain_sgd():
    blocking = parse("--no-overlap")
    assert not run_spec_from(blocking).overlap
    assert run_spec_from(blocking).outer == OuterConfig()
    overlapped = parse()  # overlap is the engine's default: plain SGD for every codec (outer.py: PLAIN_OUTER)
    assert run_spec_from(overlapped).overlap and run_spec_from(overlapped).outer == PLAIN_OUTER
    assert run_spec_from(parse("--overlap")).overlap
    assert run_spec_from(parse("--outer-lr", "0.7", "--outer-momentum", "0.9")).outer == OuterConfig()
    assert run_spec_from(parse("--no-overlap", "--compression", "sparse")).outer == PLAIN_OUTER
    sparse_momentum = parse("--no-overlap", "--compression", "sparse", "--outer-momentum", "0.5")
    assert run_spec_from(sparse_momentum).outer == OuterConfig(1.0, 0.5)
    assert run_spec_from(parse("--no-overlap", "--outer-momentum", "0")).outer == OuterConfig(0.7, 0.0, nesterov=False)
    for bad in (("--outer-lr", "0"), ("--outer-momentum", "1.0"), ("--outer-momentum", "-0.1")):
        with pytest.raises(ValueError, match="outer step"):
            run_spec_from(parse(*bad))


def test_the_neurons_spell_the_overlap_switch_dotted_and_agree_with_the_engine():
    """One definition (``add_run_args``) for both spellings: ``--run.overlap`` / ``--no-run.overlap`` for the
    neurons, ``--overlap`` / ``--no-overlap`` for the engine's peer command."""
    parser = argparse.ArgumentParser()
    add_neuron_args(parser)

    def neuron(*flags: str) -> argparse.Namespace:
        return parser.parse_args(["--netuid", "1", *flags])

    assert run_spec_from(neuron()).overlap and not run_spec_from(neuron("--no-run.overlap")).overlap
    assert run_spec_from(neuron("--no-run.overlap")) == run_spec_from(parse("--no-overlap"))
    assert run_spec_from(neuron()) == run_spec_from(parse())


def test_the_codec_defaults_to_the_presets_and_an_explicit_one_wins():
    """sparse for small and 1b (it trains like dense for ~1/9 of the bytes: docs/benchmarks.md §7), fp16 for tiny;
    the outer step follows the codec that is in effect, not the flag as typed (blocking: overlapped, every codec
    steps plainly)."""
    assert set(PRESET_COMPRESSION) == set(MODEL_PRESETS)
    assert codec_of().name == "fp16" and run_spec_from(parse("--no-overlap")).outer == OuterConfig()
    for preset in ("small", "1b"):
        assert codec_of("--preset", preset).name == "sparse"
        assert run_spec_from(parse("--no-overlap", "--preset", preset)).outer == PLAIN_OUTER
        assert codec_of("--preset", preset, "--compression", "fp16").name == "fp16"
        assert run_spec_from(parse("--no-overlap", "--preset", preset, "--compression", "fp16")).outer == OuterConfig()
    assert codec_of("--preset", "small", "--sparse-k", "128").settings.k == 128
    with pytest.raises(ValueError, match="only to compression 'sparse'"):
        codec_of("--preset", "small", "--compression", "fp16", "--sparse-k", "128")


def test_overlap_defaults_to_on_for_the_dense_codecs_and_off_for_sparse():
    """The eager update's stand-in, one peer's sparse contribution, costs +14.9 % held-out loss (fp16: +3.1 %;
    docs/benchmarks.md §1a): a sparse run blocks unless told to overlap, whichever way its codec was chosen."""
    assert all(run_spec_from(parse("--compression", codec)).overlap for codec in ("none", "fp16", "int8"))
    assert not run_spec_from(parse("--compression", "sparse")).overlap
    assert not run_spec_from(parse("--preset", "small")).overlap  # the preset's codec: sparse
    assert run_spec_from(parse("--preset", "small", "--compression", "fp16")).overlap
    assert run_spec_from(parse("--compression", "sparse", "--overlap")).overlap  # asked for: it wins
    assert not run_spec_from(parse("--compression", "fp16", "--no-overlap")).overlap
