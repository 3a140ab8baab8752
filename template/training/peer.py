"""One DiLoCo peer process: ``python -m template.training.peer --peer-key p0 --rounds 5 ...``.

It starts a hivemind DHT node (loopback by default), builds the model and data of the run, restores the newest state
(own checkpoint or a live peer's), and runs rounds until the run's round counter reaches ``--rounds``. Progress
goes to stdout as JSON lines (``ready``, ``progress``, ``round``, ``done``, ``error``), which
``python -m template.training.run`` reads; logs go to stderr. Works under ``torchrun --nproc_per_node K`` too:
rank 0 alone starts the DHT and prints.

On SIGINT/SIGTERM the peer stops where it is; the last finished round's checkpoint stays the latest on disk, and
the averager and DHT are shut down.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from dataclasses import asdict
from typing import Any

import torch

from template.p2p.dht import DHTConfig, start_dht, visible_maddrs
from template.training.averaging import AveragingConfig
from template.training.compression import CODEC_NAMES
from template.training.data import build_corpus, load_tokenizer
from template.training.diloco import DiLoCoPeer, RunMismatchError, RunSpec
from template.training.distributed import NodeGroup, close_node_group, init_node_group
from template.training.inner import InnerConfig
from template.training.model import MODEL_PRESETS
from template.training.outer import OuterConfig

log = logging.getLogger("template.training.peer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m template.training.peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    run = parser.add_argument_group("run (every peer of a run must use the same values)")
    run.add_argument("--run-id", default="diloco", help="name of the run; peers average only within it")
    run.add_argument("--model", default="tiny", choices=sorted(MODEL_PRESETS), help="model preset")
    run.add_argument("--data", default="builtin",
                     help="'builtin' (generated text, no download), paths/globs of .txt/.jsonl/.parquet "
                          "(comma-separated), or hf:DATASET[:CONFIG] (streaming)")
    run.add_argument("--text-column", default="text", help="text column of jsonl/parquet/hf data")
    run.add_argument("--max-tokens", type=int, default=None, help="use only the first N tokens of the data")
    run.add_argument("--tokenizer", default="bytes", help="'bytes' (no download) or a Hugging Face tokenizer name")
    run.add_argument("--seq-len", type=int, default=128)
    run.add_argument("--batch-size", type=int, default=8, help="sequences per inner step for the whole peer")
    run.add_argument("--inner-steps", type=int, default=50, help="H: inner steps per round")
    run.add_argument("--rounds", type=int, default=5, help="stop when the run reaches this many rounds")
    run.add_argument("--run-seed", type=int, default=0, help="seed of the data assignment")
    run.add_argument("--init-seed", type=int, default=0, help="seed of θ_0")
    run.add_argument("--lr", type=float, default=InnerConfig.lr, help="inner AdamW peak learning rate")
    run.add_argument("--warmup-steps", type=int, default=InnerConfig.warmup_steps)
    run.add_argument("--outer-lr", type=float, default=OuterConfig.lr)
    run.add_argument("--outer-momentum", type=float, default=OuterConfig.momentum)
    net = parser.add_argument_group("network")
    net.add_argument("--peer-key", required=True, help="this peer's name: selects its data assignment")
    net.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of live peers to join")
    net.add_argument("--host-maddr", default="/ip4/127.0.0.1/tcp/0", help="where the DHT listens")
    net.add_argument("--announce-maddr", default=None, help="public multiaddr to announce (deployments)")
    net.add_argument("--compression", default="fp16", choices=CODEC_NAMES, help="all-reduce codec")
    net.add_argument("--matchmaking-time", type=float, default=AveragingConfig.matchmaking_time)
    net.add_argument("--allreduce-timeout", type=float, default=AveragingConfig.allreduce_timeout)
    net.add_argument("--next-chunk-timeout", type=float, default=AveragingConfig.next_chunk_timeout,
                     help="seconds a peer may stay silent during the all-reduce before it is dropped")
    net.add_argument("--expected-peers", type=int, default=1,
                     help="wait (up to --join-timeout) until this many peers are up before round 0, and average "
                          "in groups of up to this many")
    net.add_argument("--join-timeout", type=float, default=60.0,
                     help="seconds to look for a live peer's state at start (0 with no --initial-peers)")
    local = parser.add_argument_group("this machine")
    local.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    local.add_argument("--torch-threads", type=int, default=None,
                       help="CPU threads for torch (default: torch's choice); several peers on one machine "
                            "should split the cores instead of all taking every core")
    local.add_argument("--checkpoint-dir", default=None, help="resume from / save checkpoints here")
    local.add_argument("--cache-dir", default=None, help="token cache directory")
    local.add_argument("--heldout-batches", type=int, default=4, help="held-out batches evaluated after each round")
    return parser


def run_spec_from(args: argparse.Namespace) -> RunSpec:
    return RunSpec(
        run_id=args.run_id, model=args.model, seq_len=args.seq_len, run_seed=args.run_seed, init_seed=args.init_seed,
        batch_size=args.batch_size, inner_steps=args.inner_steps,
        inner=InnerConfig(lr=args.lr, warmup_steps=args.warmup_steps),
        outer=OuterConfig(lr=args.outer_lr, momentum=args.outer_momentum),
    )


def emit(node: NodeGroup, event: str, **fields: Any) -> None:
    """One JSON line on stdout (leader rank only): the launcher's and tests' view of this peer."""
    if node.is_leader:
        print(json.dumps(dict(event=event, **fields)), flush=True)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM behaves like Ctrl-C: unwind through ``finally`` so the averager and DHT are shut down."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("hivemind", "template.training.averaging"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _interrupt)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    node = init_node_group()
    dht = peer = None
    try:
        spec = run_spec_from(args)
        tokenizer = load_tokenizer(args.tokenizer)
        corpus = build_corpus(args.data, tokenizer, spec.seq_len, text_column=args.text_column,
                              max_tokens=args.max_tokens, cache_dir=args.cache_dir)
        if node.is_leader:
            dht = start_dht(DHTConfig(host_maddrs=[args.host_maddr], initial_peers=list(args.initial_peers),
                                      announce_maddrs=[args.announce_maddr] if args.announce_maddr else []))
            emit(node, "listening", peer_key=args.peer_key, maddrs=visible_maddrs(dht))
        averaging = AveragingConfig(compression=args.compression, matchmaking_time=args.matchmaking_time,
                                    target_group_size=max(args.expected_peers, 1),
                                    min_group_size=min(args.expected_peers, 2),
                                    request_timeout=min(3.0, args.matchmaking_time / 2),
                                    allreduce_timeout=args.allreduce_timeout,
                                    next_chunk_timeout=args.next_chunk_timeout)
        peer = DiLoCoPeer(
            spec, corpus, tokenizer.vocab_size, peer_key=args.peer_key, dht=dht, averaging=averaging,
            device=args.device, checkpoint_dir=args.checkpoint_dir, node=node, heldout_batches=args.heldout_batches,
            on_progress=lambda p: emit(node, "progress", peer_key=args.peer_key, **asdict(p)),
        )
        source = peer.restore(peer_timeout_s=args.join_timeout if args.initial_peers else 0.0)
        if peer.round == 0:
            peer.wait_for_peers(args.expected_peers, args.join_timeout)
        emit(node, "ready", peer_key=args.peer_key, maddrs=visible_maddrs(dht) if dht else [], restored=source,
             round=peer.round, fingerprint=peer.fingerprint, params=sum(p.numel() for p in peer.model.parameters()),
             windows=corpus.num_windows)
        while peer.round < args.rounds:
            report = peer.run_round()
            emit(node, "round", peer_key=args.peer_key, **asdict(report))
        emit(node, "done", peer_key=args.peer_key, round=peer.round, theta_hash=peer.outer.theta_hash())
        return 0
    except KeyboardInterrupt:
        emit(node, "stopped", peer_key=args.peer_key, round=peer.round if peer else 0)
        return 130
    except (RunMismatchError, ValueError, KeyError, FileNotFoundError) as err:
        emit(node, "error", peer_key=args.peer_key, error=f"{type(err).__name__}: {err}")
        log.error("%s", err)
        return 2
    finally:
        if peer is not None:
            peer.shutdown()
        if dht is not None:
            dht.shutdown()
        close_node_group(node)


if __name__ == "__main__":
    sys.exit(main())
