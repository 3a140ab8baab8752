"""The local network command without processes: option checks, the neurons' command lines (parsed by the neurons'
own parsers, so the flags cannot drift apart), the children's environment, and the terminal view."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest

from template.base.behaviours import BUILTIN
from template.base.config import NeuronConfig
from template.localnet.network import (
    NETUID,
    RUN_MARKER_ENV,
    LocalnetConfig,
    build_parser,
    child_env,
    config_from_args,
    neuron_command,
)
from template.localnet.report import NeuronInfo
from template.localnet.view import LiveView, last_progress, print_summary, tail_text
from template.p2p.simulated_link import SimulatedPeer
from template.training.cli import run_spec_from

REPO = Path(__file__).resolve().parents[2]
VALIDATOR = NeuronInfo("validator", "validator", 0, "5Val")
MINER = NeuronInfo("miner1", "miner", 1, "5Mi1", "copycat")


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"neuron_script_{name}", REPO / "neurons" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults_and_behaviours(tmp_path):
    config = config_from_args(["--out", str(tmp_path / "run")])
    assert config.miners == 3 and config.rounds == 3 and config.model == "tiny" and config.data == "builtin"
    assert config.miner_behaviours() == ["honest"] * 3 and config.out == (tmp_path / "run").resolve()
    config = config_from_args(["--out", str(tmp_path / "r"), "--miners", "2", "--miner-behaviours",
                               "honest, template.base.behaviours:Copycat"])
    assert config.miner_behaviours() == ["honest", "template.base.behaviours:Copycat"]


def test_data_files_are_made_absolute_for_the_neurons(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = config_from_args(["--out", "run", "--data", "a.txt,texts/*.jsonl"])
    assert config.data == f"{tmp_path / 'a.txt'},{tmp_path / 'texts' / '*.jsonl'}"
    assert config_from_args(["--out", "run2", "--data", "hf:wikitext:wikitext-2-raw-v1"]).data.startswith("hf:")


@pytest.mark.parametrize("flags, message", [
    (["--miners", "1"], "--miners must be >= 2"),
    (["--rounds", "1"], "--rounds must be >= 2"),
    (["--miners", "2", "--miner-behaviours", "honest"], "names 1 behaviours for 2 miners"),
    (["--miner-behaviours", "honest,honest,hacker"], "unknown behaviour 'hacker'"),
    (["--seconds-per-block", "0"], "--seconds-per-block > 0"),
    (["--link.mbit", "0"], "rate must be > 0 Mbit/s"),
    (["--link.mbit", "50", "--link.latency_ms", "-5"], "latency must be within"),
    (["--link.latency_ms", "20"], "--link.latency_ms needs --link.mbit"),
])
def test_bad_options_are_refused_with_the_reason(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(["--out", str(tmp_path / "run"), *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_used_run_directory_is_refused(tmp_path, capsys):
    (tmp_path / "report.json").write_text("{}")
    with pytest.raises(SystemExit):
        config_from_args(["--out", str(tmp_path)])
    assert "is not empty" in capsys.readouterr().err


def test_neuron_commands_parse_with_the_neurons_own_parsers_and_agree_on_the_run(tmp_path):
    config = LocalnetConfig(out=tmp_path, inner_steps=7, seq_len=32, compression="none", data="builtin")
    url = "mock://127.0.0.1:9999"
    miner_command = neuron_command(config, MINER, url, tmp_path)
    validator_command = neuron_command(config, VALIDATOR, url, tmp_path)
    assert miner_command[1] == "neurons/miner.py" and validator_command[1] == "neurons/validator.py"
    miner = load_script("miner").build_parser().parse_args(miner_command[2:])
    validator = load_script("validator").build_parser().parse_args(validator_command[2:])
    assert miner.miner_behaviour == "copycat" and miner.wandb_off and validator.wandb_off
    assert run_spec_from(miner) == run_spec_from(validator)
    assert run_spec_from(miner).inner_steps == 7 and run_spec_from(miner).seq_len == 32
    for args, name in ((miner, "miner1"), (validator, "validator")):
        assert args.netuid == NETUID and args.subtensor_network == url and args.wallet_name == name
        assert args.neuron_events_file == str(tmp_path / f"{name}.events")
        assert args.neuron_full_path == str(tmp_path / name) and args.neuron_torch_threads == 1
        assert args.averaging_compression == "none" and args.neuron_blocks_per_round == config.blocks_per_round


def test_without_compression_the_neurons_use_the_presets_codec(tmp_path):
    for model, codec in (("tiny", "fp16"), ("small", "sparse")):
        config = LocalnetConfig(out=tmp_path, model=model)
        command = neuron_command(config, MINER, "mock://127.0.0.1:9999", tmp_path)
        assert "--averaging.compression" not in command
        args = load_script("miner").build_parser().parse_args(command[2:])
        assert NeuronConfig.from_args(args).codec().name == codec


def test_the_neurons_overlap_as_asked_or_as_their_codec_does_and_the_report_says_which(tmp_path):
    """Unasked, the network overlaps with fp16 and blocks with sparse (template.training.outer.default_overlap),
    and tells every neuron so explicitly."""
    miner = load_script("miner").build_parser()
    for flags, overlapped in (([], True), (["--compression", "sparse"], False), (["--model", "small"], False),
                              (["--compression", "sparse", "--overlap"], True), (["--no-overlap"], False)):
        config = config_from_args(["--out", str(tmp_path / "run"), *flags])
        assert config.overlapped() is overlapped, flags
        command = neuron_command(config, MINER, "mock://127.0.0.1:9999", tmp_path)
        assert ("--run.overlap" if overlapped else "--no-run.overlap") in command
        assert run_spec_from(miner.parse_args(command[2:])).overlap is overlapped


def test_children_carry_the_run_marker_and_keep_the_token_cache_in_the_run(tmp_path):
    env = child_env(tmp_path)
    assert env[RUN_MARKER_ENV] == str(tmp_path)
    assert env["BTCLI_TOKEN_SYMBOLS_CACHE"] == str(tmp_path / "token_symbols.json")
    assert env["PYTHONUNBUFFERED"] == "1"


def test_log_tails_show_what_a_terminal_shows(tmp_path):
    log = tmp_path / "miner1.log"
    log.write_bytes(b"starting\n\r\x1b[Kround 4 step 1/10 loss 5.612 812 tok/s, round ends in 9s, peers 3"
                    b"\r\x1b[Kround 4 step 2/10 loss 5.401 905 tok/s, round ends in 8s, peers 3\nTraceback: boom\n")
    assert tail_text(log, 2) == "round 4 step 2/10 loss 5.401 905 tok/s, round ends in 8s, peers 3\nTraceback: boom"
    assert last_progress(log).groups() == ("4", "2", "10", "5.401", "905")
    assert tail_text(tmp_path / "missing.log", 5) == "" and last_progress(tmp_path / "missing.log") is None


def test_the_view_shows_each_neuron_and_prints_rounds_and_weights(tmp_path):
    (tmp_path / "miner1.log").write_text("\rround 6 step 3/10 loss - 700 tok/s, round ends in 5s, peers 2")
    stream = io.StringIO()
    view = LiveView(stream, interactive=True)
    view.track([VALIDATOR, MINER], {"validator": tmp_path / "validator.log", "miner1": tmp_path / "miner1.log"})
    view.handle(dict(event="synced", peer_key="validator", round=5, heldout_loss=4.25))
    view.handle(dict(event="scored", peer_key="validator", round=5, miners=[{"uid": 1}, {"uid": 2}]))
    view.handle(dict(event="weights", peer_key="validator", round=5, block=140, ok=True,
                     weights={"2": 0.6, "1": 0.4}, error=""))
    view.refresh()
    view.round_line(dict(round=5, heldout_loss=4.25, loss=4.5, group_size=2, allreduce_s=0.31,
                         bytes_per_peer=2_500_000, theta_hashes=["abc"]))
    text = stream.getvalue()
    assert "weights round 5 at block 140: uid 1 0.40, uid 2 0.60" in text
    assert "round 5 done: held-out loss 4.2500 (train 4.5000), group 2, all-reduce 0.31s, 2.50 MB/peer, " \
           "θ identical; last weights: round 5 at block 140" in text
    statuses = view.statuses
    assert statuses["validator"].work == "scored 2" and statuses["validator"].loss == 4.25
    assert statuses["miner1"].round == 6 and statuses["miner1"].work == "step 3/10"
    assert statuses["miner1"].loss is None and statuses["miner1"].tokens_per_s == 700.0
    assert "\033[2A" in text  # the two status lines were redrawn in place
    view.close()
    plain = io.StringIO()
    LiveView(plain, interactive=False).line("hello")
    assert plain.getvalue() == "hello\n"


def test_the_summary_names_checks_and_the_report(tmp_path):
    report = dict(passed=False, checks=dict(loss_fell=True, models_identical=False, weights_on_chain=True),
                  neurons=[dict(uid=0, role="validator", behaviour=None, score=None, weight=None, incentive=0.0,
                                emission=5.0),
                           dict(uid=1, role="miner", behaviour="honest", score=0.5, weight=1.0, incentive=1.0,
                                emission=5.0)])
    stream = io.StringIO()
    print_summary(report, tmp_path, stream)
    text = stream.getvalue()
    assert "models_identical NO" in text and text.rstrip().endswith("FAILED")
    assert f"{tmp_path / 'report.html'}" in text and "uid 1   miner     honest" in text


def test_with_dashboard_each_neuron_is_given_its_own_port_on_its_command_line(tmp_path):
    assert not config_from_args(["--out", str(tmp_path / "a")]).dashboard
    config = config_from_args(["--out", str(tmp_path / "b"), "--dashboard"])
    assert config.dashboard
    url = "mock://127.0.0.1:9999"
    validator = load_script("validator").build_parser().parse_args(
        neuron_command(config, VALIDATOR, url, tmp_path, 45678)[2:])
    assert (validator.dashboard_port, validator.dashboard_ip) == (45678, "127.0.0.1")
    miner = load_script("miner").build_parser().parse_args(neuron_command(config, MINER, url, tmp_path)[2:])
    assert miner.dashboard_port == 0  # no port given: no dashboard


def test_behind_a_simulated_link_each_neuron_listens_on_its_port_and_serves_the_proxys(tmp_path, capsys):
    """--link.mbit: a neuron's host listens where the link forwards to and announces the link's proxy (the way a
    node behind a port-forwarding router uses --axon.external_port); a forwarded port needs a fixed one."""
    config = config_from_args(["--out", str(tmp_path / "a"), "--link.mbit", "50", "--link.latency_ms", "20"])
    assert (config.link_mbit, config.link_latency_ms) == (50.0, 20.0)
    link = SimulatedPeer("miner1", host_port=41001, proxy_port=41002)
    miner = load_script("miner").build_parser().parse_args(
        neuron_command(config, MINER, "mock://127.0.0.1:9999", tmp_path, link=link)[2:])
    axon = NeuronConfig.from_args(miner).axon
    assert (axon.port, axon.external_port) == (41001, 41002)
    with pytest.raises(SystemExit) as exit_info:
        load_script("miner").main(["--netuid", "3", "--axon.external_port", "41002",
                                   "--neuron.full_path", str(tmp_path / "m")])
    assert exit_info.value.code == 2 and "needs a fixed --axon.port" in capsys.readouterr().err


def test_the_miner_takes_behaviour_options_and_refuses_bad_ones(tmp_path, capsys):
    miner = load_script("miner")
    args = miner.build_parser().parse_args(
        ["--netuid", "3", "--miner.behaviour", "noisy-average", "--miner.rel", "0.3"])
    assert NeuronConfig.from_args(args).miner.load().rel == 0.3
    with pytest.raises(SystemExit) as exit_info:
        miner.main(["--netuid", "3", "--miner.behaviour", "partial", "--miner.fraction", "1.5",
                    "--neuron.full_path", str(tmp_path)])
    assert exit_info.value.code == 2 and "fraction of inner steps must be within (0, 1]" in capsys.readouterr().err
    args = miner.build_parser().parse_args(
        ["--netuid", "3", "--miner.behaviour", "concentrated", "--miner.values", "3", "--miner.share", "0.2"])
    concentrated = NeuronConfig.from_args(args).miner.load()
    assert (concentrated.values, concentrated.share) == (3, 0.2)
    with pytest.raises(SystemExit) as exit_info:
        miner.main(["--netuid", "3", "--miner.behaviour", "concentrated", "--miner.share", "1.5",
                    "--neuron.full_path", str(tmp_path)])
    assert exit_info.value.code == 2 and "share within (0, 1)" in capsys.readouterr().err


def test_help_lists_every_built_in_behaviour():
    text = " ".join(build_parser().format_help().split())  # argparse wraps names at their hyphens
    for name in BUILTIN:
        assert name in text.replace("- ", "-"), name


def test_the_token_cache_lives_in_the_state_directory_unless_a_shared_one_is_named(tmp_path):
    parser = load_script("validator").build_parser()
    own = NeuronConfig.from_args(parser.parse_args(["--netuid", "3", "--neuron.full_path", str(tmp_path / "v")]))
    assert own.cache_dir == tmp_path / "v" / "cache"
    shared = NeuronConfig.from_args(parser.parse_args(["--netuid", "3", "--neuron.full_path", str(tmp_path / "v"),
                                                       "--neuron.cache_dir", str(tmp_path / "shared")]))
    assert shared.cache_dir == tmp_path / "shared" and shared.state_dir == tmp_path / "v"
