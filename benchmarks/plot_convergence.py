"""Plot a ``benchmarks.convergence`` result: held-out loss per round of every arm, and one arm's ratio to others.

``python -m benchmarks.plot_convergence RESULT.json OUT.png [--ratio-of diloco_sparse]``

Reads the JSON the benchmark printed (any run, long or short) and writes one PNG with two panels: the held-out loss
after each round for every arm, and the ratio of the ``--ratio-of`` arm's loss to each other DiLoCo arm's at the same
round, with the 1.01 and 1.05 lines the sparse codec is judged by. Prints, as JSON, the round from which the ratio
stays at or below 1.01 for each other arm (None: never).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

PARITY = 1.01


def per_round(arm: dict[str, Any]) -> list[float]:
    """The held-out loss after each round (the curve's points are one per round, in order)."""
    return [point["loss"] for point in arm["curve"]]


def stays_within(ratios: list[float], bound: float) -> int | None:
    """The first round (1-based) from which every ratio is ≤ ``bound``; None when the last one is above it."""
    first = None
    for index, value in enumerate(ratios):
        if value > bound:
            first = None
        elif first is None:
            first = index + 1
    return first


def ratios_to_others(arms: dict[str, dict], name: str) -> dict[str, list[float]]:
    mine = per_round(arms[name])
    return {other: [a / b for a, b in zip(mine, per_round(arm), strict=False)]
            for other, arm in arms.items() if other != name and arm.get("kind", "diloco") == "diloco"}


def plot(result: dict[str, Any], path: Path, ratio_of: str) -> dict[str, int | None]:
    arms = {name: arm for name, arm in result["arms"].items() if arm.get("curve")}
    if ratio_of not in arms:
        raise SystemExit(f"no arm {ratio_of!r} with a curve in the result (arms: {', '.join(sorted(arms))})")
    figure = Figure(figsize=(11, 4), dpi=100)
    losses, ratio_axes = figure.subplots(1, 2)
    for name, arm in arms.items():
        curve = per_round(arm)
        losses.plot(range(1, len(curve) + 1), curve, label=name)
    losses.set_xlabel("round")
    losses.set_ylabel("held-out loss (nats/token)")
    losses.set_title("Held-out loss after each round")
    ratios = ratios_to_others(arms, ratio_of)
    for other, values in ratios.items():
        ratio_axes.plot(range(1, len(values) + 1), values, label=f"{ratio_of} / {other}")
    for bound, style in ((PARITY, "--"), (1.05, ":")):
        ratio_axes.axhline(bound, color="gray", linestyle=style, linewidth=1)
    ratio_axes.set_ylim(0.85, 1.5)
    ratio_axes.set_xlabel("round")
    ratio_axes.set_title(f"Loss ratio of {ratio_of} (lines: {PARITY}, 1.05)")
    for axes in (losses, ratio_axes):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    return {other: stays_within(values, PARITY) for other, values in ratios.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plot_convergence", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, help="the JSON a benchmarks.convergence run printed")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--ratio-of", default="diloco_sparse", help="the arm whose loss ratio to the others is drawn")
    args = parser.parse_args(argv)
    parity_from = plot(json.loads(args.result.read_text()), args.out, args.ratio_of)
    print(json.dumps(dict(plot=str(args.out), ratio_of=args.ratio_of, stays_within_1_01_from_round=parity_from)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
