"""Who of one group takes part in its all-reduce, as one member sees it.

The runner (:mod:`template.allreduce.runner`) waits on groupmates only while they may still come: a sender that has
not started within ``sender_timeout`` is banned (left out of our range), a member that has fetched our share no
longer keeps us alive, and a member that answers our segments "not in this group" (``BAD_GROUP_ID``: hivemind's
leader counted it in after it had stopped waiting for the leader's word) is *absent*: it is neither waited for nor
asked for shares, and since it never averaged its range, no member of the group can complete it unless a groupmate
holds its share (the runner's report says when that is what failed: ``AllReduceReport.lost_to_absent``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from hivemind.p2p import PeerID

__all__ = ["GroupRoster"]


class GroupRoster:
    """The state of each groupmate for one member: started sending, banned, absent, served (module docstring)."""

    def __init__(self, me: PeerID, members: Sequence[PeerID], senders: Sequence[PeerID], *, owns_segments: bool,
                 on_banned: Callable[[int], None]):
        """``on_banned(sender index)`` excludes a banned sender from the segments of our range it has not delivered."""
        self.me, self.members, self.senders = me, tuple(members), tuple(senders)
        self._on_banned = on_banned
        self.started: set[PeerID] = {me} if me in self.senders else set()
        self.banned: set[PeerID] = set()
        self.absent: set[PeerID] = set()  # said our group is not theirs
        self.all_started = asyncio.Event()  # every sender started, or is absent
        # peers that still have to fetch (and send) our share before we may finish
        self.unserved = {p for p in self.members if p != me} if owns_segments else set()
        self.all_served = asyncio.Event()
        self._update()

    def start(self, peer: PeerID) -> None:
        """``peer`` opened its stream of segments to us."""
        if peer in self.senders:
            self.started.add(peer)
        self._update()

    def ban(self, peer: PeerID) -> None:
        """Exclude sender ``peer`` from every segment of our range it has not delivered yet (once)."""
        if peer in self.senders and peer not in self.banned:
            self.banned.add(peer)
            self._on_banned(self.senders.index(peer))

    def served(self, peer: PeerID) -> None:
        """``peer`` got our share, or will not come for it."""
        self.unserved.discard(peer)
        self._update()

    def not_in_group(self, peer: PeerID) -> None:
        """``peer`` answered that it is not in this group: it sends nothing and fetches nothing."""
        self.absent.add(peer)
        self.ban(peer)
        self.served(peer)

    async def ban_missing_senders(self, sender_timeout: float) -> None:
        """Senders that have not started within ``sender_timeout`` are banned. One that comes within another
        ``sender_timeout`` (a stalled process) still gets our averages from us, not from a relay (measured: one relayed
        from a frozen validator, lost); after that it counts as gone (dead), and we stop waiting for it."""
        missing: list[PeerID] = []
        for _ in range(2):
            try:
                await asyncio.wait_for(self.all_started.wait(), sender_timeout)
                return
            except asyncio.TimeoutError:
                missing = self.missing_senders()
                for peer_id in missing:
                    self.ban(peer_id)
        for peer_id in missing:
            self.served(peer_id)

    def missing_senders(self) -> list[PeerID]:
        return [p for p in self.senders if p not in self.started and p not in self.absent]

    def _update(self) -> None:
        if not self.missing_senders():
            self.all_started.set()
        if not self.unserved:
            self.all_served.set()
