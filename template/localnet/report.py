"""The local network's run report: what the neurons said (their JSON events) and what the chain shows, judged.

:func:`build_report` turns the events files of one run and a :class:`ChainSnapshot` into the ``report.json``
document; :func:`write_report` writes it with two PNG plots (loss per round; weight and incentive per uid) and a
``report.html`` that shows plots and tables in a browser with no network access (images by relative path). The page
fits a 1280 px window: hotkeys and long behaviour names (``module:Class``) are shortened in the tables and the weights
plot, the full text on hover (the cell's ``title``), and long run options wrap.

The checks (all must hold for ``passed``):

- ``loss_fell``: the honest miners' mean held-out loss after the last round is below the one after the first round;
- ``models_identical``: in every round, every honest miner that reported it ended with the same θ (``theta_hash``);
- ``weights_on_chain``: the chain holds a non-zero weight row for a validator, and Yuma turned it into incentive
  for at least one miner.

On failure: everything here is a pure function of its inputs except the writers. A malformed line in an events file
(a neuron killed mid-write) is skipped, not fatal; missing data (no rounds, no weights) makes the matching check
false and never raises. ``write_report`` writes ``report.json`` first, then the plots, then the HTML that points at
them, so a reader that finds the HTML finds everything it shows; a write error (disk full) propagates.
"""

from __future__ import annotations

import html
import json
import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

HONEST = "honest"
REPORT_FILES = ("report.json", "loss.png", "weights.png", "report.html")


@dataclass(frozen=True)
class NeuronInfo:
    """Who one process of the local network is: its wallet name, role and what the chain knows it by."""

    name: str
    role: str  # "validator" or "miner"
    uid: int
    hotkey: str
    behaviour: str | None = None  # miners only: "honest", "copycat", module:Class, ...
    honest: bool | None = None  # does honest work (MinerBehaviour.honest); None: only the behaviour "honest" does

    @property
    def does_honest_work(self) -> bool:
        return self.role == "miner" and (self.behaviour == HONEST if self.honest is None else self.honest)


@dataclass(frozen=True)
class ChainSnapshot:
    """What the chain shows at the end of a run: weight rows ``{validator_uid: {uid: fraction}}``, and per uid the
    incentive (0..1) and the emission of the last epoch (in the subnet's alpha)."""

    block: int
    weights: dict[int, dict[int, float]] = field(default_factory=dict)
    incentive: dict[int, float] = field(default_factory=dict)
    emission: dict[int, float] = field(default_factory=dict)


def parse_events(lines: Iterable[str | bytes]) -> list[dict[str, Any]]:
    """The events among JSON lines; a line that is not one (cut short by a kill) is skipped."""
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


def read_events(path: Path) -> list[dict[str, Any]]:
    """The JSON events a neuron appended to ``path`` (``--neuron.events_file``); [] when it wrote none."""
    return parse_events(path.read_text().splitlines()) if path.exists() else []


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def round_rows(neurons: list[NeuronInfo], events: dict[str, list[dict]], last_round: int | None) -> list[dict]:
    """One row per round the honest miners reported (up to ``last_round``), aggregated over them.

    ``heldout_loss`` is of θ after the round, ``loss`` the mean inner training loss; ``allreduce_s``, ``group_size``
    and ``bytes_per_peer`` are the largest any honest miner saw. ``theta_hashes`` lists the distinct θ they hold.
    """
    by_round: dict[int, list[dict]] = {}
    for neuron in neurons:
        if not neuron.does_honest_work:
            continue
        for event in events.get(neuron.name, []):
            if event["event"] == "round" and (last_round is None or event["round"] <= last_round):
                by_round.setdefault(event["round"], []).append(event)
    rows = []
    for r in sorted(by_round):
        reports = by_round[r]
        rows.append(dict(
            round=r,
            loss=_mean(rep.get("train_loss") for rep in reports),
            heldout_loss=_mean(rep.get("heldout_loss") for rep in reports),
            allreduce_s=max(rep["allreduce_s"] for rep in reports),
            group_size=max(rep["group_size"] for rep in reports),
            bytes_per_peer=max(rep["bytes_sent"] for rep in reports),
            miners=len(reports),
            allreduce_ok=sum(bool(rep["allreduce_ok"]) for rep in reports),
            theta_hashes=sorted({rep["theta_hash"] for rep in reports}),
        ))
    return rows


def _last(events: list[dict], kind: str) -> dict | None:
    return next((e for e in reversed(events) if e["event"] == kind), None)


def neuron_rows(neurons: list[NeuronInfo], events: dict[str, list[dict]], chain: ChainSnapshot) -> list[dict]:
    """One row per neuron: its last score from the validators' ``scored`` events (with the bytes a validator fetched
    to score it), its weight (the mean of the validators' on-chain rows), incentive and emission from the chain."""
    validators = [n for n in neurons if n.role == "validator"]
    scores: dict[int, dict] = {}
    for validator in validators:
        scored = _last(events.get(validator.name, []), "scored")
        for miner in scored["miners"] if scored else []:
            scores[miner["uid"]] = miner
    rows = []
    for neuron in sorted(neurons, key=lambda n: n.uid):
        row_weights = [chain.weights.get(v.uid, {}).get(neuron.uid, 0.0) for v in validators]
        score = scores.get(neuron.uid, {})
        rows.append(dict(
            uid=neuron.uid, name=neuron.name, hotkey=neuron.hotkey, role=neuron.role, behaviour=neuron.behaviour,
            score=score.get("score"), ema=score.get("ema"), fetched_bytes=score.get("fetched_bytes"),
            weight=_mean(row_weights) if neuron.role == "miner" else None,
            incentive=chain.incentive.get(neuron.uid, 0.0), emission=chain.emission.get(neuron.uid, 0.0),
        ))
    return rows


def compute_checks(rounds: list[dict], neurons: list[NeuronInfo], chain: ChainSnapshot) -> dict[str, bool]:
    losses = [row["heldout_loss"] for row in rounds if row["heldout_loss"] is not None]
    validator_uids = {n.uid for n in neurons if n.role == "validator"}
    miner_uids = {n.uid for n in neurons if n.role == "miner"}
    weights_set = any(w > 0 for uid in validator_uids for w in chain.weights.get(uid, {}).values())
    incentive = any(chain.incentive.get(uid, 0.0) > 0 for uid in miner_uids)
    return dict(
        loss_fell=len(losses) >= 2 and losses[-1] < losses[0],
        models_identical=bool(rounds) and all(len(row["theta_hashes"]) == 1 for row in rounds),
        weights_on_chain=weights_set and incentive,
    )


def build_report(neurons: list[NeuronInfo], events: dict[str, list[dict]], chain: ChainSnapshot, *,
                 last_round: int | None = None, run: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``report.json`` document. ``events`` maps each neuron's name to its events; rounds after ``last_round``
    (cut short when the network was stopped) are left out; ``run`` (the configuration) is copied in as is."""
    rounds = round_rows(neurons, events, last_round)
    checks = compute_checks(rounds, neurons, chain)
    weight_events = [e for n in neurons if n.role == "validator" for e in events.get(n.name, [])
                     if e["event"] == "weights"]
    return dict(
        run=run or {},
        block=chain.block,
        rounds=rounds,
        neurons=neuron_rows(neurons, events, chain),
        weights_set=[dict(round=e["round"], block=e.get("block"), ok=e["ok"], error=e.get("error"))
                     for e in weight_events],
        chain=asdict(chain),
        checks=checks,
        passed=all(checks.values()),
    )


# --- Files ---------------------------------------------------------------------------------------------------------


def plot_losses(rounds: list[dict], path: Path) -> None:
    figure = Figure(figsize=(6, 3.6), dpi=100)
    axes = figure.add_subplot()
    for key, label in (("heldout_loss", "held-out loss (θ after the round)"), ("loss", "inner training loss")):
        points = [(row["round"], row[key]) for row in rounds if row[key] is not None]
        if points:
            axes.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("round")
    axes.set_ylabel("loss (nats/token)")
    axes.set_title("Loss per round (honest miners, mean)")
    if rounds:
        axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)


def shorten(text: str, keep: int, ellipsis_at: str = "middle") -> str:
    """``text`` cut to ``keep`` characters, the ellipsis at its ``start``, ``middle`` (both ends of a hotkey stay
    readable) or ``end``."""
    if len(text) <= keep:
        return text
    head = {"start": 0, "middle": (keep - 1) // 2 + (keep - 1) % 2, "end": keep - 1}[ellipsis_at]
    return text[:head] + "…" + text[len(text) - (keep - 1 - head):]


def behaviour_label(behaviour: str | None, keep: int = 12) -> str:
    """A plot label for a behaviour: a ``module:Class`` plug-in by its class name, at most ``keep`` characters."""
    name = str(behaviour or "").rsplit(":", 1)[-1]
    return name if len(name) <= keep else name[: keep - 1] + "…"


# Above this many miners the weights plot's labels stand on end (one text line wide each), so that they never run
# into each other; above LABELLED_MAX only every k-th miner is labelled.
UPRIGHT_LABELS_MAX = 3
LABELLED_MAX = 40


def weight_labels(miners: list[dict]) -> tuple[list[str], dict[str, Any]]:
    """The weights plot's x labels (``uid N`` and the shortened behaviour) and their text style."""
    if len(miners) <= UPRIGHT_LABELS_MAX:
        return [f"uid {row['uid']}\n{behaviour_label(row['behaviour'])}" for row in miners], {}
    every = math.ceil(len(miners) / LABELLED_MAX)
    labels = [f"uid {row['uid']} {behaviour_label(row['behaviour'])}" if i % every == 0 else ""
              for i, row in enumerate(miners)]
    return labels, dict(rotation=90, fontsize=8)


def plot_weights(neurons: list[dict], path: Path) -> Figure:
    """Weight and incentive per miner, labelled ``uid N`` and the (shortened) behaviour; returns the figure."""
    miners = [row for row in neurons if row["role"] == "miner"]
    labels, style = weight_labels(miners)
    figure = Figure(figsize=(6, 4.2 if style else 3.6), dpi=100)
    axes = figure.add_subplot()
    xs = list(range(len(miners)))
    width = 0.4
    axes.bar([x - width / 2 for x in xs], [row["weight"] or 0.0 for row in miners], width, label="weight")
    axes.bar([x + width / 2 for x in xs], [row["incentive"] for row in miners], width, label="incentive")
    axes.set_xticks(xs, labels, **style)
    axes.set_ylabel("fraction")
    axes.set_title("Validator weight and chain incentive per miner")
    axes.legend()
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    return figure


# Columns whose cells are shortened (characters kept, where the ellipsis goes); the whole value is the cell's title,
# shown on hover. A behaviour keeps its end: the class name of a module:Class plug-in.
SHORTENED = {"hotkey": (13, "middle"), "behaviour": (18, "start"), "error": (40, "end")}


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(str(v)[:12] for v in value)
    return "" if value is None else str(value)


def _td(column: str, value: Any) -> str:
    text = _cell(value)
    if column in SHORTENED and len(text) > SHORTENED[column][0]:
        return f'<td title="{html.escape(text)}">{html.escape(shorten(text, *SHORTENED[column]))}</td>'
    return f"<td>{html.escape(text)}</td>"


def _table(rows: list[dict], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(_td(c, row.get(c)) for c in columns) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(report: dict[str, Any]) -> str:
    checks = "".join(f"<li>{html.escape(name)}: <b>{'yes' if ok else 'NO'}</b></li>"
                     for name, ok in report["checks"].items())
    verdict = "PASSED" if report["passed"] else "FAILED"
    run = html.escape(json.dumps(report["run"], indent=1))
    round_columns = ["round", "heldout_loss", "loss", "group_size", "allreduce_s", "bytes_per_peer", "miners",
                     "allreduce_ok", "theta_hashes"]
    neuron_columns = ["uid", "name", "role", "behaviour", "score", "ema", "fetched_bytes", "weight", "incentive",
                      "emission", "hotkey"]
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>Local network report: {verdict}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;margin-bottom:1.5em}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}} td[title]{{cursor:help}} img{{max-width:48%}}
pre{{white-space:pre-wrap;overflow-wrap:anywhere}}</style></head>
<body><h1>Local network: {verdict}</h1>
<h2>Checks</h2><ul>{checks}</ul>
<h2>Plots</h2><img src="loss.png" alt="loss per round"> <img src="weights.png" alt="weight and incentive per uid">
<h2>Rounds</h2>{_table(report["rounds"], round_columns)}
<h2>Neurons (chain block {report["block"]})</h2>{_table(report["neurons"], neuron_columns)}
<h2>Weights set by validators</h2>{_table(report["weights_set"], ["round", "block", "ok", "error"])}
<h2>Run</h2><pre>{run}</pre>
</body></html>
"""


def write_report(report: dict[str, Any], out: Path) -> list[Path]:
    """Write :data:`REPORT_FILES` into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in REPORT_FILES]
    paths[0].write_text(json.dumps(report, indent=1))
    plot_losses(report["rounds"], paths[1])
    plot_weights(report["neurons"], paths[2])
    paths[3].write_text(render_html(report))
    return paths
