"""One DiLoCo peer: inner training, the pseudo-gradient all-reduce and the outer step, round after round.

A round reads like the pseudo-code of DESIGN.md §1::

    θ_local ← θ_r
    H inner AdamW steps on this peer's assigned windows of round r   (matchmaking starts during the last ones)
    Δ  = θ_r − θ_local
    Δ̄  = all-reduce(Δ, weight = tokens)                              (checked; never a partial result)
    θ_{r+1} = OuterNesterov(θ_r, Δ̄)

What is guaranteed when things go wrong:

- The all-reduce fails (no group before the deadline, a peer died, a part missing): the outer step is skipped
  and θ_r kept; at the start of the next round the peer asks live peers for their state and adopts it if they
  completed the round it missed — so a peer that missed one round re-joins in lockstep instead of drifting, and
  when every peer missed it, all of them simply keep θ_r.
- The group succeeded but its members started from different θ_r (their base hashes disagree): the result is
  used only by the peers whose base is the token-weighted majority's; the others re-sync from peers.
- A peer with another model, vocabulary, data or run id fails fast at start (``RunMismatchError``), naming what
  differs; such peers never share an averaging group (the group prefix carries the run fingerprint).
- After every round the state (θ, outer momentum, inner AdamW state, round) is checkpointed atomically; a
  restarted peer resumes from it when no live peer is further along.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hivemind
import torch
from hivemind.utils import get_dht_time
from torch.nn.parallel import DistributedDataParallel

from template.training.averaging import AveragingConfig, AveragingResult, PseudoGradientAverager
from template.training.checkpoint import flatten_state, load_latest_checkpoint, save_checkpoint, unflatten_state
from template.training.data import DataAssignment, TokenCorpus
from template.training.distributed import NodeGroup
from template.training.inner import InnerConfig, InnerTrainer, evaluate
from template.training.model import build_model, place_model
from template.training.outer import OuterConfig, OuterOptimizer

log = logging.getLogger(__name__)

# Seconds of inner training that overlap matchmaking's DHT round trips (see DiLoCoPeer._matchmaking_lead_steps).
MATCHMAKING_LEAD_S = 1.5


class RunMismatchError(RuntimeError):
    """Another peer of the same run id trains a different model / data / settings."""


@dataclass(frozen=True)
class RunSpec:
    """Everything the peers of one run must agree on (its hash is the run fingerprint)."""

    run_id: str = "diloco"
    model: str = "tiny"
    seq_len: int = 128
    run_seed: int = 0
    init_seed: int = 0
    batch_size: int = 8  # sequences per inner step for the whole peer (split across its ranks)
    inner_steps: int = 50  # H
    heldout_fraction: float = 0.05
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)

    def __post_init__(self) -> None:
        if not self.run_id or "." in self.run_id:
            raise ValueError(f"run_id must be non-empty and contain no '.', got {self.run_id!r}")
        if self.inner_steps < 1 or self.batch_size < 1 or self.seq_len < 1:
            raise ValueError("inner_steps, batch_size and seq_len must be positive")

    def identity(self, corpus: TokenCorpus, vocab_size: int) -> dict[str, Any]:
        """The fields a peer compares with others, plain JSON/msgpack values."""
        fields = asdict(self)
        fields["inner"]["betas"] = list(self.inner.betas)
        return dict(fields, vocab_size=vocab_size, corpus=corpus.fingerprint, tokenizer=corpus.tokenizer_name)

    def fingerprint(self, corpus: TokenCorpus, vocab_size: int) -> str:
        canonical = json.dumps(self.identity(corpus, vocab_size), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RoundReport:
    """What one round did, for logs, progress lines and benchmarks."""

    round: int
    base_theta_hash: str  # θ_r the round started from
    inner_steps: int
    tokens: int
    train_loss: float | None
    heldout_loss: float | None  # of θ_{r+1} (θ_r when the round failed), on held-out windows
    allreduce_ok: bool
    reason: str
    group_size: int
    allreduce_s: float  # from handing Δ over to having Δ̄ (what the round waits for)
    round_s: float
    inner_s: float
    bytes_sent: int
    theta_hash: str  # of θ after the round: equal on every peer that took the step


@dataclass(frozen=True)
class Progress:
    """A live progress sample during inner training."""

    round: int
    step: int
    of_steps: int
    loss: float | None
    tokens_per_s: float


class DiLoCoPeer:
    """A DiLoCo peer: owns the model, the inner and outer optimizers, and (on the leader rank) the averager."""

    def __init__(
        self,
        spec: RunSpec,
        corpus: TokenCorpus,
        vocab_size: int,
        *,
        peer_key: str,
        dht: hivemind.DHT | None,
        averaging: AveragingConfig | None = None,
        device: str | torch.device = "cpu",
        checkpoint_dir: str | Path | None = None,
        node: NodeGroup | None = None,
        heldout_batches: int = 4,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> None:
        node = node or NodeGroup()
        if corpus.seq_len != spec.seq_len:
            raise ValueError(f"corpus windows are {corpus.seq_len} tokens, the run uses seq_len {spec.seq_len}")
        if spec.batch_size % node.world:
            raise ValueError(f"batch_size {spec.batch_size} must be divisible by the node's {node.world} ranks")
        if node.is_leader and dht is None:
            raise ValueError("the leader rank needs a DHT")
        self.spec = spec
        self.corpus = corpus
        self.peer_key = peer_key
        self.node = node
        self.device = torch.device(device)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.heldout_batches = heldout_batches
        self.on_progress = on_progress
        self.fingerprint = spec.fingerprint(corpus, vocab_size)
        self.identity = spec.identity(corpus, vocab_size)
        self.assignment = DataAssignment(corpus.fingerprint, corpus.num_windows, spec.run_seed, spec.heldout_fraction)

        self.model = place_model(build_model(spec.model, vocab_size, spec.seq_len, init_seed=spec.init_seed), device)
        trained = DistributedDataParallel(self.model) if node.distributed else self.model
        self.inner = InnerTrainer(trained, spec.inner, self.device)
        self.outer = OuterOptimizer(self.model, spec.outer)
        self.round = 0
        self._resync_needed = False  # the last all-reduce failed: look for a peer that completed it
        self._state_lock = threading.Lock()  # the averager's state provider runs on another thread
        self._step_time_s: float | None = None  # running estimate, to schedule matchmaking ahead
        # Hooks for miner behaviours: which windows to train on, how many steps (default: assigned ones, H).
        self.window_selector: Callable[[int], list[int]] | None = None
        self.max_inner_steps = spec.inner_steps
        self.last_delta: list[torch.Tensor] | None = None  # Δ of the last round (leader), for publication
        self.last_averaged: list[torch.Tensor] | None = None  # the group's Δ̄ of the last round, if it succeeded
        self.last_result: AveragingResult | None = None  # the last all-reduce as this peer saw it (group, weights)
        # Validators score round r's pseudo-gradients against θ_r after the round moved on: keep a copy of it.
        self.keep_base = False
        self.last_base: list[torch.Tensor] | None = None

        self.dht = dht
        self.averager: PseudoGradientAverager | None = None
        if node.is_leader:
            assert dht is not None
            check_run_identity(dht, spec.run_id, self.identity)
            config = averaging or AveragingConfig()
            config = AveragingConfig(**{**asdict(config), "prefix": f"{spec.run_id}_{self.fingerprint}"})
            self.averaging_config = config
            self.min_contributors = min(2, config.min_group_size)  # trainers (tokens > 0) a group needs to count
            shapes = [p.shape for p in self.model.parameters()]
            self.averager = PseudoGradientAverager(dht, shapes, config, state_provider=self._shared_state)

    # ------------------------------------------------------------------------------------------ start-up

    def restore(self, peer_timeout_s: float = 10.0) -> str:
        """Load the newest state: own checkpoint or a live peer's, whichever is further along. Returns the source.

        Every rank reads the checkpoint (same node, same directory); the leader alone asks peers and then
        broadcasts θ and the round to the other ranks.
        """
        source = "fresh"
        checkpoint = load_latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir else None
        if checkpoint is not None and checkpoint.metadata.get("fingerprint") == self.fingerprint:
            self._load_checkpoint(checkpoint.tensors, checkpoint.metadata)
            source = f"checkpoint round {self.round}"
        elif checkpoint is not None:
            log.warning("ignoring checkpoint %s: it belongs to run %s, this is %s", checkpoint.path,
                        checkpoint.metadata.get("fingerprint"), self.fingerprint)
        if self.node.is_leader and self._adopt_peer_state(peer_timeout_s, min_round=self.round):
            source = f"peer state round {self.round}"
        self._sync_ranks()
        return source

    def wait_for_peers(self, count: int, timeout_s: float) -> int:
        """Say we are ready (state restored), then block until ``count`` peers of this run (us included) are, so
        that round 0 starts together; returns how many were seen (fewer only after ``timeout_s``).
        """
        seen = 1
        if self.dht is not None:
            key = f"{self.spec.run_id}_ready"
            expiration = get_dht_time() + IDENTITY_TTL_S
            self.dht.store(key, self.round, expiration_time=expiration, subkey=str(self.dht.peer_id))
            deadline = time.monotonic() + timeout_s
            while (seen := count_subkeys(self.dht, key)) < count and time.monotonic() < deadline:
                time.sleep(0.2)
            log.info("%d of %d peers ready", seen, count)
        return self.node.broadcast_int(seen)

    # ------------------------------------------------------------------------------------------ the round

    def skip_to(self, round: int) -> None:
        """Jump to a later round (a chain-clocked peer that missed rounds); θ is re-synced from peers first."""
        if round > self.round:
            with self._state_lock:
                self.round = round
            self._resync_needed = True

    def run_round(self, train_until: float | None = None, finish_by: float | None = None) -> RoundReport:
        """One DiLoCo round: at most H inner steps, stopping at ``train_until``; the all-reduce ends by ``finish_by``.

        Both are ``time.time()`` values (a chain-clocked miner derives them from the round's last block); without
        them the round runs exactly H steps and the all-reduce gets matchmaking time + ``allreduce_timeout``.
        """
        round_started = time.monotonic()
        if self._resync_needed and self.node.is_leader:
            resync_timeout = self.averaging_config.matchmaking_time
            self._resync_needed = not self._adopt_peer_state(resync_timeout, min_round=self.round)
        self._sync_ranks()
        r = self.round
        spec = self.spec
        self.outer.load_into(self.model)  # θ_local ← θ_r
        base_hash = self.outer.theta_hash()
        if self.keep_base:
            self.last_base = [t.clone() for t in self.outer.params()]
        log.info("round %d starts from θ %s", r, base_hash[:12])
        windows = self.window_selector(r) if self.window_selector else self.assigned_windows(r)
        batches = self._rank_batches(windows)
        step_tokens = spec.batch_size * spec.seq_len

        # Train until a few steps before the end, start matchmaking, then finish training while it runs.
        lead_steps = self.node.broadcast_int(self._matchmaking_lead_steps())  # the leader's choice, for all ranks
        stats_head = self._train(batches, self.max_inner_steps - lead_steps, train_until, r, 0)
        if train_until is not None and self.node.is_leader:
            # On a shared clock every peer starts matchmaking at the same moment, however early it finished
            # training (or had nothing to train: a validator): otherwise the early ones would form the round's
            # group among themselves and leave the others out.
            time.sleep(max(0.0, train_until - MATCHMAKING_LEAD_S - time.time()))
        handle = None
        if self.averager is not None:
            remaining_s = lead_steps * (self._step_time_s or 0.0)
            scheduled = time.time() + max(remaining_s, self.averager.config.matchmaking_time)
            gather = dict(peer_key=self.peer_key, round=r, base=base_hash, fingerprint=self.fingerprint)
            announced_tokens = stats_head.tokens + lead_steps * step_tokens  # the weight is fixed at matchmaking
            handle = self.averager.begin(announced_tokens, gather, scheduled,
                                         deadline=self._allreduce_deadline(scheduled, finish_by))
        stats_tail = self._train(batches, lead_steps, train_until, r, stats_head.steps)
        steps = stats_head.steps + stats_tail.steps
        tokens = stats_head.tokens + stats_tail.tokens
        inner_s = stats_head.seconds + stats_tail.seconds
        if steps:
            self._step_time_s = inner_s / steps
        losses = [(s.mean_loss, s.steps) for s in (stats_head, stats_tail) if s.mean_loss is not None]
        train_loss = sum(loss * n for loss, n in losses) / steps if steps else None

        # Δ, all-reduce, outer step (leader); then every rank takes θ_{r+1} from the leader.
        allreduce_started = time.monotonic()
        result = None
        if self.averager is not None and handle is not None:
            delta = self.outer.pseudo_gradient(self.model)
            self.last_delta = delta
            result = self.averager.finish(handle, delta, self._allreduce_deadline(time.time(), finish_by))
        allreduce_s = time.monotonic() - allreduce_started
        self.last_result = result
        took_step, reason = self._apply(result, base_hash) if self.node.is_leader else (False, "")
        self.last_averaged = result.averaged if took_step and result is not None else None
        with self._state_lock:
            self.round = r + 1  # after a failed round θ_r is kept, but the next round's data is new for everyone
        self._resync_needed = self.node.is_leader and not took_step
        if self.averager is not None and self.dht is not None:
            self.averager.set_state_priority(self.round if took_step else -1)  # joiners pick the newest state
            announce_run_identity(self.dht, spec.run_id, self.identity)  # keep our record alive
        self._sync_ranks()
        self.outer.load_into(self.model)
        if not self.node.hashes_agree(list(self.model.parameters())):
            raise RuntimeError(f"round {r}: the ranks of this node hold different parameters")
        heldout = self.evaluate_heldout(r) if self.heldout_batches else None
        self.save()
        return RoundReport(
            round=r, base_theta_hash=base_hash, inner_steps=steps, tokens=tokens, train_loss=train_loss,
            heldout_loss=heldout,
            allreduce_ok=took_step, reason=reason, group_size=result.group_size if result else 0,
            allreduce_s=allreduce_s, round_s=time.monotonic() - round_started, inner_s=inner_s,
            bytes_sent=result.bytes_sent if result else 0, theta_hash=self.outer.theta_hash(),
        )

    def _apply(self, result: AveragingResult | None, base_hash: str) -> tuple[bool, str]:
        """Take the outer step if the all-reduce succeeded and our θ_r is the group's (majority) base."""
        if result is None:
            return False, "no averager"
        if not result.ok:
            return False, result.reason
        contributors = sum(1 for weight in result.weights.values() if weight > 0)
        if contributors < self.min_contributors:
            # hivemind counts auxiliary members (validators) and zero-token members toward the group size: a
            # trainer "averaging" with a validator alone would apply its own Δ and drift away from the others
            return False, f"only {contributors} peer(s) with tokens in the group: round not applied"
        bases: Counter[str] = Counter()
        for peer, gathered in result.group.items():
            if isinstance(gathered, dict) and isinstance(gathered.get("base"), str):
                bases[gathered["base"]] += result.weights.get(peer, 0.0)
        majority = max(bases.items(), key=lambda item: (item[1], item[0]))[0] if bases else base_hash
        if majority != base_hash:
            log.warning("our θ_r %s differs from the group's %s (bases by weight: %s)", base_hash[:12], majority[:12],
                        {k[:12]: v for k, v in bases.items()})
            return False, "our θ_r differs from the group's: re-syncing"
        with self._state_lock:
            self.outer.step(result.averaged)
        return True, ""

    def evaluate_heldout(self, round: int) -> float:
        """Loss of the model's current parameters on held-out windows (assigned to no peer)."""
        windows = self.assignment.heldout_windows(round, self.heldout_batches * self.spec.batch_size)
        return evaluate(self.model, self.corpus.batches(windows, self.spec.batch_size), self.device)

    # ------------------------------------------------------------------------------------------ helpers

    def _rank_batches(self, windows: list[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for input_ids, labels in self.corpus.batches(windows, self.spec.batch_size):
            yield self.node.split(input_ids), self.node.split(labels)

    def _train(self, batches, steps: int, deadline: float | None, r: int, done: int) -> _Stats:
        """Inner steps in chunks, reporting progress between chunks.

        The leader decides between chunks whether to go on (deadline) and tells the other ranks, so that all
        ranks of a node always run the same number of DDP steps.
        """
        chunk = max(1, min(10, steps))
        total_steps = total_tokens = 0
        loss_sum = 0.0
        seconds = 0.0
        last_loss = None
        while total_steps < steps:
            in_time = deadline is None or time.time() < deadline
            if not self.node.broadcast_int(int(in_time)):
                break
            stats = self.inner.train(batches, min(chunk, steps - total_steps))
            if stats.steps == 0:
                break
            total_steps += stats.steps
            total_tokens += stats.tokens * self.node.world
            seconds += stats.seconds
            loss_sum += (stats.mean_loss or 0.0) * stats.steps
            last_loss = stats.last_loss
            if self.on_progress and self.node.is_leader:
                self.on_progress(Progress(r, done + total_steps, self.spec.inner_steps, last_loss,
                                          total_tokens / max(seconds, 1e-9)))
        return _Stats(total_steps, total_tokens, loss_sum / total_steps if total_steps else None, seconds)

    def _matchmaking_lead_steps(self) -> int:
        """How many inner steps before the end to start matchmaking.

        Matchmaking costs a few DHT round trips; starting it about ``MATCHMAKING_LEAD_S`` before the last step hides
        them behind training. Starting much earlier would not help: a group cannot run before its slowest member
        finishes training, and members that finished wait for it.
        """
        if self.averager is None or self.max_inner_steps < 2:
            return 0
        if not self._step_time_s:
            return 1
        needed = math.ceil(MATCHMAKING_LEAD_S / self._step_time_s)
        return max(1, min(self.max_inner_steps - 1, needed))

    def _allreduce_deadline(self, start: float, finish_by: float | None) -> float:
        budget = start + self.averaging_config.matchmaking_time + self.averaging_config.allreduce_timeout
        return budget if finish_by is None else max(min(budget, finish_by), start + 1.0)

    def assigned_windows(self, round: int) -> list[int]:
        """The windows this peer must train on in ``round`` (what validators recompute)."""
        return self.assignment.assigned_windows(self.peer_key, round, self.spec.inner_steps * self.spec.batch_size)

    def _shared_state(self) -> tuple[dict, list[torch.Tensor]]:
        """What a joining peer downloads: θ_r, the outer momentum and the round (called on another thread)."""
        with self._state_lock:
            state = self.outer.state_dict()
            names = sorted(state)
            metadata = dict(round=self.round, fingerprint=self.fingerprint, names=names,
                            theta_hash=self.outer.theta_hash())
            return metadata, [state[name] for name in names]

    def _adopt_peer_state(self, timeout_s: float, min_round: int) -> bool:
        """Download a live peer's state and take it if it is for this run and at ``min_round`` or later (leader)."""
        assert self.averager is not None
        downloaded = self.averager.load_state_from_peers(timeout=timeout_s)
        if downloaded is None:
            return False
        metadata, tensors = downloaded
        names = metadata.get("names")
        if metadata.get("fingerprint") != self.fingerprint or not isinstance(names, list) or len(names) != len(tensors):
            log.warning("ignoring a peer state for another run or with a malformed layout")
            return False
        peer_round = metadata.get("round")
        if not isinstance(peer_round, int) or peer_round < min_round:
            return False
        try:
            with self._state_lock:
                self.outer.load_state_dict(dict(zip(names, tensors, strict=True)))
                self.round = peer_round
        except ValueError as err:
            log.warning("ignoring a peer state that does not fit this model: %s", err)
            return False
        log.info("adopted peer state: round %d, θ hash %s", peer_round, self.outer.theta_hash()[:12])
        return True

    def _sync_ranks(self) -> None:
        """Every rank takes the leader's θ and round (no-op for a single-process peer)."""
        if not self.node.distributed:
            return
        self.round = self.node.broadcast_int(self.round)
        self.node.broadcast_tensors(self.outer.params())

    def save(self) -> Path | None:
        """Checkpoint θ_r, the outer momentum, the inner AdamW state and the round (leader rank only)."""
        if self.checkpoint_dir is None or not self.node.is_leader:
            return None
        outer_tensors = {f"outer.{k}": v for k, v in self.outer.state_dict().items()}
        inner_tensors, inner_skeleton = flatten_state("inner", self.inner.state_dict())
        metadata = dict(fingerprint=self.fingerprint, round=self.round, inner=inner_skeleton, peer_key=self.peer_key)
        return save_checkpoint(self.checkpoint_dir, self.round, {**outer_tensors, **inner_tensors}, metadata)

    def _load_checkpoint(self, tensors: dict[str, torch.Tensor], metadata: dict) -> None:
        self.outer.load_state_dict({k[len("outer."):]: v for k, v in tensors.items() if k.startswith("outer.")})
        self.inner.load_state_dict(unflatten_state(metadata["inner"], tensors))
        self.round = int(metadata["round"])

    def shutdown(self) -> None:
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None


@dataclass(frozen=True)
class _Stats:
    steps: int
    tokens: int
    mean_loss: float | None
    seconds: float


# A peer refreshes its identity record every round; records of peers that left expire after this long.
IDENTITY_TTL_S = 600.0


def announce_run_identity(dht: hivemind.DHT, run_id: str, identity: dict[str, Any]) -> None:
    dht.store(f"{run_id}_identity", identity, expiration_time=get_dht_time() + IDENTITY_TTL_S,
              subkey=str(dht.peer_id))


def count_subkeys(dht: hivemind.DHT, key: str) -> int:
    """How many peers stored a (live) record under ``key``."""
    found = dht.get(key, latest=True)
    return len(found.value) if found is not None and isinstance(found.value, dict) else 0


def check_run_identity(dht: hivemind.DHT, run_id: str, identity: dict[str, Any]) -> None:
    """Announce this peer's run identity under the run id and fail fast if a live peer announced another.

    Peers of another fingerprint could never share an averaging group (different prefix), so without this check a
    misconfigured peer would wait for a group forever; here it stops at once and says which fields differ.
    """
    ours = str(dht.peer_id)
    found = dht.get(f"{run_id}_identity", latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    for peer, entry in entries.items():
        other = getattr(entry, "value", None)
        if peer == ours or not isinstance(other, dict):
            continue
        differing = sorted(k for k in set(identity) | set(other) if identity.get(k) != other.get(k))
        if differing:
            details = ", ".join(f"{k}: ours={identity.get(k)!r} theirs={other.get(k)!r}" for k in differing)
            raise RunMismatchError(f"peer {peer} of run {run_id!r} trains with different settings ({details})")
    announce_run_identity(dht, run_id, identity)  # only once we know we fit: a misfit must not block others
