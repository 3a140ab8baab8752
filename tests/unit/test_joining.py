"""When a peer looking for its round's group knows that the group formed without it (template/training/joining.py)."""

from __future__ import annotations

from template.training.joining import passed_by


class Declaring:
    """An averager whose groupmates declare ``newest`` as their state-sharing priority (None: nobody declares) and
    ``searchers[round]`` in that round's matchmaking (peer → still looking)."""

    def __init__(self, newest: float | None, searchers: dict[int, dict[str, bool]] | None = None):
        self.newest, self.searchers = newest, searchers or {}

    def newest_declared_state(self) -> float | None:
        return self.newest

    def round_searchers(self, round: int) -> dict[str, bool]:
        return self.searchers.get(round, {})


def test_blocking_a_peer_is_passed_by_once_another_declares_the_round_after_its_own():
    assert passed_by(Declaring(None), 5) is None
    assert passed_by(Declaring(5.0), 5) is None  # they are at our round: its group may still form
    assert passed_by(Declaring(-1.0), 5) is None  # a peer that missed a round shares nothing
    why = passed_by(Declaring(6.0), 5)
    assert why is not None and "round 6's state" in why and "round 5's group formed without this peer" in why


def test_overlapped_a_peer_is_passed_by_only_once_another_landed_its_round():
    # overlapped, a peer declares r + 1 as soon as round r's all-reduce starts: that is no sign of a group without us
    assert passed_by(Declaring(6.0), 5, overlapped=True) is None
    assert passed_by(Declaring(7.0), 5, overlapped=True) is not None


def test_a_peer_is_passed_by_once_another_looks_for_the_next_rounds_group_and_none_for_its_own():
    for overlapped in (False, True):
        assert passed_by(Declaring(None, {4: {"a": True}}), 5, overlapped=overlapped) is None  # the round before
        for looking in (True, False):  # still looking for round 6's group, or found it
            why = passed_by(Declaring(None, {6: {"a": looking}}), 5, overlapped=overlapped)
            assert why is not None and "round 6's matchmaking and none looks for round 5's group" in why, why
            # another peer still looks for round 5's group: the two of us may still form it
            assert passed_by(Declaring(None, {6: {"a": looking}, 5: {"b": True}}), 5, overlapped=overlapped) is None
            # one that found round 5's group (withdrawn) is no partner for us: that group formed without us
            assert passed_by(Declaring(None, {6: {"a": looking}, 5: {"b": False}}), 5, overlapped=overlapped)
