"""``HIVEMIND_LOGLEVEL`` means the same in every program that runs peers: warnings by default, more on request."""

from __future__ import annotations

import logging

import pytest

from template.p2p.dht import hivemind_log_level


@pytest.fixture
def restore_hivemind_level():
    logger = logging.getLogger("hivemind")
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_hivemind_logs_warnings_only_unless_asked(monkeypatch, restore_hivemind_level):
    monkeypatch.delenv("HIVEMIND_LOGLEVEL", raising=False)
    restore_hivemind_level.setLevel(logging.DEBUG)
    hivemind_log_level()
    assert restore_hivemind_level.level == logging.WARNING


def test_hivemind_loglevel_debug_shows_matchmaking_and_dht_calls(monkeypatch, restore_hivemind_level):
    monkeypatch.setenv("HIVEMIND_LOGLEVEL", "DEBUG")
    hivemind_log_level()
    assert restore_hivemind_level.level == logging.DEBUG
