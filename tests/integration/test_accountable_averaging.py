"""Attacks inside the all-reduce protocol (DESIGN.md §9), on one small network: mock chain, 1 validator, 5 miners.

Two honest miners share the network with one miner per attack on the accountable all-reduce
(``template/base/behaviours.py`` has the table):

- equivocator: commits to Δ, sends its segments' owners other bytes (signing them);
- liar-reducer: as an owner, returns the negated average of its segments to every member (signing it);
- framer: as an owner, refuses another sender's segments with a forged proof.

The two-faced miners (publication ≠ contribution) run in tests/integration/test_validator.py, not here: the validator
recomputes an averaged segment only when it holds the publication of every sender included in it, and a two-faced
miner's publication is refused, so in one group with it a liar-reducer's segments cannot be checked (measured: the
liar then took 96 % of the weight; docs/validation.md, known limits).

Judged after 6 scored rounds (5 paid: the validator's first is not, as it does not hold the previous average yet):
the honest miners hold ≥ 95 % of the weight together and none has less than half the honest average; every attacker
gets ≤ 1 %; the validator convicts each attacker with a reason resting on what the
attacker signed, and never an honest miner (counted over every honest scored row); every honest miner ends every
round on the same θ.
"""

from __future__ import annotations

import pytest

from tests.integration.adversarial_network import AdversarialNetwork, NetworkSettings, scored_rounds, share
from tests.integration.neuron_processes import events

RUN = ("--run.data", "stdlib", "--run.inner_steps", "20", "--run.warmup_steps", "20",
       "--averaging.matchmaking_time", "4")
SETTINGS = NetworkSettings(netuid=5, seconds_per_block=0.5, blocks_per_round=40, tempo=20, judged_rounds=6,
                           run_args=RUN)
HONEST = {"honest-a": ("--miner.behaviour", "honest"), "honest-b": ("--miner.behaviour", "honest")}
ATTACKERS = {
    "equivocator": ("--miner.behaviour", "equivocator"),
    "liar-reducer": ("--miner.behaviour", "liar-reducer"),
    "framer": ("--miner.behaviour", "framer"),
}
# the reason the validator gives for each attack it can prove (a fragment of it)
PROVEN = {
    "equivocator": "other than it committed",
    "liar-reducer": "wrong average",
    "framer": "without proof",
}


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accountable")
    with AdversarialNetwork(tmp, SETTINGS, {**HONEST, **ATTACKERS}) as net:
        last = net.judged_weights(480)
        yield dict(uids=net.uids, weights={int(k): v for k, v in last["weights"].items()},
                   scored=net.validator_events("scored"),
                   rounds={name: [e for e in events(tmp, name) if e["event"] == "round"] for name in HONEST})


def rows_of(network, name: str) -> list[dict]:
    uid = network["uids"][name]
    return [row for event in network["scored"] for row in event["miners"] if row["uid"] == uid]


@pytest.mark.timeout(900)
def test_honest_miners_hold_95_percent_and_none_is_left_behind(network):
    weights, uids = network["weights"], network["uids"]
    rounds = scored_rounds(network["scored"], uids, HONEST)
    assert share(weights, uids, HONEST) >= 0.95, (weights, rounds)
    honest = [weights.get(uids[name], 0.0) for name in HONEST]
    print(f"honest weights {honest}: max/min {max(honest) / min(honest):.3f}")
    assert min(honest) >= 0.5 * sum(honest) / len(honest), (honest, rounds)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("attacker", sorted(ATTACKERS))
def test_every_attacker_gets_at_most_1_percent(network, attacker):
    assert share(network["weights"], network["uids"], [attacker]) <= 0.01, (attacker, network["weights"])


@pytest.mark.timeout(900)
def test_each_provable_attack_is_convicted_from_what_the_attacker_signed(network):
    for name, fragment in PROVEN.items():
        binding = [row["reason"] for row in rows_of(network, name) if row["binding"]]
        assert any(fragment in reason for reason in binding), (name, [r["reason"] for r in rows_of(network, name)])


@pytest.mark.timeout(900)
def test_no_honest_miner_is_ever_convicted(network):
    rows = [row for name in HONEST for row in rows_of(network, name)]
    convicted = [row for row in rows if row["binding"]]
    print(f"honest rows scored: {len(rows)}, convicted: {len(convicted)}")
    assert len(rows) >= 2 * (SETTINGS.judged_rounds - 1) and not convicted, convicted


@pytest.mark.timeout(900)
def test_honest_miners_end_every_round_on_the_same_theta(network):
    hashes = [{e["round"]: e["theta_hash"] for e in network["rounds"][name] if e["allreduce_ok"]} for name in HONEST]
    common = sorted(set(hashes[0]) & set(hashes[1]))
    assert len(common) >= SETTINGS.judged_rounds, hashes
    assert all(hashes[0][r] == hashes[1][r] for r in common), [(r, hashes[0][r], hashes[1][r]) for r in common]
