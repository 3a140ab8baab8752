"""wandb logging for neurons: offline by default (runs are written under the neuron's state directory and can be
uploaded later with ``wandb sync``), online with ``--wandb.mode online``, off with ``--wandb.off``.

On failure: wandb problems never stop a neuron — a run that cannot start is logged once and the neuron goes on
without it.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WandbConfig:
    """wandb logging (``--wandb.*``)."""

    off: bool = False  # do not log to wandb
    project: str = "diloco-subnet"
    mode: str = "offline"  # offline writes runs under the state directory (upload with `wandb sync`); or online

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WandbConfig:
        return cls(off=args.wandb_off, project=args.wandb_project, mode=args.wandb_mode)


def add_wandb_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("wandb")
    group.add_argument("--wandb.off", dest="wandb_off", action="store_true", help="do not log to wandb")
    group.add_argument("--wandb.project", dest="wandb_project", default=WandbConfig.project, help="wandb project")
    group.add_argument("--wandb.mode", dest="wandb_mode", default=WandbConfig.mode, choices=["offline", "online"],
                       help="offline (default) writes runs under the state directory; upload them with `wandb sync`")


class Telemetry:
    """A wandb run, or nothing (``--wandb.off``, or wandb failed to start)."""

    def __init__(self, run: Any | None) -> None:
        self._run = run

    @classmethod
    def open(cls, settings: WandbConfig, *, role: str, name: str, directory: Path, config: dict) -> Telemetry:
        if settings.off:
            return cls(None)
        try:
            import wandb

            directory.mkdir(parents=True, exist_ok=True)
            run = wandb.init(project=settings.project, mode=settings.mode, dir=str(directory), name=name,
                             group=role, config=config, settings=wandb.Settings(silent=True))
            return cls(run)
        except Exception as err:  # wandb must never take a neuron down
            log.warning("wandb did not start (%s); going on without it", err)
            return cls(None)

    @property
    def active(self) -> bool:
        return self._run is not None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self._run is not None:
            self._run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None},
                          step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
