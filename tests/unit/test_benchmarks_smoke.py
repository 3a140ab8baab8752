"""Smoke test of the benchmarks: each runs with ``--quick`` in its own subprocess and prints one sane JSON object.

The benchmarks run in two lanes, the longest first, so at most two of them (and their peers) share the two cores
of a CI machine: the whole set took 67 s here. All eight at once took 64–77 s, and over 150 s
on a slow run, every process starving the others; each benchmark has its own bound, five to twenty-five times its
time alone, so a slow machine only waits longer and a hung benchmark names itself. Every check is on the numbers
they print: shapes, finiteness, and relations that must hold whatever the machine's speed (codec sizes, the analytic
byte bounds, losses below chance level)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# longest first (seconds alone on two idle cores, --quick): bytes_per_round 21, round_overhead 16, dataplane 15,
# allreduce 12, convergence 11, own_share 10, validator_cost 8, allreduce_load 8, codec_speed 4
BENCHMARKS = ("bytes_per_round", "round_overhead", "dataplane", "allreduce", "convergence", "own_share",
              "validator_cost", "allreduce_load", "codec_speed")
LANES = 2
BENCHMARK_TIMEOUT_S = 100
# the first test waits for the whole fixture: every benchmark of the longer lane at its bound, and a margin
FIXTURE_TIMEOUT_S = (len(BENCHMARKS) + LANES - 1) // LANES * BENCHMARK_TIMEOUT_S + 60
CHANCE_LOSS = math.log(257)  # uniform over the byte vocabulary: θ_0's loss is about this


def run_quick(name: str) -> dict:
    """Run one benchmark with ``--quick`` in its own process; its one line of JSON."""
    try:
        process = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--quick"], cwd=REPO_ROOT,
                                 capture_output=True, text=True, timeout=BENCHMARK_TIMEOUT_S)
    except subprocess.TimeoutExpired as timeout:
        raise AssertionError(f"{name} ran past {BENCHMARK_TIMEOUT_S} s:\n{str(timeout.stderr or '')[-3000:]}") from None
    assert process.returncode == 0, f"{name} failed:\n{process.stderr[-3000:]}"
    lines = [line for line in process.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"{name} must print exactly one line of JSON, got {len(lines)}"
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def outputs() -> dict[str, dict]:
    with ThreadPoolExecutor(max_workers=LANES) as lanes:
        futures = {name: lanes.submit(run_quick, name) for name in BENCHMARKS}
        return {name: future.result() for name, future in futures.items()}


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def check_common(result: dict, name: str) -> None:
    assert result["benchmark"] == name and result["quick"] is True
    machine = result["machine"]
    assert machine["cpus"] >= 1 and machine["device"] == "cpu" and finite(machine["load_average_1m"])
    assert finite(result["seconds"]) and result["seconds"] > 0


@pytest.mark.timeout(FIXTURE_TIMEOUT_S)
def test_convergence_quick(outputs):
    result = outputs["convergence"]
    check_common(result, "convergence")
    settings, arms = result["settings"], result["arms"]
    assert set(arms) == {"dp", "single", "diloco_none", "diloco_fp16", "diloco_int8"}
    for arm in arms.values():
        assert finite(arm["final_heldout_loss"]) and 0 < arm["final_heldout_loss"] < CHANCE_LOSS
        assert [point["step"] for point in arm["curve"]] == [
            settings["inner_steps"] * (r + 1) for r in range(settings["rounds"])
        ]
    # same tokens for DP and DiLoCo; one worker sees 1/N of them
    assert arms["dp"]["tokens"] == arms["diloco_none"]["tokens"] == settings["workers"] * arms["single"]["tokens"]
    summary = result["summary"]
    assert summary["communications"] == dict(dp=settings["steps_per_worker"], diloco=settings["rounds"])
    assert arms["dp"]["bytes_sent_per_peer"] > arms["diloco_none"]["bytes_sent_per_peer"] > 0
    assert arms["diloco_none"]["bytes_sent_per_peer"] > arms["diloco_fp16"]["bytes_sent_per_peer"]
    assert arms["diloco_fp16"]["bytes_sent_per_peer"] > arms["diloco_int8"]["bytes_sent_per_peer"]
    ratio = arms["diloco_none"]["final_heldout_loss"] / arms["dp"]["final_heldout_loss"]
    assert summary["diloco_over_dp"] == pytest.approx(ratio)
    assert summary["diloco_over_dp_goal_met"] == (ratio <= 1.02)
    assert set(summary["codec_loss_change_vs_none"]) == {"fp16", "int8"}
    assert all(abs(change) < 0.05 for change in summary["codec_loss_change_vs_none"].values())


@pytest.mark.timeout(FIXTURE_TIMEOUT_S)
def test_own_share_quick(outputs):
    result = outputs["own_share"]
    check_common(result, "own_share")
    arms = result["arms"]
    assert set(arms) == {f"n{n}_{rule}" for n in (2, 4) for rule in ("averaged", "deferred", "dropped")}
    for name, arm in arms.items():
        assert finite(arm["final_heldout_loss"]) and 0 < arm["final_heldout_loss"] < CHANCE_LOSS, (name, arm)
        reference = arms[f"n{arm['workers']}_averaged"]["final_heldout_loss"]
        assert arm["loss_over_averaged"] == pytest.approx(arm["final_heldout_loss"] / reference)
    # leaving the owner out changes the average: the rules must not all train the same θ
    assert arms["n4_deferred"]["final_heldout_loss"] != arms["n4_averaged"]["final_heldout_loss"]


@pytest.mark.timeout(FIXTURE_TIMEOUT_S)
def test_allreduce_quick(outputs):
    result = outputs["allreduce"]
    check_common(result, "allreduce")
    rows = result["rows"]
    assert [(r["peers"], r["size"], r["codec"]) for r in rows] == [(2, 100_000, c) for c in ("none", "fp16", "int8")]
    bytes_per_value = {"none": 4.0, "fp16": 2.0, "int8": 1.0 + 4 / 256}
    # worst-case codec error of a mean of N(0, 1) vectors (|x| < 6 here): input and output rounding
    error_bound = {"none": 1e-6, "fp16": 2 * 6 * 2.0**-11, "int8": 6 / 127}
    for r in rows:
        assert r["failures"] == [] and r["identical"] is True
        assert finite(r["seconds"]) and r["seconds"] > 0 and finite(r["gloo_s"]) and r["gloo_s"] > 0
        assert r["hivemind_over_gloo"] == pytest.approx(r["seconds"] / r["gloo_s"])
        assert 0 <= r["max_abs_error"] <= error_bound[r["codec"]]
        assert r["gloo_max_abs_error"] <= 1e-6
        # 2(N-1)/N x size x codec bytes, plus a little protobuf framing
        assert 1.0 <= r["bytes_over_float32_bound"] / (bytes_per_value[r["codec"]] / 4) <= 1.01
    summary = result["summary"]
    assert summary["default_codec"] in ("none", "fp16", "int8") and summary["failed_allreduces"] == 0
    assert summary["all_identical"] is True and summary["checked_rows"] == len(rows)
    assert summary["goal_met"] == (summary["worst_default_codec_over_gloo"] <= 3.0)


@pytest.mark.timeout(FIXTURE_TIMEOUT_S)
def test_allreduce_load_quick(outputs):
    result = outputs["allreduce_load"]
    check_common(result, "allreduce_load")
    assert result["settings"] == dict(lanes=2, rounds=2, peers=2, values=100_000, codec="fp16", timeout_s=60.0,
                                      absent=0)
    assert result["allreduces"] == result["allreduces_expected"] == 4
    assert result["member_outcomes"] == 8
    assert result["members_ok"] + result["members_partial"] + result["members_failed"] == 8
    assert result["split"] == 0  # members that succeeded always hold the same bytes
    assert result["members_ok"] >= 6, result  # a lost round under this light load is a regression
    assert finite(result["round_s_median"]) and result["round_s_max"] >= result["round_s_median"] > 0


@pytest.mark.timeout(FIXTURE_TIMEOUT_S)
def test_dataplane_quick(outputs):
    result = outputs["dataplane"]
    check_common(result, "dataplane")
    (row,) = result["rows"]
    assert (row["peers"], row["size"], row["codec"]) == (2, 300_000, "fp16")
    assert row["identical"] is True and 0 <= row["max_abs_error"] <= 2 * 6 * 2.0**-11  # fp16 in and out
    assert finite(row["gloo_s"]) and row["gloo_s"] > 0 and finite(row["dataplane_s"]) and row["dataplane_s"] > 0
    assert row["dataplane_over_gloo"] == pytest.approx(row["dataplane_s"] / row["gloo_s"])
    assert result["summary"]["goal_met"] == (result["summary"]["worst_over_gloo"] <= 3.0)
    # the same butterfly through a transport child: identical bytes (part of "identical"), its own timings
    assert all(finite(row[k]) and row[k] > 0 for k in ("child_s", "child_round_setup_s"))
    assert row["child_respawn_s"] is None  # a second spawn per rank only without --quick
    assert row["child_over_gloo"] == pytest.approx((row["child_s"] + row["child_round_setup_s"]) / row["gloo_s"])
    assert result["summary"]["child_goal_met"] == (result["summary"]["worst_child_over_gloo"] <= 3.0)
    probe = result["oversize_probe"]  # gloo 2.13 aborts the receiver: SIGABRT (docs/benchmarks.md §2b)
    assert (probe["posted_bytes"], probe["sent_bytes"]) == (1024, 2048) and probe["receiver_exit_status"] is not None
    assert probe["receiver_survived"] == (probe["receiver_exit_status"] == 0) == result["summary"][
        "safe_among_untrusted_peers"]
    assert probe["receiver_survived"] or probe["receiver_exit_status"] < 0 and probe["receiver_signal"]


@pytest.mark.timeout(FIXTURE_TIMEOUT_S)
def test_round_overhead_quick(outputs):
    result = outputs["round_overhead"]
    check_common(result, "round_overhead")
    (tiny,) = result["configs"]
    assert tiny["model"] == "tiny" and tiny["finished"] is True and tiny["failed_allreduces"] == 0
    assert tiny["samples"] == tiny["peers"] * (tiny["rounds"] - 1)
    assert 0 < tiny["allreduce_s"] < tiny["overhead_s"] <= tiny["overhead_s_max"]
    assert tiny["t_step_s"] > 0 and tiny["t_step_solo_s"] > 0
    assert tiny["overhead_steps"] == pytest.approx(tiny["overhead_s"] / tiny["t_step_s"])
    utilization = tiny["utilization"]
    assert 0 < utilization["H100"] < utilization["H500"] < 1
    h100 = 100 * tiny["t_step_s"] / (100 * tiny["t_step_s"] + tiny["overhead_s"])
    assert utilization["H100"] == pytest.approx(h100)
    assert result["summary"]["goal_met"] == (tiny["overhead_steps"] <= 5.0)


@pytest.mark.timeout(FIXTURE_TIMEOUT_S)
def test_bytes_per_round_quick(outputs):
    result = outputs["bytes_per_round"]
    check_common(result, "bytes_per_round")
    codecs = {m["codec"]: m for m in result["codecs"]}
    assert set(codecs) == {"none", "int8"}  # --quick: the two extremes, run as two concurrent peer groups
    for m in codecs.values():
        assert m["finished"] is True and m["errors"] == {}, m
        why = (m["codec"], m["seconds"], m["per_round"], m["logs"])  # a failed round: its failures, its peers' logs
        assert m["measured_over_analytic"] is not None and 1.0 <= m["measured_over_analytic"] <= 1.01, why  # framing
        assert all(row["theta_identical"] for row in m["per_round"]), m["per_round"]
    assert codecs["none"]["bytes_per_round_per_peer"] > 3.9 * codecs["int8"]["bytes_per_round_per_peer"]
    # data-parallel sends float32 gradients every step: H x 4 / (codec bytes per value) times more per round
    h = result["settings"]["inner_steps"]
    assert codecs["none"]["dp_over_diloco"] == pytest.approx(h, rel=0.01)
    assert codecs["int8"]["dp_over_diloco"] == pytest.approx(4 * h / (1 + 4 / 256), rel=0.01)
    analytic = result["analytic"]
    assert analytic["tiny"]["params"] == codecs["none"]["params"] and analytic["small"]["params"] > 50_000_000


@pytest.mark.timeout(FIXTURE_TIMEOUT_S)
def test_validator_cost_quick(outputs):
    result = outputs["validator_cost"]
    check_common(result, "validator_cost")
    (tiny,) = result["results"]
    assert tiny["preset"] == "tiny" and tiny["miners"] == 4 and tiny["parameters"] > 1_000_000
    assert tiny["t_step_s"] > 0 and tiny["t_miner_s"] > 0
    assert tiny["ratio_miner_to_step"] == pytest.approx(tiny["t_miner_s"] / tiny["t_step_s"], rel=0.02)
    assert tiny["scoring_total_s"] == pytest.approx(4 * tiny["t_miner_s"], rel=0.02)
    localnet = result["localnet"]
    assert 0 < localnet["scoring_budget_s"] < localnet["round_s"]
    assert localnet["fits_one_round"] == (localnet["tiny_16_miners_s"] <= localnet["scoring_budget_s"])


@pytest.mark.timeout(FIXTURE_TIMEOUT_S)
def test_codec_speed_quick(outputs):
    result = outputs["codec_speed"]
    check_common(result, "codec_speed")
    codecs = {row["codec"]: row for row in result["codecs"]}
    assert set(codecs) == {"none", "fp16", "int8", "sparse"}
    for row in codecs.values():
        assert all(finite(s) and s > 0 for s in row["seconds_at_total"].values()), row
        # a butterfly peer sends (N−1)/N of its contribution and of the averaged segments (N = 4 here)
        expected = 0.75 * (row["contribution_bits_per_param"] + row["averaged_bits_per_param"])
        assert row["butterfly_bits_per_param_sent"] == pytest.approx(expected, rel=1e-6), row
    assert codecs["none"]["contribution_bits_per_param"] == 32 and codecs["fp16"]["contribution_bits_per_param"] == 16
    assert codecs["sparse"]["butterfly_bits_per_param_sent"] <= 2.0  # issue 13: ≤ 2 bits per parameter per round
    for row in codecs.values():  # one peer's round at N = 8: its parts, their sum, the largest, the ratio to fp16's
        cost = row["round"]
        parts = cost["seconds_at_total"]
        assert cost["peers"] == 8 and set(parts) == {"encode", "decode_own", "reduce_share", "decode_average"}
        assert all(finite(s) and s > 0 for s in parts.values()) and cost["dominated_by"] == max(parts, key=parts.get)
        assert cost["total_s"] == pytest.approx(sum(parts.values()))
        assert cost["over_fp16"] == pytest.approx(cost["total_s"] / codecs["fp16"]["round"]["total_s"])


@pytest.mark.timeout(120)
def test_influence_quick():
    """Run alone, after the others (it computes all the time): honest rounds untouched by the value bound — nothing
    clipped or bounded, θ and bytes bit-identical without it — and the concentrated attacker bounded in every round,
    its pull on its coordinates cut from tens of times honest training's largest move to at most the bound."""
    process = subprocess.run([sys.executable, "-m", "benchmarks.influence", "--quick"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=110)
    assert process.returncode == 0, process.stderr[-3000:]
    result = json.loads(process.stdout)
    check_common(result, "influence")
    summary = result["summary"]
    rows = [(case["codec"], case["honest"]["member_rounds"]) for case in result["cases"]]
    assert rows == [("fp16", 6), ("sparse", 6)]
    assert summary["honest_member_rounds"] == 12 and summary["honest_norm_clipped"] == summary["honest_bounded"] == 0
    assert summary["theta_identical_without_bound"] and summary["bytes_identical_without_bound"]
    assert 1.0 <= summary["largest_honest_reach"] < summary["value_bound_multiple"]
    assert summary["attacker_bounded_in_every_round"]
    assert summary["largest_attack_pull"] <= summary["value_bound_multiple"] * 1.01
    assert summary["largest_attack_pull_without_bound"] > 10 * summary["largest_attack_pull"]
    for case in result["cases"]:
        # 2 rounds of 2 steps stay near chance on a fresh clone's stdlib text: what counts is that the bound
        # changed nothing (θ bit-identical, so the same loss)
        assert case["loss_without_bound"] == case["honest"]["heldout_loss"] and finite(case["loss_without_bound"])
