"""The flags that describe a DiLoCo run and its all-reduce, shared by every command that trains.

The engine's peer command spells them ``--seq-len``; the neurons spell them bittensor-style, ``--run.seq_len``.
Both build the same ``RunSpec``, ``DataConfig`` and ``AveragingConfig`` from the same definitions, so a run configured
for the engine and one configured for the subnet cannot silently differ.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from template.allreduce.averager import AveragingConfig
from template.allreduce.codecs import CODEC_NAMES, SegmentCodec, SparseSettings, get_codec
from template.p2p.dht import hivemind_log_level
from template.training.data import DataConfig
from template.training.inner import InnerConfig
from template.training.model import MODEL_PRESETS
from template.training.outer import PLAIN_OUTER, OuterConfig, default_outer, default_overlap, outer_step
from template.training.spec import RunSpec

Spelling = Callable[[str, str], str]  # (group, name) -> flag; names read well in both spellings


def log_to_stderr() -> None:
    """INFO logs to stderr for a program that runs peers (the engine's CLI, the benchmarks): the all-reduce's
    per-segment chatter and hivemind's only from warnings up, unless ``HIVEMIND_LOGLEVEL`` asks hivemind for more."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("template.allreduce.averager", "template.allreduce.averager_process",
                  "template.allreduce.runner", "template.allreduce.segment_reducer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    hivemind_log_level()


def dashed(group: str, name: str) -> str:
    """``run``/``id`` → ``--run-id``; other names stand alone: ``seq_len`` → ``--seq-len``."""
    return f"--{group}-{name}" if name in GROUP_QUALIFIED else "--" + name.replace("_", "-")


def dotted(group: str, name: str) -> str:
    """``run``/``seq_len`` → ``--run.seq_len`` (the bittensor neurons' style)."""
    return f"--{group}.{name}"


GROUP_QUALIFIED = {"id", "seed"}  # too vague without their group in the dashed spelling

# The codec a preset's run uses when --averaging.compression is not given. The sparse codec trains as well as dense
# (docs/benchmarks.md §7: 1.003 × dense after 200 rounds) for ~1/9 of fp16's bytes at N = 8, which decides a
# 124 M or 1.1 B model's round on a home link; the tiny preset's rounds are a few MB either way, and its tests,
# demos and benchmarks compare against the dense fp16 path.
PRESET_COMPRESSION = {"tiny": "fp16", "small": "sparse", "1b": "sparse"}


def add_run_args(parser: argparse.ArgumentParser, flag: Spelling = dashed) -> None:
    """What every peer of one run must agree on (they fail fast when they do not)."""
    run = parser.add_argument_group("run (every peer of a run must use the same values)")

    def add(name: str, **kwargs) -> None:
        run.add_argument(flag("run", name), dest=f"run_{name}", metavar=name.upper(), **kwargs)

    add("id", default="diloco", help="name of the run; peers average only within it")
    add("preset", default="tiny", choices=sorted(MODEL_PRESETS), help="model preset (tiny ~1.9M, small ~124M, 1b)")
    add("data", default="builtin",
        help="'builtin' (generated text, no download), paths/globs of .txt/.jsonl/.parquet (comma-separated), "
             "or hf:DATASET[:CONFIG] (streaming)")
    add("text_column", default="text", help="text column of jsonl/parquet/hf data")
    add("max_tokens", type=int, default=None, help="use only the first N tokens of the data")
    add("tokenizer", default="bytes", help="'bytes' (no download) or a Hugging Face tokenizer name")
    add("seq_len", type=int, default=128, help="tokens per training sequence")
    add("batch_size", type=int, default=8, help="sequences per inner step for the whole peer")
    add("inner_steps", type=int, default=50, help="H: inner steps per round (at most)")
    add("seed", type=int, default=0, help="seed of the data assignment")
    add("init_seed", type=int, default=0, help="seed of θ_0")
    add("lr", type=float, default=InnerConfig.lr, help="inner AdamW peak learning rate")
    add("warmup_steps", type=int, default=InnerConfig.warmup_steps, help="inner learning-rate warmup steps")
    add("outer_lr", type=float, default=None,
        help=f"outer SGD learning rate (default {OuterConfig.lr}; {PLAIN_OUTER.lr} with the sparse codec or overlap)")
    add("outer_momentum", type=float, default=None,
        help=f"outer Nesterov momentum, 0 for plain SGD (default {OuterConfig.momentum}; {PLAIN_OUTER.momentum} "
             "with the sparse codec or overlap)")
    add("overlap", action=argparse.BooleanOptionalAction, default=None,
        help="train round r+1 while round r's all-reduce runs, from θ stepped with this peer's own contribution; "
             "the true average's outer step is taken as soon as it lands, between two inner steps, and the round "
             "trains on from there (the eager update corrected on arrival, docs/benchmarks.md §1a). "
             f"{'--no-' + flag('run', 'overlap')[2:]} waits for every all-reduce. Default: on for the dense codecs "
             "(fp16: the tiny preset's), off for sparse (the small and 1b presets': +14.9 %% held-out loss "
             "overlapped)")


def add_averaging_args(parser: argparse.ArgumentParser, flag: Spelling = dashed) -> None:
    """How this peer finds its group and how long each stage of the all-reduce may take."""
    group = parser.add_argument_group("all-reduce")

    def add(name: str, **kwargs) -> None:
        group.add_argument(flag("averaging", name), dest=f"averaging_{name}", metavar=name.upper(), **kwargs)

    add("compression", default=None, choices=CODEC_NAMES,
        help="codec of the pseudo-gradient all-reduce (default: "
             + ", ".join(f"{codec} for {preset}" for preset, codec in PRESET_COMPRESSION.items()) + ")")
    sparse = SparseSettings()
    add("sparse_chunk", type=int, default=sparse.chunk,
        help="sparse codec: values per chunk, the unit of its top-k (every peer of a run must use the same)")
    add("sparse_k", type=int, default=sparse.k, help="sparse codec: entries each chunk keeps (density k/chunk)")
    add("sparse_bits", type=int, default=sparse.bits,
        help="sparse codec: bits per kept value, 1 (the sign at the mean kept magnitude) to 8")
    add("matchmaking_time", type=float, default=AveragingConfig.matchmaking_time,
        help="seconds a group leader waits for peers (peers without a chain clock that overlap: plus the slowest "
             "groupmate's round of training, since it may begin looking that much later)")
    add("allreduce_timeout", type=float, default=AveragingConfig.allreduce_timeout,
        help="seconds the whole all-reduce may take once the group is formed")
    add("next_chunk_timeout", type=float, default=AveragingConfig.next_chunk_timeout,
        help="seconds a peer may stay silent during the all-reduce before it is dropped")


def run_spec_from(args: argparse.Namespace) -> RunSpec:
    """The run the flags describe."""
    return RunSpec(
        run_id=args.run_id, model=args.run_preset, seq_len=args.run_seq_len, run_seed=args.run_seed,
        init_seed=args.run_init_seed, batch_size=args.run_batch_size, inner_steps=args.run_inner_steps,
        inner=InnerConfig(lr=args.run_lr, warmup_steps=args.run_warmup_steps), outer=outer_config_from(args),
        overlap=overlap_from(args),
    )


def overlap_from(args: argparse.Namespace) -> bool:
    """``--overlap`` as given, or the codec's default (:func:`~template.training.outer.default_overlap`)."""
    return default_overlap(codec_name_from(args)) if args.run_overlap is None else args.run_overlap


def codec_name_from(args: argparse.Namespace) -> str:
    """The codec in effect; "" for a command without the all-reduce's flags."""
    return compression_from(args) if hasattr(args, "averaging_compression") else ""


def outer_config_from(args: argparse.Namespace) -> OuterConfig:
    """The outer step the flags ask for; an unset one is the default of the codec and overlap (`default_outer`)."""
    default = default_outer(codec_name_from(args), overlap_from(args))
    lr = default.lr if args.run_outer_lr is None else args.run_outer_lr
    momentum = default.momentum if args.run_outer_momentum is None else args.run_outer_momentum
    if not lr > 0 or not 0 <= momentum < 1:
        raise ValueError(f"the outer step needs lr > 0 and 0 <= momentum < 1, got lr {lr} and momentum {momentum}")
    return outer_step(lr, momentum)


def data_config_from(args: argparse.Namespace) -> DataConfig:
    return DataConfig(source=args.run_data, text_column=args.run_text_column, max_tokens=args.run_max_tokens,
                      tokenizer=args.run_tokenizer)


@dataclass(frozen=True)
class AveragingFlags:
    """What the all-reduce flags say; :func:`averaging_config` turns them into the averager's configuration."""

    compression: str = AveragingConfig.compression
    sparse_chunk: int = SparseSettings.chunk
    sparse_k: int = SparseSettings.k
    sparse_bits: int = SparseSettings.bits
    matchmaking_time: float = AveragingConfig.matchmaking_time
    allreduce_timeout: float = AveragingConfig.allreduce_timeout
    next_chunk_timeout: float = AveragingConfig.next_chunk_timeout

    def __post_init__(self) -> None:
        codec_from(self)  # ValueError for sparse settings that are invalid or given to a dense codec, at parse time


def compression_from(args: argparse.Namespace) -> str:
    """``--averaging.compression``, or the run preset's codec when it is not given."""
    return codec_in_effect(args.averaging_compression, args.run_preset)


def codec_in_effect(compression: str | None, preset: str) -> str:
    """The codec asked for, or the preset's (:data:`PRESET_COMPRESSION`) when none is."""
    return compression or PRESET_COMPRESSION[preset]


def averaging_flags_from(args: argparse.Namespace) -> AveragingFlags:
    return AveragingFlags(compression=compression_from(args), sparse_chunk=args.averaging_sparse_chunk,
                          sparse_k=args.averaging_sparse_k, sparse_bits=args.averaging_sparse_bits,
                          matchmaking_time=args.averaging_matchmaking_time,
                          allreduce_timeout=args.averaging_allreduce_timeout,
                          next_chunk_timeout=args.averaging_next_chunk_timeout)


def codec_from(flags: AveragingFlags) -> SegmentCodec:
    """The codec of ``--averaging.compression`` with its settings (every peer of a run must use the same: the codec
    and its settings are part of the run's identity, so a peer with other settings stops at start and says which).
    ValueError for invalid sparse settings, or sparse settings given to a dense codec (they would do nothing)."""
    sparse = dict(chunk=flags.sparse_chunk, k=flags.sparse_k, bits=flags.sparse_bits)
    if flags.compression == "sparse":
        return get_codec("sparse", **sparse)
    defaults = SparseSettings()
    changed = sorted(f"sparse_{name}" for name, value in sparse.items() if value != getattr(defaults, name))
    if changed:
        raise ValueError(f"the sparse codec's settings ({', '.join(changed)}) apply only to compression 'sparse', "
                         f"not {flags.compression!r}")
    return get_codec(flags.compression)


def averaging_config(flags: AveragingFlags, expected_peers: int, *, phase_s: float | None = None,
                     auxiliary: bool = False) -> AveragingConfig:
    """The one place an :class:`AveragingConfig` is built: from the flags, the number of peers expected in a round,
    the length of the round's all-reduce phase (chain-clocked neurons) and the role.

    Groups hold up to ``expected_peers`` and at least a majority of them (two when two or three are expected): a
    majority minimum means at most one group per round can succeed, since two disjoint groups would average different
    Δ̄s and split the peers into diverging models. When no majority gathers, every peer keeps θ_r.

    ``phase_s`` cuts the all-reduce's own timeouts to the round's all-reduce phase: an all-reduce that outlives its
    round keeps the averager busy into the next one, whose all-reduce then fails too, and on a slow machine one late
    round would turn into a cascade of failed rounds. An ``auxiliary`` peer (a validator) receives Δ̄ and contributes
    nothing.
    """
    allreduce_timeout, next_chunk_timeout = flags.allreduce_timeout, flags.next_chunk_timeout
    if phase_s is not None:
        allreduce_timeout, next_chunk_timeout = min(allreduce_timeout, phase_s), min(next_chunk_timeout, phase_s / 2)
    return AveragingConfig(
        compression=flags.compression, matchmaking_time=flags.matchmaking_time,
        request_timeout=min(3.0, flags.matchmaking_time / 2), allreduce_timeout=allreduce_timeout,
        next_chunk_timeout=next_chunk_timeout, target_group_size=max(expected_peers, 1),
        min_group_size=max(min(expected_peers, 2), expected_peers // 2 + 1), auxiliary=auxiliary,
    )
