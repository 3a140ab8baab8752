"""GroupRoster: whom one member of a group still waits for, and when a group never formed."""

from __future__ import annotations

import asyncio

from template.allreduce.roster import GroupRoster


def make(me="a", members=("a", "b", "c"), senders=("a", "b", "c"), owns_segments=True):
    banned: list[int] = []
    roster = GroupRoster(me, members, senders, owns_segments=owns_segments, on_banned=banned.append)
    return roster, banned


def run(coroutine_function):
    return asyncio.run(coroutine_function())


def test_an_absent_groupmate_is_banned_served_and_no_longer_waited_for():
    async def scenario():
        roster, banned = make()
        roster.not_in_group("b")
        assert not roster.all_started.is_set()  # c may still come
        assert roster.missing_senders() == ["c"] and roster.unserved == {"c"}
        roster.not_in_group("c")
        assert roster.all_started.is_set() and roster.all_served.is_set()  # nobody left to wait for
        assert sorted(banned) == [1, 2] and roster.absent == {"b", "c"}
        roster.not_in_group("c")
        assert sorted(banned) == [1, 2]  # banned once
    run(scenario)


def test_a_sender_is_banned_once_and_an_auxiliary_is_never_banned():
    async def scenario():
        roster, banned = make(members=("a", "b", "v"), senders=("a", "b"))
        roster.ban("b")
        roster.ban("b")
        roster.ban("v")  # an auxiliary sends placeholders: there is nothing to exclude
        assert banned == [1]
        assert roster.missing_senders() == ["b"]  # banned, yet it has not started: still missing
        roster.start("b")
        assert roster.all_started.is_set() and not roster.all_served.is_set()
        roster.served("b")
        roster.served("v")
        assert roster.all_served.is_set()
    run(scenario)


def test_a_member_that_owns_nothing_serves_nobody():
    async def scenario():
        roster, _ = make(owns_segments=False)
        assert roster.all_served.is_set() and not roster.all_started.is_set()
    run(scenario)
