"""How a peer joins a DiLoCo run and stays in it: the run-identity record, the ready barrier, and the shared state.

- **Run identity** (:func:`check_run_identity`): each peer stores its run's identity fields (model, data, seeds,
  optimizers: :meth:`RunSpec.identity <template.training.spec.RunSpec.identity>`) in the DHT under the run id and
  compares them with the live records of others. A peer of the same run id with other settings could never share an
  averaging group (the group prefix carries the fingerprint), so it would wait forever; instead it fails at start
  with :class:`~template.training.spec.RunMismatchError` naming the differing fields. Records expire after
  :data:`IDENTITY_TTL_S`; live peers refresh theirs every round.
- **Ready barrier** (:func:`wait_until_ready`): peers that start together say "ready" (state restored) and wait,
  bounded, until the expected number are, so that round 0 starts together.
- **Shared state** (:class:`SharedState`): θ_r, the outer momentum and the round counter, which change together
  under one lock: the averager offers them to joining peers from another thread, and a peer that missed a round (or
  starts late) adopts a live peer's copy when it belongs to this run and is at least as far along.

On failure: a DHT that does not answer makes the checks see no other peer (a misconfigured pair then simply never
meets); a downloaded state of another run, of an older round or of the wrong shapes is ignored (logged) and the
peer keeps its own.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import hivemind
import torch
from hivemind.utils import get_dht_time

from template.allreduce.averager import PseudoGradientAverager
from template.training.outer import OuterOptimizer
from template.training.spec import RunMismatchError

log = logging.getLogger(__name__)

# A peer refreshes its identity record every round; records of peers that left expire after this long.
IDENTITY_TTL_S = 600.0
STATE_RETRY_S = 0.5  # a peer state older than the one wanted is asked for again after this long


def announce_run_identity(dht: hivemind.DHT, run_id: str, identity: dict[str, Any]) -> None:
    dht.store(f"{run_id}_identity", identity, expiration_time=get_dht_time() + IDENTITY_TTL_S,
              subkey=str(dht.peer_id))


def count_subkeys(dht: hivemind.DHT, key: str) -> int:
    """How many peers stored a (live) record under ``key``."""
    found = dht.get(key, latest=True)
    return len(found.value) if found is not None and isinstance(found.value, dict) else 0


def check_run_identity(dht: hivemind.DHT, run_id: str, identity: dict[str, Any]) -> None:
    """Announce this peer's run identity under the run id; raise RunMismatchError if a live peer announced another."""
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


def wait_until_ready(dht: hivemind.DHT, run_id: str, round: int, count: int, timeout_s: float) -> int:
    """Say we are ready (at ``round``), then block until ``count`` peers of the run (us included) are, or
    ``timeout_s`` passes; returns how many were seen."""
    key = f"{run_id}_ready"
    dht.store(key, round, expiration_time=get_dht_time() + IDENTITY_TTL_S, subkey=str(dht.peer_id))
    deadline = time.monotonic() + timeout_s
    while (seen := count_subkeys(dht, key)) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    log.info("%d of %d peers ready", seen, count)
    return seen


def passed_by(averager: PseudoGradientAverager, round: int, *, overlapped: bool = False) -> str | None:
    """Why a late peer's search for ``round``'s group is over, if it is; None while the group may still form.

    Two signs, each read from the DHT:

    - a peer declares the state of a round that it settled after ``round``: the round's one group formed without us
      (we re-sync from that state). A peer that took round r's outer step declares r + 1, or r + 2 overlapped (it
      declares r + 1 when round r's all-reduce starts, and lands round r one round later);
    - a peer is declared in round r + 1's matchmaking while nobody else still looks for round r's group: it is done
      with round r, whatever came of it (a peer begins a round's all-reduce only after its last one ended), and no
      group of round r can form around us alone. This also covers a round that was lost for everyone, after which
      nobody declares a newer state: hivemind's leader can count in a follower that never heard its word (its
      leader was killed, or the word came late), and the others move on while that follower looked for the group
      until its deadline (a minute, in the overlapped kill test, holding its next round back as long).
    """
    newest = averager.newest_declared_state()
    if newest is not None and newest >= round + (2 if overlapped else 1):
        return f"a peer holds round {int(newest)}'s state: round {round}'s group formed without this peer"
    ahead = averager.round_searchers(round + 1)
    if ahead and not any(averager.round_searchers(round).values()):
        return (f"{len(ahead)} peer(s) went on to round {round + 1}'s matchmaking and none looks for round {round}'s "
                "group")
    return None


class SharedState:
    """θ_r with its outer momentum, and the round it is for: read by joining peers, replaced by a live peer's copy.

    The averager's state provider calls :meth:`snapshot` on another thread; every change of θ or of the round goes
    through :meth:`changing` so that a joiner never downloads θ of one round labelled with another.
    """

    def __init__(self, outer: OuterOptimizer, fingerprint: str, round: int = 0) -> None:
        self.outer = outer
        self.fingerprint = fingerprint
        self.round = round
        self._lock = threading.Lock()

    def changing(self) -> threading.Lock:
        """Hold while changing θ (the outer step, a load) or the round."""
        return self._lock

    def snapshot(self) -> tuple[dict, list[torch.Tensor]]:
        """What a joining peer downloads: the round, the run's fingerprint, θ_r and the outer momentum."""
        with self._lock:
            state = self.outer.state_dict()
            names = sorted(state)
            metadata = dict(round=self.round, fingerprint=self.fingerprint, names=names,
                            theta_hash=self.outer.theta_hash())
            return metadata, [state[name] for name in names]

    def adopt_from_peers(self, averager: PseudoGradientAverager, timeout_s: float, min_round: int) -> bool:
        """Download a live peer's state and take it if it is for this run and at ``min_round`` or later; a state of an
        earlier round (a peer still finishing it) is asked for again, once a peer declares one of ``min_round``, until
        ``timeout_s`` has passed."""
        deadline = time.monotonic() + timeout_s
        downloaded_once = False
        while (left := deadline - time.monotonic()) > 0:
            # after a state too old, download again only once a peer declares one of min_round (priority = round):
            # a whole state is gigabytes for the 1b preset
            newest = averager.newest_declared_state() if downloaded_once else None
            if newest is None or newest >= min_round:
                downloaded = averager.load_state_from_peers(timeout=left)
                if downloaded is None:
                    return False
                downloaded_once = True
                adopted = self._adopt(*downloaded, min_round)
                if adopted is not None:
                    return adopted
            time.sleep(min(STATE_RETRY_S, max(deadline - time.monotonic(), 0.0)))
        return False

    def _adopt(self, metadata: dict, tensors: list[torch.Tensor], min_round: int) -> bool | None:
        """Take a downloaded state: True when taken, False when it is not for us, None when it is too old."""
        names = metadata.get("names")
        if metadata.get("fingerprint") != self.fingerprint or not isinstance(names, list) or len(names) != len(tensors):
            log.warning("ignoring a peer state for another run or with a malformed layout")
            return False
        peer_round = metadata.get("round")
        if not isinstance(peer_round, int):
            return False
        if peer_round < min_round:
            return None
        try:
            with self._lock:
                self.outer.load_state_dict(dict(zip(names, tensors, strict=True)))
                self.round = peer_round
        except ValueError as err:
            log.warning("ignoring a peer state that does not fit this model: %s", err)
            return False
        log.info("adopted peer state: round %d, θ hash %s", peer_round, self.outer.theta_hash()[:12])
        return True
