"""Fairness of the validator's pay: equal work earns equal weight; less work, or a copy of what is free, earns less.

``python -m benchmarks.fairness [--quick] [--networks 10] [--scenarios honest,partial,copiers] [--out DIR]``

Each network is one real local network (:mod:`template.localnet`: a mock chain over loopback, one validator and the
miners as processes, on this machine), run until every miner has reported its rounds and the validator has set
weights; then the validator's last weights and its per-round ``scored`` rows are read. Scenarios:

- ``honest`` (``--networks`` times): 3 honest miners, 6 rounds (5 scored). Per network: max/min of the honest
  miners' weights (goal ≤ 1.25 in ≥ 9 of 10 networks).
- ``partial``: 2 honest miners, ``skips-one`` (its 3rd all-reduce lost: it trains, contributes an empty Δ),
  ``partial`` at f = 0.1 and at f = 0.5; 11 rounds (10 scored). Goals: skips-one ≥ 0.8 of the honest mean;
  partial weight / honest mean ≤ f + 0.05, > 0 at f = 0.5.
- ``copiers-a``, ``copiers-b``, ``copiers-c``: 3 honest miners and two copiers each — ``noisy-average`` at rel 0.15
  and 0.3; ``noisy-average`` at 0.6 and ``stale-average``; ``copycat`` and ``freerider`` — 6 rounds. Goals: each
  copier ≤ 1 % of the weight, and its credit in a round ≤ 10 % of the best honest credit of that round in ≥ 90 % of
  its paid rounds. (Honest miners are the majority: with six copiers beside two honest miners the copiers' smaller
  norms set the round's reference norm and the honest updates were refused as "over 3x" — docs/validation.md.)

Networks differ by their fresh wallets (hotkeys, hence data assignments and validator samples) and timing. The
baseline in the same run is the honest miners themselves: every number is a ratio to them.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, benchmark_parser, emit, log, machine_info, parse_benchmark_args
from template.base.behaviours import MinerBehaviour, NoisyAverage, Partial
from template.localnet import LocalnetConfig
from template.localnet.network import ChildDied, Localnet
from template.localnet.report import HONEST, read_events


def with_option(base: type[MinerBehaviour], class_name: str, name: str, **options: float) -> type[MinerBehaviour]:
    """A plug-in subclass of ``base`` with its option fixed: the local network gives a miner a behaviour by
    ``module:Class`` and no options."""
    def __init__(self: MinerBehaviour) -> None:
        base.__init__(self, **options)

    return type(class_name, (base,), {"name": name, "__init__": __init__, "__module__": __name__})


Partial10 = with_option(Partial, "Partial10", "partial-0.1", fraction=0.1)
Partial50 = with_option(Partial, "Partial50", "partial-0.5", fraction=0.5)
NoisyAverage15 = with_option(NoisyAverage, "NoisyAverage15", "noisy-average-0.15", rel=0.15)
NoisyAverage30 = with_option(NoisyAverage, "NoisyAverage30", "noisy-average-0.3", rel=0.3)
NoisyAverage60 = with_option(NoisyAverage, "NoisyAverage60", "noisy-average-0.6", rel=0.6)


PLUGIN = "benchmarks.fairness:"


@dataclass(frozen=True)
class Scenario:
    name: str
    behaviours: tuple[str, ...]
    rounds: int


SCENARIOS = {
    "honest": Scenario("honest", (HONEST,) * 3, 6),
    "partial": Scenario("partial", (HONEST, HONEST, "skips-one", PLUGIN + "Partial10", PLUGIN + "Partial50"), 11),
    "copiers-a": Scenario("copiers-a", (HONEST,) * 3 + (PLUGIN + "NoisyAverage15", PLUGIN + "NoisyAverage30"), 6),
    "copiers-b": Scenario("copiers-b", (HONEST,) * 3 + (PLUGIN + "NoisyAverage60", "stale-average"), 6),
    "copiers-c": Scenario("copiers-c", (HONEST,) * 3 + ("copycat", "freerider"), 6),
}


def run_network(scenario: Scenario, out: Path, data: str, rounds: int) -> dict[str, Any]:
    """One local network of ``scenario``; the validator's last weights and every scored row, by miner name."""
    config = LocalnetConfig(out=out, miners=len(scenario.behaviours), rounds=rounds, behaviours=scenario.behaviours,
                            data=data, timeout_s=300 + 60 * rounds)
    os.environ["BTCLI_TOKEN_SYMBOLS_CACHE"] = str(out / "token_symbols.json")  # as the local network's own CLI
    os.environ["PYTHONPATH"] = str(REPO_ROOT)  # the miners load this module's behaviours (module:Class)
    network = Localnet(config)
    for signum in (signal.SIGINT, signal.SIGTERM):  # stop the network's processes, as its own CLI does
        signal.signal(signum, lambda *_: network.interrupt.set())
    started = time.monotonic()
    try:
        report = network.run()
    except (ChildDied, TimeoutError) as err:
        return dict(scenario=scenario.name, error=str(err), seconds=round(time.monotonic() - started, 1))
    finally:
        network.stop()
    names = {row["uid"]: row["name"] for row in report["neurons"]}
    behaviour = {row["name"]: row["behaviour"] for row in report["neurons"] if row["role"] == "miner"}
    validator_events = read_events(out / "validator.events")
    weights = next((e["weights"] for e in reversed(validator_events) if e["event"] == "weights" and e["ok"]), {})
    rounds_scored = [dict(round=e["round"], paid=e["paid"],
                          credit={names[row["uid"]]: row["credit"] for row in e["miners"]},
                          quality={names[row["uid"]]: row["quality"] for row in e["miners"]},
                          reason={names[row["uid"]]: row["reason"] for row in e["miners"]})
                     for e in validator_events if e["event"] == "scored"]
    return dict(scenario=scenario.name, seconds=round(time.monotonic() - started, 1), passed=report["passed"],
                behaviour=behaviour, weights={names[int(uid)]: w for uid, w in weights.items()},
                scored=rounds_scored)


def judge(network: dict[str, Any]) -> dict[str, Any]:
    """The ratios the goals are stated in (module docstring)."""
    behaviour, weights = network["behaviour"], network["weights"]
    honest = [name for name, b in behaviour.items() if b == HONEST]
    honest_weights = [weights.get(name, 0.0) for name in honest]
    mean_honest = statistics.fmean(honest_weights) if honest_weights else 0.0
    result: dict[str, Any] = dict(honest_weights=honest_weights,
                                  honest_max_over_min=(max(honest_weights) / min(honest_weights)
                                                       if min(honest_weights, default=0) > 0 else None))
    others = {}
    for name, b in behaviour.items():
        if b == HONEST:
            continue
        rounds = [r for r in network["scored"] if name in r["quality"] and r["paid"]]
        low = 0
        for r in rounds:
            best = max((r["credit"].get(h) or 0.0) for h in honest)
            low += (r["credit"].get(name) or 0.0) <= 0.1 * best or r["quality"][name] == 0.0
        others[b.rsplit(":", 1)[-1]] = dict(
            weight=weights.get(name, 0.0), of_honest_mean=weights.get(name, 0.0) / mean_honest if mean_honest else None,
            rounds_paid=len(rounds), rounds_at_most_10_percent=low,
            reasons=sorted({r["reason"][name] for r in rounds if r["reason"][name]}))
    result["others"] = others
    return result


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("fairness", __doc__, "one honest network of 3 rounds, nothing else")
    parser.set_defaults(data="stdlib")
    parser.add_argument("--networks", type=int, default=10, help="all-honest networks (default 10)")
    parser.add_argument("--scenarios", default="partial,copiers-a,copiers-b,copiers-c,honest",
                        help="comma-separated: " + ", ".join(SCENARIOS))
    parser.add_argument("--out", default=None, help="keep every network's directory here (default: a temporary one)")
    args = parse_benchmark_args(parser, argv)
    chosen = [SCENARIOS[name] for name in args.scenarios.split(",") if name]
    plan = [(s, i) for s in chosen for i in range(args.networks if s.name == "honest" else 1)]
    if args.quick:
        plan = [(SCENARIOS["honest"], 0)]
    results, started = [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fairness-") as scratch:
        base = Path(args.out) if args.out else Path(scratch)
        for scenario, index in plan:
            out = base / f"{scenario.name}-{index}"
            out.mkdir(parents=True, exist_ok=False)
            network = run_network(scenario, out, args.data, 3 if args.quick else scenario.rounds)
            if "error" not in network:
                network["judged"] = judge(network)
            log.info("%s %d: %s", scenario.name, index, json.dumps(network.get("judged", network)))
            results.append(network)
    honest_ratios = [n["judged"]["honest_max_over_min"] if "judged" in n else None
                     for n in results if n["scenario"] == "honest"]
    emit(dict(benchmark="fairness", quick=args.quick, seconds=round(time.monotonic() - started, 1),
              machine=machine_info(), data=args.data, networks=results,
              honest_within_1_25=sum(1 for r in honest_ratios if r is not None and r <= 1.25),
              honest_networks=len(honest_ratios)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
