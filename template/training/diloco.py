"""One DiLoCo peer: inner training, the pseudo-gradient all-reduce and the outer step, round after round.

A round reads like the pseudo-code of DESIGN.md §1 (:meth:`DiLoCoPeer.run_round`, one :class:`RoundPlan` in, one
:class:`RoundOutcome` out)::

    θ_local ← θ_r
    the plan's inner AdamW steps on its windows of round r
    Δ  = θ_r − θ_local
    c  = encode(Δ + β·e), e ← (Δ + β·e) − decode(c)               (once; e: the codec's error feedback, if any)
    Δ̄  = all-reduce(c, weight = tokens)                              (committed, checked; never a partial result)
    θ_{r+1} = OuterNesterov(θ_r, Δ̄)

With overlap (``RunSpec.overlap``, ``--overlap``) round r's all-reduce runs in the background while round r+1 trains.
Writing G_r for θ after the outer steps of rounds 0 … r−1 (the same on every peer, with the same outer momentum),
round r+1 starts while Δ̄_r is in flight, from each peer's own contribution c_r, shrunk by s (``outer.stand_in_scale``:
the fit of its last average on its last c), standing in for it (the *eager* update of Kale et al., 2025), and the
stand-in's error is corrected as soon as the average lands, between two inner steps (*on arrival*)::

    S = OuterNesterov(G_r, s·decode(c_r))  on copies (θ and momentum unchanged)    (G_0 for round 0)
    θ_local ← S; the plan's inner steps, and as soon as Δ̄_r has landed:
        G_{r+1} = OuterNesterov(G_r, Δ̄_r); θ_local += G_{r+1} − S;  Δ_{r+1} = G_{r+1} − θ_local at the end
    (landed after training: G_{r+1} as above and Δ_{r+1} = S − θ_local, the plain eager update)
    all-reduce(Δ_{r+1}) starts in the background

G — checkpointed, shared with joiners, compared by the group; a round's ``base`` (what publications name) is the G it
started from — stays bit-identical on every peer; only S and when the average landed are a peer's own. Why eager,
shrunk, plain SGD, corrected: docs/benchmarks.md §1a, §9. A peer that did not land the previous round (its all-reduce
failed, or it restarted with nothing in flight) re-syncs from live peers after its next round's training, when they
have settled the round before: their state is G with the round whose all-reduce they expect in flight, the same round
as its own. A crash loses the round in flight (the checkpoint holds G and the next).

What is guaranteed when things go wrong:

- The all-reduce fails (no group before the deadline, a peer died, a part missing): the outer step is skipped
  and θ_r kept; at the start of the next round the peer asks live peers for their state and adopts it if they
  completed the round it missed — so a peer that missed one round re-joins in lockstep instead of drifting, and
  when every peer missed it, all of them simply keep θ_r.
- The group succeeded but its members started from different θ_r (their base hashes disagree): the result is
  used only by the peers whose base is the token-weighted majority's; the others re-sync from peers.
- A peer with another model, vocabulary, data or run id fails fast at start (``RunMismatchError``), naming what
  differs; such peers never share an averaging group (the group prefix carries the run fingerprint).
- After every round the state (θ, outer momentum, inner AdamW state, error-feedback residual, round) is checkpointed
  atomically; a restarted peer resumes from it when no live peer is further along (a peer that starts from a live
  peer's state starts with an empty residual).
- The contribution c is encoded once, signed (a commitment to its Merkle root) and travels as exactly those bytes
  (:mod:`template.allreduce.contribution`); the outcome carries it, so a publication can be exactly what went in.

How a peer joins and re-syncs (identity record, ready barrier, state sharing) is :mod:`template.training.joining`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import hivemind
import torch
from torch.nn.parallel import DistributedDataParallel

from template.allreduce.averager import AveragingConfig, AveragingHandle, AveragingResult, PseudoGradientAverager
from template.allreduce.codecs import SegmentCodec, get_codec, with_feedback
from template.allreduce.contribution import (
    EncodedContribution,
    Signer,
    codec_descriptor,
    encode_contribution,
    encoded_sizes,
    shaped,
)
from template.allreduce.terms import AllReduceFaults
from template.training.checkpoint import (
    BackgroundCheckpoints,
    CheckpointError,
    load_latest_checkpoint,
    peer_snapshot,
    peer_state,
)
from template.training.data import DataAssignment, TokenCorpus
from template.training.distributed import NodeGroup
from template.training.inner import InnerTrainer, evaluate
from template.training.joining import (
    SharedState,
    announce_run_identity,
    check_run_identity,
    passed_by,
    wait_until_ready,
)
from template.training.model import build_model, place_model
from template.training.outer import OuterOptimizer, load_into, move_start, stand_in_scale
from template.training.round import Progress, RoundOutcome, RoundPlan, RoundReport, Tensors
from template.training.round_state import (
    Arrival,
    InFlight,
    Landing,
    Trained,
    allreduce_deadline,
    matchmaking_window,
    may_apply,
    pace,
    train_in_chunks,
)
from template.training.spec import RunMismatchError, RunSpec, fingerprint_of

__all__ = ["DiLoCoPeer", "Progress", "RoundOutcome", "RoundPlan", "RoundReport", "RunMismatchError", "RunSpec"]

log = logging.getLogger(__name__)

Contribute = Callable[[int, Tensors], Tensors]  # (round, Δ) -> what enters the all-reduce (a behaviour's choice)


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
        codec: SegmentCodec | None = None,
        signer: Signer | None = None,
        scope: str = "",
        faults: AllReduceFaults | None = None,
    ) -> None:
        """``codec`` encodes contributions (default: the averaging config's compression with default settings);
        ``signer`` signs them (a neuron's hotkey; default: a key made for this process); ``scope`` names where
        commitments count (a neuron passes its subnet; the run's prefix is always part of it); ``faults`` are an
        adversarial peer's all-reduce misbehaviours (tests and research only)."""
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
        self._checkpoints = BackgroundCheckpoints(self.checkpoint_dir) if self.checkpoint_dir is not None else None
        self.heldout_batches = heldout_batches
        self.on_progress = on_progress
        averaging = averaging or AveragingConfig()
        self.codec = codec or get_codec(averaging.compression)
        # every peer of the run encodes alike: the codec (with its settings) is part of the run's identity
        self.identity = dict(spec.identity(corpus, vocab_size), codec=codec_descriptor(self.codec))
        self.fingerprint = fingerprint_of(self.identity)
        self.assignment = DataAssignment(corpus.fingerprint, corpus.num_windows, spec.run_seed, spec.heldout_fraction)

        self.model = place_model(build_model(spec.model, vocab_size, spec.seq_len, init_seed=spec.init_seed), device)
        trained = DistributedDataParallel(self.model) if node.distributed else self.model
        self.inner = InnerTrainer(trained, spec.inner, self.device)
        self.outer = OuterOptimizer(self.model, spec.outer)
        self.state = SharedState(self.outer, self.fingerprint)
        self._resync_needed = False  # the last all-reduce failed: look for a peer that completed it
        self._in_flight: InFlight | None = None  # overlap: the round whose all-reduce runs while the next trains
        self._start: Tensors | None = None  # overlap: where the next round trains from, when it is not θ
        self._shapes = [p.shape for p in self.model.parameters()]
        numel = sum(p.numel() for p in self.model.parameters())
        # what the codec did not send yet (error feedback), added to the next contribution; empty for dense codecs
        self.residual = torch.zeros(numel if self.codec.error_feedback else 0, dtype=torch.float32)

        self.dht = dht
        # the run's peers, and only they, average together: the group prefix carries the run fingerprint
        self.averaging_config = replace(averaging, prefix=f"{spec.run_id}_{self.fingerprint}")
        self.scope = f"{scope}/{self.averaging_config.prefix}" if scope else self.averaging_config.prefix
        self.min_contributors = min(2, self.averaging_config.min_group_size)  # trainers a group needs to count
        self.averager: PseudoGradientAverager | None = None
        if node.is_leader:  # with a DHT (checked above)
            check_run_identity(dht, spec.run_id, self.identity)
            self.averager = PseudoGradientAverager(dht, self._shapes, self.averaging_config, codec=self.codec,
                                                   signer=signer, state_provider=self.state.snapshot, faults=faults)

    @property
    def round(self) -> int:
        """The round this peer is at: the next one it will run."""
        return self.state.round

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
        if self.averager is not None and self.state.adopt_from_peers(self.averager, peer_timeout_s, self.round):
            source = f"peer state round {self.round}"
            self.residual.zero_()  # what this peer had not sent belongs to the state it left behind
        self._sync_ranks()
        return source

    def wait_for_peers(self, count: int, timeout_s: float) -> int:
        """Say we are ready (state restored), then block until ``count`` peers of this run (us included) are, so
        that round 0 starts together; returns how many were seen (fewer only after ``timeout_s``)."""
        seen = 1
        if self.dht is not None:
            seen = wait_until_ready(self.dht, self.spec.run_id, self.round, count, timeout_s)
        return self.node.broadcast_int(seen)

    # ------------------------------------------------------------------------------------------ the round

    def plan(self, round: int | None = None, *, train_until: float | None = None,
             finish_by: float | None = None) -> RoundPlan:
        """The plain DiLoCo plan for ``round`` (default: the peer's next round): H steps on the assigned windows.

        ``train_until`` / ``finish_by`` are ``time.time()`` values (a chain-clocked neuron derives them from the
        round's last block); without them the round runs exactly H steps and the all-reduce gets matchmaking time +
        ``allreduce_timeout``.
        """
        round = self.round if round is None else round
        return RoundPlan(round, tuple(self.assigned_windows(round)), self.spec.inner_steps, train_until, finish_by)

    def run_round(self, plan: RoundPlan, contribute: Contribute | None = None) -> RoundOutcome | None:
        """Run ``plan`` (see the module docstring) and say what happened.

        ``contribute`` (default: Δ itself) chooses what enters the all-reduce — an attack on the contribution is a
        behaviour; whatever it returns is what gets encoded, committed and sent. A plan for a later round than the
        peer's moves the peer there (a chain-clocked neuron that missed rounds) and re-syncs θ from live peers first.
        If that re-sync adopts a state that is already past the plan's round, the plan is stale: nothing is trained
        and the outcome says so (plan the peer's new round next).

        With overlap (``spec.overlap``), the call that trains round r lands round r−1's all-reduce (which runs while
        round r trains: between two inner steps once it has finished, else after them), takes its outer step,
        starts round r's all-reduce in the background and returns round r−1's outcome — None when no round was in
        flight; :meth:`land_last_round` lands the last one.
        """
        if plan.round < self.round:
            raise ValueError(f"round {plan.round} is over: this peer is at round {self.round}")
        if plan.contributes == self.averaging_config.auxiliary and self.node.is_leader:
            role = "an auxiliary peer cannot contribute" if plan.contributes else "a contributor must contribute"
            raise ValueError(f"{role}: plan for round {plan.round}")
        round_started = time.monotonic()
        if plan.round > self.round:
            with self.state.changing():
                self.state.round = plan.round
            self._resync_needed = True
        if not self.spec.overlap:
            self._resync()
        if self._in_flight is not None and self._in_flight.trained.plan.round != self.round - 1:
            # its Δ̄ belongs on a θ this peer no longer holds (it skipped rounds)
            self._drop_in_flight(f"this peer moved to round {self.round}")
        if self.round != plan.round:
            return self._stale(plan, round_started)
        trained = self._train_round(plan, contribute)
        if not self.spec.overlap:
            trained, handle = self._begin(trained, trained.base_hash, after=None)
            result = None
            if handle is not None:
                deadline = allreduce_deadline(self.averaging_config, time.time(), plan.finish_by)
                result = self.averager.finish(handle, deadline,
                                              left_behind=lambda: passed_by(self.averager, plan.round))
            waited_s = time.monotonic() - trained.trained_at
            applied = self._apply(result, trained.base_hash)
            return self._land(trained, handle, result, applied, plan.round + 1, round_started, waited_s=waited_s)

        # With overlap a peer re-syncs after training, when the others have settled round r−1 and are about to land
        # it: at the start of the round they may not have yet (their state would be older than ours), and a peer that
        # re-synced then would miss every round it re-tried. Its round r contribution counts either way: the group
        # compares the θ the average lands on, not where each member started. A peer out of step lands round r−1
        # first: when its group applies that average onto the θ this peer holds (they all lost round r−2 alike), it
        # is in step again, and a state adopted now would throw away a round it took part in.
        leader, landing = self.node.is_leader, self._in_flight
        result, applied = None, (False, "")
        early = trained.landed
        if early is not None:  # round r−1 landed while round r trained
            result, applied = early.result, early.applied
            landing.landed_at_step = early.at_step
        landed_first = early is None and landing is not None and leader and self._resync_needed
        if landed_first:
            result = landing.result()
            applied = self._apply(result, trained.base_hash)
            self._resync_needed = not applied[0]
            if applied[0]:
                log.info("round %d landed on the θ this peer holds: in step again", landing.trained.plan.round)
        adopted = self._resync()
        if adopted_ahead := self.round > plan.round:  # the adopted state has round r−1's average in it already
            self._drop_in_flight(f"adopted a peer state of round {self.round}")
            landing = None
        # θ is hashed once per change (a pass over θ takes seconds for the 1b preset): training left it as the
        # round's base on the leader unless a re-sync replaced it (other ranks take the leader's θ when they sync)
        theta_hash = trained.base_hash if leader and not adopted else self.outer.theta_hash()
        if landing is not None and early is None and (adopted or not landed_first):
            result = landing.result()
            applied = self._apply(result, theta_hash)
        if applied[0]:
            theta_hash = self.outer.theta_hash()
        # round r's all-reduce starts once round r−1's outer step is taken: its group compares the θ that its
        # average will be applied to (a member that missed round r−1's step holds another and will not apply it)
        begun_at = time.time()
        trained, handle = self._begin(trained, theta_hash, after=result)
        pending = None if handle is None else self.averager.finish_in_background(
            handle, handle.deadline, lambda: passed_by(self.averager, plan.round, overlapped=True))
        self._in_flight = InFlight(trained, handle, pending, begun_at)
        own = trained.contribution
        if landing is None:
            outcome = None
            in_step = plan.round == 0 or adopted_ahead  # round 0: no round before it, every peer holds θ_0
            self._settle(plan.round + 1, in_step, evaluated_round=None, stand_in=own)
        else:
            outcome = self._land(landing.trained, landing.handle, result, applied, plan.round + 1, landing=landing,
                                 stand_in=own, theta_hash=theta_hash if leader else None)
        if handle is not None and plan.finish_by is None and landing is not None and early is None:
            self._in_flight.paced_s = pace(self.averager, handle, trained)  # free-running, after a late landing
        self._in_flight.round_s = time.monotonic() - round_started
        return outcome

    def _resync(self) -> bool:
        """When the last round was not applied here: adopt a live peer's state of this round or a later one. True
        when this peer (the leader) took one."""
        adopted = False
        if self._resync_needed and self.averager is not None:
            resync_timeout = self.averaging_config.matchmaking_time
            adopted = self.state.adopt_from_peers(self.averager, resync_timeout, self.round)
            self._resync_needed = not adopted
            if adopted:
                self._start = None  # a start point ahead of the θ left behind
        self._sync_ranks()
        return adopted

    def land_last_round(self) -> RoundOutcome | None:
        """Overlap only: wait for the last round's all-reduce, take its outer step and return its outcome (None
        when nothing is in flight). Call it before reading the final θ or stopping."""
        landing, self._in_flight = self._in_flight, None
        if landing is None:
            return None
        result = landing.result()
        applied = self._apply(result, self.outer.theta_hash())
        return self._land(landing.trained, landing.handle, result, applied, self.round, landing=landing)

    def _train_round(self, plan: RoundPlan, contribute: Contribute | None) -> Trained:
        """θ_local ← θ, the plan's inner steps, then (leader) Δ and its encoding: everything but the all-reduce."""
        r = plan.round
        start = self._start
        if start is None:
            self.outer.load_into(self.model)  # θ_local ← θ
        else:
            load_into(self.model, start)  # θ_local ← the start point (overlap)
        base_hash = self.outer.theta_hash()
        log.info("round %d starts from θ %s", r, base_hash[:12])
        arrival = self._arrival(base_hash, start)
        stats = train_in_chunks(self.inner, self.node, self._rank_batches(list(plan.windows)), plan.max_steps,
                                plan.train_until, self.on_progress, r, arrival)
        landed = arrival.landed if arrival is not None else None
        if landed is not None and landed.applied[0]:
            start = None  # corrected: the round went on from G_r, and its Δ is measured from there
        trained_at = time.monotonic()
        delta = contribution = None
        if self.averager is not None:
            if plan.train_until is not None:
                # On a shared clock every peer starts matchmaking at the same moment, however early it finished
                # training (or had nothing to train: a validator): otherwise the early ones would form the round's
                # group among themselves and leave the others out.
                time.sleep(max(0.0, plan.train_until - time.time()))
            if plan.contributes:
                delta = self.outer.pseudo_gradient(self.model, start)
                contribution = self._encode(contribute(r, delta) if contribute is not None else delta)
        return Trained(plan, base_hash, None, stats, delta, contribution, trained_at, landed)

    def _arrival(self, base_hash: str, start: Tensors | None) -> Arrival | None:
        """Overlap: the all-reduce in flight, for :func:`train_in_chunks` to land while this round trains (None when
        nothing is in flight or the round trains from θ itself). A peer out of step lands it after training instead
        (``run_round``)."""
        landing = self._in_flight
        if landing is None or start is None:
            return None

        def ready() -> bool:
            return not self._resync_needed and landing.pending is not None and landing.pending.done()

        def land(steps: int) -> Landing:  # every rank: round r−1's outer step, then θ_local += G_r − S
            result = landing.result()
            applied = self._apply(result, base_hash)
            if self.node.broadcast_int(int(applied[0])):
                if self.node.distributed:
                    self.node.broadcast_tensors(self.outer.params())
                move_start(self.model, start, self.outer.params())
                log.info("round %d landed after %d inner steps: θ_local corrected", landing.trained.plan.round, steps)
            return Landing(steps, result, applied)

        return Arrival(ready, land)

    def _begin(self, trained: Trained, onto: str,
               after: AveragingResult | None) -> tuple[Trained, AveragingHandle | None]:
        """Commit to the round's contribution and start matchmaking (leader). ``onto`` is the hash of the θ the
        average will be applied to, which θ is now (the round's base without overlap; overlapped, the round before's
        step taken). A plan that does not contribute (a validator's) keeps a copy of it in the returned ``Trained``:
        the θ it scores the round against. ``after``: the round before's all-reduce (:func:`matchmaking_window`)."""
        if not trained.plan.contributes:
            trained = replace(trained, base=[t.clone() for t in self.outer.params()])
        if self.averager is None:
            return trained, None
        plan = trained.plan
        scheduled = time.time() + matchmaking_window(self.averaging_config, trained, self.spec.overlap, after)
        gather = dict(peer_key=self.peer_key, round=plan.round, base=trained.base_hash, onto=onto,
                      fingerprint=self.fingerprint, trained_s=round(trained.stats.seconds, 3))
        deadline = allreduce_deadline(self.averaging_config, scheduled, plan.finish_by)
        return trained, self.averager.begin(trained.contribution, trained.stats.tokens, gather, scheduled,
                                            deadline=deadline, scope=self.scope, round=plan.round)

    def _land(self, trained: Trained, handle: AveragingHandle | None, result: AveragingResult | None,
              applied: tuple[bool, str], next_round: int, round_started: float = 0.0, waited_s: float = 0.0,
              landing: InFlight | None = None, stand_in: EncodedContribution | None = None,
              theta_hash: str | None = None) -> RoundOutcome:
        """After the trained round's outer step was taken or not (``applied``: :meth:`_apply`), move the state to
        ``next_round`` and say what happened. Blocking: ``round_started`` times the round and ``waited_s`` its
        all-reduce; overlap: ``landing`` says when the all-reduce began, how long the call that trained the round took
        and how long it waited, ``stand_in`` (see :meth:`_settle`) is the contribution in flight; ``theta_hash``: θ's
        hash when the caller holds it (settling does not change the leader's θ)."""
        r = trained.plan.round
        if landing is None:
            allreduce_s = wait_s = waited_s
        else:
            finished_at = result.finished_at if result is not None and result.finished_at else time.time()
            allreduce_s = max(0.0, finished_at - landing.begun_at)
            wait_s = landing.waited_s
        took_step, reason = applied
        averaged = result.averaged if took_step and result is not None else None
        own = trained.contribution.decoded if stand_in is not None and trained.contribution is not None else None
        heldout = self._settle(next_round, took_step, evaluated_round=r, stand_in=stand_in,
                               scale=stand_in_scale(own, averaged))  # two passes over Δ: overlap only
        report = RoundReport(
            round=r, base_theta_hash=trained.base_hash, inner_steps=trained.stats.steps, tokens=trained.stats.tokens,
            train_loss=trained.stats.mean_loss, heldout_loss=heldout, allreduce_ok=took_step, reason=reason,
            group_size=result.group_size if result else 0, allreduce_s=allreduce_s,
            round_s=landing.round_s if landing is not None else time.monotonic() - round_started,
            inner_s=trained.stats.seconds, bytes_sent=result.bytes_sent if result else 0,
            theta_hash=theta_hash if theta_hash is not None else self.outer.theta_hash(), allreduce_wait_s=wait_s,
            segments_refuted=len(result.evidence.refuted()) if result else 0,
            landed_after_steps=landing.landed_at_step if landing is not None else None,
            paced_s=landing.paced_s if landing is not None else 0.0,
        )
        return RoundOutcome(report, trained.base, trained.delta, averaged, result, trained.contribution,
                            handle.commitment if handle is not None else None)

    def _settle(self, next_round: int, in_step: bool, evaluated_round: int | None,
                stand_in: EncodedContribution | None = None, scale: float = 1.0) -> float | None:
        """After an outer step was taken (``in_step``) or not: the state moves to ``next_round`` (after a failed
        round θ is kept, but the next round's data is new for everyone), a peer out of step re-syncs next round,
        θ reaches every rank and is checkpointed. Returns θ's held-out loss on ``evaluated_round``'s windows (None:
        not evaluated).

        With ``stand_in`` (overlap: the contribution whose average is in flight), the next round starts from θ
        stepped with ``scale`` × it instead of the average (the eager update, module docstring)."""
        with self.state.changing():
            self.state.round = next_round
        self._resync_needed = self.node.is_leader and not in_step
        if self.averager is not None and self.dht is not None:
            self.averager.set_state_priority(self.round if in_step else -1)  # joiners pick the newest state
            announce_run_identity(self.dht, self.spec.run_id, self.identity)  # keep our record alive
        self._start = None if stand_in is None else self.outer.lookahead(shaped(stand_in.decoded, self._shapes), scale)
        self._sync_ranks()
        self.outer.load_into(self.model)
        if not self.node.hashes_agree(list(self.model.parameters())):
            raise RuntimeError(f"round {next_round - 1}: the ranks of this node hold different parameters")
        evaluate = self.heldout_batches and evaluated_round is not None
        heldout = self.evaluate_heldout(evaluated_round) if evaluate else None
        self.save()
        return heldout

    def _drop_in_flight(self, why: str) -> None:
        """Give up the all-reduce in flight (overlap): its result is not applied."""
        dropped, self._in_flight = self._in_flight, None
        self._start = None
        if dropped is not None and dropped.handle is not None:
            log.info("dropping round %d's all-reduce in flight: %s", dropped.trained.plan.round, why)
            self.averager.cancel(dropped.handle)
            dropped.result()  # its buffers are free for the next round's contribution once it has returned

    def encode(self, tensors: Tensors) -> EncodedContribution:
        """``tensors`` encoded like a contribution, without error feedback: what a two-faced behaviour publishes."""
        return encode_contribution(self.codec, torch.cat([t.detach().reshape(-1) for t in tensors]).cpu())

    @property
    def feedback_norm(self) -> float | None:
        """The L2 norm of the error feedback this peer will add to its next contribution (None: its codec keeps
        none). Zero after adopting a peer's state: what it had not sent belongs to the state it left behind."""
        return float(self.residual.norm()) if self.residual.numel() else None

    @property
    def contribution_nbytes(self) -> int:
        """The exact byte size of every contribution (and publication) of this run."""
        return sum(encoded_sizes(self.codec, sum(p.numel() for p in self.model.parameters())))

    def _encode(self, tensors: Tensors) -> EncodedContribution:
        """Encode what enters the all-reduce, once; with error feedback, what the codec left out waits for the next
        round, fading by the codec's β (e ← (x + β·e) − decode(encode(x + β·e)))."""
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
        if self.residual.numel():
            flat = with_feedback(self.codec, flat, self.residual)
        contribution = self.averager.contribute(flat)
        if self.residual.numel():
            self.residual = flat - contribution.decoded
        return contribution

    def _stale(self, plan: RoundPlan, round_started: float) -> RoundOutcome:
        """The outcome of a plan overtaken by an adopted peer state: nothing trained, nothing averaged."""
        log.info(reason := f"adopted a peer state of round {self.round}: plan for round {plan.round} not run")
        report = RoundReport(plan.round, theta := self.outer.theta_hash(), 0, 0, None, None, False, reason, 0, 0.0,
                             time.monotonic() - round_started, 0.0, 0, theta)
        return RoundOutcome(report, None, None, None, None, None, None)

    def _apply(self, result: AveragingResult | None, current: str) -> tuple[bool, str]:
        """Take the outer step (leader) when :func:`may_apply` says so; returns its verdict."""
        if not self.node.is_leader:
            return False, ""
        verdict = may_apply(result, current, self.min_contributors)
        if verdict[0]:
            with self.state.changing():
                self.outer.step(result.averaged)
        return verdict

    def evaluate_heldout(self, round: int) -> float:
        """Loss of the model's current parameters on held-out windows (assigned to no peer)."""
        windows = self.assignment.heldout_windows(round, self.heldout_batches * self.spec.batch_size)
        return evaluate(self.model, self.corpus.batches(windows, self.spec.batch_size), self.device)

    # ------------------------------------------------------------------------------------------ helpers

    def _rank_batches(self, windows: list[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for input_ids, labels in self.corpus.batches(windows, self.spec.batch_size):
            yield self.node.split(input_ids), self.node.split(labels)

    def assigned_windows(self, round: int) -> list[int]:
        """The windows this peer must train on in ``round`` (what validators recompute)."""
        return self.assignment.assigned_windows(self.peer_key, round, self.spec.inner_steps * self.spec.batch_size)

    def _sync_ranks(self) -> None:
        """Every rank takes the leader's θ, round and start point (no-op for a single-process peer)."""
        if not self.node.distributed:
            return
        self.state.round = self.node.broadcast_int(self.round)
        self.node.broadcast_tensors(self.outer.params())
        if self.node.broadcast_int(int(self._start is not None)):
            if self._start is None:  # the leader's contribution is the node's: other ranks receive its start point
                self._start = [t.clone() for t in self.outer.params()]
            self.node.broadcast_tensors(self._start)
        else:
            self._start = None

    def save(self) -> None:
        """Checkpoint θ_r, outer momentum, inner AdamW state, error feedback and round (leader), in the background."""
        if self._checkpoints is None or not self.node.is_leader:
            return
        self._checkpoints.write(self.round, lambda: peer_snapshot(
            self.outer.state_dict(), self.inner.state_dict(), self.residual,
            dict(fingerprint=self.fingerprint, round=self.round, peer_key=self.peer_key)))

    def flush_checkpoint(self) -> None:
        """Wait for the checkpoint being written (if any); raise its CheckpointError if the write failed."""
        if self._checkpoints is not None:
            self._checkpoints.flush()

    def _load_checkpoint(self, tensors: dict[str, torch.Tensor], metadata: dict) -> None:
        state = peer_state(tensors, metadata)
        with self.state.changing():
            self.outer.load_state_dict(state.outer)
            self.inner.load_state_dict(state.inner)
            self.state.round = state.round
        if state.residual is not None and state.residual.shape == self.residual.shape:
            self.residual = state.residual

    def shutdown(self) -> None:
        """Stop the averager, giving up an all-reduce in flight; the checkpoint being written is finished first (a
        failure is logged: call :meth:`flush_checkpoint` before to have it raised)."""
        try:
            self.flush_checkpoint()
        except CheckpointError as err:
            log.error("the last checkpoint was not written: %s", err)
        if self._checkpoints is not None:
            self._checkpoints.close()
        self._drop_in_flight("stopping")  # its finish would otherwise keep a thread alive until its deadline
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None
        self.inner.model = self.model  # drops the node's DDP wrapper, which must be gone before close_node_group
