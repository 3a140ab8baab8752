"""One typed config tree with the bittensor-style flags subnet operators already type in their pm2 scripts.

Flags are dotted (``--wallet.name``, ``--subtensor.network``, ``--netuid``) and map one-to-one onto dataclass fields.
Bittensor 11's environment variables (``BT_NETWORK``, ``BT_WALLET``, ``BT_WALLET_HOTKEY``, ``BT_WALLET_PATH``) give
the defaults, so ``btcli`` and the neurons can share one setup; an explicit flag always wins.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

DEFAULT_WALLET_PATH = "~/.bittensor/wallets"
# What --subtensor.network accepts, for --help and for the chain facade's error messages.
NETWORK_HELP = "finney, test, local, ws://HOST:PORT, wss://HOST:PORT or mock://127.0.0.1:PORT (the loopback mock chain)"


@dataclass(frozen=True)
class WalletConfig:
    name: str = "default"
    hotkey: str = "default"
    path: str = DEFAULT_WALLET_PATH


@dataclass(frozen=True)
class SubtensorConfig:
    network: str = "finney"


@dataclass(frozen=True)
class ChainArgs:
    """What every neuron and script needs to find its chain, subnet and keys."""

    netuid: int
    wallet: WalletConfig
    subtensor: SubtensorConfig


def netuid_flag(text: str) -> int:
    """``--netuid``: a subnet uid is a non-negative integer; argparse turns the error into usage + exit code 2."""
    try:
        netuid = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if netuid < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {netuid}")
    return netuid


def add_chain_args(parser: argparse.ArgumentParser, *, require_netuid: bool = True) -> None:
    """Add --netuid, --wallet.*, --subtensor.network (defaults from BT_* environment variables)."""
    env = os.environ.get
    parser.add_argument("--netuid", type=netuid_flag, required=require_netuid, help="subnet uid to work on")
    group = parser.add_argument_group("wallet")
    group.add_argument("--wallet.name", dest="wallet_name", default=env("BT_WALLET", WalletConfig.name),
                       help="coldkey wallet name (env BT_WALLET; default %(default)s)")
    group.add_argument("--wallet.hotkey", dest="wallet_hotkey", default=env("BT_WALLET_HOTKEY", WalletConfig.hotkey),
                       help="hotkey name inside the wallet (env BT_WALLET_HOTKEY; default %(default)s)")
    group.add_argument("--wallet.path", dest="wallet_path", default=env("BT_WALLET_PATH", DEFAULT_WALLET_PATH),
                       help="directory holding wallets (env BT_WALLET_PATH; default %(default)s)")
    chain = parser.add_argument_group("subtensor")
    network_default = env("BT_NETWORK", SubtensorConfig.network)
    chain.add_argument("--subtensor.network", dest="subtensor_network", default=network_default,
                       help=f"chain to use: {NETWORK_HELP} (env BT_NETWORK; default %(default)s)")


def chain_args_from(namespace: argparse.Namespace) -> ChainArgs:
    return ChainArgs(
        netuid=namespace.netuid,
        wallet=WalletConfig(namespace.wallet_name, namespace.wallet_hotkey, namespace.wallet_path),
        subtensor=SubtensorConfig(namespace.subtensor_network),
    )
