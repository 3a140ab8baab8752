#!/usr/bin/env python3
"""Run a DiLoCo miner on the subnet.

    python neurons/miner.py --netuid N --wallet.name W --wallet.hotkey H --subtensor.network test \\
        --axon.port 8091 --axon.external_ip YOUR.PUBLIC.IP --neuron.device cuda --run.preset 1b

Every round (``--neuron.blocks_per_round`` chain blocks) the miner trains the shared model on the data assigned to its
hotkey, averages its pseudo-gradient with the other miners over hivemind (the port must be reachable), applies the
outer step and publishes the round's pseudo-gradient to validators. A multi-GPU node runs the same command under
``torchrun --standalone --nproc_per_node K``; rank 0 alone talks to the chain and to other peers.
See docs/running_a_miner.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from template.base.behaviours import BUILTIN, load_behaviour
from template.base.miner import Miner
from template.base.neuron import (
    NEURON_ERRORS,
    add_neuron_args,
    fatal_error,
    prepare_process,
    start_neuron,
    state_dir,
)
from template.base.telemetry import add_wandb_args
from template.chain.wallets import open_wallet
from template.config import chain_args_from
from template.training.cli import add_averaging_args, add_run_args, dotted
from template.training.distributed import close_node_group, init_node_group


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neurons/miner.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_neuron_args(parser)
    add_wandb_args(parser)
    add_run_args(parser, dotted)
    add_averaging_args(parser, dotted)
    parser.add_argument("--miner.behaviour", dest="miner_behaviour", default="honest",
                        help=f"what this miner trains and publishes: {', '.join(sorted(BUILTIN))}, or module:Class "
                             "(see template/base/behaviours.py)")
    return parser


def rank_device(device: str, local_rank: int, world: int) -> str:
    """Under torchrun each rank takes its own GPU: ``cuda`` becomes ``cuda:LOCAL_RANK``."""
    return f"cuda:{local_rank}" if world > 1 and device == "cuda" else device


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop = prepare_process(args)
    node = init_node_group()
    ctx = miner = None
    try:
        try:
            behaviour = load_behaviour(args.miner_behaviour)
            chain_args = chain_args_from(args)
            hotkey = open_wallet(chain_args.wallet.name, chain_args.wallet.hotkey, chain_args.wallet.path)
            if node.is_leader:
                ctx = start_neuron(args, stop)
        except NEURON_ERRORS:
            node.broadcast_int(0)  # the other ranks must not wait for a leader that is not coming
            raise
        if not node.broadcast_int(1):
            return 2
        device = rank_device(args.neuron_device, int(os.environ.get("LOCAL_RANK", "0")), node.world)
        miner = Miner(ctx, args, behaviour, hotkey=hotkey.hotkey.ss58_address, state=state_dir(args, chain_args),
                      node=node, stop=stop, device=device)
        rounds = miner.run()
        if ctx is not None:
            ctx.emit("stopped", uid=ctx.uid, rounds=rounds)
        return 0
    except NEURON_ERRORS as err:
        return fatal_error(err, args.subtensor_network)
    finally:
        if miner is not None:
            miner.close()
        if ctx is not None:
            ctx.close()
        close_node_group(node)


if __name__ == "__main__":
    sys.exit(main())
