#!/usr/bin/env python3
"""Run a validator on the subnet.

    python neurons/validator.py --netuid N --wallet.name W --wallet.hotkey H --subtensor.network test \\
        --axon.port 8092 --axon.external_ip YOUR.PUBLIC.IP

Every round (``--neuron.blocks_per_round`` chain blocks) the validator takes part in the miners' all-reduce as an
auxiliary peer (it receives the average, contributes nothing) so it holds the same model θ as the miners; during the
next round it fetches each miner's published pseudo-gradient, scores it (integrity, copies, replays, loss on the
miner's assigned data against other data, participation in the all-reduce), keeps the scores over rounds in its state
directory and sets weights on chain. The ``--run.*`` flags must match the miners'. It refuses to start without a
validator permit unless ``--neuron.allow_no_permit``. See docs/running_a_validator.md and docs/validation.md.
"""

from __future__ import annotations

import argparse
import sys

from template.base.config import NeuronConfig, add_neuron_args, add_validator_args
from template.base.neuron import NEURON_ERRORS, fatal_error, prepare_process, start_neuron
from template.base.validator import Validator


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neurons/validator.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_neuron_args(parser)
    add_validator_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = NeuronConfig.from_args(args)
    except ValueError as err:  # values that parse but do not fit together (e.g. a run id with a '.')
        parser.error(str(err))
    stop = prepare_process(config)
    ctx = validator = None
    try:
        ctx = start_neuron(config, stop)
        permit = bool(ctx.chain.metagraph().neuron(ctx.uid).validator_permit)
        if not permit and not config.validator.allow_no_permit:
            print(f"error: uid {ctx.uid} has no validator permit on netuid {ctx.netuid}: stake more "
                  "(btcli stake add) or wait for the next epoch; --neuron.allow_no_permit runs anyway, but miners "
                  "refuse to serve a validator without a permit", file=sys.stderr)
            return 2
        validator = Validator(ctx)
        rounds = validator.run()
        ctx.emit("stopped", uid=ctx.uid, rounds=rounds)
        return 0
    except NEURON_ERRORS as err:
        return fatal_error(err, config.chain.subtensor.network)
    finally:
        if validator is not None:
            validator.close()
        if ctx is not None:
            ctx.close()


if __name__ == "__main__":
    sys.exit(main())
