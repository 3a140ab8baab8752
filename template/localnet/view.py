"""The local network's terminal view: one status line per neuron, redrawn every second, and permanent lines for
finished rounds, weights and messages.

Sources: the neurons' JSON events (handed to :meth:`LiveView.handle`) and, for the live step, loss and tokens/s
of a training miner, the progress line it rewrites on its log (``round R step S/N loss L T tok/s``). On a terminal
the status block is redrawn in place; elsewhere (CI logs, a pipe) it is printed every ``PLAIN_EVERY_S`` seconds
instead, so logs stay readable.

On failure: the view only reads; an unreadable or missing log shows as ``-`` fields, and a terminal that went away
is not written to: it never raises.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from template.localnet.report import NeuronInfo

PROGRESS = re.compile(r"round (\d+) step (\d+)/(\d+) loss (\S+) (\d+) tok/s")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
PLAIN_EVERY_S = 30.0
TAIL_BYTES = 16 * 1024


def tail_text(path: Path, lines: int) -> str:
    """The last ``lines`` non-empty lines of a log as a terminal would show them (``\\r`` rewrites collapsed)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    shown = [ANSI.sub("", line.split("\r")[-1]).rstrip() for line in text.splitlines()]
    return "\n".join([line for line in shown if line.strip()][-lines:])


def last_progress(path: Path) -> re.Match | None:
    """The newest progress line a miner wrote to its log, if any."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    matches = list(PROGRESS.finditer(text))
    return matches[-1] if matches else None


def _number(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


@dataclass
class NeuronStatus:
    info: NeuronInfo
    log_path: Path
    state: str = "starting"
    round: int | None = None
    work: str = "-"  # "step 7/10" for a miner, "scored 3" for a validator
    loss: float | None = None
    tokens_per_s: float | None = None
    progress_seen: str = ""  # the progress line last shown, so that an old one does not overwrite a round report

    def text(self) -> str:
        kind = self.info.behaviour or ""  # the name says the role (validator, minerK); miners add their behaviour
        return (f"  {self.info.name:<9} {kind:<10} uid {self.info.uid:<3} {self.state:<8} round "
                f"{_number(self.round, 'd'):>3} {self.work:<10} loss {_number(self.loss, '.3f'):>6} "
                f"{_number(self.tokens_per_s, '.0f'):>5} tok/s")


class LiveView:
    """Status lines (redrawn) above nothing; permanent lines scroll above them."""

    def __init__(self, stream: TextIO = sys.stderr, interactive: bool | None = None) -> None:
        self.stream = stream
        self.interactive = stream.isatty() if interactive is None else interactive
        self.statuses: dict[str, NeuronStatus] = {}
        self._drawn = 0
        self._plain_at = time.monotonic()
        self._last_weights = "none yet"

    def track(self, neurons: list[NeuronInfo], log_paths: dict[str, Path]) -> None:
        self.statuses = {n.name: NeuronStatus(n, log_paths[n.name]) for n in neurons}

    def handle(self, event: dict) -> None:
        status = self.statuses.get(event["peer_key"])
        if status is None:
            return
        kind = event["event"]
        if kind == "ready":
            status.state, status.round = "ready", event.get("chain_round")
        elif kind == "round":  # a miner finished a round: show its held-out loss until it trains again
            status.state, status.round, status.loss = "averaged" if event["allreduce_ok"] else "failed", \
                event["round"], event.get("heldout_loss")
            status.work = f"step {event['inner_steps']}"
        elif kind == "synced":
            status.state, status.round, status.loss = "synced", event["round"], event.get("heldout_loss")
        elif kind == "scored":
            status.state, status.work = "scored", f"scored {len(event['miners'])}"
        elif kind == "weights":
            weights = ", ".join(f"uid {uid} {w:.2f}" for uid, w in sorted(event.get("weights", {}).items(),
                                                                          key=lambda kv: int(kv[0])))
            self._last_weights = (f"round {event['round']} at block {event.get('block')}: {weights}" if event["ok"]
                                  else f"round {event['round']} FAILED ({event.get('error')})")
            self.line(f"weights {self._last_weights}")
        elif kind == "stopped":
            status.state = "stopped"

    def refresh(self) -> None:
        """Pick up the miners' progress lines and redraw (on a terminal) or print now and then (elsewhere)."""
        for status in self.statuses.values():
            if status.info.role != "miner":
                continue
            match = last_progress(status.log_path)
            if match is None or match.group(0) == status.progress_seen:
                continue
            status.progress_seen = match.group(0)
            round_, step, of, loss, rate = match.groups()
            status.state, status.round, status.work = "training", int(round_), f"step {step}/{of}"
            status.loss = None if loss == "-" else float(loss)
            status.tokens_per_s = float(rate)
        if self.interactive:
            self._erase()
            self._draw()
        elif time.monotonic() - self._plain_at >= PLAIN_EVERY_S:
            self._plain_at = time.monotonic()
            self._write("".join(s.text() + "\n" for s in self.statuses.values()))

    def round_line(self, row: dict) -> None:
        identical = "θ identical" if len(row["theta_hashes"]) == 1 else f"θ DIFFERS ({len(row['theta_hashes'])})"
        self.line(f"round {row['round']} done: held-out loss {_number(row['heldout_loss'], '.4f')} (train "
                  f"{_number(row['loss'], '.4f')}), group {row['group_size']}, all-reduce {row['allreduce_s']:.2f}s, "
                  f"{row['bytes_per_peer'] / 1e6:.2f} MB/peer, {identical}; last weights: {self._last_weights}")

    def line(self, text: str) -> None:
        """A permanent line above the status block."""
        self._erase()
        self._write(text + "\n")
        self._draw()

    def close(self) -> None:
        self._erase()

    def _draw(self) -> None:
        if self.interactive and self.statuses:
            self._write("".join(s.text()[: self._width()] + "\n" for s in self.statuses.values()))
            self._drawn = len(self.statuses)

    def _erase(self) -> None:
        if self._drawn:
            self._write(f"\033[{self._drawn}A\r\033[J")
            self._drawn = 0

    def _width(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns - 1
        except (OSError, ValueError):
            return 200

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except OSError:  # the terminal went away (SIGHUP): the run still has to stop its children
            pass


def print_summary(report: dict, out: Path, stream: TextIO = sys.stdout) -> None:
    """The end of a run in a few lines: checks, each neuron's score, weight and incentive, where the report is."""
    lines = ["", "neurons:"]
    for row in report["neurons"]:
        lines.append(f"  uid {row['uid']:<3} {row['role']:<9} {str(row['behaviour'] or ''):<10} score "
                     f"{_number(row['score'], '.4f'):>8}  weight {_number(row['weight'], '.3f'):>6}  incentive "
                     f"{row['incentive']:.3f}  emission {row['emission']:.3f}")
    lines.append("checks: " + ", ".join(f"{name} {'yes' if ok else 'NO'}" for name, ok in report["checks"].items()))
    lines.append(f"report: {out / 'report.html'} (and report.json, loss.png, weights.png)")
    lines.append("PASSED" if report["passed"] else "FAILED")
    stream.write("\n".join(lines) + "\n")
    stream.flush()
