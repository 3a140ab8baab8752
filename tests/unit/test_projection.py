"""The analytic projection of a 1b round (``benchmarks.projection``): relations that must hold for any settings."""

from __future__ import annotations

import json

import pytest

from benchmarks.projection import (
    PARAMS_1B,
    SPARSE_AVERAGED_MEASURED,
    SYSTEMS,
    Settings,
    main,
    rows,
    sparse_averaged_bits,
    traffic,
)


def test_projection_overlap_h_bytes_and_templar_download(capsys):
    settings = Settings(peers=(8, 32, 64), links_mbit=(100.0, 1000.0), inner_steps=(100, 500), gpu_tflops=100.0,
                        tokens_per_step=16384, latency_ms=20.0, round_trips=4, outer_s=3.0)
    by_key = {(r.system, r.codec, r.peers, r.link_mbit, r.inner_steps, r.overlap): r for r in rows(settings)}

    blocking = [r for r in by_key.values() if not r.overlap]
    overlapped = [r for r in by_key.values() if r.overlap]
    assert overlapped
    for row in overlapped:  # overlap never loses compute to the all-reduce that blocking would not
        same = by_key[(row.system, row.codec, row.peers, row.link_mbit, row.inner_steps, False)]
        assert row.utilization >= same.utilization
    for row in blocking + overlapped:  # more inner steps per round: the round's fixed costs weigh less
        if row.inner_steps == 100:
            longer = by_key[(row.system, row.codec, row.peers, row.link_mbit, 500, row.overlap)]
            assert longer.utilization > row.utilization
        assert 0 < row.utilization <= 1

    dense = by_key[("this subnet", "fp16", 8, 100.0, 100, False)]
    assert dense.bytes_sent_per_peer == pytest.approx(2 * 7 / 8 * PARAMS_1B * 2)
    assert dense.transfer_s == pytest.approx(dense.bytes_sent_per_peer * 8 / 100e6)

    templar = next(s for s in SYSTEMS if s.gather)
    contribution = traffic(templar, 2)[1]
    for peers in range(2, 129):
        sent, received, _ = traffic(templar, peers)
        assert sent == pytest.approx(contribution)
        assert received == pytest.approx((peers - 1) * contribution)

    for peers, measured in SPARSE_AVERAGED_MEASURED.items():  # the union formula reproduces the measured sizes
        assert sparse_averaged_bits(peers) == pytest.approx(measured, rel=0.01)
    assert sparse_averaged_bits(53) < 16 <= sparse_averaged_bits(54)  # §6: above dense fp16 from N = 54

    assert main(["--peers", "8", "--links-mbit", "100", "--inner-steps", "100"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(printed["rows"]) == sum(len(s.overlaps) for s in SYSTEMS)
    assert all("source" in c and "value" in c for c in printed["constants"].values())
