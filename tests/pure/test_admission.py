"""Admission: the in-flight limit and the drain."""

from __future__ import annotations

import pytest

from nixl_twisted.admission.gate import Admission
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError


def test_past_the_limit_is_a_503_and_a_release_makes_room() -> None:
    admission = Admission(max_in_flight=2)
    admission.admit()
    admission.admit()
    with pytest.raises(ProxyError) as refused:
        admission.admit()
    assert (refused.value.status, refused.value.code) == (
        503,
        ErrorCode.TOO_MANY_REQUESTS_IN_FLIGHT,
    )
    assert admission.release("passed on") == "passed on"
    admission.admit()
    assert admission.in_flight == 2


def test_draining_refuses_everything_and_fires_when_the_last_request_ends() -> None:
    admission = Admission(max_in_flight=8)
    admission.admit()
    admission.start_draining()
    drained = admission.drained()
    with pytest.raises(ProxyError, match="shutting down"):
        admission.admit()
    assert not drained.called
    admission.release()
    assert drained.called


def test_draining_with_nothing_in_flight_is_drained_at_once() -> None:
    admission = Admission(max_in_flight=8)
    admission.start_draining()
    assert admission.drained().called
