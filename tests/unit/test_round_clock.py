"""The chain clock's phases of a round: when training stops and when the round's all-reduce must end, blocking and
overlapped (``--run.overlap``). Every neuron derives them from the same blocks, so they must agree to the second."""

from __future__ import annotations

from template.base.neuron import RoundClock, RoundTime


class Blocks:
    """The one chain call the clock makes at construction."""

    def block_time(self) -> float:
        return 0.5


def clocks() -> tuple[RoundClock, RoundClock]:
    # 40 blocks of 0.5 s: 20 s rounds; grace = max(2 s, 0.25 × 20 s) = 5 s
    return RoundClock(Blocks(), 40, 0.25), RoundClock(Blocks(), 40, 0.25, overlap=True)


def test_blocking_leaves_matchmaking_and_grace_before_the_last_block_and_grace_after_it():
    blocking, _ = clocks()
    assert blocking.phases(RoundTime(3, 130, 1000.0, 0.5), matchmaking_time=4.0) == (991.0, 1005.0)
    assert blocking.allreduce_phase_s == 10.0


def test_overlapped_training_runs_until_grace_before_the_last_block_and_the_allreduce_until_the_next_rounds_end():
    _, overlapped = clocks()
    train_until, finish_by = overlapped.phases(RoundTime(3, 130, 1000.0, 0.5), matchmaking_time=4.0)
    assert (train_until, finish_by) == (995.0, 1015.0)
    # round r's all-reduce is due exactly when round r+1's training ends: that is when the engine lands it
    next_train_until, _ = overlapped.phases(RoundTime(4, 160, 1020.0, 0.5), matchmaking_time=4.0)
    assert finish_by == next_train_until
    assert overlapped.allreduce_phase_s == 20.0  # its timeouts are cut to a round, not to 2 × grace
