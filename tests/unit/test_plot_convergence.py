"""The convergence plot: the round from which a ratio stays within parity, and the PNG it writes."""

from __future__ import annotations

import json

from benchmarks.plot_convergence import main, stays_within


def test_parity_counts_from_the_first_round_after_the_last_excursion():
    assert stays_within([1.3, 1.0, 1.02, 1.0, 0.99], 1.01) == 4
    assert stays_within([1.0, 1.0], 1.01) == 1
    assert stays_within([1.0, 1.2], 1.01) is None
    assert stays_within([], 1.01) is None


def test_the_plot_is_written_and_the_parity_rounds_printed(tmp_path, capsys):
    def arm(losses, kind="diloco"):
        return dict(kind=kind, curve=[dict(step=25 * (i + 1), loss=x) for i, x in enumerate(losses)])

    result = dict(arms=dict(diloco_none=arm([3.0, 2.0, 1.5]), diloco_sparse=arm([3.6, 2.1, 1.5]),
                            dp=arm([2.9, 1.9, 1.4], kind="dp")))
    (tmp_path / "result.json").write_text(json.dumps(result))
    assert main([str(tmp_path / "result.json"), str(tmp_path / "plot.png")]) == 0
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    printed = json.loads(capsys.readouterr().out)
    assert printed["stays_within_1_01_from_round"] == {"diloco_none": 3}  # dp is not a DiLoCo arm: no ratio
