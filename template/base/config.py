"""One typed configuration for a neuron, built once from its command line: a tree of dataclasses.

Each flag maps to one field, and each field says what it is (its ``help``, which ``--help`` prints too), in the spirit
of torchtitan's job config. The spellings are the ones subnet operators already type in their pm2 scripts
(``--netuid``, ``--wallet.name``, ``--subtensor.network``, ``--axon.port``, ``--neuron.*``, ``--run.*``,
``--averaging.*``, ``--validator.*``, ``--miner.behaviour``, ``--dashboard.*``, ``--wandb.*``, ``--logging.debug``),
and stay so.
The neuron entry points parse their flags with :func:`add_neuron_args` (+ :func:`add_miner_args` or
:func:`add_validator_args`) and hand :meth:`NeuronConfig.from_args` to ``template.base``; nothing below the entry
points reads the raw ``argparse`` namespace. The all-reduce settings are turned into an
:class:`~template.allreduce.averager.AveragingConfig` in one place,
:func:`template.training.cli.averaging_config`.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from template.allreduce.codecs import SegmentCodec
from template.base.behaviours import MinerBehaviour, load_behaviour
from template.base.telemetry import WandbConfig, add_wandb_args
from template.config import ChainArgs, add_chain_args, chain_args_from
from template.training.cli import (
    AveragingFlags,
    add_averaging_args,
    add_run_args,
    averaging_flags_from,
    codec_from,
    data_config_from,
    dotted,
    run_spec_from,
)
from template.training.data import DataConfig
from template.training.spec import RunSpec
from template.validation.rewards import RewardConfig
from template.validation.scoring import ScoringConfig


def _help(text: str, **kwargs: Any) -> Any:
    """A dataclass field whose ``help`` is its documentation and its ``--help`` line."""
    return field(metadata={"help": text}, **kwargs)


@dataclass(frozen=True)
class AxonConfig:
    """This neuron's hivemind host: where it listens and the address it serves on chain."""

    ip: str = _help("address the host listens on (0.0.0.0 on a server)", default="127.0.0.1")
    port: int = _help("TCP port to listen on; open it in your firewall (0 = any free port)", default=0)
    external_ip: str | None = _help("public IP that peers dial, served on chain (default: --axon.ip)", default=None)
    external_port: int | None = _help("public TCP port that peers dial, served on chain, when a router or proxy "
                                      "forwards it to --axon.port (default: --axon.port)", default=None)

    def __post_init__(self) -> None:
        if self.external_port is not None and not (self.port and 0 < self.external_port < 65536):
            raise ValueError("--axon.external_port needs a fixed --axon.port for it to forward to, and must be a port "
                             "number (1-65535)")


DEFAULT_ALLREDUCE_FRACTION = 0.2


@dataclass(frozen=True)
class NeuronSettings:
    """How this neuron runs on this machine, and the round clock every neuron of the subnet shares."""

    device: str = _help("cpu, cuda or cuda:N", default="cpu")
    full_path: str | None = _help(
        "state directory (checkpoints, scores); default ~/.diloco/<wallet>/<hotkey>/netuid<N>", default=None)
    cache_dir: str | None = _help(
        "token cache directory; neurons of one machine that train on the same data may share one, so that only the "
        "first builds it (default: <state directory>/cache)", default=None)
    blocks_per_round: int = _help("chain blocks per DiLoCo round (every neuron of the subnet must agree)", default=25)
    allreduce_fraction: float = _help(
        "share of a round kept for the all-reduce on each side of the round's last block: training stops that long "
        "(plus the matchmaking time) before it, and the all-reduce may run that long past it (overlapped: training "
        "stops that long before it, and the all-reduce may run until the next round's training ends)",
        default=DEFAULT_ALLREDUCE_FRACTION)
    max_rounds: int = _help("stop after this many rounds (0 = run until stopped)", default=0)
    events_file: str | None = _help("append one JSON line per event (ready, round, ...) to this file, for tools and "
                                    "tests", default=None)
    torch_threads: int | None = _help("CPU threads for torch (default: torch's choice)", default=None)


@dataclass(frozen=True)
class DashboardConfig:
    """The neuron's read-only web dashboard (``template/base/dashboard.py``): off unless a port is given."""

    port: int = _help("serve a live dashboard of this neuron on this TCP port (0 = no dashboard)", default=0)
    ip: str = _help("address the dashboard listens on; keep 127.0.0.1 and reach it through an SSH tunnel",
                    default="127.0.0.1")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--dashboard.port must be within 0..65535, not {self.port}")


@dataclass(frozen=True)
class MinerSettings:
    """What only a miner is told."""

    behaviour: str = _help("what this miner trains and publishes: a built-in name or module:Class "
                           "(see template/base/behaviours.py)", default="honest")
    rel: float | None = _help("noise relative to the copied average's norm, for noisy-average and stale-average "
                              "(default 0.15)", default=None)
    fraction: float | None = _help("share of the inner steps a partial miner runs (default 0.5)", default=None)
    values: int | None = _help("coordinates a concentrated miner moves its norm into (default 8)", default=None)
    share: float | None = _help("share of its squared norm a concentrated miner moves there (default 0.5)",
                                default=None)

    def load(self) -> MinerBehaviour:
        """The behaviour these settings name; ValueError for an unknown name or an option out of range."""
        return load_behaviour(self.behaviour, rel=self.rel, fraction=self.fraction, values=self.values,
                              share=self.share)


@dataclass(frozen=True)
class ValidatorSettings:
    """What only a validator is told: how it scores, smooths and sets weights."""

    allow_no_permit: bool = _help("run even without a validator permit (weights from such a validator do not count)",
                                  default=False)
    eval_windows: int = _help("windows every miner of a round is scored on (the same for all: cost vs noise)",
                              default=ScoringConfig.eval_windows)
    max_miners: int = _help("miners scored per round, least recently scored first (0 = all)", default=0)
    fetch_timeout: float = _help("seconds one publication fetch may take", default=20.0)
    ema_alpha: float = _help("weight of the newest round in the score average", default=RewardConfig.ema_alpha)
    power: float = _help("weights are score ** power, normalized", default=RewardConfig.power)
    weights_every: int = _help("set weights every N scored rounds", default=1)

    @property
    def rewards(self) -> RewardConfig:
        return RewardConfig(self.ema_alpha, self.power)


@dataclass(frozen=True)
class NeuronConfig:
    """Everything one neuron (miner or validator) is configured with."""

    chain: ChainArgs
    axon: AxonConfig
    neuron: NeuronSettings
    run: RunSpec
    data: DataConfig
    averaging: AveragingFlags
    wandb: WandbConfig
    debug: bool = False
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)
    miner: MinerSettings | None = None
    validator: ValidatorSettings | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NeuronConfig:
        """The tree of a parsed command line (miner or validator: whichever groups the parser had); ValueError for
        values that parse but do not fit together (the codec's settings included, before any network)."""
        return cls(
            chain=chain_args_from(args), axon=_section(AxonConfig, args, "axon"),
            neuron=_section(NeuronSettings, args, "neuron"), run=run_spec_from(args),
            data=data_config_from(args),
            averaging=averaging_flags_from(args), wandb=WandbConfig.from_args(args),
            debug=args.logging_debug, dashboard=_section(DashboardConfig, args, "dashboard"),
            miner=_section(MinerSettings, args, "miner") if hasattr(args, "miner_behaviour") else None,
            validator=_validator_section(args) if hasattr(args, "validator_eval_windows") else None,
        )

    def codec(self) -> SegmentCodec:
        """The codec every contribution of the run is encoded with (``--averaging.compression`` and its settings)."""
        return codec_from(self.averaging)

    @property
    def state_dir(self) -> Path:
        """Where this neuron keeps its checkpoints, scores and caches."""
        if self.neuron.full_path:
            return Path(self.neuron.full_path).expanduser()
        wallet = self.chain.wallet
        return Path("~/.diloco").expanduser() / wallet.name / wallet.hotkey / f"netuid{self.chain.netuid}"

    @property
    def cache_dir(self) -> Path:
        """Where this neuron's token cache lives (``--neuron.cache_dir``, else inside its state directory)."""
        return Path(self.neuron.cache_dir).expanduser() if self.neuron.cache_dir else self.state_dir / "cache"


# ------------------------------------------------------------------------------------------------ flags


def _field(cls: type, name: str):
    return next(f for f in fields(cls) if f.name == name)


def _add(group: argparse._ArgumentGroup, flag: str, cls: type, name: str, **kwargs: Any) -> None:
    """``flag`` for field ``cls.name``: its dest is the flag's name with dots as underscores, its default and help
    come from the field."""
    spec = _field(cls, name)
    default = spec.default if spec.default is not MISSING else None
    if isinstance(default, bool) and "action" not in kwargs:
        kwargs["action"] = "store_true"
    suffix = "" if default is None or "action" in kwargs else " (default %(default)s)"
    group.add_argument(flag, dest=flag[2:].replace(".", "_"), default=default, help=spec.metadata["help"] + suffix,
                       **kwargs)


def _section(cls: type, args: argparse.Namespace, prefix: str):
    return cls(**{f.name: getattr(args, f"{prefix}_{f.name}") for f in fields(cls)})


def _validator_section(args: argparse.Namespace) -> ValidatorSettings:
    values = {f.name: getattr(args, f"validator_{f.name}") for f in fields(ValidatorSettings)
              if f.name != "allow_no_permit"}
    return ValidatorSettings(allow_no_permit=args.neuron_allow_no_permit, **values)


def add_neuron_args(parser: argparse.ArgumentParser) -> None:
    """Chain, wallet, axon, neuron, run, all-reduce and wandb flags (bittensor style): every neuron has these."""
    add_chain_args(parser)
    axon = parser.add_argument_group("axon (this neuron's hivemind host)")
    _add(axon, "--axon.ip", AxonConfig, "ip")
    _add(axon, "--axon.port", AxonConfig, "port", type=int)
    _add(axon, "--axon.external_ip", AxonConfig, "external_ip")
    _add(axon, "--axon.external_port", AxonConfig, "external_port", type=int)
    neuron = parser.add_argument_group("neuron")
    _add(neuron, "--neuron.device", NeuronSettings, "device")
    _add(neuron, "--neuron.full_path", NeuronSettings, "full_path")
    _add(neuron, "--neuron.cache_dir", NeuronSettings, "cache_dir")
    _add(neuron, "--neuron.blocks_per_round", NeuronSettings, "blocks_per_round", type=int)
    _add(neuron, "--neuron.allreduce_fraction", NeuronSettings, "allreduce_fraction", type=float)
    _add(neuron, "--neuron.max_rounds", NeuronSettings, "max_rounds", type=int)
    _add(neuron, "--neuron.events_file", NeuronSettings, "events_file")
    _add(neuron, "--neuron.torch_threads", NeuronSettings, "torch_threads", type=int)
    dashboard = parser.add_argument_group("dashboard (read-only web page of this neuron)")
    _add(dashboard, "--dashboard.port", DashboardConfig, "port", type=int)
    _add(dashboard, "--dashboard.ip", DashboardConfig, "ip")
    parser.add_argument("--logging.debug", dest="logging_debug", action="store_true", help="debug logging")
    add_wandb_args(parser)
    add_run_args(parser, dotted)
    add_averaging_args(parser, dotted)


def add_miner_args(parser: argparse.ArgumentParser, behaviours: list[str]) -> None:
    group = parser.add_argument_group("miner")
    spec = _field(MinerSettings, "behaviour")
    group.add_argument("--miner.behaviour", dest="miner_behaviour", default=spec.default,
                       help=spec.metadata["help"].replace("a built-in name", ", ".join(behaviours)))
    _add(group, "--miner.rel", MinerSettings, "rel", type=float)
    _add(group, "--miner.fraction", MinerSettings, "fraction", type=float)
    _add(group, "--miner.values", MinerSettings, "values", type=int)
    _add(group, "--miner.share", MinerSettings, "share", type=float)


def add_validator_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("validator")
    _add(group, "--neuron.allow_no_permit", ValidatorSettings, "allow_no_permit")
    _add(group, "--validator.eval_windows", ValidatorSettings, "eval_windows", type=int)
    _add(group, "--validator.max_miners", ValidatorSettings, "max_miners", type=int)
    _add(group, "--validator.fetch_timeout", ValidatorSettings, "fetch_timeout", type=float)
    _add(group, "--validator.ema_alpha", ValidatorSettings, "ema_alpha", type=float)
    _add(group, "--validator.power", ValidatorSettings, "power", type=float)
    _add(group, "--validator.weights_every", ValidatorSettings, "weights_every", type=int)
