"""One small network of real neuron processes for the adversarial tests: a mock chain served over loopback, one
validator and one miner process per behaviour, run until the validator has judged a given number of rounds.

Each adversarial test module runs *one* such network with many attackers in it (one network per attacker would cost
minutes each), then asserts on what the validator saw: its ``scored`` and ``weights`` events.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from template.chain.mock import MockSubstrate
from template.chain.mock_server import MockChainServer
from template.chain.wallets import create_wallet
from template.training.data import DataConfig
from tests.integration.neuron_processes import (
    REPO,
    SEQ_LEN,
    events,
    neuron_command,
    require_alive,
    start_process,
    stop_processes,
    wait_until,
)


@dataclass(frozen=True)
class NetworkSettings:
    netuid: int
    seconds_per_block: float
    blocks_per_round: int
    tempo: int
    judged_rounds: int  # the validator's weights count once it has scored this many rounds, all but the first paid
    data: str  # --run.data of every neuron
    run_args: tuple[str, ...]  # the run's other flags, the same for every neuron


class AdversarialNetwork:
    """Context manager: registers every neuron on a fresh mock chain, starts them, stops them all on exit.

    ``miners`` maps a wallet name to the miner's own flags (``--miner.behaviour ...`` and its options)."""

    def __init__(self, tmp: Path, settings: NetworkSettings, miners: dict[str, tuple[str, ...]]) -> None:
        self.tmp = tmp
        self.settings = settings
        self.miners = miners
        self.mock = MockSubstrate()
        self.mock.create_subnet(settings.netuid, tempo=settings.tempo, weights_rate_limit=2, serving_rate_limit=0)
        wallets = {name: create_wallet(name, "default", tmp / "wallets") for name in ("validator", *miners)}
        self.uids = {name: self.mock.register(settings.netuid, w.hotkey.ss58_address, w.coldkeypub.ss58_address,
                                              1000.0 if name == "validator" else 0.0)
                     for name, w in wallets.items()}
        (tmp / "leak").mkdir(exist_ok=True)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", DILOCO_LEAK_DIR=str(tmp / "leak"), PYTHONPATH=str(REPO))
        self.processes: dict[str, subprocess.Popen] = {}
        self.server = MockChainServer(self.mock, seconds_per_block=settings.seconds_per_block)

    def __enter__(self) -> AdversarialNetwork:
        # the token cache every neuron reads: built once here instead of in each process at once (the stdlib corpus
        # costs ~4 CPU-s to build, and ten neurons that start together share two cores)
        DataConfig(source=self.settings.data).load(SEQ_LEN, self.tmp / "cache")
        self.server.__enter__()
        try:
            for name, extra in self.miners.items():
                self.processes[name] = self._start("miner", name, *extra)
            self.processes["validator"] = self.start_validator()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            stop_processes(list(self.processes.values()), grace_s=5)  # clean stops are tested elsewhere
        finally:
            self.server.__exit__(None, None, None)

    def _start(self, script: str, name: str, *extra: str) -> subprocess.Popen:
        s = self.settings
        command = neuron_command(script, name, self.tmp, self.server.url, s.netuid, s.blocks_per_round,
                                 "--run.data", s.data, "--neuron.cache_dir", str(self.tmp / "cache"), *s.run_args,
                                 *extra)
        return start_process(command, self.tmp / f"{name}.log", self.env)

    def start_validator(self) -> subprocess.Popen:
        return self._start("validator", "validator")

    def validator_events(self, kind: str) -> list[dict]:
        return [e for e in events(self.tmp, "validator") if e["event"] == kind]

    def judged_weights(self, timeout: float) -> dict:
        """The first successful weights event once the validator has scored ``judged_rounds`` rounds, all but one of
        them paid; fails at once if a neuron exits.

        Scored rounds are counted, not chain rounds: a validator that misses one round's group under load (hivemind's
        leader counted it in, it still looked for the group at its deadline) is out of step, adopts a peer's state
        ahead of the round it has in flight and never scores that one; a count of chain rounds then judged on one
        scored round fewer (18 honest rows of 21 in the CI run of 2026-12-06)."""
        def judged() -> list[dict]:
            require_alive(self.processes, self.tmp)
            last = judged_round(self.validator_events("scored"), self.settings.judged_rounds)
            if last is None:
                return []
            return [e for e in self.validator_events("weights") if e["ok"] and e["round"] >= last]

        return wait_until(judged, timeout, f"weights after {self.settings.judged_rounds} scored rounds")[0]


def judged_round(scored: list[dict], rounds: int) -> int | None:
    """The round of the ``scored`` event by which the validator has scored ``rounds`` rounds, ``rounds`` − 1 of them
    paid (None: not yet)."""
    paid = 0
    for count, event in enumerate(scored, start=1):
        paid += bool(event.get("paid"))
        if count >= rounds and paid >= rounds - 1:
            return event["round"]
    return None


def share(weights: dict[int, float], uids: dict[str, int], names) -> float:
    """The part of ``weights`` that goes to the miners ``names``."""
    return sum(weights.get(uids[name], 0.0) for name in names)


def scored_rounds(scored: list[dict], uids: dict[str, int], names) -> str:
    """The validator's rounds for ``names``, one line each (what a failed assertion on weights prints: the network's
    logs go with its temporary folder)."""
    by_uid = {uids[name]: name for name in names}
    lines = []
    for event in scored:
        rows = [f"{by_uid[row['uid']]} credit {row.get('credit')} ± {row.get('credit_se')} quality {row['quality']:.4g}"
                f"{' (' + row['reason'] + ')' if row['reason'] else ''}"
                for row in event["miners"] if row["uid"] in by_uid]
        lines.append(f"round {event['round']} ({'paid' if event.get('paid') else 'not paid'}, free scale "
                     f"{event.get('free_scale')}): " + "; ".join(rows))
    return "\n".join(lines)
