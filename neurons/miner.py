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

from template.base.behaviours import BUILTIN
from template.base.config import NeuronConfig, add_miner_args, add_neuron_args
from template.base.miner import Miner
from template.base.neuron import NEURON_ERRORS, fatal_error, prepare_process, start_neuron
from template.chain.wallets import open_wallet
from template.training.distributed import close_node_group, init_node_group


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neurons/miner.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_neuron_args(parser)
    add_miner_args(parser, sorted(BUILTIN))
    return parser


def rank_device(device: str, local_rank: int, world: int) -> str:
    """Under torchrun each rank takes its own GPU: ``cuda`` becomes ``cuda:LOCAL_RANK``."""
    return f"cuda:{local_rank}" if world > 1 and device == "cuda" else device


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = NeuronConfig.from_args(args)
        behaviour = config.miner.load()
    except ValueError as err:  # values that parse but do not fit together (e.g. a run id with a '.')
        parser.error(str(err))
    stop = prepare_process(config)
    node = init_node_group()
    ctx = miner = None
    try:
        try:
            wallet = config.chain.wallet
            hotkey = open_wallet(wallet.name, wallet.hotkey, wallet.path)
            if node.is_leader:
                ctx = start_neuron(config, stop)
        except NEURON_ERRORS:
            node.broadcast_int(0)  # the other ranks must not wait for a leader that is not coming
            raise
        if not node.broadcast_int(1):
            return 2
        device = rank_device(config.neuron.device, int(os.environ.get("LOCAL_RANK", "0")), node.world)
        miner = Miner(ctx, config, behaviour, hotkey=hotkey.hotkey.ss58_address, node=node, stop=stop, device=device)
        rounds = miner.run()
        if ctx is not None:
            ctx.emit("stopped", uid=ctx.uid, rounds=rounds)
        return 0
    except NEURON_ERRORS as err:
        return fatal_error(err, config.chain.subtensor.network)
    finally:
        if miner is not None:
            miner.close()
        if ctx is not None:
            ctx.close()
        close_node_group(node)


if __name__ == "__main__":
    sys.exit(main())
