"""A pytest plugin that keeps the garbage collector out of ``ast.parse`` for the whole test session.

Why: CPython 3.11 keeps one AST-construction depth counter per interpreter. A parse that starts while another is
being built (a finalizer run by the collector in the middle of the first one) leaves the outer parse with a counter it
did not set, and the outer parse fails with ``SystemError: AST constructor recursion depth mismatch``. In this suite
the inner parse is pytest's own: hivemind's ``ControlClient.__del__`` raises when a cycle holding it is collected,
pytest's unraisable-exception hook formats that error, and Python 3.11's traceback formatting parses the failing line
to place its carets. When the outer parse is pytest rendering a failed test's source, the whole run ends in an
INTERNALERROR (CI, Dec 2026: after 143 tests) and the real failure is never shown. With the collector off during every
parse, no finalizer can start inside one; cycles are collected at the next allocation after it.
"""

from __future__ import annotations

import ast
import functools
import gc

_unguarded_parse = ast.parse


@functools.wraps(_unguarded_parse)
def parse_without_collector(*args, **kwargs):
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _unguarded_parse(*args, **kwargs)
    finally:
        if was_enabled:
            gc.enable()


def pytest_configure(config) -> None:
    ast.parse = parse_without_collector


def pytest_unconfigure(config) -> None:
    ast.parse = _unguarded_parse
