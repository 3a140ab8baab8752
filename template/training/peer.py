"""One DiLoCo peer process: ``python -m template.training.peer --peer-key p0 --rounds 5 ...``.

It starts a hivemind DHT node (loopback by default), builds the model and data of the run, restores the newest state
(own checkpoint or a live peer's), and runs rounds until the run's round counter reaches ``--rounds``. Progress
goes to stdout as JSON lines (``ready``, ``progress``, ``round``, ``done``, ``error``), which
``python -m template.training.run`` reads; logs go to stderr. Works under ``torchrun --nproc_per_node K`` too:
rank 0 alone starts the DHT and prints. With overlap (the default; ``--no-overlap`` blocks) a round's ``round``
event comes once its all-reduce has landed, during the next round (the last one before ``done``).

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
from template.training.checkpoint import CheckpointError
from template.training.cli import (
    add_averaging_args,
    add_run_args,
    averaging_config,
    averaging_flags_from,
    codec_from,
    data_config_from,
    log_to_stderr,
    run_spec_from,
)
from template.training.diloco import DiLoCoPeer, RunMismatchError
from template.training.distributed import NodeGroup, close_node_group, init_node_group

log = logging.getLogger("template.training.peer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m template.training.peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser)
    parser.add_argument("--rounds", type=int, default=5, help="stop when the run reaches this many rounds")
    add_averaging_args(parser)
    net = parser.add_argument_group("network")
    net.add_argument("--peer-key", required=True, help="this peer's name: selects its data assignment")
    net.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of live peers to join")
    net.add_argument("--host-maddr", default="/ip4/127.0.0.1/tcp/0", help="where the DHT listens")
    net.add_argument("--announce-maddr", default=None, help="public multiaddr to announce (deployments)")
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


def emit(node: NodeGroup, event: str, **fields: Any) -> None:
    """One JSON line on stdout (leader rank only): the launcher's and tests' view of this peer."""
    if node.is_leader:
        print(json.dumps(dict(event=event, **fields)), flush=True)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM behaves like Ctrl-C: unwind through ``finally`` so the averager and DHT are shut down."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_to_stderr()
    signal.signal(signal.SIGTERM, _interrupt)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    node = init_node_group()
    dht = peer = None
    try:
        spec = run_spec_from(args)
        tokenizer, corpus = data_config_from(args).load(spec.seq_len, args.cache_dir)
        if node.is_leader:
            dht = start_dht(DHTConfig(host_maddrs=[args.host_maddr], initial_peers=list(args.initial_peers),
                                      announce_maddrs=[args.announce_maddr] if args.announce_maddr else []))
            emit(node, "listening", peer_key=args.peer_key, maddrs=visible_maddrs(dht))
        flags = averaging_flags_from(args)
        averaging = averaging_config(flags, args.expected_peers)
        peer = DiLoCoPeer(
            spec, corpus, tokenizer.vocab_size, peer_key=args.peer_key, dht=dht, averaging=averaging,
            codec=codec_from(flags),
            device=args.device, checkpoint_dir=args.checkpoint_dir, node=node, heldout_batches=args.heldout_batches,
            on_progress=lambda p: emit(node, "progress", peer_key=args.peer_key, **asdict(p)),
        )
        source = peer.restore(peer_timeout_s=args.join_timeout if args.initial_peers else 0.0)
        if peer.round == 0:
            peer.wait_for_peers(args.expected_peers, args.join_timeout)
        emit(node, "ready", peer_key=args.peer_key, maddrs=visible_maddrs(dht) if dht else [], restored=source,
             round=peer.round, fingerprint=peer.fingerprint, params=sum(p.numel() for p in peer.model.parameters()),
             windows=corpus.num_windows, feedback_norm=peer.feedback_norm)
        while peer.round < args.rounds:
            outcome = peer.run_round(peer.plan())  # with --overlap: the round before's, once it landed
            if outcome is not None:
                emit(node, "round", peer_key=args.peer_key, **asdict(outcome.report))
        if (last := peer.land_last_round()) is not None:
            emit(node, "round", peer_key=args.peer_key, **asdict(last.report))
        peer.flush_checkpoint()  # the last checkpoint is on disk (or its CheckpointError raised) before "done"
        emit(node, "done", peer_key=args.peer_key, round=peer.round, theta_hash=peer.outer.theta_hash())
        return 0
    except KeyboardInterrupt:
        emit(node, "stopped", peer_key=args.peer_key, round=peer.round if peer else 0)
        return 130
    except (RunMismatchError, ValueError, KeyError, FileNotFoundError) as err:
        emit(node, "error", peer_key=args.peer_key, error=f"{type(err).__name__}: {err}")
        log.error("%s", err)
        return 2
    except CheckpointError as err:
        emit(node, "error", peer_key=args.peer_key, error=f"{type(err).__name__}: {err}")
        log.error("%s (the last checkpoint that was written is intact)", err)
        return 1
    finally:
        if peer is not None:
            peer.shutdown()
        if dht is not None:
            dht.shutdown()
        close_node_group(node)


if __name__ == "__main__":
    sys.exit(main())
