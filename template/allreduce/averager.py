"""Butterfly all-reduce of DiLoCo pseudo-gradients over hivemind, with checked contributions and identical results.

This module is the host-side facade: :class:`PseudoGradientAverager` (what the rest of the code uses), its
:class:`AveragingConfig`, and the :class:`AveragingResult` of a step.

Protocol (one all-reduce in one group, built on hivemind ``DecentralizedAverager`` matchmaking): the flat
vector of all tensors is cut into parts; each reducing peer *owns* a contiguous share of parts. Every
contributing peer streams its compressed parts to each owner together with its weight (tokens). Each owner drops
invalid contributions, clips outliers, takes the weighted mean of each part, compresses it **once** and sends
those same bytes to every peer of the group, so all peers that succeed hold **bit-identical** Δ̄ for every
codec. Auxiliary peers (validators) contribute nothing and receive exactly the same bytes as the contributors.
The parts live in their own modules, each readable alone:

- :mod:`template.allreduce.segment_reducer`: the owner's rule for one part (which contributions count, clipping,
  the weight cap, the weighted mean, compress once);
- :mod:`template.allreduce.runner`: the all-reduce of one group (streaming parts to owners, serving
  this peer's share, collecting the averaged parts, the report of who was included);
- :mod:`template.allreduce.averager_process`: the ``DecentralizedAverager`` subclass that runs in the averager
  process (matchmaking, rate limits on its handlers, partial results refused);
- this module: the host process side (starting and stopping the averager process, handing over tensors,
  deadlines, retries before an all-reduce starts, state downloads).

What is guaranteed when a peer disappears mid-round (SIGKILL, network loss, stall):

- Nobody waits past the caller's deadline: matchmaking is bounded by the step timeout, every stream by
  ``next_chunk_timeout`` (senders) / 2× that (reducers), the whole all-reduce by ``allreduce_timeout``, and
  :meth:`PseudoGradientAverager.finish` returns at its deadline at the latest (``ok=False``).
- A sender that stops sending is excluded from the parts it had not delivered yet; parts that it did deliver
  keep its contribution. Either way, the owner's bytes are the same for everyone.
- A peer whose result is missing *any* part reports ``ok=False`` and its averaging buffers are left untouched: a
  partial result is never returned as success, and no all-reduce is retried after it has started (a retry in a
  new group could give two "successful" peers different averages); a step that failed before any data moved (no
  group, the leader left) is retried within the deadline, and so is one whose group no member can complete (what it
  misses is the share of a member that answered it is not in the group — hivemind's leader counted in a follower
  that had left — and no groupmate held it).
- Every peer that reports ``ok=True`` for the same ``group_id`` holds byte-identical Δ̄. Peers of one group
  can still differ in ``ok`` (an owner died after serving some peers but not others): a peer with ``ok=False``
  must skip the outer step and re-sync its state (:meth:`PseudoGradientAverager.load_state_from_peers`).
- A peer that floods us with join requests or state downloads beyond its per-minute allowance is turned away
  (logged); the all-reduce handler serves members of a running group only.

Every peer of a run must use this code: its wire protocol differs from stock hivemind's (see
:mod:`template.allreduce.averager_process`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
from hivemind.averaging.control import AveragingStage, StepControl

from template.allreduce.averager_process import CheckedAverager, ContributionBuffer, StateProvider
from template.allreduce.codecs import CODEC_NAMES, SegmentCodec, get_codec
from template.allreduce.confirmation import confirm_shares
from template.allreduce.contribution import (
    Commitment,
    EncodedContribution,
    Signer,
    Verifier,
    codec_descriptor,
    encode_contribution,
    shaped,
    sign_statements,
)
from template.allreduce.disputes import counted_disputes, dispute_bytes
from template.allreduce.evidence import AllReduceEvidence, AllReduceReport
from template.allreduce.owner_inputs import OwnerInputs
from template.allreduce.reduction import OwnerRule
from template.allreduce.terms import AllReduceFaults, SegmentLayout
from template.p2p.dht import rejoin_connected_peers
from template.p2p.hivemind_compat import (
    cancel_step,
    declared_state_priorities,
    kill_if_alive,
    matchmaking_declarations,
)
from template.p2p.keys import ephemeral_signer, verify_signature

__all__ = ["AveragingConfig", "AveragingHandle", "AveragingResult", "PseudoGradientAverager", "StateProvider"]

logger = logging.getLogger(__name__)

GROUP_POLL_S = 0.02  # how often a pacing peer looks whether its group has formed (a read of shared memory)
LEFT_BEHIND_POLL_S = 1.0  # how often a peer late for its group asks whether it was left behind (a DHT read)


@dataclass
class AveragingConfig:
    """How peers find a group and how long each stage of the all-reduce may take (seconds, bytes)."""

    prefix: str = "diloco"  # peers average only with peers of the same prefix (one run = one prefix)
    # DiLoCo needs ONE group per round (every peer must apply the same average): keep target_group_size >= the
    # number of peers; hivemind splits larger populations into groups that would average separately.
    target_group_size: int = 64
    min_group_size: int = 2
    matchmaking_time: float = 5.0  # hivemind's min_matchmaking_time: how long a leader gathers followers
    request_timeout: float = 3.0  # one matchmaking request; must be < matchmaking_time
    allreduce_timeout: float = 60.0  # the whole all-reduce after the group is formed
    next_chunk_timeout: float = 10.0  # max silence of a sender (reducers get 2x) before it is dropped
    compression: str = "fp16"  # one of codecs.CODEC_NAMES; the codec itself is given to the averager
    confirmation_time: float = 3.0  # how long members wait for each other's confirmation after the all-reduce
    norm_clip_multiple: float | None = 3.0  # None or 0: no norm clipping (validation still applies)
    value_bound_multiple: float | None = 3.0  # None or 0: no bound on single values (reduction.OwnerRule)
    own_input_min_senders: int = 6  # from this many senders an owner averages without its own input; 0: never
    auxiliary: bool = False  # validators: contribute nothing, receive the average
    # per-peer allowances of the handlers anyone who reaches our host may call (a peer sends a few join requests
    # per round and downloads our state when it (re)joins; a flood beyond these is refused)
    max_join_requests_per_minute: int = 120
    max_state_downloads_per_minute: int = 30
    start_timeout: float = 30.0
    shutdown_timeout: float = 5.0

    def __post_init__(self) -> None:
        if "." in self.prefix or not self.prefix:
            raise ValueError("prefix must be a non-empty string without '.'")
        if self.compression not in CODEC_NAMES:
            raise ValueError(f"unknown compression {self.compression!r}: expected one of {', '.join(CODEC_NAMES)}")
        if self.min_group_size < 1 or self.target_group_size < self.min_group_size:
            raise ValueError("need 1 <= min_group_size <= target_group_size")
        for name in ("matchmaking_time", "request_timeout", "allreduce_timeout", "next_chunk_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0: an unset timeout lets a dead peer hang the round")
        if self.request_timeout >= self.matchmaking_time:
            raise ValueError("request_timeout must be < matchmaking_time (hivemind matchmaking can deadlock otherwise)")
        _ = self.owner_rule  # ValueError for a bound out of range
        if self.confirmation_time < 0:
            raise ValueError("confirmation_time must be >= 0")
        if self.max_join_requests_per_minute < 1 or self.max_state_downloads_per_minute < 1:
            raise ValueError("the per-peer allowances must be >= 1 per minute")

    @property
    def owner_rule(self) -> OwnerRule:
        """The bounds an owner applies to every contribution (and a validator's audit with it)."""
        return OwnerRule(self.norm_clip_multiple, self.value_bound_multiple, self.own_input_min_senders)


@dataclass
class AveragingResult:
    """What one peer saw of one all-reduce. ``averaged`` is set iff ``ok``; peers are base58 peer id strings."""

    ok: bool
    averaged: list[torch.Tensor] | None
    group: dict[str, Any]  # peer id -> the ``gather`` object that peer passed (validators included)
    group_size: int
    seconds: float
    bytes_sent: int  # payload bytes this peer sent during the all-reduce (parts + averaged parts it served)
    reason: str  # "" when ok, else why not
    bytes_received: int = 0
    weights: dict[str, float] = field(default_factory=dict)  # peer id -> announced weight (0 for auxiliaries)
    group_id: str = ""  # hex; peers with ok=True and the same group_id hold identical bytes
    commitments: dict[str, dict] = field(default_factory=dict)  # sender -> its signed commitment (wire form)
    evidence: AllReduceEvidence = field(default_factory=AllReduceEvidence)  # what this member saw (validators audit)
    inputs: OwnerInputs | None = None  # what it accepted as an owner: served to validators (template.p2p.publication)
    finished_at: float = 0.0  # time.time() when the all-reduce ended in the averager process (0: it never ran)
    abandoned_groups: list[str] = field(default_factory=list)  # hex ids of groups no member could complete (absent)

    @property
    def coverage(self) -> dict[str, float]:
        """Sender -> the fraction of the vector's segments whose average includes it."""
        return self.evidence.coverage()


@dataclass
class AveragingHandle:
    """A step whose matchmaking runs in the background until :meth:`PseudoGradientAverager.finish`."""

    control: StepControl
    weight: float
    gather: Any  # what goes to the group: weight, terms, commitment and the caller's data
    deadline: float
    commitment: Commitment | None
    scheduled: float  # time.time() by which the group forms with whoever has joined (it forms earlier when full)
    cancelled: bool = False  # given up by PseudoGradientAverager.cancel: never retried


class PseudoGradientAverager:
    """Average pseudo-gradients (lists of CPU float32 tensors) with a group of peers, weighted by tokens, each peer's
    contribution encoded once, committed and signed (:mod:`template.allreduce.contribution`).

    One step at a time: :meth:`contribute` encodes, :meth:`begin` commits and starts matchmaking, :meth:`finish`
    runs the all-reduce and the members' confirmation and returns by its deadline (:meth:`finish_in_background` does
    it while the caller goes on); :meth:`average` does all three.
    Nothing here knows about models, chains or validators: ``scope`` names the run, ``signer``/``verify`` the keys.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        shapes: Sequence[torch.Size],
        config: AveragingConfig,
        *,
        codec: SegmentCodec | None = None,
        signer: Signer | None = None,
        verify: Verifier = verify_signature,
        state_provider: StateProvider | None = None,
        faults: AllReduceFaults | None = None,
    ):
        """``codec`` defaults to ``config.compression`` with default settings; a contributing peer without a
        ``signer`` signs with a key made for this process (a neuron passes its hotkey)."""
        codec = codec or get_codec(config.compression)
        if signer is None and not config.auxiliary:
            signer = ephemeral_signer()
        self.config, self.codec, self.signer, self.verify, self.dht = config, codec, signer, verify, dht
        self.shapes = [torch.Size(shape) for shape in shapes]
        if not self.shapes or any(shape.numel() == 0 for shape in self.shapes):
            raise ValueError("shapes must be a non-empty list of non-empty shapes")
        if codec.name != config.compression:
            raise ValueError(f"the codec is {codec.name!r}, the configuration says {config.compression!r}")
        numel = sum(shape.numel() for shape in self.shapes)
        self.buffer = ContributionBuffer(SegmentLayout(numel, codec.segment_values), codec)
        self._output = torch.zeros(numel, dtype=torch.float32)
        # auxiliaries too: hivemind splits the vector among owners in proportion to the *total size of the averaged
        # tensors*, rounded; a 1-byte input on the auxiliary made it compute other segment ranges than the senders
        # (measured: 91 % of the average received, 2 owners "failed", with 13 segments and the dense codecs)
        self._input = torch.zeros(self.buffer.nbytes, dtype=torch.uint8)
        self._closed = False
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="allreduce-finish")
        self._averager = CheckedAverager(
            [self._output, self._input],  # hivemind moves them to shared memory: the child process reads/writes here
            dht,
            start=False,
            buffer=self.buffer,
            signer=signer,
            verify=verify,
            faults=faults or AllReduceFaults(),
            prefix=config.prefix,
            target_group_size=config.target_group_size,
            min_group_size=config.min_group_size,
            min_matchmaking_time=config.matchmaking_time,
            request_timeout=config.request_timeout,
            allreduce_timeout=config.allreduce_timeout,
            next_chunk_timeout=config.next_chunk_timeout,
            auxiliary=config.auxiliary,
            bandwidth=0.0 if config.auxiliary else None,  # auxiliaries own no share of the vector
            allow_state_sharing=state_provider is not None,
            shutdown_timeout=config.shutdown_timeout,
            owner_rule=config.owner_rule,
            state_provider=state_provider,
            max_join_requests_per_minute=config.max_join_requests_per_minute,
            max_state_downloads_per_minute=config.max_state_downloads_per_minute,
        )
        # members of a group must average the same thing: hivemind compares this hash at matchmaking; ours names the
        # vector's length and the codec (an auxiliary's byte buffer is a placeholder of another size)
        self._averager.schema_hash = hashlib.sha256(f"{numel}|{codec_descriptor(codec)}".encode()).digest()
        try:
            self._averager.run_in_background(await_ready=True, timeout=config.start_timeout)
        except BaseException:
            self.shutdown()
            raise

    @property
    def peer_id(self) -> str:
        return str(self._averager.peer_id)

    def contribute(self, tensors: Sequence[torch.Tensor] | torch.Tensor) -> EncodedContribution:
        """Encode this peer's tensors (or one flat vector) once, with the averager's codec."""
        flat = tensors if isinstance(tensors, torch.Tensor) else torch.cat([t.detach().reshape(-1) for t in tensors])
        if flat.numel() != self.buffer.layout.numel:
            raise ValueError(f"expected {self.buffer.layout.numel} values, got {flat.numel()}")
        return encode_contribution(self.codec, flat.cpu())

    def begin(
        self, contribution: EncodedContribution | Sequence[torch.Tensor] | None, weight: float, gather: Any,
        scheduled_time: float, deadline: float | None = None, *, scope: str = "", round: int = 0,
    ) -> AveragingHandle:
        """Commit to ``contribution`` (tensors are encoded here; None for auxiliaries), and start matchmaking now
        for an all-reduce at ``scheduled_time`` (time.time()).

        The signed commitment to (``scope``, ``round``, codec, root) and the segments with their signed statements
        are fixed here: what the all-reduce sends is exactly what was committed. ``weight`` (tokens) is announced to
        the group now and cannot change; auxiliaries' weight is ignored. ``gather`` must be msgpack-able; everyone in
        the group receives it. ``deadline`` (time.time()) bounds matchmaking; it defaults to ``scheduled_time +
        allreduce_timeout``.
        """
        self._check_open()
        auxiliary = self.config.auxiliary
        weight = 0.0 if auxiliary else float(weight)
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be finite and >= 0, got {weight}")
        if (contribution is None) != auxiliary:
            raise ValueError("auxiliaries contribute nothing; every other peer contributes")
        if deadline is None:
            deadline = scheduled_time + self.config.allreduce_timeout
        if not scheduled_time < deadline:
            raise ValueError("scheduled_time must be before the deadline")
        scope = scope or self.config.prefix
        commitment = None
        if contribution is not None and not isinstance(contribution, EncodedContribution):
            contribution = self.contribute(contribution)
        if contribution is not None:
            commitment = Commitment.sign(self.signer, scope, round, contribution)
            statements = sign_statements(self.signer, scope, round, contribution)
            if not self._with_buffers(deadline, self.buffer.write, self._input, contribution, statements):
                raise TimeoutError("the averaging buffers stayed locked by an earlier all-reduce")
        terms = dict(scope=scope, round=round, codec=codec_descriptor(self.codec))
        blob = dict(weight=weight, data=gather, terms=terms,
                    commitment=None if commitment is None else commitment.to_wire())
        control = self._step(weight, blob, scheduled_time, deadline, require_trigger=True)
        return AveragingHandle(control, weight, blob, deadline, commitment, scheduled_time)

    def _step(self, weight: float, blob: Any, scheduled_time: float, deadline: float, require_trigger: bool):
        # a DHT that dropped its groupmates from its routing table would look for the group alone (see the function)
        try:
            rejoin_connected_peers(self.dht)
        except OSError as err:  # a dead DHT process: the step fails on its own, with its own message
            logger.debug("could not ask the DHT to rejoin its peers: %r", err)
        # peers of one round only find each other: with overlap a peer that (re)joined looks for round r+1's group
        # while the others still gather round r's, and a mixed group refuses every segment across the rounds
        # (measured: "partial all-reduce: received 56.1 %" in every round after a rejoin, both sides)
        self._averager.set_group_bits(round_group_bits(blob["terms"]["round"]))
        return self._averager.step(
            gather=blob,
            weight=None if self.config.auxiliary else weight,
            scheduled_time=scheduled_time,
            timeout=max(deadline - time.time(), 1e-3),
            allow_retries=False,  # an all-reduce that started is never silently redone (module docstring)
            require_trigger=require_trigger,
            wait=False,
        )

    def finish(self, handle: AveragingHandle, deadline: float,
               left_behind: Callable[[], str | None] | None = None) -> AveragingResult:
        """Run the all-reduce that :meth:`begin` prepared, then the members' confirmation; return by ``deadline``.

        ``seconds`` of the result is the time spent in this call (waiting for the group, then the all-reduce).
        ``left_behind`` is asked every :data:`LEFT_BEHIND_POLL_S` while this peer still looks for a group after its
        scheduled time (+ ``request_timeout``); a reason it returns ends the wait. A peer whose round's group formed
        without it (it trained late) would otherwise look for that group until the deadline — a minute — and, when
        it re-syncs, arrive late again (measured: every round after a restart under CI's load). It is asked only
        after the scheduled time: a group that forms on time is never given up on, whatever a peer declares.
        """
        self._check_open()
        started = time.monotonic()
        deadline = min(deadline, handle.deadline)
        control = handle.control
        control.allow_allreduce()
        abandoned: list[str] = []
        while True:
            try:
                wait = max(deadline - time.time(), 0.0)
                outcome = control.result(timeout=wait if left_behind is None else min(wait, LEFT_BEHIND_POLL_S))
            except TimeoutError:
                why = None
                if time.time() < deadline and (why := self._left_behind(control, left_behind)) is None:
                    continue
                cancel_step(control)
                if why is not None:
                    return self._failure(started, f"gave up looking for a group: {why}")
                return self._failure(started, f"deadline passed (stage {control.stage.name})")
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # whatever the averager process set, CancelledError included
                why = f"{type(e).__name__}: {e}"
                if control.began_allreduce:
                    return self._failure(started, why)
            else:
                report: AllReduceReport = outcome["report"]
                if not report.lost_to_absent:
                    break
                why = report.failure
                abandoned.append(report.group_id.hex())
            # no group, the leader left, or no member can complete the group: look again within the deadline
            if (control := self._retry(handle, deadline, why)) is None:
                return self._failure(started, why)

        gathered, terms = outcome["gathered"], handle.gather["terms"]
        evidence = report.evidence
        confirmation = confirm_shares(
            self.dht, f"{self.config.prefix}_confirm_{report.group_id.hex()}", self.peer_id, evidence,
            report.group_id, gathered, terms, self.verify,
            until=min(deadline, time.time() + self.config.confirmation_time),
            disputes=self._signed_disputes(evidence, report.group_id, terms))
        evidence.conflicts, evidence.disputes = confirmation.conflicts, confirmation.disputes
        conflicts = list(evidence.conflicts)
        reason = report.failure or (f"owner(s) {conflicts} sent different members different signed shares: "
                                    "round refused by all" if conflicts else "")
        averaged: list[torch.Tensor] | None = None
        if not reason:
            flat: list[torch.Tensor] = []
            if self._with_buffers(deadline, lambda: flat.append(self._output.clone())):
                self._drop_disputed(flat[0], evidence)
                averaged = shaped(flat[0], self.shapes)
            else:
                reason = "the averaged result could not be read before the deadline"
        return AveragingResult(
            ok=not reason,
            averaged=averaged,
            group={peer: data.get("data") if isinstance(data, dict) else None for peer, data in gathered.items()},
            group_size=len(gathered),
            seconds=time.monotonic() - started,
            bytes_sent=report.bytes_sent,
            reason=reason,
            bytes_received=report.bytes_received,
            inputs=report.inputs,
            weights={peer: _weight_of(data) for peer, data in gathered.items()},
            group_id=report.group_id.hex(),
            commitments={peer: data["commitment"] for peer, data in gathered.items()
                         if isinstance(data, dict) and isinstance(data.get("commitment"), dict)},
            evidence=evidence,
            finished_at=report.finished_at,
            abandoned_groups=abandoned,
        )

    def _signed_disputes(self, evidence: AllReduceEvidence, group_id: bytes, terms: dict) -> dict[int, bytes]:
        """segment -> our signed dispute, for each owner's segment that misstated our input (disputes.py)."""
        if self.signer is None:
            return {}
        return {segment: self.signer.sign(dispute_bytes(terms["scope"], terms["round"], group_id, segment,
                                                        record.digest))
                for segment, record in evidence.segments.items() if record.disputed}

    def _drop_disputed(self, flat: torch.Tensor, evidence: AllReduceEvidence) -> None:
        """Zeros over every segment whose dispute counts and that is not refuted already, and why in its record: no
        step there, on every member that read the dispute (template.allreduce.disputes)."""
        owner_of = {segment: record.owner for segment, record in evidence.segments.items()}
        counted = counted_disputes(((d.segment, d.sender) for d in evidence.disputes), owner_of)
        for segment, sender in counted.items():
            record = evidence.segments[segment]
            if not record.refuted:
                start, stop = self.buffer.layout.values(segment, segment + 1)
                flat[start:stop] = 0.0
                evidence.segments[segment] = dataclasses.replace(
                    record, refuted=f"sender {evidence.senders[sender]} disputed the owner's statement of its input")

    def _retry(self, handle: AveragingHandle, deadline: float, why: str) -> StepControl | None:
        """A new step for ``handle``'s round, whose last step failed before any data moved or in a group that no
        member can complete; None when there is no time left for one or the step was given up."""
        retry_at = time.time() + self.config.matchmaking_time
        if handle.cancelled or retry_at >= deadline - self.config.request_timeout:
            return None
        logger.warning("averaging step failed (%s); looking for a group again", why)
        handle.control = self._step(handle.weight, handle.gather, retry_at, deadline, require_trigger=False)
        return handle.control  # what cancel must reach now

    def finish_in_background(self, handle: AveragingHandle, deadline: float,
                             left_behind: Callable[[], str | None] | None = None) -> Future[AveragingResult]:
        """:meth:`finish` on this averager's background thread: the all-reduce runs as soon as its group forms and
        the members' confirmation follows, while the caller trains the next round (overlap). The future is done by
        ``deadline`` at the latest; one all-reduce at a time."""
        self._check_open()
        return self._background.submit(self.finish, handle, deadline, left_behind)

    def wait_for_group(self, handle: AveragingHandle, until: float) -> bool:
        """Wait until ``handle``'s group has formed (or its step has ended), at most until ``until`` (time.time());
        True when it no longer looks for a group. A free-running overlapped peer paces itself with it: the round it
        trains meanwhile then starts together with its groupmates', and the average lands early in it."""
        while handle.control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
            if handle.cancelled or time.time() >= until:
                return False
            time.sleep(GROUP_POLL_S)
        return True

    def cancel(self, handle: AveragingHandle) -> None:
        """Give up ``handle``'s step: its :meth:`finish` fails soon and is not retried (its result is not wanted)."""
        handle.cancelled = True
        cancel_step(handle.control)

    def average(
        self, tensors: Sequence[torch.Tensor] | None, weight: float, gather: Any, deadline: float, round: int = 0,
    ) -> AveragingResult:
        """Encode ``tensors`` (None for auxiliaries), find a group now and all-reduce them weighted by ``weight``;
        return by ``deadline`` (time.time())."""
        scheduled_time = time.time() + self.config.matchmaking_time
        if scheduled_time >= deadline:
            return AveragingResult(False, None, {}, 0, 0.0, 0, "deadline is shorter than matchmaking_time")
        return self.finish(self.begin(tensors, weight, gather, scheduled_time, deadline, round=round), deadline)

    def set_state_priority(self, priority: float) -> None:
        """Peers loading state pick the sharing peer with the highest priority: pass e.g. the round number."""
        self._averager.state_sharing_priority = float(priority)

    def newest_declared_state(self) -> float | None:
        """The highest state-sharing priority another peer declares (None: none declares any): the one whose state
        :meth:`load_state_from_peers` would download. With the round as the priority, a peer can see whether a state
        of the round it needs is on offer before it downloads a whole one."""
        others = [priority for peer, priority in declared_state_priorities(self.dht, self.config.prefix).items()
                  if peer != self.peer_id]
        return max(others, default=None)

    def round_searchers(self, round: int) -> dict[str, bool]:
        """The other peers declared in ``round``'s matchmaking (a DHT read, a moment old): True while one looks for that
        round's group, False once it found one or stopped looking. A peer declares itself only for the one round it
        looks a group for, and begins a round's all-reduce only after its last one ended: one that appears under
        round r + 1 is done with round r."""
        declared = matchmaking_declarations(self.dht, self.config.prefix, round_group_bits(round))
        declared.pop(self.peer_id, None)
        return declared

    def load_state_from_peers(self, timeout: float) -> tuple[dict, list[torch.Tensor]] | None:
        """Download (metadata, tensors) that a live peer's ``state_provider`` returns; None if none in time."""
        self._check_open()
        deadline = time.time() + timeout
        while (remaining := deadline - time.time()) > 0:
            try:
                state = self._averager.load_state_from_peers(wait=True, timeout=remaining)
            except TimeoutError:
                return None
            if state is not None:
                metadata, tensors = state
                if isinstance(metadata, dict) and all(isinstance(t, torch.Tensor) for t in tensors):
                    return metadata, list(tensors)
                logger.warning("a peer sent a malformed state; trying again")
            # no peer has declared its state yet (DHT records take a moment to appear): poll, bounded
            time.sleep(min(0.5, max(deadline - time.time(), 0.0)))
        return None

    def shutdown(self) -> None:
        """Stop the averager process; idempotent; bounded: ~``shutdown_timeout``, then SIGTERM, then SIGKILL."""
        if self._closed:
            return
        self._closed = True
        self._background.shutdown(wait=False, cancel_futures=True)  # a running finish ends by its deadline
        if self._averager.is_alive():
            self._averager.shutdown()  # asks politely, joins for shutdown_timeout, then terminates
        kill_if_alive(self._averager, "the averager process")

    def __enter__(self) -> PseudoGradientAverager:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- helpers ---------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the averager was shut down")

    def _with_buffers(self, deadline: float, function: Callable, *args) -> bool:
        """Run ``function`` while holding the averager's tensor lock; False if the lock stays taken past deadline."""
        lock = self._averager.lock_averaged_tensors
        if not lock.acquire(timeout=max(deadline - time.time(), 0.0)):
            return False
        try:
            function(*args)
            return True
        finally:
            lock.release()

    def _left_behind(self, control: StepControl, left_behind: Callable[[], str | None] | None) -> str | None:
        late = time.time() > control.scheduled_time + self.config.request_timeout
        if left_behind is None or not late or control.stage != AveragingStage.LOOKING_FOR_GROUP:
            return None
        return left_behind()

    def _failure(self, started: float, reason: str) -> AveragingResult:
        logger.warning("averaging failed: %s", reason)
        return AveragingResult(False, None, {}, 0, time.monotonic() - started, 0, reason)


def round_group_bits(round: int) -> str:
    """The group-key bits of ``round``'s matchmaking (hivemind's bucket suffix of the run's prefix): its last 8 bits.
    A peer 256 rounds off shares the key, and its round still differs in the terms every segment is checked against."""
    return format(round % 256, "08b")


def _weight_of(gathered: Any) -> float:
    weight = gathered.get("weight") if isinstance(gathered, dict) else None
    return float(weight) if isinstance(weight, (int, float)) else 0.0
