"""The validator: keeps θ in sync, scores every miner's published pseudo-gradient, sets weights on chain.

Each chain round r (blocks [r·B, (r+1)·B)):

1. score round r−1: fetch the miners' signed publications of r−1 over the permit-only RPC; check that each is exactly
   the contribution its miner committed to the all-reduce, and audit the all-reduce itself against them
   (:mod:`template.base.audit`: refusals without proof, conflicting certificates, every averaged segment recomputed);
   hand the verified contributions with θ_{r−1}, Δ̄_{r−1}, Δ̄_{r−2} (free for every miner of round r−1) and each
   miner's coverage and token share in that all-reduce to the :class:`~template.validation.round.RoundScorer`
   (integrity, copies, replays, the credit beyond the best free update); a miner convicted by the audit or whose
   publication is not its contribution scores 0 with the reason; fold the round into the
   :class:`~template.validation.rewards.ScoreBook` and save it (a round the validator's own all-reduce failed in, or
   scored without Δ̄_{r−2} — the first after a start, or after such a round — is reported but paid to nobody:
   :func:`why_unpaid`);
2. set weights from the book (``SetWeights`` with ``template.spec_version`` as the version key) every
   ``--validator.weights_every`` rounds;
3. join round r's all-reduce as an auxiliary peer (no contribution) and apply the outer step, so the validator holds
   θ_{r+1} like the miners; keep θ_r for step 1 of the next round.

Scoring must end before the miners' all-reduce of round r begins (the validator takes part in it): miners not scored
by then are scored first in a later round (the book's rotation).

With ``--run.overlap`` round r's all-reduce runs while round r+1 trains and lands at the end of its training, when
the miners publish round r: the validator scores round r during round r+2, against the θ round r's average was
applied to (G_r: round r−1's step taken), with the same arithmetic as blocking — G_r − Δ against G_r and its free
updates. Publications still name the θ round r trained from (G_{r−1}). docs/validation.md, "Overlap".

On failure: a miner that cannot be fetched (refused, timed out, not published) scores 0 for the round; a failed
all-reduce makes the validator re-sync θ from peers next round, judge that round without Δ̄ and participation and pay
nobody for it (nobody is penalized for what the validator could not see, nobody paid for what it could not check);
a refused ``SetWeights`` (rate limit, chain error) is
logged and tried again next round. The score book and the replay history are written atomically after every scored
round and read back on start, so a validator killed and restarted keeps its scores.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import bittensor as bt
import torch

import template
from template.allreduce.averager import AveragingResult
from template.allreduce.contribution import Commitment, ContributionError
from template.allreduce.owner_inputs import verified_inputs
from template.allreduce.reduction import lower_median
from template.base.audit import audit_allreduce, owners_to_ask, read_publication
from template.base.neuron import NeuronContext
from template.base.telemetry import Telemetry
from template.p2p.identity import PeerDirectory
from template.p2p.publication import (
    FetchError,
    NotFoundError,
    ProtocolError,
    Publication,
    fetch_owner_inputs,
    fetch_publication,
)
from template.protocol import PROTOCOL_VERSION, FetchKind, FetchRequest
from template.training.diloco import DiLoCoPeer
from template.training.round import RoundOutcome
from template.validation.integrity import IntegrityConfig
from template.validation.rewards import ScoreBook
from template.validation.round import Candidate, RoundContext, RoundScorer, Verdict
from template.validation.scoring import LossProbe, ScoringConfig, WindowSampler

log = logging.getLogger(__name__)

SCORING_MARGIN_S = 1.0  # stop scoring this long before the round's all-reduce matchmaking starts
FETCH_RETRY_S = 2.0  # a miner that has not published yet is asked again after this long (its rate limit!)


@dataclass
class PendingRound:
    """Round r as the validator lived it, kept until it is scored during round r+1 (overlap: r+2)."""

    round: int
    theta: list[torch.Tensor]  # the θ round r's average was applied to: θ_r (overlap: G_r, round r−1's step taken)
    theta_hash: str  # the θ round r trained from, which every publication of the round names: θ_r (overlap: G_{r−1})
    averaged: list[torch.Tensor] | None
    result: AveragingResult | None
    directory: PeerDirectory

    @classmethod
    def of(cls, outcome: RoundOutcome, directory: PeerDirectory) -> PendingRound:
        """What the validator keeps of its (auxiliary) round: θ_r, Δ̄ when it took the outer step with it, and the
        all-reduce as it saw it (audited even when the round was refused; coverage counts only when it succeeded)."""
        return cls(outcome.round, outcome.base, outcome.report.base_theta_hash, outcome.averaged,
                   outcome.averaging, directory)

    @property
    def applied(self) -> AveragingResult | None:
        """The all-reduce, when it succeeded for the validator (then its group and coverage are the round's)."""
        return self.result if self.averaged is not None else None


class Validator:
    def __init__(self, ctx: NeuronContext) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.settings = ctx.config.validator
        self.stop = ctx.stop
        spec = self.config.run
        tokenizer, corpus = self.config.data.load(spec.seq_len, self.config.cache_dir)
        self.directory = ctx.settled_directory()
        self.peer = DiLoCoPeer(spec, corpus, tokenizer.vocab_size, peer_key=ctx.hotkey, dht=ctx.dht,
                               averaging=ctx.averaging_config(len(self.directory), auxiliary=True),
                               device=self.config.neuron.device, checkpoint_dir=ctx.state_dir / "checkpoints",
                               codec=self.config.codec(), scope=f"netuid{ctx.netuid}")
        self.layout = [(name, tuple(p.shape)) for name, p in self.peer.model.named_parameters()]
        self.payload_bytes = self.peer.contribution_nbytes  # a contribution's exact size
        secret = load_or_create_secret(ctx.state_dir / "validator_secret.json")
        self.scorer = RoundScorer(
            LossProbe(self.peer.model, corpus, spec.batch_size, self.config.neuron.device),  # scratch: the round
            WindowSampler(self.peer.assignment, spec.inner_steps * spec.batch_size, secret),  # reloads θ each round
            [torch.Size(shape) for _, shape in self.layout],
            integrity=IntegrityConfig(), scoring=ScoringConfig(eval_windows=self.settings.eval_windows),
            sketch_seed=secret,
        )
        self.book_path = ctx.state_dir / "scores.json"
        self.history_path = ctx.state_dir / "sketches.safetensors"
        self.book = ScoreBook.load(self.book_path, self.settings.rewards)
        self.scorer.load_history(self.history_path)
        self.p2p = ctx.runner.run(ctx.dht.replicate_p2p())
        self.telemetry = Telemetry.open(self.config.wandb, role="validator", name=f"validator-uid{ctx.uid}",
                                        directory=ctx.state_dir,
                                        config=dict(dataclasses.asdict(spec), uid=ctx.uid, hotkey=ctx.hotkey))
        self.rounds_scored = 0
        self._audited = (0, 0)  # segments of the last scored round recomputed, and left unchecked

    # ------------------------------------------------------------------------------------------ the loop

    def run(self) -> int:
        """Rounds until stopped or ``--neuron.max_rounds``; returns how many rounds ran."""
        source = self.peer.restore(peer_timeout_s=self.ctx.join_for_state(self.directory))
        clock = self.ctx.clock
        now = clock.now()
        log.info("validator uid %d (%s) ready: state from %s, %d miners scored before, chain round %d",
                 self.ctx.uid, self.ctx.hotkey, source, len(self.book.miners), now.round)
        self.ctx.emit("ready", uid=self.ctx.uid, hotkey=self.ctx.hotkey, peer_id=str(self.ctx.dht.peer_id),
                      restored=source, chain_round=now.round, scores_restored=len(self.book.miners))
        target, done, pending, free_average = now.round + 1, 0, None, None
        max_rounds = self.config.neuron.max_rounds
        while not self.stop.is_set() and not (max_rounds and done >= max_rounds):
            now = clock.wait_for_round(target, self.stop, clock.round_timeout_s)
            if now is None:
                break
            train_until, finish_by = clock.phases(now, self.peer.averaging_config.matchmaking_time)
            if pending is not None:
                self._score(pending, free_average, scoring_deadline=train_until - SCORING_MARGIN_S)
            plan = self.peer.plan(now.round, train_until=train_until, finish_by=finish_by).auxiliary()
            outcome = self.peer.run_round(plan)  # --run.overlap: the round before's, landed (None: nothing was)
            # Δ̄ of the round just scored is free for every miner of the next one; θ and the rest are let go
            free_average = (pending.round, pending.averaged) if pending is not None else None
            pending = None
            if outcome is not None:
                pending, report = PendingRound.of(outcome, self.directory), outcome.report
                self.ctx.emit("synced", uid=self.ctx.uid, round=report.round, theta_hash=report.theta_hash,
                              heldout_loss=report.heldout_loss, allreduce_ok=report.allreduce_ok,
                              group_size=report.group_size, group_hotkeys=self._group_hotkeys(pending),
                              allreduce_s=report.allreduce_s, bytes_sent=report.bytes_sent)
            self.directory = self.ctx.directory()
            self.ctx.join_peers(self.directory)
            target, done = now.round + 1, done + 1
        return done

    # ------------------------------------------------------------------------------------------ scoring

    def _score(self, pending: PendingRound, free_average: tuple[int, list[torch.Tensor] | None] | None,
               scoring_deadline: float) -> None:
        """Score round r (``pending``); ``free_average`` is (r', Δ̄_{r'}) of the round the validator scored before,
        which every miner held for free in round r when r' = r − 1."""
        started = time.monotonic()
        directory = self.ctx.directory()  # miners registered now, with their PeerIDs
        # Every other neuron with a PeerID: a permit is no sign of a validator (miners that earn emission gain stake
        # and, on a small subnet, a permit); a validator publishes nothing and so scores 0.
        miners = {r.hotkey: r for r in directory if r.hotkey != self.ctx.hotkey}
        chosen = self.book.choose(miners, pending.round, self.settings.max_miners)
        publications = self.ctx.runner.run(
            self._fetch_all([miners[h].peer_id for h in chosen], chosen, pending.round, scoring_deadline),
            timeout=max(scoring_deadline - time.time(), 0.0) + self.settings.fetch_timeout + 5,
        )
        fetch_s = time.monotonic() - started
        shapes = [torch.Size(shape) for _, shape in self.layout]
        contributed = self._contributed(pending)
        read = {hotkey: read_publication(fetched, self.peer.codec, shapes, self.peer.scope, contributed.get(hotkey))
                for hotkey, fetched in publications.items() if not isinstance(fetched, str)}
        accused, framed, unshown = self._audit(pending, read)
        coverage = self._coverage(pending, framed)
        share, tokens = self._share_of_average(pending), self._token_share(pending)
        block = self.ctx.chain.block()
        candidates, binding = [], set()
        for hotkey in chosen:
            fetched, uid = publications[hotkey], miners[hotkey].uid
            if isinstance(fetched, str):
                candidates.append(Candidate(hotkey, uid, None, fetch_error=fetched, coverage=coverage.get(hotkey)))
                continue
            if refused := accused.get(hotkey) or read[hotkey].reason:
                binding.add(hotkey)  # proven from what it signed: not a timeout or a fetch that failed
                candidates.append(Candidate(hotkey, uid, None, refused=refused, coverage=coverage.get(hotkey)))
                continue
            if hotkey in unshown:  # an owner that does not show what it averaged earns nothing for the round
                candidates.append(Candidate(hotkey, uid, None, refused=f"did not show the inputs of {unshown[hotkey]} "
                                            "segments it averaged as an owner", coverage=coverage.get(hotkey)))
                continue
            candidates.append(Candidate(hotkey, uid, read[hotkey].tensors, fetched.meta.base_theta_hash,
                                        fetched.meta.published_at_block, coverage=coverage.get(hotkey),
                                        share_of_average=share.get(hotkey, 0.0),
                                        token_share=tokens.get(hotkey, 0.0) if tokens else None))
        free = free_average[1] if free_average is not None and free_average[0] == pending.round - 1 else None
        context = RoundContext(pending.round, pending.theta, pending.theta_hash, pending.averaged,
                               first_block=pending.round * self.ctx.clock.blocks_per_round, last_block=block,
                               previous_average=free, contributors=sum(1 for w in share.values() if w > 0))
        verdicts = self.scorer.score(context, candidates, out_of_time=lambda: time.time() > scoring_deadline)
        unpaid = why_unpaid(pending, free)
        paid = not unpaid
        scores = {v.hotkey: v.quality if paid else 0.0 for v in verdicts}
        if paid:
            self.book.update(pending.round, scores, {v.hotkey: v.reason for v in verdicts},
                             forfeit=[v.hotkey for v in verdicts if v.forfeits])
        else:
            log.info("round %d is not paid: %s", pending.round, unpaid)
        self.book.forget_except(r.hotkey for r in directory)
        self.book.save(self.book_path)
        self.scorer.save_history(self.history_path)
        self.rounds_scored += 1
        fetched_bytes = {h: len(f.payload) for h, f in publications.items() if not isinstance(f, str)}
        self._report_scores(pending.round, verdicts, scores, binding, paid, time.monotonic() - started, fetch_s,
                            fetched_bytes)
        if self.rounds_scored % max(1, self.settings.weights_every) == 0:
            self._set_weights(pending.round, directory)

    async def _fetch_all(self, peer_ids: list[str], hotkeys: list[str], round: int,
                         deadline: float) -> dict[str, Publication | str]:
        """Every chosen miner's publication of ``round`` (or why not), fetched concurrently, polled until
        ``deadline`` while a miner has not published yet."""
        request = FetchRequest(version=PROTOCOL_VERSION, netuid=self.ctx.netuid, round=round)

        async def one(peer_id: str, hotkey: str) -> Publication | str:
            while True:
                try:
                    return await fetch_publication(self.p2p, peer_id, request, expected_hotkey=hotkey,
                                                   timeout=self.settings.fetch_timeout,
                                                   expected_layout=self.layout, max_bytes=self.payload_bytes)
                except NotFoundError as err:
                    if time.time() + FETCH_RETRY_S > deadline:
                        return f"not published ({err})"
                    await asyncio.sleep(FETCH_RETRY_S)
                except (FetchError, ProtocolError, ValueError) as err:
                    return f"{type(err).__name__}: {err}"

        results = await asyncio.gather(*(one(p, h) for p, h in zip(peer_ids, hotkeys, strict=True)))
        return dict(zip(hotkeys, results, strict=True))

    def _contributed(self, pending: PendingRound) -> dict[str, dict]:
        """hotkey → the commitment it gave round r's group (as the validator saw the group)."""
        result = pending.result
        if result is None:
            return {}
        return {record.hotkey: commitment for peer_id, commitment in result.commitments.items()
                if (record := pending.directory.get(peer_id)) is not None}

    def _audit(self, pending: PendingRound, read: dict) -> tuple[dict[str, str], dict[str, int], dict[str, int]]:
        """hotkey → why the round's all-reduce convicts it (:func:`template.base.audit.audit_allreduce`), hotkey →
        segments of it refused without proof, and hotkey → segments it owned whose inputs it did not show."""
        result = pending.result
        if result is None:
            return {}, {}, {}
        peers = {record.hotkey: peer_id for peer_id in result.group if (record := pending.directory.get(peer_id))}
        segments = {peers[hotkey]: r.segments for hotkey, r in read.items()
                    if r.tensors is not None and hotkey in peers}
        served = self._owners_inputs(pending, owners_to_ask(result, segments))
        outcome = audit_allreduce(result, segments, self.peer.codec, self.peer.scope, pending.round,
                                  self.peer.averaging_config.owner_rule, served)
        hotkeys = {peer_id: hotkey for hotkey, peer_id in peers.items()}
        self._audited = (outcome.segments_checked, outcome.segments_unchecked)
        accused = {hotkeys[peer]: f"convicted by the all-reduce: {why}" for peer, why in outcome.accused.items()
                   if peer in hotkeys}
        return accused, {hotkeys[peer]: count for peer, count in outcome.framed.items() if peer in hotkeys}, \
            {hotkeys[peer]: count for peer, count in outcome.unshown.items() if peer in hotkeys}

    def _owners_inputs(self, pending: PendingRound, owners: list[str]) -> dict[str, dict[int, bytes]]:
        """peer id → segment → bytes: what ``owners`` averaged in the pending round (fetched concurrently, bounded by
        the fetch timeout), each sender's bytes verified against the root it signed, whoever served them."""
        result = pending.result
        if not owners or result is None:
            return {}
        commitments = {}
        for peer_id, wire in result.commitments.items():
            with contextlib.suppress(ContributionError):
                commitments[peer_id] = Commitment.from_wire(wire)
        by_key = {c.key: c for c in commitments.values()}
        peer_of_key = {c.key: peer_id for peer_id, c in commitments.items()}
        request = FetchRequest(PROTOCOL_VERSION, self.ctx.netuid, pending.round, FetchKind.INPUTS)
        codec, members = self.peer.codec, list(result.group)
        segment_bytes = codec.encoded_size(codec.segment_values)

        async def one(owner: str):
            start, stop = result.evidence.ranges[members.index(owner)]
            try:
                return await fetch_owner_inputs(self.p2p, owner, request, timeout=self.settings.fetch_timeout,
                                                max_bytes=(stop - start) * segment_bytes * len(commitments))
            except (FetchError, ProtocolError, ValueError) as err:
                log.info("owner %s did not show the inputs it averaged in round %d: %s", owner, pending.round, err)
                return None

        async def every_owner() -> list:
            return await asyncio.gather(*(one(owner) for owner in owners))

        fetched = self.ctx.runner.run(every_owner(), timeout=self.settings.fetch_timeout + 5)
        served: dict[str, dict[int, bytes]] = {}
        for got in filter(None, fetched):
            for key, kept in verified_inputs(*got, by_key, segment_bytes).items():
                served.setdefault(peer_of_key[key], {}).update(kept)
        log.info("round %d: %d owners asked for the inputs they averaged, %d showed some", pending.round, len(owners),
                 sum(got is not None for got in fetched))
        return served

    def _coverage(self, pending: PendingRound, framed: dict[str, int]) -> dict[str, float]:
        """hotkey → the share of the round's averaged segments that include its contribution, counting the segments
        an owner refused without proof as included (only known when the validator's own all-reduce succeeded; a
        miner missing from the group then has coverage 0)."""
        result = pending.applied
        if result is None:
            return {}
        segments = len(result.evidence.segments) or 1
        coverage = {record.hotkey: 0.0 for record in pending.directory}
        for peer_id, fraction in result.coverage.items():
            if (record := pending.directory.get(peer_id)) is not None:
                coverage[record.hotkey] = min(1.0, fraction + framed.get(record.hotkey, 0) / segments)
        return coverage

    def _share_of_average(self, pending: PendingRound) -> dict[str, float]:
        """hotkey → its token weight / the group's total (how much of Δ̄ is its own)."""
        result = pending.applied
        total = sum(result.weights.values()) if result is not None else 0.0
        if result is None or total <= 0:
            return {}
        return {record.hotkey: weight / total for peer_id, weight in result.weights.items()
                if (record := pending.directory.get(peer_id)) is not None}

    def _token_share(self, pending: PendingRound) -> dict[str, float]:
        """hotkey → the tokens it announced to the group / the lower median of the positive announcements, at most 1
        (what a full assignment announces while most miners train theirs; one inflated announcement cannot lower the
        others' share); {} when the validator's all-reduce failed."""
        result = pending.applied
        positive = [w for w in result.weights.values() if w > 0] if result is not None else []
        if not positive:
            return {}
        full = lower_median(positive)
        return {record.hotkey: min(1.0, weight / full) for peer_id, weight in result.weights.items()
                if (record := pending.directory.get(peer_id)) is not None}

    def _group_hotkeys(self, pending: PendingRound) -> list[str]:
        if pending.applied is None:
            return []
        return sorted(r.hotkey for peer_id in pending.applied.group if (r := pending.directory.get(peer_id)))

    # ------------------------------------------------------------------------------------------ weights

    def _set_weights(self, round: int, directory: PeerDirectory) -> None:
        """Weights for the miners of ``directory`` (the book holds no one else: it forgets who left it)."""
        weights = self.book.weights({record.hotkey: record.uid for record in directory})
        block = self.ctx.chain.block()
        if not weights:
            log.info("no miner has a positive score yet: weights not set")
            self.ctx.emit("weights", round=round, block=block, ok=False, weights={}, error="no positive score")
            return
        try:
            self.ctx.chain.set_weights(self.ctx.wallet, weights, version_key=template.spec_version)
        except (bt.ChainError, ConnectionError, TimeoutError, OSError) as err:
            log.warning("set_weights refused at block %d: %s; trying again next round", block, err)
            self.ctx.emit("weights", round=round, block=block, ok=False, weights=_str_keys(weights), error=str(err))
            return
        self.book.last_weights_block = block
        self.book.save(self.book_path)
        log.info("weights set at block %d: %s", block, weights)
        self.ctx.emit("weights", round=round, block=block, ok=True, weights=_str_keys(weights), error="")
        print(f"weights set at block {block}: " + ", ".join(f"uid{u} {w:.3f}" for u, w in weights.items()),
              file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------------------------ reporting

    def _report_scores(self, round: int, verdicts: list[Verdict], scores: dict[str, float], binding: set[str],
                       paid: bool, seconds: float, fetch_s: float, fetched_bytes: dict[str, int]) -> None:
        """One ``scored`` event, wandb scalars and a log line per miner; ``binding`` are the miners whose reason
        rests on their own signatures (publication ≠ contribution, convicted by the all-reduce); ``fetched_bytes``
        the payload bytes fetched per miner (the codec's exact contribution size; 0 when the fetch failed)."""
        rows = []
        for v in verdicts:
            record = self.book.miners.get(v.hotkey)
            rows.append(dict(uid=v.uid, hotkey=v.hotkey, score=scores.get(v.hotkey, 0.0), quality=v.quality,
                             ema=record.ema if record else 0.0, reason=v.reason, binding=v.hotkey in binding,
                             coverage=v.coverage, share=v.share, norm=v.norm,
                             fetched_bytes=fetched_bytes.get(v.hotkey, 0),
                             gain=v.gains.gain if v.gains else None,
                             credit=v.gains.credit if v.gains else None,
                             credit_se=v.gains.credit_se if v.gains else None,
                             own_model_gain=v.gains.own_model_gain if v.gains else None,
                             own_model_se=v.gains.own_model_se if v.gains else None,
                             own_model_windows=v.gains.own_model_windows if v.gains else None))
        checked, unchecked = self._audited
        self.ctx.emit("scored", uid=self.ctx.uid, round=round, seconds=seconds, fetch_s=fetch_s, miners=rows,
                      paid=paid, free_scale=self.scorer.last_free_scale, segments_recomputed=checked,
                      segments_unchecked=unchecked)
        self.telemetry.log({f"score/uid{r['uid']}": r["score"] for r in rows}
                           | {f"ema/uid{r['uid']}": r["ema"] for r in rows} | {"scoring_s": seconds}, step=round)
        top = sorted(rows, key=lambda r: -r["ema"])[:5]
        print(f"round {round}: scored {len(rows)} miners in {seconds:.1f}s; top "
              + ", ".join(f"uid{r['uid']} {r['ema']:.2f}" for r in top), file=sys.stderr, flush=True)
        for r in rows:
            log.info("round %d uid %d: score %.4f ema %.3f %s", round, r["uid"], r["score"], r["ema"],
                     r["reason"] or "ok")

    def close(self) -> None:
        self.ctx.runner.run_on_close(self.p2p.shutdown(), "the P2P replica")
        self.telemetry.close()
        self.peer.shutdown()


def why_unpaid(pending: PendingRound, free: list[torch.Tensor] | None) -> str:
    """Why round r is judged (copies, convictions) and reported but paid to nobody, alike for everyone; "" when paid.

    - The validator's own all-reduce of round r failed: it did not see what each miner contributed, so it cannot
      check that a publication is what went into the average — a miner that publishes its honest Δ and contributes
      −Δ (``twofaced``) would be paid for it (measured: 8.4 % of the weight on the suite's network, from one such
      round). A failed round moved nobody's θ, so paying nobody for it is fair.
    - It does not hold Δ̄_{r−1} (its first round after a start, or the round after its all-reduce failed): it cannot
      tell what a miner re-published for free from what it trained.
    """
    if pending.applied is None:
        return f"the validator's own all-reduce of round {pending.round} failed: it cannot check what each miner " \
               "contributed"
    if free is None:
        return f"the validator does not hold Δ̄ of round {pending.round - 1}, which every miner had for free"
    return ""


def load_or_create_secret(path: Path) -> int:
    """The validator's private seed for window samples and sketches: random on first start, then kept, so that
    miners cannot predict what will be checked and a restart checks consistently."""
    if path.exists():
        try:
            return int(json.loads(path.read_text())["seed"])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"cannot read {path}: {err}; delete it to draw a new secret") from None
    seed = secrets.randbits(62)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"seed": seed}))
    return seed


def _str_keys(weights: dict[int, float]) -> dict[str, float]:
    return {str(uid): w for uid, w in weights.items()}
