"""wandb telemetry: offline runs land under the given directory; --wandb.off logs nothing."""

from __future__ import annotations

import argparse

from template.base.telemetry import Telemetry, WandbConfig, add_wandb_args


def parse(*argv: str) -> WandbConfig:
    parser = argparse.ArgumentParser()
    add_wandb_args(parser)
    return WandbConfig.from_args(parser.parse_args(argv))


def test_offline_run_is_written_under_the_state_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    telemetry = Telemetry.open(parse(), role="miner", name="uid1", directory=tmp_path, config={"netuid": 1})
    assert telemetry.active
    telemetry.log({"round": 3, "train_loss": 2.5, "reason": "not a number", "heldout_loss": None}, step=3)
    telemetry.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))


def test_wandb_off_logs_nothing(tmp_path):
    telemetry = Telemetry.open(parse("--wandb.off"), role="miner", name="uid1", directory=tmp_path, config={})
    assert not telemetry.active
    telemetry.log({"round": 1}, step=1)
    telemetry.close()
    assert not (tmp_path / "wandb").exists()
