"""What a neuron's dashboard shows, gathered from the events the neuron emits: one bounded, thread-safe summary.

Why: an operator wants to see, live, what the JSON events file already says (a per-UID score table on a validator,
the loss curve and all-reduces on a miner) without reading JSON lines. The neuron needs no dashboard calls: every
event it reports through :meth:`NeuronContext.emit <template.base.neuron.NeuronContext.emit>` (the same dicts it
writes to ``--neuron.events_file``) is handed to :meth:`DashboardState.record`, and :meth:`DashboardState.snapshot`
returns the JSON document that ``GET /api/state`` serves and the page draws.

What it keeps:

- every neuron: role, version, uid, hotkey, state (starting, running, training, stopped), event counts;
- validator (``synced``, ``scored``, ``weights``): one row per miner uid with the fields of its last ``scored`` row
  (whatever keys they are), the weight it last got on chain and when it was last scored; the weights set over time;
  the moving average per uid per scored round; θ's held-out loss per round; the last all-reduce; scoring times;
- miner (``progress``, ``round``, ``published``, ``served``): the live round, step, loss and tokens/s, their recent
  samples, one entry per round (losses, all-reduce result, group, seconds, bytes), and its recent publications with
  the hotkeys that fetched each one.

Every history is a bounded deque and the table holds at most :data:`MAX_UIDS` rows, so a neuron that runs for months
uses the same memory as one that ran for an hour.

On failure: :meth:`DashboardState.record` never raises into the neuron. An event it cannot read (a field missing or of
the wrong type) is counted in ``dropped`` and logged at debug level; non-finite floats (a NaN loss) become ``null``
so that the document stays valid JSON for browsers.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

SAMPLES = 600  # live progress samples kept (at most one a second: ten minutes)
ROUNDS = 200  # per-round entries kept
PUBLICATIONS = 20  # recent publications kept, each with who fetched it
FETCHERS = 64  # distinct fetchers kept per publication
MAX_UIDS = 4096  # rows of the per-UID table (a subnet has at most 256 uids today)
MAX_STRING = 2000  # longer strings (an error text from a peer) are cut


def json_safe(value: Any) -> Any:
    """A copy of ``value`` that ``json.dumps(allow_nan=False)`` accepts: NaN/inf → None, tuples → lists, dict keys →
    strings, long strings cut, anything else → its ``str``."""
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return value[:MAX_STRING]
    if isinstance(value, dict):
        return {str(k)[:MAX_STRING]: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)[:MAX_STRING]


def _pick(event: dict, *keys: str) -> dict:
    return {key: event.get(key) for key in keys}


class DashboardState:
    """The dashboard's view of one neuron, fed by its events (``record``) and read as JSON (``snapshot``)."""

    def __init__(self, role: str, version: str, clock: Callable[[], float] = time.time) -> None:
        self.role = role
        self.dropped = 0
        self._lock = threading.Lock()
        self._neuron: dict[str, Any] = dict(role=role, version=version, uid=None, hotkey=None, state="starting",
                                            started=clock(), last_event=None, restored=None)
        self._counts: Counter[str] = Counter()
        # validator
        self._miners: dict[int, dict[str, Any]] = {}
        self._weights: deque[dict] = deque(maxlen=ROUNDS)
        self._ema: deque[dict] = deque(maxlen=ROUNDS)
        self._synced: deque[dict] = deque(maxlen=ROUNDS)
        self._scoring: deque[dict] = deque(maxlen=ROUNDS)
        # miner
        self._live: dict[str, Any] = {}
        self._samples: deque[dict] = deque(maxlen=SAMPLES)
        self._rounds: deque[dict] = deque(maxlen=ROUNDS)
        self._publications: OrderedDict[int, dict] = OrderedDict()
        self._handlers: dict[str, Callable[[dict], None]] = {
            "ready": self._ready, "stopped": self._stopped, "progress": self._progress, "round": self._round,
            "published": self._published, "served": self._served, "synced": self._synced_event,
            "scored": self._scored, "weights": self._weights_event,
        }

    def record(self, event: dict[str, Any]) -> None:
        """Fold one event (``{"event": kind, "time": t, **fields}``) into the state; never raises."""
        try:
            clean = json_safe(event)
            kind = clean["event"]
            with self._lock:
                self._counts[kind] += 1
                self._neuron["last_event"] = clean.get("time")
                handler = self._handlers.get(kind)
                if handler is not None:
                    handler(clean)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            self.dropped += 1
            log.debug("dashboard: event %r not shown: %r", event.get("event") if isinstance(event, dict) else event,
                      err)

    def snapshot(self) -> dict[str, Any]:
        """The document of ``GET /api/state``: plain JSON values only, copied under the lock."""
        with self._lock:
            document: dict[str, Any] = dict(neuron=dict(self._neuron), events=dict(self._counts), dropped=self.dropped)
            if self.role == "validator":
                document.update(
                    miners=[dict(self._miners[uid]) for uid in sorted(self._miners)],
                    weights=list(self._weights), ema=list(self._ema), rounds=list(self._synced),
                    last_allreduce=self._synced[-1] if self._synced else None, scoring=list(self._scoring),
                )
            else:
                document.update(
                    live=dict(self._live), samples=list(self._samples), rounds=list(self._rounds),
                    publications=[dict(p, fetched_by=list(p["fetched_by"].values()))
                                  for p in self._publications.values()],
                )
            return json_safe(document)

    # ------------------------------------------------------------------------------------------ every neuron

    def _ready(self, event: dict) -> None:
        self._neuron.update(uid=event.get("uid"), hotkey=event.get("hotkey"), state="running",
                            restored=event.get("restored"), round=event.get("chain_round"))

    def _stopped(self, event: dict) -> None:
        self._neuron["state"] = "stopped"

    # ------------------------------------------------------------------------------------------ miner

    # Each handler reads the fields it needs before it changes anything: a bad event changes nothing.

    def _progress(self, event: dict) -> None:
        round = event["round"]
        sample = _pick(event, "time", "round", "step", "of_steps", "loss", "tokens_per_s")
        self._live = sample
        self._samples.append(sample)
        self._neuron.update(state="training", round=round)

    def _round(self, event: dict) -> None:
        round, ok = event["round"], event["allreduce_ok"]
        self._rounds.append(_pick(event, "time", "round", "inner_steps", "tokens", "train_loss", "heldout_loss",
                                  "allreduce_ok", "reason", "group_size", "allreduce_s", "bytes_sent", "theta_hash"))
        self._neuron.update(state="averaged" if ok else "all-reduce failed", round=round)

    def _publication(self, round: int) -> dict:
        publication = self._publications.get(round)
        if publication is None:
            publication = self._publications[round] = dict(round=round, bytes=None, time=None, fetched_by={})
            while len(self._publications) > PUBLICATIONS:
                self._publications.popitem(last=False)
        return publication

    def _published(self, event: dict) -> None:
        self._publication(int(event["round"])).update(bytes=event.get("bytes"), time=event.get("time"))

    def _served(self, event: dict) -> None:
        fetched_by = self._publication(int(event["round"]))["fetched_by"]
        hotkey = event.get("hotkey") or "unknown"
        if hotkey in fetched_by or len(fetched_by) < FETCHERS:
            times = fetched_by.get(hotkey, {}).get("times", 0) + 1
            fetched_by[hotkey] = dict(hotkey=hotkey, time=event.get("time"), times=times)

    # ------------------------------------------------------------------------------------------ validator

    def _synced_event(self, event: dict) -> None:
        round = event["round"]
        entry = _pick(event, "time", "round", "heldout_loss", "allreduce_ok", "group_size", "allreduce_s",
                      "bytes_sent", "theta_hash")
        entry["group_hotkeys"] = list(event.get("group_hotkeys") or [])
        self._synced.append(entry)
        self._neuron.update(state="synced", round=round)

    def _row(self, uid: int, hotkey: str | None) -> dict | None:
        """The table row of ``uid``; a new hotkey on a known uid (re-registration) starts a fresh row."""
        row = self._miners.get(uid)
        if row is not None and hotkey is not None and row.get("hotkey") not in (None, hotkey):
            row = None
        if row is None:
            if uid not in self._miners and len(self._miners) >= MAX_UIDS:
                return None
            row = self._miners[uid] = dict(uid=uid, hotkey=hotkey)
        return row

    def _scored(self, event: dict) -> None:
        round, seen = event["round"], event.get("time")
        rows = [(int(scored["uid"]), scored) for scored in event["miners"]]
        for uid, scored in rows:
            row = self._row(uid, scored.get("hotkey"))
            if row is not None:
                row.update(scored, round=round, last_seen=seen)
        self._ema.append(dict(round=round, ema={str(uid): scored.get("ema") for uid, scored in rows}))
        self._scoring.append(dict(round=round, time=seen, seconds=event.get("seconds"), fetch_s=event.get("fetch_s"),
                                  miners=len(rows)))
        self._neuron["scored_round"] = round

    def _weights_event(self, event: dict) -> None:
        weights = {str(int(uid)): w for uid, w in (event.get("weights") or {}).items()}
        self._weights.append(dict(_pick(event, "time", "round", "block", "ok", "error"), weights=weights))
        if not event.get("ok"):
            return
        for uid, row in self._miners.items():
            row["weight"] = weights.get(str(uid), 0.0)  # a uid left out of a weight row has weight 0
        for uid, weight in weights.items():
            row = self._row(int(uid), None)
            if row is not None:
                row["weight"] = weight
