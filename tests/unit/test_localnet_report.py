"""The local network's report, built from synthetic events and a synthetic chain snapshot: rounds aggregated over
honest miners, the three checks (each shown failing on its own), neuron rows from scores and chain, and the files."""

from __future__ import annotations

import itertools
import json

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from template.localnet.report import (
    REPORT_FILES,
    ChainSnapshot,
    NeuronInfo,
    behaviour_label,
    build_report,
    parse_events,
    plot_weights,
    read_events,
    render_html,
    shorten,
    write_report,
)

NEURONS = [
    NeuronInfo("validator", "validator", 0, "5Val"),
    NeuronInfo("miner1", "miner", 1, "5Mi1", "honest"),
    NeuronInfo("miner2", "miner", 2, "5Mi2", "honest"),
    NeuronInfo("miner3", "miner", 3, "5Mi3", "copycat"),
]


def round_event(r: int, heldout: float, theta: str, *, train: float = 5.0, group: int = 3, allreduce_s: float = 0.5,
                bytes_sent: int = 1000, ok: bool = True) -> dict:
    return dict(event="round", time=100.0 + r, uid=1, behaviour="honest", round=r, base_theta_hash="b", inner_steps=10,
                tokens=640, train_loss=train, heldout_loss=heldout, allreduce_ok=ok, reason="", group_size=group,
                allreduce_s=allreduce_s, round_s=12.0, inner_s=5.0, bytes_sent=bytes_sent, theta_hash=theta)


def healthy_events() -> dict[str, list[dict]]:
    return {
        "miner1": [dict(event="ready", time=1.0, uid=1),
                   round_event(5, 5.0, "t5", train=5.4, allreduce_s=0.4, bytes_sent=900),
                   round_event(6, 4.0, "t6", train=4.4), round_event(7, 3.0, "t7", train=3.4),
                   round_event(8, 9.0, "stopped-mid-round")],  # after the run's last round: left out
        "miner2": [round_event(5, 5.2, "t5", train=5.6, allreduce_s=0.6, bytes_sent=1100),
                   round_event(6, 4.2, "t6"), round_event(7, 3.2, "t7"), round_event(8, 9.0, "t8")],
        "miner3": [round_event(5, 99.0, "other"), round_event(6, 99.0, "other"), round_event(7, 99.0, "other")],
        "validator": [
            dict(event="scored", time=1.0, round=5, miners=[dict(uid=1, score=0.1, ema=0.1)]),
            dict(event="weights", time=2.0, round=6, block=150, ok=False, weights={}, error="no positive score"),
            dict(event="scored", time=3.0, round=6, miners=[dict(uid=1, score=0.4, ema=0.3, fetched_bytes=1234),
                                                            dict(uid=2, score=0.5, ema=0.35),
                                                            dict(uid=3, score=0.0, ema=0.0)]),
            dict(event="weights", time=4.0, round=6, block=170, ok=True, weights={"1": 0.45, "2": 0.55}, error=""),
        ],
    }


def healthy_chain() -> ChainSnapshot:
    return ChainSnapshot(block=200, weights={0: {1: 0.45, 2: 0.55}}, incentive={0: 0.0, 1: 0.45, 2: 0.55, 3: 0.0},
                         emission={0: 5.0, 1: 2.25, 2: 2.75, 3: 0.0})


def test_a_healthy_run_passes_with_rounds_aggregated_over_honest_miners():
    report = build_report(NEURONS, healthy_events(), healthy_chain(), last_round=7, run={"miners": 3})
    assert report["checks"] == dict(loss_fell=True, models_identical=True, weights_on_chain=True)
    assert report["passed"] is True
    assert [row["round"] for row in report["rounds"]] == [5, 6, 7]
    first = report["rounds"][0]
    assert first["heldout_loss"] == pytest.approx(5.1)  # miners 1 and 2; the copycat's 99 is not in the mean
    assert first["loss"] == pytest.approx(5.5)
    assert first["allreduce_s"] == 0.6 and first["bytes_per_peer"] == 1100 and first["group_size"] == 3
    assert first["miners"] == 2 and first["allreduce_ok"] == 2 and first["theta_hashes"] == ["t5"]
    assert report["run"] == {"miners": 3} and report["block"] == 200
    assert [w["ok"] for w in report["weights_set"]] == [False, True]


def test_a_plug_in_that_does_honest_work_counts_as_an_honest_miner():
    plug_in = NeuronInfo("miner2", "miner", 2, "5Mi2", "my.module:CarefulHonest", honest=True)
    report = build_report([NEURONS[0], NEURONS[1], plug_in, NEURONS[3]], healthy_events(), healthy_chain(),
                          last_round=7)
    assert report["rounds"][0]["miners"] == 2 and report["checks"]["models_identical"]
    labelled_honest = NeuronInfo("miner3", "miner", 3, "5Mi3", "honest", honest=False)  # what the behaviour says wins
    report = build_report([*NEURONS[:3], labelled_honest], healthy_events(), healthy_chain(), last_round=7)
    assert report["rounds"][0]["miners"] == 2


def test_neuron_rows_take_scores_from_the_last_scored_event_and_the_rest_from_the_chain():
    rows = {row["uid"]: row for row in build_report(NEURONS, healthy_events(), healthy_chain())["neurons"]}
    assert [rows[uid]["role"] for uid in range(4)] == ["validator", "miner", "miner", "miner"]
    assert rows[3]["behaviour"] == "copycat" and rows[0]["behaviour"] is None
    assert rows[1]["score"] == 0.4 and rows[1]["ema"] == 0.3 and rows[0]["score"] is None
    assert rows[1]["fetched_bytes"] == 1234 and rows[2]["fetched_bytes"] is None  # older events lack the field
    assert rows[2]["weight"] == 0.55 and rows[3]["weight"] == 0.0 and rows[0]["weight"] is None
    assert rows[2]["incentive"] == 0.55 and rows[2]["emission"] == 2.75 and rows[0]["emission"] == 5.0
    assert rows[1]["hotkey"] == "5Mi1" and rows[1]["name"] == "miner1"


def test_without_a_last_round_every_reported_round_counts():
    report = build_report(NEURONS, healthy_events(), healthy_chain())
    assert [row["round"] for row in report["rounds"]] == [5, 6, 7, 8]
    assert report["rounds"][-1]["theta_hashes"] == ["stopped-mid-round", "t8"]
    assert report["checks"]["models_identical"] is False and report["checks"]["loss_fell"] is False


def test_each_check_fails_on_its_own():
    events = healthy_events()
    events["miner1"][-2] = round_event(7, 6.0, "t7")  # round 7's mean held-out loss 5.6: above round 5's 5.1
    events["miner2"][-2] = round_event(7, 5.2, "t7")
    report = build_report(NEURONS, events, healthy_chain(), last_round=7)
    assert report["checks"] == dict(loss_fell=False, models_identical=True, weights_on_chain=True)
    assert report["passed"] is False

    events = healthy_events()
    events["miner2"][1] = round_event(6, 4.2, "t6-differs")
    report = build_report(NEURONS, events, healthy_chain(), last_round=7)
    assert report["checks"] == dict(loss_fell=True, models_identical=False, weights_on_chain=True)

    no_incentive = ChainSnapshot(block=200, weights={0: {1: 0.5, 2: 0.5}}, incentive={1: 0.0, 2: 0.0})
    assert build_report(NEURONS, healthy_events(), no_incentive, last_round=7)["checks"]["weights_on_chain"] is False
    no_row = ChainSnapshot(block=200, weights={0: {}}, incentive={1: 0.5})
    assert build_report(NEURONS, healthy_events(), no_row, last_round=7)["checks"]["weights_on_chain"] is False


def test_no_rounds_at_all_fails_every_check_without_raising():
    report = build_report(NEURONS, {}, ChainSnapshot(block=3))
    assert report["rounds"] == [] and report["passed"] is False
    assert report["checks"] == dict(loss_fell=False, models_identical=False, weights_on_chain=False)
    assert all(row["score"] is None and row["incentive"] == 0.0 for row in report["neurons"])


def test_events_files_skip_lines_cut_short(tmp_path):
    path = tmp_path / "m.events"
    path.write_text(json.dumps(dict(event="ready", time=1.0)) + "\n" + '{"event": "round", "ti' + "\n[1, 2]\n")
    assert read_events(path) == [dict(event="ready", time=1.0)]
    assert read_events(tmp_path / "missing.events") == []
    assert parse_events([b'{"event": "x"}', b"\xff\xfe"]) == [dict(event="x")]


def test_files_are_written_and_the_html_shows_plots_and_tables(tmp_path):
    neurons = [*NEURONS[:3], NeuronInfo("miner3", "miner", 3, "5Mi3", "evil.module:<Copy&Paste>")]
    report = build_report(neurons, healthy_events(), healthy_chain(), last_round=7)
    paths = write_report(report, tmp_path / "run")
    assert [p.name for p in paths] == list(REPORT_FILES)
    assert json.loads((tmp_path / "run" / "report.json").read_text()) == json.loads(json.dumps(report))
    for png in ("loss.png", "weights.png"):
        data = (tmp_path / "run" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    page = (tmp_path / "run" / "report.html").read_text()
    assert '<img src="loss.png"' in page and '<img src="weights.png"' in page
    assert "Local network: PASSED" in page and "loss_fell: <b>yes</b>" in page
    assert "5Mi2" in page and "<td>copycat</td>" not in page
    assert "evil.module:&lt;Copy&amp;Paste&gt;" in page and "<Copy&Paste>" not in page


def test_a_failed_report_says_so_in_the_html(tmp_path):
    report = build_report(NEURONS, {}, ChainSnapshot(block=3))
    write_report(report, tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert "Local network: FAILED" in page and "weights_on_chain: <b>NO</b>" in page


def tick_boxes(figure):
    """The pixel boxes of the x tick labels, as drawn into the PNG (Agg, the figure's own size and dpi)."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    return [label.get_window_extent(renderer) for label in figure.axes[0].get_xticklabels() if label.get_text()]


@pytest.mark.parametrize("miners", [3, 8, 64])
def test_weights_plot_labels_never_overlap_with_long_behaviour_names(tmp_path, miners):
    rows = [dict(uid=uid, role="miner", behaviour=f"tests.integration.copy_behaviours:CopyFromTheBestMinerUid{uid}",
                 weight=1 / miners, incentive=1 / miners) for uid in range(1, miners + 1)]
    figure = plot_weights(rows, tmp_path / "weights.png")
    boxes = tick_boxes(figure)
    assert len(boxes) == {3: 3, 8: 8, 64: 32}[miners]  # of 64 miners, every second one is labelled
    for left, right in itertools.pairwise(boxes):
        assert not left.overlaps(right), (left, right)
    width, _ = figure.canvas.get_width_height()
    assert all(box.x0 >= 0 and box.x1 <= width and box.y0 >= 0 for box in boxes)  # inside the picture


def test_long_hotkeys_and_behaviours_are_shortened_in_the_html_with_the_full_text_on_hover():
    hotkey = "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty"
    behaviour = "tests.integration.copy_behaviours:CopyFromTheBestMinerUid1"
    neurons = [NeuronInfo("miner1", "miner", 1, hotkey, behaviour), NeuronInfo("validator", "validator", 0, "5Val")]
    page = render_html(build_report(neurons, {}, healthy_chain()))
    assert f'<td title="{hotkey}">{shorten(hotkey, 13)}</td>' in page
    assert shorten(hotkey, 13) == "5FHneW…M694ty"
    assert f'<td title="{behaviour}">…mTheBestMinerUid1</td>' in page and "<td>5Val</td>" in page
    assert shorten("abcdefgh", 5, "start") == "…efgh" and shorten("abcdefgh", 5, "end") == "abcd…"
    assert behaviour_label(behaviour) == "CopyFromThe…" and behaviour_label("honest") == "honest"
