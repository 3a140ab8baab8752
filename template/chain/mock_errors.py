"""The errors the mock chain (:mod:`template.chain.mock`) raises, built as the SDK's RPC backend builds them.

- :func:`chain_error`: a chain-side rejection, named as the chain names it (``SettingWeightsTooFast``, ...), with the
  error's docs from the SDK's generated error table as the message and ``detail`` in parentheses.
- :func:`invalid_argument`: a request that would not even encode (wrong type, missing field, malformed storage key);
  code ``INVALID_ARGUMENT``, no chain error name.
- :func:`unsupported`: something the mock chain does not model (a storage item, call, runtime API, ...); code
  ``DISABLED``, and the message lists what is supported.

These only build errors; nothing here reads or changes chain state.
"""

from __future__ import annotations

from typing import Any

import bittensor as bt
from bittensor._generated.errors import ERRORS
from bittensor.result import ErrorCode

_DOCS = {info.name: info.docs for info in ERRORS.values()}


def chain_error(name: str, detail: str = "") -> bt.ChainError:
    """A ``bt.ChainError`` as the RPC backend builds it from a failed receipt: the error's docs, its exact name."""
    docs = _DOCS.get(name, name)
    return bt.ChainError(f"{docs} ({detail})" if detail else docs, name)


def invalid_argument(message: str) -> bt.ChainError:
    """A rejection with no chain error name: the call would not even encode (wrong type, missing field, ...)."""
    return bt.ChainError(message, code=ErrorCode.INVALID_ARGUMENT)


def unsupported(what: str, supported: Any = ()) -> bt.ChainError:
    listed = f"; supported: {', '.join(sorted(supported))}" if supported else ""
    return bt.ChainError(f"the mock chain does not support {what}{listed}", code=ErrorCode.DISABLED)


__all__ = ["chain_error", "invalid_argument", "unsupported"]
