"""``PLACE``'s reply read by name: each part checked, the ready lane's count among them."""

from __future__ import annotations

import pytest

from nixl_twisted.fleet.queue_scripts import BLOCKED, GRANTED, QUEUED, read_place
from nixl_twisted.fleet.replies import WrongReply

VIEW = [b"prefill|http://p:1", 2]


def test_a_reply_carries_the_ready_lane_of_its_model() -> None:
    granted = read_place([GRANTED, b"", VIEW, 3, [b"1000"], 7, 4])
    assert (granted.code, granted.view, granted.version) == (GRANTED, {"prefill|http://p:1": 2}, 7)
    assert (granted.waiting, granted.grants, granted.ready) == (3, [1000.0], 4)
    assert read_place([BLOCKED, b"decode", VIEW, 0, [], 7, 2]).ready == 2
    queued = read_place([QUEUED, b"0001:r:1\nqueued\n1.5\n", VIEW, 1, [], 8, 5])
    assert (queued.member, queued.finish, queued.blocked, queued.ready) == ("0001:r:1", 1.5, "", 5)


def test_a_reply_without_its_ready_count_or_with_a_wrong_one_is_refused() -> None:
    for wrong in (
        [GRANTED, b"", VIEW, 3, [], 7],  # (the reply of a script before the count)
        [GRANTED, b"", VIEW, 3, [], 7, -1],
        [GRANTED, b"", VIEW, 3, [], 7, b"many"],
        [GRANTED, b"", VIEW, 3, [], 7, True],
        [GRANTED, b"", VIEW, 3, [], 7, 1, 1],
    ):
        with pytest.raises(WrongReply):
            read_place(wrong)
