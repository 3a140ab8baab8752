"""Fixtures every test shares."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _token_symbol_cache(tmp_path, monkeypatch):
    """The bittensor SDK caches token symbols on disk when it connects; keep that out of the home directory."""
    monkeypatch.setenv("BTCLI_TOKEN_SYMBOLS_CACHE", str(tmp_path / "token_symbols.json"))
