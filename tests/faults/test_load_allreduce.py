"""Load: one pseudo-gradient all-reduce among 8 peers on loopback, with the parameter shapes of the ``tiny`` model.

Eight DHT nodes and eight averagers (each its own process with its own p2p daemon) on this machine; all eight must
land in one group, and every peer must end with the same bytes, equal to the token-weighted mean the owners' rule
takes within the codec's error: with 8 senders (≥ ``OwnerRule.own_input_min_senders``) each owner averages its segments
without its own input, so that every input of an average has a sender that checks its claim. One of the eight returns
the negated average of its segments with every claim true but one, forged to fit (``AllReduceFaults(lie=
"forged-own")``: below 6 senders its own input's claim takes the lie and passes; here it must be another sender's):
that sender disputes it, and every peer writes the liar's segments as zeros. The time of the all-reduce itself is
printed (``-s``) for docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from template.allreduce.averager import AveragingConfig, PseudoGradientAverager
from template.allreduce.terms import AllReduceFaults
from template.p2p.dht import DHTConfig, start_dht, visible_maddrs
from template.training.model import build_model

PEERS = 8
LIAR = 3  # the peer that lies as an owner


def digest(tensors) -> str:
    return hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in tensors)).hexdigest()


@pytest.mark.timeout(300)
def test_eight_peers_average_the_tiny_model_into_identical_bytes_and_drop_a_forging_owners_segments():
    shapes = [p.shape for p in build_model("tiny", vocab_size=257, seq_len=64).parameters()]
    config = AveragingConfig(prefix=f"load{uuid.uuid4().hex[:10]}", target_group_size=PEERS, min_group_size=PEERS,
                             matchmaking_time=8.0, request_timeout=3.0, allreduce_timeout=120.0,
                             next_chunk_timeout=30.0, compression="fp16")
    weights = [float(1000 + 100 * i) for i in range(PEERS)]
    deltas = []
    for i in range(PEERS):
        generator = torch.Generator().manual_seed(i)
        deltas.append([torch.randn(shape, generator=generator) * 1e-2 for shape in shapes])

    first = start_dht()
    nodes, averagers = [first], []
    try:
        # one after another: hivemind starts its processes from the main thread only
        for _ in range(PEERS - 1):
            nodes.append(start_dht(DHTConfig(initial_peers=visible_maddrs(first))))
        for i, node in enumerate(nodes):
            faults = AllReduceFaults(lie="forged-own") if i == LIAR else None
            averagers.append(PseudoGradientAverager(node, shapes, config, faults=faults))
        liar_id = averagers[LIAR].peer_id
        scheduled = time.time() + config.matchmaking_time
        deadline = scheduled + config.allreduce_timeout
        triples = enumerate(zip(averagers, deltas, weights, strict=True))
        handles = [averager.begin(d, weight, {"peer": i}, scheduled, deadline) for i, (averager, d, weight) in triples]
        with ThreadPoolExecutor(PEERS) as pool:
            futures = [pool.submit(averager.finish, handle, deadline)
                       for averager, handle in zip(averagers, handles, strict=True)]
            results = [future.result(timeout=deadline - time.time() + 30) for future in futures]
    finally:
        for averager in averagers:
            averager.shutdown()
        for node in nodes:
            node.shutdown()

    assert all(r.ok for r in results), [r.reason for r in results]
    assert all(r.group_size == PEERS for r in results)
    assert len({(r.group_id, digest(r.averaged)) for r in results}) == 1, "peers must hold the same bytes"
    result = results[0]
    averaged = torch.cat([t.reshape(-1) for t in result.averaged]).double()
    flats = [torch.cat([t.reshape(-1) for t in d]).double() for d in deltas]
    members, evidence = list(result.group), result.evidence
    peer_of = [result.group[peer]["peer"] for peer in evidence.senders]
    segment_values = averagers[0].codec.segment_values
    assert len(evidence.segments) == -(-averaged.numel() // segment_values)
    liar = evidence.senders.index(liar_id)
    for segment, record in evidence.segments.items():
        owner = evidence.senders.index(members[record.owner])
        assert record.included == tuple(s for s in range(PEERS) if s != owner), (segment, record.included, owner)
        start, stop = segment * segment_values, min((segment + 1) * segment_values, averaged.numel())
        if owner == liar:
            assert "disputed" in record.refuted and not averaged[start:stop].any(), (segment, record.refuted)
            continue
        assert record.refuted == "", (segment, record.refuted)
        peers = [peer_of[s] for s in record.included]
        expected = sum(weights[p] * flats[p][start:stop] for p in peers) / sum(weights[p] for p in peers)
        largest = max(float(flats[p][start:stop].abs().max()) for p in peers)
        assert float((averaged[start:stop] - expected).abs().max()) <= 2 * largest * 2.0**-11  # fp16 in, fp16 out
    assert all(coverage == 1.0 for coverage in result.coverage.values()), result.coverage  # left out, not lost
    seconds = max(r.seconds for r in results)
    values = sum(shape.numel() for shape in shapes)
    print(f"\n8-peer all-reduce of {values} values (fp16): {seconds:.2f} s, "
          f"{sum(r.bytes_sent for r in results) / 2**20:.1f} MiB sent in total")
