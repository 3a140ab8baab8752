#!/usr/bin/env python3
"""Run a DiLoCo miner on the subnet.

    python neurons/miner.py --netuid N --wallet.name W --wallet.hotkey H --subtensor.network test \\
        --axon.port 8091 --axon.external_ip YOUR.PUBLIC.IP --neuron.device cuda --run.preset 1b

Every round (``--neuron.blocks_per_round`` chain blocks) the miner trains the shared model on the data assigned to its
hotkey, averages its pseudo-gradient with the other miners over hivemind (the port must be reachable), applies the
outer step and publishes the round's pseudo-gradient to validators. See docs/running_a_miner.md.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from template.base.behaviours import BUILTIN, load_behaviour
from template.base.miner import Miner
from template.base.neuron import StopFlag, add_neuron_args, start_neuron
from template.chain.client import NetworkConfigError, NotRegisteredError
from template.training.cli import add_averaging_args, add_run_args, dotted
from template.training.diloco import RunMismatchError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neurons/miner.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_neuron_args(parser)
    add_run_args(parser, dotted)
    add_averaging_args(parser, dotted)
    parser.add_argument("--miner.behaviour", dest="miner_behaviour", default="honest",
                        help=f"what this miner trains and publishes: {', '.join(sorted(BUILTIN))}, or module:Class "
                             "(see template/base/behaviours.py)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.logging_debug else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    if args.neuron_torch_threads:
        torch.set_num_threads(args.neuron_torch_threads)
    stop = StopFlag()
    stop.install()
    try:
        behaviour = load_behaviour(args.miner_behaviour)
        ctx = start_neuron(args, stop)
    except (NotRegisteredError, NetworkConfigError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    miner = None
    try:
        miner = Miner(ctx, args, behaviour)
        rounds = miner.run()
        ctx.emit("stopped", uid=ctx.uid, rounds=rounds)
        return 0
    except RunMismatchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if miner is not None:
            miner.close()
        ctx.close()


if __name__ == "__main__":
    sys.exit(main())
