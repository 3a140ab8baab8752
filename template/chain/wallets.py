"""Non-interactive bittensor wallets for tests and the local network.

Real operators create wallets with ``btcli wallet create`` (or ``new-coldkey`` / ``new-hotkey``), see
docs/running_on_testnet.md.
Here nothing may prompt: keys are written unencrypted into a directory the caller owns (usually a temp dir), which
is only acceptable for throwaway keys on a mock chain.
"""

from __future__ import annotations

from pathlib import Path

import bittensor as bt


def create_wallet(name: str, hotkey: str, path: str | Path) -> bt.Wallet:
    """Create (or overwrite) a coldkey + hotkey pair without a password and return the wallet."""
    wallet = bt.Wallet(name, hotkey, path=str(path))
    wallet.create_new_coldkey(use_password=False, overwrite=True, suppress=True)
    wallet.create_new_hotkey(use_password=False, overwrite=True, suppress=True)
    return wallet


def open_wallet(name: str, hotkey: str, path: str | Path | None = None) -> bt.Wallet:
    """Open an existing wallet; raise FileNotFoundError naming the hotkey file when it is missing."""
    wallet = bt.Wallet(name, hotkey, path=str(path)) if path is not None else bt.Wallet(name, hotkey)
    hotkey_file = Path(wallet.path).expanduser() / name / "hotkeys" / hotkey
    if not hotkey_file.exists():
        raise FileNotFoundError(
            f"no hotkey file at {hotkey_file}: create it with "
            f"`btcli wallet new-hotkey --wallet {name} --wallet-hotkey {hotkey}`"
        )
    return wallet
