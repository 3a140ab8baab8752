"""The dashboard without sockets: its flags, and its state built from the events a neuron emits (the validator's
per-UID table, weights and rounds; the miner's live progress, rounds and publications; bounds, bad events, JSON)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from template.base import dashboard_state
from template.base.config import DashboardConfig, NeuronConfig, add_miner_args, add_neuron_args
from template.base.dashboard import start_dashboard
from template.base.dashboard_state import DashboardState, json_safe


def scored_row(uid: int, score: float, **extra) -> dict:
    return dict(uid=uid, hotkey=f"5hot{uid}", score=score, quality=score, ema=score / 2, reason="", coverage=1.0,
                share=1.0, norm=1.5, gain=0.03, credit=0.01, credit_se=0.002, **extra)


def validator_with_two_rounds() -> DashboardState:
    state = DashboardState("validator", "9.9.9", clock=lambda: 100.0)
    state.record(dict(event="ready", time=101.0, uid=0, hotkey="5val", restored="fresh", chain_round=3))
    state.record(dict(event="synced", time=110.0, round=4, theta_hash="aa", heldout_loss=5.0, allreduce_ok=True,
                      group_size=3, group_hotkeys=["5hot1", "5hot2"], allreduce_s=0.5, bytes_sent=1000))
    state.record(dict(event="scored", time=120.0, round=4, seconds=2.0, fetch_s=0.5,
                      miners=[scored_row(1, 0.8), scored_row(2, 0.0, reason_detail="x")]))
    state.record(dict(event="weights", time=121.0, round=4, block=90, ok=True, weights={"1": 1.0}, error=""))
    state.record(dict(event="synced", time=130.0, round=5, theta_hash="bb", heldout_loss=4.5, allreduce_ok=False,
                      group_size=0, group_hotkeys=[], allreduce_s=3.0, bytes_sent=0))
    state.record(dict(event="scored", time=140.0, round=5, seconds=2.5, fetch_s=0.7, miners=[scored_row(1, 0.6)]))
    state.record(dict(event="weights", time=141.0, round=5, block=130, ok=False, weights={}, error="rate limit"))
    return state


def test_validator_table_has_one_row_per_uid_with_its_last_score_weight_and_when_it_was_seen():
    snapshot = validator_with_two_rounds().snapshot()
    rows = {row["uid"]: row for row in snapshot["miners"]}
    assert sorted(rows) == [1, 2]
    assert rows[1]["score"] == 0.6 and rows[1]["round"] == 5 and rows[1]["last_seen"] == 140.0
    assert rows[2]["score"] == 0.0 and rows[2]["round"] == 4 and rows[2]["last_seen"] == 120.0
    assert rows[2]["reason_detail"] == "x"  # keys the validator adds later are kept as they come
    assert rows[1]["weight"] == 1.0 and rows[2]["weight"] == 0.0  # a uid missing from the weight row has weight 0
    for key in ("hotkey", "quality", "ema", "coverage", "share", "norm", "gain", "credit"):
        assert key in rows[1]


def test_validator_histories_weights_ema_heldout_and_last_allreduce():
    snapshot = validator_with_two_rounds().snapshot()
    assert [(w["round"], w["ok"], w["weights"]) for w in snapshot["weights"]] == [(4, True, {"1": 1.0}),
                                                                                (5, False, {})]
    assert snapshot["weights"][1]["error"] == "rate limit"
    assert [(e["round"], e["ema"]) for e in snapshot["ema"]] == [(4, {"1": 0.4, "2": 0.0}), (5, {"1": 0.3})]
    assert [(r["round"], r["heldout_loss"]) for r in snapshot["rounds"]] == [(4, 5.0), (5, 4.5)]
    last = snapshot["last_allreduce"]
    assert (last["round"], last["allreduce_ok"], last["group_size"], last["allreduce_s"]) == (5, False, 0, 3.0)
    assert [(s["round"], s["miners"]) for s in snapshot["scoring"]] == [(4, 2), (5, 1)]
    neuron = snapshot["neuron"]
    assert (neuron["role"], neuron["uid"], neuron["hotkey"], neuron["version"]) == ("validator", 0, "5val", "9.9.9")
    assert neuron["state"] == "synced" and neuron["round"] == 5 and neuron["last_event"] == 141.0
    assert snapshot["events"] == dict(ready=1, synced=2, scored=2, weights=2)


def test_a_new_hotkey_on_a_uid_starts_a_fresh_row():
    state = validator_with_two_rounds()
    state.record(dict(event="scored", time=150.0, round=6, seconds=1.0, fetch_s=0.1,
                      miners=[dict(uid=2, hotkey="5newcomer", score=0.3)]))
    row = next(r for r in state.snapshot()["miners"] if r["uid"] == 2)
    assert row == dict(uid=2, hotkey="5newcomer", score=0.3, round=6, last_seen=150.0)


def test_miner_live_progress_rounds_and_publications_with_their_fetchers():
    state = DashboardState("miner", "1.0.0")
    state.record(dict(event="ready", time=1.0, uid=3, hotkey="5min", restored="checkpoint round 7", chain_round=7))
    for step in range(1, 4):
        state.record(dict(event="progress", time=1.0 + step, round=8, step=step, of_steps=10, loss=5.0 - step,
                          tokens_per_s=900.0 + step))
    state.record(dict(event="round", time=9.0, round=8, base_theta_hash="a", inner_steps=10, tokens=640,
                      train_loss=3.5, heldout_loss=3.7, allreduce_ok=True, reason="", group_size=3, allreduce_s=0.4,
                      round_s=9.0, inner_s=6.0, bytes_sent=12345, theta_hash="b"))
    state.record(dict(event="published", time=9.5, round=8, bytes=4000))
    for hotkey in ("5val", "5val", "5other"):
        state.record(dict(event="served", time=10.0, round=8, hotkey=hotkey))
    state.record(dict(event="served", time=10.5, round=7, hotkey=None))  # a round published before a restart
    snapshot = state.snapshot()
    assert snapshot["live"] == dict(time=4.0, round=8, step=3, of_steps=10, loss=2.0, tokens_per_s=903.0)
    assert [s["loss"] for s in snapshot["samples"]] == [4.0, 3.0, 2.0]
    (entry,) = snapshot["rounds"]
    assert (entry["round"], entry["allreduce_ok"], entry["group_size"], entry["bytes_sent"]) == (8, True, 3, 12345)
    assert entry["train_loss"] == 3.5 and entry["heldout_loss"] == 3.7 and entry["theta_hash"] == "b"
    publications = {p["round"]: p for p in snapshot["publications"]}
    assert publications[8]["bytes"] == 4000
    assert {(f["hotkey"], f["times"]) for f in publications[8]["fetched_by"]} == {("5val", 2), ("5other", 1)}
    assert publications[7]["bytes"] is None and publications[7]["fetched_by"][0]["hotkey"] == "unknown"
    assert snapshot["neuron"]["state"] == "averaged" and snapshot["neuron"]["restored"] == "checkpoint round 7"


def test_histories_are_bounded(monkeypatch):
    monkeypatch.setattr(dashboard_state, "MAX_UIDS", 5)
    monkeypatch.setattr(dashboard_state, "PUBLICATIONS", 3)
    monkeypatch.setattr(dashboard_state, "FETCHERS", 2)
    miner = DashboardState("miner", "1.0.0")
    for i in range(dashboard_state.SAMPLES + 50):
        miner.record(dict(event="progress", time=float(i), round=1, step=i, of_steps=10, loss=1.0, tokens_per_s=1.0))
    for r in range(10):
        miner.record(dict(event="published", time=float(r), round=r, bytes=1))
        for k in range(4):
            miner.record(dict(event="served", time=float(r), round=r, hotkey=f"5v{k}"))
    snapshot = miner.snapshot()
    assert len(snapshot["samples"]) == dashboard_state.SAMPLES and snapshot["samples"][-1]["step"] == 649
    assert [p["round"] for p in snapshot["publications"]] == [7, 8, 9]
    assert all(len(p["fetched_by"]) == 2 for p in snapshot["publications"])
    validator = DashboardState("validator", "1.0.0")
    validator.record(dict(event="scored", time=1.0, round=1, miners=[scored_row(uid, 0.5) for uid in range(9)]))
    assert [row["uid"] for row in validator.snapshot()["miners"]] == [0, 1, 2, 3, 4]


def test_unreadable_events_are_counted_and_never_raise():
    state = DashboardState("validator", "1.0.0")
    state.record(dict(event="scored", time=1.0, round=1))  # no miners
    state.record(dict(event="scored", time=1.0, round=1, miners=[dict(uid="not a number")]))
    state.record(dict(time=1.0))  # no kind
    state.record(dict(event="synced", time=1.0))  # no round
    state.record("not even a dict")  # type: ignore[arg-type]
    state.record(dict(event="something new", time=2.0, value=1))  # an unknown kind is counted, not an error
    snapshot = state.snapshot()
    assert state.dropped == 5 and snapshot["dropped"] == 5
    assert snapshot["events"]["something new"] == 1 and snapshot["miners"] == []


def test_the_document_is_strict_json_even_with_nan_losses_and_odd_values():
    state = DashboardState("miner", "1.0.0")
    state.record(dict(event="progress", time=1.0, round=1, step=1, of_steps=2, loss=float("nan"),
                      tokens_per_s=float("inf")))
    state.record(dict(event="round", time=2.0, round=1, inner_steps=1, tokens=1, train_loss=float("-inf"),
                      heldout_loss=None, allreduce_ok=False, reason="x" * 10_000, group_size=0, allreduce_s=0.0,
                      bytes_sent=0, theta_hash="c"))
    text = json.dumps(state.snapshot(), allow_nan=False)
    document = json.loads(text)
    assert document["live"]["loss"] is None and document["live"]["tokens_per_s"] is None
    assert len(document["rounds"][0]["reason"]) == dashboard_state.MAX_STRING
    assert json_safe({1: (math.nan, b"x", object)}) == {"1": [None, "b'x'", "<class 'object'>"]}


def neuron_config(*flags: str) -> NeuronConfig:
    parser = argparse.ArgumentParser()
    add_neuron_args(parser)
    add_miner_args(parser, ["honest"])
    return NeuronConfig.from_args(parser.parse_args(["--netuid", "1", *flags]))


def test_the_dashboard_is_off_by_default_and_binds_loopback_unless_told():
    assert neuron_config().dashboard == DashboardConfig(port=0, ip="127.0.0.1")
    assert start_dashboard(neuron_config().dashboard, "miner") is None  # no port: no server, no thread
    config = neuron_config("--dashboard.port", "8000", "--dashboard.ip", "0.0.0.0").dashboard
    assert (config.port, config.ip) == (8000, "0.0.0.0")
    with pytest.raises(ValueError, match="--dashboard.port must be within"):
        neuron_config("--dashboard.port", "70000")
