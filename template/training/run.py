"""Start an N-peer DiLoCo run on 127.0.0.1 and watch it: ``python -m template.training.run --peers 3 --rounds 5``.

Every peer is its own process (``python -m template.training.peer``); the first one's DHT address bootstraps the
others. Flags this launcher does not know are passed unchanged to every peer (see
``python -m template.training.peer --help``: model, data, H, compression, ...). While it runs, one status line
per peer shows its round, inner step, loss and tokens/s; each finished round prints one line (held-out loss, group
size, all-reduce seconds, whether every peer holds the same θ). At the end a JSON summary is printed and written to
``--out DIR/summary.json``; the exit status is 0 only if every peer finished and all of them hold bit-identical θ.

On Ctrl-C, on ``--timeout``, or when a peer fails, all peers are stopped (SIGTERM, then SIGKILL) before exiting:
no process is left behind. Each peer's log is ``DIR/<peer>.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STOP_GRACE_S = 10.0


class PeerProcess:
    """One peer subprocess and the JSON events it prints, read on a background thread."""

    def __init__(self, peer_key: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None,
                 events: queue.Queue | None = None, launcher: list[str] | None = None) -> None:
        self.peer_key = peer_key
        self.events: queue.Queue[dict[str, Any]] = events if events is not None else queue.Queue()
        self.log_path = log_dir / f"{peer_key}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        command = (launcher or [sys.executable, "-m"]) + ["template.training.peer", "--peer-key", peer_key, *args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                        env=env, start_new_session=True)
        self.last: dict[str, Any] = {}
        self._reader = threading.Thread(target=self._read, name=f"read-{peer_key}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # not ours (a library printing to stdout)
            if isinstance(event, dict) and "event" in event:
                event.setdefault("peer_key", self.peer_key)
                self.last = event
                self.events.put(event)
        self.events.put(dict(event="exit", peer_key=self.peer_key))

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would (used by fault tests)."""
        if self.alive():
            os.killpg(self.process.pid, 9)
        self.process.wait(timeout=STOP_GRACE_S)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL of the whole process group (torchrun children, hivemind's DHT/averager/p2pd
        processes), also when the peer itself already exited: nothing it started may outlive it."""
        if self.alive():
            try:
                os.killpg(self.process.pid, 15)
                self.process.wait(timeout=STOP_GRACE_S)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        try:
            os.killpg(self.process.pid, 9)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=STOP_GRACE_S)
        self._reader.join(timeout=STOP_GRACE_S)
        self._log.close()
        return self.process.returncode


def wait_for_event(events: queue.Queue, predicate, timeout_s: float) -> dict[str, Any]:
    """The first event for which ``predicate(event)`` holds; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            event = events.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            continue
        if predicate(event):
            return event
    raise TimeoutError(f"no matching event within {timeout_s:.0f}s")


@dataclass
class RunWatch:
    """Collects the peers' round reports and prints the live view."""

    peers: list[str]
    rounds: dict[int, dict[str, dict]] = field(default_factory=dict)
    done: dict[str, dict] = field(default_factory=dict)
    restored: dict[str, str] = field(default_factory=dict)  # peer -> where its starting state came from
    errors: dict[str, str] = field(default_factory=dict)
    interactive: bool = field(default_factory=lambda: sys.stderr.isatty())

    def handle(self, event: dict[str, Any]) -> None:
        kind, peer = event["event"], event["peer_key"]
        if kind == "progress":
            loss = "-" if event["loss"] is None else f"{event['loss']:.3f}"
            self._status(f"{peer} round {event['round']} step {event['step']}/{event['of_steps']} "
                         f"loss {loss} {event['tokens_per_s']:.0f} tok/s")
        elif kind == "round":
            reports = self.rounds.setdefault(event["round"], {})
            reports[peer] = event
            if set(reports) >= set(self.peers) - set(self.errors):
                self._print_round(event["round"], reports)
        elif kind == "ready":
            self.restored[peer] = event["restored"]
            self._line(f"{peer} ready: state from {event['restored']}, round {event['round']}, "
                       f"{event['params'] / 1e6:.2f}M params")
        elif kind == "done":
            self.done[peer] = event
        elif kind == "error":
            self.errors[peer] = event.get("error", "")
            self._line(f"{peer} failed: {event.get('error')}")

    def _print_round(self, r: int, reports: dict[str, dict]) -> None:
        hashes = {rep["theta_hash"] for rep in reports.values() if rep["allreduce_ok"]}
        losses = [rep["heldout_loss"] for rep in reports.values() if rep["heldout_loss"] is not None]
        ok = sum(rep["allreduce_ok"] for rep in reports.values())
        self._line(f"round {r}: held-out loss {sum(losses) / max(len(losses), 1):.4f}, all-reduce ok {ok}/"
                   f"{len(reports)}, group {max(rep['group_size'] for rep in reports.values())}, "
                   f"all-reduce {max(rep['allreduce_s'] for rep in reports.values()):.2f}s, "
                   f"θ identical: {len(hashes) <= 1}")

    def _status(self, text: str) -> None:
        if self.interactive:
            print(f"\r\033[K{text}", end="", file=sys.stderr, flush=True)

    def _line(self, text: str) -> None:
        prefix = "\r\033[K" if self.interactive else ""
        print(prefix + text, file=sys.stderr, flush=True)

    def summary(self) -> dict[str, Any]:
        rounds = []
        for r in sorted(self.rounds):
            reports = self.rounds[r]
            stepped = [rep for rep in reports.values() if rep["allreduce_ok"]]
            losses = [rep["heldout_loss"] for rep in reports.values() if rep["heldout_loss"] is not None]
            rounds.append(dict(
                round=r, peers=len(reports), allreduce_ok=len(stepped),
                heldout_loss=sum(losses) / len(losses) if losses else None,
                identical=len({rep["theta_hash"] for rep in stepped}) <= 1,
                group_size=max(rep["group_size"] for rep in reports.values()),
                allreduce_s=max(rep["allreduce_s"] for rep in reports.values()),
                round_s=max(rep["round_s"] for rep in reports.values()),
                bytes_sent_per_peer=max(rep["bytes_sent"] for rep in reports.values()),
                failures={peer: rep["reason"] for peer, rep in reports.items() if not rep["allreduce_ok"]},
                # overlap: after how many of the next round's inner steps each peer's average landed (None: after all)
                landed_after_steps={peer: rep.get("landed_after_steps") for peer, rep in reports.items()},
            ))
        final = {peer: event["theta_hash"] for peer, event in self.done.items()}
        finished = set(final) == set(self.peers)
        identical = len(set(final.values())) == 1
        return dict(peers=self.peers, restored=self.restored, rounds=rounds, final_theta_hashes=final,
                    errors=self.errors, finished=finished, identical=identical,
                    passed=finished and identical and not self.errors)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m template.training.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=3, help="number of peer processes")
    parser.add_argument("--rounds", type=int, default=5, help="rounds to run (passed to the peers)")
    parser.add_argument("--out", default=None, help="directory for logs, checkpoints and summary.json")
    parser.add_argument("--timeout", type=float, default=1800.0, help="stop everything after this many seconds")
    parser.add_argument("--start-timeout", type=float, default=120.0, help="seconds for the first peer to be ready")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, peer_args = build_parser().parse_known_args(argv)
    if args.peers < 1:
        raise SystemExit("--peers must be >= 1")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="diloco-run-"))
    out.mkdir(parents=True, exist_ok=True)
    names = [f"peer{i}" for i in range(args.peers)]
    events: queue.Queue = queue.Queue()
    watch = RunWatch(names)
    peers: list[PeerProcess] = []
    threads = max(1, (os.cpu_count() or 1) // args.peers)  # peers split the cores (a later --torch-threads wins)
    common = ["--rounds", str(args.rounds), "--expected-peers", str(args.peers), "--torch-threads", str(threads),
              *peer_args]
    print(f"DiLoCo run: {args.peers} peers, {args.rounds} rounds, logs in {out}", file=sys.stderr)
    deadline = time.monotonic() + args.timeout
    try:
        first = PeerProcess(names[0], [*common, "--checkpoint-dir", str(out / names[0])], out, events=events)
        peers.append(first)
        listening = wait_for_event(events, lambda e: e["event"] in ("listening", "error", "exit"), args.start_timeout)
        if listening["event"] != "listening":
            raise RuntimeError(f"{names[0]} did not start: {listening.get('error', 'exited')} (log: {first.log_path})")
        bootstrap = listening["maddrs"]
        for name in names[1:]:
            peer_flags = [*common, "--checkpoint-dir", str(out / name), "--initial-peers", *bootstrap]
            peers.append(PeerProcess(name, peer_flags, out, events=events))
        exited: set[str] = set()
        while len(exited) < len(peers) and time.monotonic() < deadline:
            try:
                event = events.get(timeout=1.0)
            except queue.Empty:
                continue
            if event["event"] == "exit":
                exited.add(event["peer_key"])
            else:
                watch.handle(event)
        if len(exited) < len(peers):
            print(f"timeout after {args.timeout:.0f}s: stopping", file=sys.stderr)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping all peers", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        for peer in peers:
            peer.stop()
    summary = watch.summary()
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
