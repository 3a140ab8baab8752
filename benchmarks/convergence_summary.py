"""The convergence benchmark's verdicts: every arm's held-out loss against the baselines of the same run (ratios),
and whether each goal is met. Kept apart from the arms (``benchmarks.convergence``), which only train and measure."""

from __future__ import annotations

from typing import Any

from benchmarks.common import ratio

DILOCO_OVER_DP_GOAL = 1.02
CODEC_LOSS_GOAL = 0.01
SPARSE_OVER_DENSE_GOAL = 1.01  # the product's bar: sparse held-out loss ≤ 1.01 × dense fp32
OVERLAP_OVER_BLOCKING_GOAL = 1.01  # overlapped communication within 1 % of the blocking arm


def summarize(arms: dict[str, dict], codecs: list[str]) -> dict[str, Any]:
    """Ratios against the baselines of the same run, and whether the goals are met."""
    loss = {name: arm.get("final_heldout_loss") for name, arm in arms.items()}
    summary: dict[str, Any] = {}
    summary.update(compression_summary(arms, loss))
    headline = next((f"diloco_{c}" for c in codecs if loss.get(f"diloco_{c}") is not None), None)
    if headline is None:
        headline = next((name for name in arms if name.startswith("hivemind_") and loss.get(name)), None)
    if headline is None or loss.get("dp") is None:
        return summary
    summary.update(
        headline_arm=headline,
        diloco_over_dp=loss[headline] / loss["dp"],
        diloco_over_dp_goal=DILOCO_OVER_DP_GOAL,
        diloco_over_dp_goal_met=loss[headline] / loss["dp"] <= DILOCO_OVER_DP_GOAL,
        single_over_dp=ratio(loss["single"], loss["dp"]),
        diloco_beats_single=loss[headline] < loss["single"],
        communications=dict(dp=arms["dp"]["communications"], diloco=arms[headline].get("communications")),
    )
    changes = {c: loss[f"diloco_{c}"] / loss["diloco_none"] - 1 for c in codecs
               if c != "none" and loss.get(f"diloco_{c}") is not None and loss.get("diloco_none") is not None}
    if changes:
        summary.update(codec_loss_change_vs_none=changes, codec_loss_goal=CODEC_LOSS_GOAL,
                       codec_loss_goal_met=all(abs(v) <= CODEC_LOSS_GOAL for v in changes.values()))
    sweep = {name: value for name, value in loss.items() if "_lr" in name and value is not None}
    if sweep:
        summary["outer_sweep_over_dp"] = {name: value / loss["dp"] for name, value in sweep.items()}
    return summary


def compression_summary(arms: dict[str, dict], loss: dict[str, float | None]) -> dict[str, Any]:
    """Every DiLoCo arm against dense fp32 (``diloco_none``), and every overlap arm against its blocking arm."""
    dense = loss.get("diloco_none")
    summary: dict[str, Any] = {}
    if dense:
        table = {name: dict(loss=loss[name], over_dense_fp32=loss[name] / dense,
                            contribution_bits_per_param=arm["contribution_bits_per_param"],
                            averaged_bits_per_param=arm["averaged_bits_per_param"])
                 for name, arm in arms.items()
                 if arm.get("kind") == "diloco" and loss.get(name) and "averaged_bits_per_param" in arm}  # exact arms
        sparse = {name: row["over_dense_fp32"] for name, row in table.items()
                  if arms[name]["codec"] == "sparse" and arms[name]["overlap"] == "blocking"}
        summary.update(over_dense_fp32=table)
        if sparse:
            best = min(sparse, key=sparse.get)
            summary.update(sparse_goal=SPARSE_OVER_DENSE_GOAL, best_sparse_arm=best,
                           sparse_goal_met={name: value <= SPARSE_OVER_DENSE_GOAL for name, value in sparse.items()})
    overlap = {}
    for name, arm in arms.items():
        blocking = f"diloco_{arm.get('codec')}"
        if arm.get("overlap", "blocking") != "blocking" and loss.get(name) and loss.get(blocking):
            overlap[name] = loss[name] / loss[blocking]
    if overlap:
        summary.update(overlap_over_blocking=overlap, overlap_goal=OVERLAP_OVER_BLOCKING_GOAL,
                       overlap_goal_met={name: value <= OVERLAP_OVER_BLOCKING_GOAL for name, value in overlap.items()})
    return summary
