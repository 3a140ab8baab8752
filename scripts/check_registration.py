#!/usr/bin/env python3
"""Print whether a wallet's hotkey is registered on a subnet, and its uid.

    python scripts/check_registration.py --subtensor.network test --netuid 123 --wallet.name W --wallet.hotkey H

Exit status: 0 registered, 1 not registered, 2 bad input (unknown network, missing wallet, no such subnet).
"""

from __future__ import annotations

import argparse
import sys

from template.chain.client import ChainClient, NetworkConfigError
from template.chain.wallets import open_wallet
from template.config import add_chain_args, chain_args_from


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_chain_args(parser)
    args = chain_args_from(parser.parse_args(argv))
    try:
        wallet = open_wallet(args.wallet.name, args.wallet.hotkey, args.wallet.path)
        client = ChainClient.connect(args.subtensor.network, args.netuid)
        hotkey = wallet.hotkey.ss58_address
        uid = client.uid_of(hotkey)
    except (FileNotFoundError, NetworkConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if uid is None:
        print(f"NOT registered: hotkey {hotkey} has no uid on netuid {args.netuid} ({args.subtensor.network})")
        print(f"register with: btcli subnets register --netuid {args.netuid} --network {args.subtensor.network} "
              f"--wallet {args.wallet.name} --wallet-hotkey {args.wallet.hotkey}")
        return 1
    print(f"registered: hotkey {hotkey} is uid {uid} on netuid {args.netuid} ({args.subtensor.network})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
