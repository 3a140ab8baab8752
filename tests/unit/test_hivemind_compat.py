"""The private hivemind members the project relies on (template/p2p/hivemind_compat.py), one test each.

A hivemind upgrade that renames or reshapes any of them fails here, by name, instead of breaking a round silently.
Nothing is started: these read hivemind's classes and signatures.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import time
from concurrent.futures import InvalidStateError
from pathlib import Path
from types import SimpleNamespace

import hivemind
import pytest
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2

from template.p2p import hivemind_compat
from template.p2p.hivemind_compat import HIVEMIND_VERSION, OwnAllReduceHooks, cancel_step, check_hivemind_version

REPO = Path(__file__).resolve().parents[2]


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_the_installed_hivemind_is_the_pinned_one():
    assert hivemind.__version__ == HIVEMIND_VERSION
    assert f"hivemind=={HIVEMIND_VERSION}" in (REPO / "requirements.txt").read_text().split()
    check_hivemind_version()


def test_another_hivemind_version_is_refused_with_the_pinned_one_named():
    with pytest.raises(RuntimeError, match=f"hivemind=={HIVEMIND_VERSION}"):
        check_hivemind_version("1.2.0")


def test_private_aggregate_with_group_takes_the_group_and_the_minimum_vector_size():
    assert parameters(DecentralizedAverager._aggregate_with_group)[:3] == ["self", "group_info", "min_vector_size"]
    # it hands our override the keyword arguments our _run_allreduce_inplace_ reads
    source = inspect.getsource(DecentralizedAverager._aggregate_with_group)
    assert "self._run_allreduce_inplace_(local_tensors, group_info, peer_fractions=peer_fractions, **kwargs)" in source
    # its allreduce_timeout starts when it is called: our runner counts its own deadline from that moment
    step = "".join(inspect.getsource(DecentralizedAverager._step).split())
    assert "awaitasyncio.wait_for(self._aggregate_with_group(" in step and "timeout=self._allreduce_timeout" in step


def test_private_run_allreduce_inplace_is_the_all_reduce_hook():
    assert parameters(DecentralizedAverager._run_allreduce_inplace_) == ["self", "tensors", "group_info", "group_id",
                                                                         "kwargs"]
    source = inspect.getsource(DecentralizedAverager._step)
    for keyword in ("weight=step.weight", "**self.allreduce_kwargs"):
        assert keyword in source
    init = inspect.getsource(DecentralizedAverager.__init__)
    for keyword in ("sender_timeout=", "reducer_timeout="):
        assert keyword in init  # allreduce_kwargs carries both timeouts


def test_private_running_groups_routes_rpc_aggregate_part_to_the_registered_runner():
    source = inspect.getsource(DecentralizedAverager.rpc_aggregate_part)
    assert "self._running_groups.get(request.group_id)" in source
    assert "group.rpc_aggregate_part(" in source
    assert "self._running_groups" in inspect.getsource(DecentralizedAverager.__init__)


def test_private_pending_groups_registered_is_what_a_groupmates_call_waits_on_for_an_unknown_group():
    """Our ``rpc_aggregate_part`` bounds the wait that hivemind's leaves unbounded: the event must still be cleared
    while a peer looks for a group and set when any group registers (or leaves), and hivemind's handler must still
    wait on it; otherwise a follower that left its leader answers too early or too late."""
    assert "await self._pending_groups_registered.wait()" in inspect.getsource(DecentralizedAverager.rpc_aggregate_part)
    step = inspect.getsource(DecentralizedAverager._step)
    assert "self._pending_groups_registered.clear()" in step
    assert step.index("_pending_groups_registered.clear()") < step.index("AveragingStage.LOOKING_FOR_GROUP")
    register = inspect.getsource(DecentralizedAverager._register_allreduce_group)
    assert register.count("self._pending_groups_registered.set()") == 2  # on registering, and on leaving
    assert "self._pending_groups_registered = asyncio.Event()" in inspect.getsource(DecentralizedAverager._run_internal)
    assert parameters(DecentralizedAverager.rpc_aggregate_part) == parameters(OwnAllReduceHooks.rpc_aggregate_part)


def test_the_handler_hivemind_registers_for_a_groupmates_segments_is_ours():
    from hivemind.p2p.servicer import ServicerBase

    from template.allreduce.averager_process import CheckedAverager

    # hivemind collects the rpc_* handlers by class attribute lookup (the MRO): the mixin's comes first
    assert "inspect.getmembers(cls, predicate=inspect.isfunction)" in inspect.getsource(
        ServicerBase._collect_rpc_handlers)
    assert CheckedAverager.rpc_aggregate_part is OwnAllReduceHooks.rpc_aggregate_part


def test_private_state_updated_wakes_state_sharing():
    assert "self._state_updated" in inspect.getsource(DecentralizedAverager._declare_for_download_periodically)


def test_averagers_declare_their_state_priority_under_the_prefixs_all_averagers_key():
    key = 'f"{self._matchmaking.group_key_manager.prefix}.all_averagers"'
    assert key in inspect.getsource(DecentralizedAverager._declare_for_download_periodically)
    assert "value=self.state_sharing_priority" in inspect.getsource(
        DecentralizedAverager._declare_for_download_periodically)
    assert 'f"{key_manager.prefix}.all_averagers", latest=True' in inspect.getsource(
        DecentralizedAverager._load_state_from_peers)


def test_averagers_declare_their_matchmaking_under_the_group_key_with_whether_they_still_look():
    """``matchmaking_declarations`` reads the group key as hivemind writes it (the live reading is tested in
    tests/integration/test_averaging.py, a peer left alone in its round's matchmaking)."""
    from hivemind.averaging.key_manager import GroupKeyManager

    assert 'f"{self.prefix}.0b{self.group_bits}"' in inspect.getsource(GroupKeyManager.current_key.fget)
    declare = inspect.getsource(GroupKeyManager.declare_averager)
    assert "subkey=peer_id.to_bytes()" in declare and "value=looking_for_group" in declare


def test_private_p2p_is_the_averagers_host():
    assert "self._p2p" in inspect.getsource(DecentralizedAverager._run_internal)


def test_private_dht_get_visible_maddrs_takes_latest():
    assert parameters(hivemind.DHT._get_visible_maddrs)[-1] == "latest"
    assert hivemind_compat.visible_maddrs_coroutine().keywords == {"latest": False}


def test_private_p2p_client_connects_to_an_address():
    assert "self._client" in inspect.getsource(P2P.create)
    from hivemind.p2p.p2p_daemon_bindings.p2pclient import Client

    assert parameters(Client.connect) == ["self", "peer_id", "maddrs"]


def test_private_step_looks_for_a_group_whose_withdrawal_from_the_dht_comes_before_the_group_registers():
    """``OwnAllReduceHooks._step`` wraps the group key manager's ``declare_averager`` before hivemind's step runs: the
    manager must still be ``_matchmaking.group_key_manager``, the withdrawal (``looking_for_group=False``) must still be
    awaited on the way out of the search, and the search must still end before the group registers."""
    from hivemind.averaging.key_manager import GroupKeyManager
    from hivemind.averaging.matchmaking import Matchmaking, PotentialLeaders

    assert parameters(DecentralizedAverager._step) == ["self", "step", "future_for_init"]
    assert "self._matchmaking = Matchmaking(" in inspect.getsource(DecentralizedAverager._run_internal)
    assert "self.group_key_manager = GroupKeyManager(" in inspect.getsource(Matchmaking.__init__)
    assert parameters(GroupKeyManager.declare_averager) == ["self", "group_key", "peer_id", "expiration_time",
                                                            "looking_for_group"]
    withdraw = inspect.getsource(PotentialLeaders._declare_averager_periodically)
    assert "await key_manager.declare_averager(" in withdraw and "looking_for_group=False" in withdraw
    search = inspect.getsource(PotentialLeaders.begin_search)
    assert "await cancel_and_wait(declare_averager_task)" in search
    look = inspect.getsource(Matchmaking.look_for_group)
    assert "self.potential_leaders.begin_search(" in inspect.getsource(Matchmaking._request_join_potential_leaders)
    assert "await cancel_and_wait(request_leaders_task)" in look
    step = inspect.getsource(DecentralizedAverager._step)
    assert step.index("group_info = await matchmaking_task") < step.index("self._register_allreduce_group(group_info)")


def test_private_matchmaking_members_that_decide_whom_a_leader_counts_in():
    """``OnlyWaitingFollowers`` wraps ``_check_reasons_to_reject`` (asked under the join lock, before a follower is
    counted in) and ``leader_assemble_group`` (every way a leader forms its group), and relies on how long a follower
    waits: ``request_timeout`` for the answer, its own expiration + ``request_timeout`` for the word."""
    from hivemind.averaging.matchmaking import Matchmaking

    assert parameters(Matchmaking._check_reasons_to_reject) == ["self", "request", "context"]
    assert parameters(Matchmaking.leader_assemble_group) == ["self"]
    join = "".join(inspect.getsource(Matchmaking.rpc_join_group).split())
    assert join.index("reason_to_reject=self._check_reasons_to_reject(request,context)") < join.index(
        "self.current_followers[context.remote_id]=request")
    assert join.count("awaitself.leader_assemble_group()") == 2
    assert "return await self.leader_assemble_group()" in inspect.getsource(
        Matchmaking._request_join_potential_leaders)
    assert "ordered_peer_ids = list(self.current_followers)" in inspect.getsource(Matchmaking.leader_assemble_group)
    request = inspect.getsource(Matchmaking._request_join_group)
    assert "asyncio.wait_for(anext(stream), timeout=self.request_timeout)" in request
    assert "time_to_expiration = max(0.0, request_expiration_time - get_dht_time())" in request
    assert "asyncio.wait_for(anext(stream), time_to_expiration + self.request_timeout)" in request
    init = inspect.getsource(Matchmaking.__init__)
    assert "self.min_group_size" in init and "self.request_timeout = " in init


class _Matchmaking:
    """What ``OnlyWaitingFollowers`` reads and wraps of hivemind's ``Matchmaking`` (checked above)."""

    def __init__(self, expirations: dict[str, float], min_group_size: int):
        self.current_followers = {peer: averaging_pb2.JoinRequest(expiration=expiration)
                                  for peer, expiration in expirations.items()}
        self.request_timeout, self.min_group_size = 2.0, min_group_size
        self.assembled_with: list[str] | None = None

    def _check_reasons_to_reject(self, request, context):
        # hivemind's own answer to a follower of ours whose leader we follow now: go to our leader
        if context.remote_id == "sent_on":
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_A_LEADER)
        return None

    async def leader_assemble_group(self):
        self.assembled_with = sorted(self.current_followers)
        return "group"


def test_a_leader_refuses_a_join_request_that_waited_for_it_past_half_its_senders_wait():
    async def scenario() -> list:
        matchmaking, since = _Matchmaking({}, min_group_size=2), {}
        hivemind_compat.OnlyWaitingFollowers(matchmaking, since).install()
        now = asyncio.get_running_loop().time()
        since.update(fresh=now - 0.9, stale=now - 1.1, sent_on=now - 1.1)  # the senders wait 2 s for our answer
        return [matchmaking._check_reasons_to_reject(averaging_pb2.JoinRequest(), SimpleNamespace(remote_id=peer))
                for peer in ("fresh", "stale", "unknown", "sent_on")]

    fresh, stale, unknown, sent_on = asyncio.run(scenario())
    assert fresh is None and unknown is None  # hivemind's own checks decide
    assert stale.code == averaging_pb2.BAD_EXPIRATION_TIME
    assert sent_on.code == averaging_pb2.NOT_A_LEADER  # hivemind's own reason comes first


def test_a_leader_forms_its_group_without_followers_whose_wait_for_its_word_ran_out_while_enough_remain():
    from hivemind.utils.timed_storage import get_dht_time

    def assemble(expirations: dict[str, float], min_group_size: int) -> list[str]:
        matchmaking = _Matchmaking(expirations, min_group_size)
        hivemind_compat.OnlyWaitingFollowers(matchmaking, {}).install()
        assert asyncio.run(matchmaking.leader_assemble_group()) == "group"
        return matchmaking.assembled_with

    now = get_dht_time()  # a follower waits for the word until its expiration + request_timeout (2 s)
    followers = dict(waiting=now + 1.0, nearly_gone=now - 0.9, gone=now - 1.1)
    assert assemble(followers, min_group_size=3) == ["nearly_gone", "waiting"]
    assert assemble(followers, min_group_size=4) == ["gone", "nearly_gone", "waiting"]  # too few would remain


def test_a_withdrawal_runs_in_the_background_and_a_declaration_is_awaited():
    calls: list[tuple[bool, str]] = []

    async def declare(group_key, peer_id, expiration_time, looking_for_group=True) -> bool:
        calls.append((looking_for_group, "started"))
        await asyncio.sleep(0.3)  # a DHT store that waits out a frozen node
        calls.append((looking_for_group, "stored"))
        return True

    async def scenario() -> tuple[float, float]:
        wrapped = hivemind_compat.WithdrawalsInBackground(declare)
        began = time.monotonic()
        assert await wrapped("key", "peer", 1.0, looking_for_group=False)
        withdrawal_s = time.monotonic() - began
        began = time.monotonic()
        assert await wrapped("key", "peer", 2.0)
        declaration_s = time.monotonic() - began
        await asyncio.sleep(0.05)  # the withdrawal, started first, has finished by now
        return withdrawal_s, declaration_s

    withdrawal_s, declaration_s = asyncio.run(scenario())
    assert withdrawal_s < 0.1 <= 0.3 <= declaration_s
    assert sorted(calls) == [(False, "started"), (False, "stored"), (True, "started"), (True, "stored")]


def test_the_compat_subclass_overrides_exactly_the_three_private_hooks():
    overridden = {name for name, value in vars(OwnAllReduceHooks).items()
                  if name.startswith("_") and not name.startswith("__") and callable(value)}
    assert overridden == {"_aggregate_with_group", "_run_allreduce_inplace_", "_step"}
    for name in overridden:
        assert hasattr(DecentralizedAverager, name), name


def test_no_other_module_touches_a_private_hivemind_member():
    """Outside the compat module, no code names the private members it wraps."""
    privates = ("_aggregate_with_group", "_run_allreduce_inplace_", "_running_groups", "_state_updated",
                "_pending_groups_registered", "._matchmaking", "group_key_manager",
                "_get_visible_maddrs", "p2p._client", "AllReduceRunner.__init__", ".all_averagers",
                "matchmaking._check_reasons_to_reject", "leader_assemble_group", "current_followers")
    offenders = []
    for folder in ("template", "neurons", "scripts", "benchmarks"):
        for path in (REPO / folder).rglob("*.py"):
            if path.name == "hivemind_compat.py":
                continue
            text = path.read_text()
            offenders += [f"{path.relative_to(REPO)}: {name}" for name in privates if name in text]
    assert not offenders, offenders


def test_private_dht_inner_pipe_is_read_by_the_request_loop_which_does_not_catch_eoferror():
    source = inspect.getsource(hivemind.DHT.run)
    assert "method, args, kwargs = self._inner_pipe.recv()" in source
    assert "except (OSError, ConnectionError, RuntimeError)" in source  # no EOFError: why the wrapper exists
    assert "getattr(self, method)(*args, **kwargs)" in source  # how the skipped request runs


def _sender_gone():
    """What rebuilding a dead sender's result pipe raises in the DHT process."""
    raise EOFError


class RequestOfADeadSender:
    def __reduce__(self):
        return _sender_gone, ()


@pytest.mark.timeout(60)
def test_a_request_of_a_dead_sender_is_skipped_and_the_dht_keeps_serving():
    """Before: the DHT process died on such a request (EOFError, uncaught), and every later call on it hung."""
    from hivemind.utils import get_dht_time

    from template.p2p.dht import start_dht

    dht = start_dht()
    try:
        assert isinstance(dht, hivemind_compat.DHTSurvivingDeadSenders)
        dht._outer_pipe.send(RequestOfADeadSender())  # as a request whose sender exited before it was read
        assert dht.store("key", "value", expiration_time=get_dht_time() + 30)
        assert dht.get("key", latest=True).value == "value"
        assert dht.is_alive()
    finally:
        dht.shutdown()


@pytest.mark.timeout(60)
def test_a_dht_process_that_neither_shuts_down_nor_takes_sigterm_is_killed_by_shutdown():
    """A neuron's DHT process keeps the neuron's SIGTERM handler (a stop flag) and, after a stop sent to the whole
    process group, waits on a p2p daemon that is gone. Here it is frozen (SIGSTOP) with such a handler: hivemind's
    shutdown asks, waits and sends SIGTERM in vain, and the process lived on (the neuron hung at exit); ours ends it."""
    from template.p2p.dht import start_dht

    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # what StopFlag.install does in a neuron
    try:
        dht = start_dht()
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        os.kill(dht.pid, signal.SIGSTOP)
        started = time.monotonic()
        dht.shutdown()
        assert not dht.is_alive() and dht.exitcode == -signal.SIGKILL
        assert time.monotonic() - started < dht.shutdown_timeout + 10
    finally:
        if dht.is_alive():
            dht.kill()


def _what_the_averager_sees_when_woken(cancel) -> list[bool]:
    """Whether the step reads as cancelled at the moment the averager's cancel future is set (what hivemind's step
    loop checks when that future wakes it)."""
    now = time.time()
    control = StepControl(scheduled_time=now + 60, deadline=now + 120, allow_retries=False, weight=1.0,
                          data_for_gather=b"")
    seen: list[bool] = []

    class AveragerSide:  # stands in for the averager process's trigger and cancel futures
        def set_result(self, _):
            seen.append(control.cancelled())

        def cancel(self):
            return True

        def done(self):
            return True

    control.attach(AveragerSide(), AveragerSide())
    cancel(control)
    return seen


def test_step_control_cancel_wakes_the_averager_before_the_step_reads_as_cancelled():
    """The order cancel_step works around: when it is gone, cancel_step can become a plain cancel."""
    assert _what_the_averager_sees_when_woken(StepControl.cancel) == [False]


def test_cancel_step_marks_the_step_cancelled_before_it_wakes_the_averager():
    assert _what_the_averager_sees_when_woken(cancel_step) == [True]


def test_a_step_cancelled_twice_wakes_the_averager_once_and_raises_nothing():
    """A step given up at its deadline (finish) and then dropped (the engine) is cancelled twice; hivemind's own
    ``StepControl.cancel`` raises on the second (its cancel future is set already): it crashed an overlapped peer."""
    now = time.time()
    control = StepControl(scheduled_time=now + 60, deadline=now + 120, allow_retries=False, weight=1.0,
                          data_for_gather=b"")
    woken: list[None] = []

    class CancelFuture:  # like hivemind's MPFuture: a result can be set once
        def set_result(self, value):
            if woken:
                raise InvalidStateError("Can't set_result to a future that is FINISHED")
            woken.append(value)

    class Trigger:
        def cancel(self):
            return True

    control.attach(Trigger(), CancelFuture())
    StepControl.cancel(control)
    with pytest.raises(InvalidStateError):  # what hivemind does on its own
        StepControl.cancel(control)
    woken.clear()
    fresh = StepControl(scheduled_time=now + 60, deadline=now + 120, allow_retries=False, weight=1.0,
                        data_for_gather=b"")
    fresh.attach(Trigger(), CancelFuture())
    cancel_step(fresh)
    cancel_step(fresh)
    assert woken == [None] and fresh.cancelled()
