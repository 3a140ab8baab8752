"""The miner: DiLoCo rounds on the chain's clock, and the round's pseudo-gradient published to validators.

Every round r (blocks [r·B, (r+1)·B) of the chain): train at most H inner steps on the windows assigned to this
hotkey for r, stopping early enough for the all-reduce to end by the round's last block; all-reduce with the other
miners; take the outer step; publish what the behaviour says (honest: the Δ contributed) signed by the hotkey,
for validators with a permit to fetch; checkpoint. A miner that joins late or missed rounds skips to the chain's
round and re-syncs θ from peers first.

On failure: a failed all-reduce leaves θ_r (the engine re-syncs next round) and the round's Δ is still published
(validators score what the miner did); SIGINT/SIGTERM stop the loop between rounds or at the next inner-step chunk,
the last checkpoint stays intact, and the publication server and hivemind host are closed.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import asdict

from template.base.behaviours import MinerBehaviour
from template.base.neuron import NeuronContext, RoundClock
from template.p2p.identity import PeerDirectory
from template.p2p.publication import AuthDecision, PublicationServer, permit_holders
from template.training.cli import averaging_config_from, run_spec_from
from template.training.data import build_corpus, load_tokenizer
from template.training.diloco import DiLoCoPeer, Progress, RoundReport

log = logging.getLogger(__name__)

# Seconds past a round's last block that a late all-reduce may still use before the next round starts.
ALLREDUCE_GRACE_S = 2.0
# An unknown caller makes the miner re-read the metagraph, but not more often than this (seconds).
DIRECTORY_REFRESH_S = 1.0


class Miner:
    def __init__(self, ctx: NeuronContext, args: argparse.Namespace, behaviour: MinerBehaviour) -> None:
        self.ctx = ctx
        self.args = args
        self.behaviour = behaviour
        self.clock = RoundClock(ctx.chain, args.neuron_blocks_per_round)
        spec = run_spec_from(args)
        tokenizer = load_tokenizer(args.run_tokenizer)
        corpus = build_corpus(args.run_data, tokenizer, spec.seq_len, text_column=args.run_text_column,
                              max_tokens=args.run_max_tokens, cache_dir=ctx.state_dir / "cache")
        self._directory: PeerDirectory = ctx.directory()
        self._directory_at = time.monotonic()
        expected_peers = max(2, sum(1 for record in self._directory if not record.validator_permit))
        averaging = averaging_config_from(args, expected_peers)
        self.peer = DiLoCoPeer(
            spec, corpus, tokenizer.vocab_size, peer_key=ctx.hotkey, dht=ctx.dht, averaging=averaging,
            device=args.neuron_device, checkpoint_dir=ctx.state_dir / "checkpoints", on_progress=self._progress,
        )
        behaviour.configure(self.peer)
        self.names = [name for name, _ in self.peer.model.named_parameters()]
        self._round_end = 0.0
        self._permit_holders = permit_holders(lambda: self._directory)
        self.p2p = ctx.runner.run(ctx.dht.replicate_p2p())
        self.server = PublicationServer(self.p2p, netuid=ctx.chain_args.netuid, wallet=ctx.wallet,
                                        authorize=self._authorize)
        ctx.runner.run(self.server.start())

    def run(self) -> int:
        """Rounds until stopped or ``--neuron.max_rounds``; returns how many rounds ran."""
        self.ctx.join_peers(self._directory)
        source = self.peer.restore(peer_timeout_s=5.0)
        now = self.clock.now()
        log.info("miner uid %d (%s, behaviour %s) ready: state from %s; chain round %d",
                 self.ctx.uid, self.ctx.hotkey, self.behaviour.name, source, now.round)
        self.ctx.emit("ready", uid=self.ctx.uid, hotkey=self.ctx.hotkey, restored=source, chain_round=now.round,
                      peer_id=str(self.ctx.dht.peer_id))
        target = now.round + 1  # start at a round boundary, with the whole round ahead
        done = 0
        max_rounds = self.args.neuron_max_rounds
        while not self.ctx.stop.is_set() and (max_rounds == 0 or done < max_rounds):
            round_timeout = 4 * self.clock.blocks_per_round * self.clock.seconds_per_block + 60
            now = self.clock.wait_for_round(target, self.ctx.stop, round_timeout)
            if now is None:
                break
            self.peer.skip_to(now.round)
            self._round_end = now.round_end
            budget = self.peer.averaging_config.matchmaking_time + ALLREDUCE_GRACE_S
            report = self.peer.run_round(train_until=now.round_end - budget,
                                         finish_by=now.round_end + ALLREDUCE_GRACE_S)
            self._publish(report, now.block)
            self._refresh_directory()  # who may fetch, and who to average with, as of this round
            self.ctx.join_peers(self._directory)
            self._report(report)
            target = now.round + 1
            done += 1
        return done

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

    def _publish(self, report: RoundReport, block: int) -> None:
        delta = self.peer.last_delta
        if delta is None:
            return
        tensors = self.behaviour.submission(report.round, delta, self.peer.last_averaged)
        self.server.publish(
            round=report.round, base_theta_hash=report.base_theta_hash, tokens=report.tokens,
            inner_steps=report.inner_steps, loss=report.train_loss if report.train_loss is not None else 0.0,
            named_tensors=dict(zip(self.names, tensors, strict=True)), codec="fp16", block=block,
        )

    def _progress(self, progress: Progress) -> None:
        loss = "-" if progress.loss is None else f"{progress.loss:.3f}"
        left = max(0.0, self._round_end - time.time())
        print(f"\r\033[Kround {progress.round} step {progress.step}/{progress.of_steps} loss {loss} "
              f"{progress.tokens_per_s:.0f} tok/s, round ends in {left:.0f}s, peers {len(self._directory)}",
              end="", file=sys.stderr, flush=True)

    def _report(self, report: RoundReport) -> None:
        fields = asdict(report)
        self.ctx.emit("round", uid=self.ctx.uid, behaviour=self.behaviour.name, **fields)
        print("\r\033[K" + (f"round {report.round}: steps {report.inner_steps}, loss {report.train_loss}, "
                            f"held-out {report.heldout_loss}, all-reduce {'ok' if report.allreduce_ok else 'FAILED'} "
                            f"(group {report.group_size}, {report.allreduce_s:.1f}s), θ {report.theta_hash[:12]}"),
              file=sys.stderr, flush=True)
        log.info("round report %s", fields)

    def close(self) -> None:
        self.ctx.runner.run(self.server.stop())
        self.ctx.runner.run(self.p2p.shutdown())
        self.peer.shutdown()
