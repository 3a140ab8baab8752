"""The miner: DiLoCo rounds on the chain's clock, and the round's pseudo-gradient published to validators.

Every round r (blocks [r·B, (r+1)·B) of the chain): train at most H inner steps on the windows assigned to this
hotkey for r, stopping early enough for the all-reduce to end by the round's last block; encode what the behaviour
contributes (honest: Δ, plus the codec's error feedback) once, commit to it with the hotkey and all-reduce exactly
those bytes with the other miners; take the outer step; publish the same bytes and commitment (a behaviour may
publish something else: validators then see that it is not what went into the all-reduce) for validators with a
permit to fetch; checkpoint. A miner that joins late or missed rounds skips to the chain's
round and re-syncs θ from peers first.

With ``--run.overlap`` (every neuron of the run alike) round r's all-reduce runs while round r+1 trains: training
goes on until just before the round's last block, and the call that trains round r+1 lands round r (its outer step
as soon as the average has landed, between two inner steps; its publication and report after that training, one
round later; the publication still names the θ round r trained from).

A multi-GPU miner runs under ``torchrun``: rank 0 (the leader) alone talks to the chain and hivemind; each round it
broadcasts (go, round, train-until, finish-by) to the other ranks, which train data-parallel in lockstep.

On failure: a failed all-reduce leaves θ_r (the engine re-syncs next round) and the round's contribution is still
published (validators score what reached the shared model: nothing, that round); SIGINT/SIGTERM stop the loop
between rounds or at the next inner-step chunk, the last checkpoint stays intact, and the publication server and
hivemind host are closed.

Besides ``ready``, ``round`` and ``stopped``, the miner emits ``progress`` (at most once a second while training),
``published`` (round, bytes of the published contribution) and ``served`` (round, the fetcher's hotkey): what its
dashboard shows.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict

from template.allreduce.contribution import Commitment
from template.base.behaviours import MinerBehaviour
from template.base.config import NeuronConfig
from template.base.neuron import NeuronContext, StopFlag
from template.base.telemetry import Telemetry
from template.p2p.identity import PeerDirectory
from template.p2p.keys import KeypairSigner
from template.p2p.publication import AuthDecision, PublicationServer, permit_holders
from template.training.diloco import DiLoCoPeer
from template.training.distributed import NodeGroup
from template.training.round import Progress, RoundOutcome

log = logging.getLogger(__name__)

# An unknown caller makes the miner re-read the metagraph, but not more often than this (seconds).
DIRECTORY_REFRESH_S = 1.0
PROGRESS_EVENT_S = 1.0  # at most one `progress` event per this many seconds


class Miner:
    """One miner node. ``ctx`` (chain, wallet, hivemind host) exists on the leader rank only."""

    def __init__(self, ctx: NeuronContext | None, config: NeuronConfig, behaviour: MinerBehaviour, *,
                 hotkey: str, node: NodeGroup, stop: StopFlag, device: str) -> None:
        self.ctx = ctx
        self.config = config
        self.behaviour = behaviour
        self.node = node
        self.stop = stop
        spec = config.run
        tokenizer, corpus = config.data.load(spec.seq_len, config.cache_dir if node.is_leader else None)
        self._round_end = self._progress_at = 0.0
        self._directory: PeerDirectory | None = None
        averaging = self.signer = None
        if ctx is not None:
            self._directory, self._directory_at = ctx.settled_directory(), time.monotonic()
            averaging = ctx.averaging_config(len(self._directory))
            self.signer = KeypairSigner(ctx.wallet.hotkey)  # the hotkey commits to every contribution
        self.peer = DiLoCoPeer(
            spec, corpus, tokenizer.vocab_size, peer_key=hotkey, dht=ctx.dht if ctx else None,
            averaging=averaging, device=device, node=node, on_progress=self._progress,
            checkpoint_dir=config.state_dir / "checkpoints",  # every rank reads it at start; the leader alone writes it
            codec=config.codec(), signer=self.signer, scope=f"netuid{config.chain.netuid}",
            faults=behaviour.allreduce_faults,
        )
        self.layout = [(name, tuple(p.shape)) for name, p in self.peer.model.named_parameters()]
        self.server = self.p2p = None
        self.telemetry = Telemetry(None)
        if ctx is not None:
            self._permit_holders = permit_holders(lambda: self._directory)
            self.p2p = ctx.runner.run(ctx.dht.replicate_p2p())
            self.server = PublicationServer(self.p2p, netuid=ctx.netuid, wallet=ctx.wallet, authorize=self._authorize,
                                            on_served=lambda r, hotkey: ctx.emit("served", round=r, hotkey=hotkey))
            ctx.runner.run(self.server.start())
            self.telemetry = Telemetry.open(config.wandb, role="miner", name=f"miner-uid{ctx.uid}",
                                            directory=ctx.state_dir, config=dict(asdict(spec), uid=ctx.uid,
                                                                                 hotkey=ctx.hotkey,
                                                                                 behaviour=behaviour.name))

    def run(self) -> int:
        """Rounds until stopped or ``--neuron.max_rounds``; returns how many rounds ran."""
        wait_s = self.ctx.join_for_state(self._directory) if self.ctx is not None else 0.0  # other ranks: no DHT
        source = self.peer.restore(peer_timeout_s=wait_s)  # every rank: the leader's state reaches all of them
        target = 0
        if self.ctx is not None:
            now = self.ctx.clock.now()
            log.info("miner uid %d (%s, behaviour %s, %d rank(s)) ready: state from %s; chain round %d",
                     self.ctx.uid, self.ctx.hotkey, self.behaviour.name, self.node.world, source, now.round)
            self.ctx.emit("ready", uid=self.ctx.uid, hotkey=self.ctx.hotkey, restored=source, chain_round=now.round,
                          peer_id=str(self.ctx.dht.peer_id), ranks=self.node.world)
            target = now.round + 1  # start at a round boundary, with the whole round ahead
        done = 0
        max_rounds = self.config.neuron.max_rounds
        while True:
            decision = self._next_round(target, done, max_rounds)
            go, round, train_until_ms, finish_by_ms = self.node.broadcast_ints(decision)
            if not go:
                break
            plan = self.peer.plan(round, train_until=train_until_ms / 1000, finish_by=finish_by_ms / 1000)
            # with --run.overlap, the outcome of the round before (None after the first): its all-reduce ran while
            # this round trained
            self._finish(self.peer.run_round(self.behaviour.plan(plan), self.behaviour.contribution))
            target = round + 1
            done += 1
        # overlap: the last round's all-reduce is due by its deadline; SIGINT/SIGTERM give it up, the end of
        # --neuron.max_rounds and SIGUSR1 (stop after the round in progress) land it. The leader decides for all.
        finish = not self.stop.is_set() or self.stop.finish_round
        if self.node.broadcast_int(int(self.peer.spec.overlap and finish)):
            self._finish(self.peer.land_last_round())
        return done

    def _finish(self, outcome: RoundOutcome | None) -> None:
        """After a round landed: the behaviour sees it, the leader publishes it and reports it."""
        if outcome is None:
            return
        self.behaviour.after_round(outcome)
        if self.ctx is not None:
            self._publish(outcome)
            self._refresh_directory()  # who may fetch, and who to average with, as of this round
            self.ctx.join_peers(self._directory)
            self._report(outcome)

    def _next_round(self, target: int, done: int, max_rounds: int) -> list[int]:
        """Leader: wait for round ``target`` and say when to stop training and finish; others: placeholders."""
        if self.ctx is None:
            return [0, 0, 0, 0]
        if self.stop.is_set() or (max_rounds and done >= max_rounds):
            return [0, 0, 0, 0]
        clock = self.ctx.clock
        now = clock.wait_for_round(target, self.stop, clock.round_timeout_s)
        if now is None:
            return [0, 0, 0, 0]
        self._round_end = now.round_end
        train_until, finish_by = clock.phases(now, self.peer.averaging_config.matchmaking_time)
        return [1, now.round, int(train_until * 1000), int(finish_by * 1000)]

    def _refresh_directory(self) -> None:
        self._directory = self.ctx.directory()
        self._directory_at = time.monotonic()

    def _authorize(self, peer_id: str) -> AuthDecision:
        """Validator-permit holders only. A caller we do not know yet (a validator that started after our last
        metagraph sync) triggers one fresh sync, at most every ``DIRECTORY_REFRESH_S`` seconds."""
        decision = self._permit_holders(peer_id)
        if not decision.allowed and time.monotonic() - self._directory_at > DIRECTORY_REFRESH_S:
            self._refresh_directory()
            decision = self._permit_holders(peer_id)
        return decision

    def _publish(self, outcome: RoundOutcome) -> None:
        """Publish exactly the bytes this miner contributed, with its commitment (or, when the behaviour says so,
        other tensors under a commitment of their own: validators then see they are not what was contributed)."""
        contribution, commitment = outcome.contribution, outcome.commitment
        if contribution is None or commitment is None:
            return
        owned = outcome.averaging.inputs if outcome.averaging is not None else None
        if owned is not None:  # what it averaged as an owner, for validators to recompute (owner_inputs.py)
            self.server.keep_inputs(outcome.round, *owned.to_wire(self.ctx.netuid, outcome.round))
        other = self.behaviour.publication(outcome)
        if other is not None:
            contribution = self.peer.encode(other)
            commitment = Commitment.sign(self.signer, commitment.scope, commitment.round, contribution)
        report = outcome.report
        self.server.publish(
            round=report.round, base_theta_hash=report.base_theta_hash, tokens=report.tokens,
            inner_steps=report.inner_steps, loss=report.train_loss if report.train_loss is not None else 0.0,
            layout=self.layout, codec=contribution.codec, commitment=commitment.to_wire(),
            segments=contribution.segments, block=self.ctx.chain.block(),
        )
        self.ctx.emit("published", round=report.round, bytes=contribution.nbytes)

    def _progress(self, progress: Progress) -> None:
        loss = "-" if progress.loss is None else f"{progress.loss:.3f}"
        left = max(0.0, self._round_end - time.time())
        peers = len(self._directory) if self._directory is not None else 0
        print(f"\r\033[Kround {progress.round} step {progress.step}/{progress.of_steps} loss {loss} "
              f"{progress.tokens_per_s:.0f} tok/s, round ends in {left:.0f}s, peers {peers}",
              end="", file=sys.stderr, flush=True)
        if self.ctx is not None and time.monotonic() - self._progress_at >= PROGRESS_EVENT_S:
            self._progress_at = time.monotonic()
            self.ctx.emit("progress", **asdict(progress))

    def _report(self, outcome: RoundOutcome) -> None:
        report = outcome.report
        fields = asdict(report)
        self.ctx.emit("round", uid=self.ctx.uid, behaviour=self.behaviour.name, **fields)
        self.telemetry.log(fields, step=report.round)
        print("\r\033[K" + (f"round {report.round}: steps {report.inner_steps}, loss {report.train_loss}, "
                            f"held-out {report.heldout_loss}, all-reduce {'ok' if report.allreduce_ok else 'FAILED'} "
                            f"(group {report.group_size}, {report.allreduce_s:.1f}s"
                            + (f", {report.segments_refuted} segments dropped: wrong average" if report.segments_refuted
                               else "") + f"), θ {report.theta_hash[:12]}"),
              file=sys.stderr, flush=True)
        log.info("round report %s", fields)

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.runner.run_on_close(self.server.stop(), "the publication server")
            self.ctx.runner.run_on_close(self.p2p.shutdown(), "the P2P replica")
        self.telemetry.close()
        self.peer.shutdown()
