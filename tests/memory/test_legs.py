"""One attempt of a decode leg (``decode.decode_attempt``), in memory: what each outcome counts.

A completion's decode leg and the single-leg routes share this one attempt;
here it runs against a scripted decode resource behind treq's in-memory
agent, time on a ``Clock``.
"""

from __future__ import annotations

from typing import Any

import pytest
from treq.testing import RequestTraversalAgent
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred, fail
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IBodyProducer, IResponse
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request
from zope.interface import implementer

from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.service import BackendService
from nixl_twisted.backends.upstream import Upstream
from nixl_twisted.config import ProxyConfig
from nixl_twisted.exchange.decode import DecodeRequest, decode_attempt
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.sending import Retry
from nixl_twisted.kv.events import KvEvents
from nixl_twisted.observe.access import AccessRecord
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.observe.spans import NO_ATTEMPT
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError

LIVE, DEAD = "http://decode.memory", "http://dead.memory"


class Decode(Resource):
    """Answers ``status`` at once, or holds every request when ``holding``."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.status = 200
        self.holding = False
        self.seen: list[tuple[bytes, bytes, bytes, Headers]] = []
        #: Held requests whose connection the proxy closed.
        self.cut: list[Request] = []

    def render(self, request: Request) -> Any:
        assert request.content is not None
        self.seen.append(
            (request.method, request.uri, request.content.read(), request.requestHeaders)
        )
        if self.holding:
            request.notifyFinish().addErrback(lambda _: self.cut.append(request))
            return NOT_DONE_YET
        request.setResponseCode(self.status)
        return b"{}"


@implementer(IAgent)
class Backends:
    """The decode resource as an agent; the dead instance refuses every connection."""

    def __init__(self, decode: Decode) -> None:
        self.traversal = RequestTraversalAgent(decode)

    def request(
        self,
        method: bytes,
        uri: bytes,
        headers: Headers | None = None,
        bodyProducer: IBodyProducer | None = None,
    ) -> Deferred[IResponse]:
        if uri.startswith(DEAD.encode()):
            return fail(ConnectionRefusedError("refused"))
        return self.traversal.request(method, uri, headers, bodyProducer)


class Setup:
    def __init__(self) -> None:
        self.clock = Clock()
        self.decode = Decode()
        self.agent = Backends(self.decode)
        self.pool = BackendPool("decode", [LIVE, DEAD], self.clock)
        prefill = BackendPool("prefill", ["http://prefill.memory"], self.clock)
        given = {"prefill": ["http://prefill.memory"], "decode": [LIVE, DEAD]}
        config = ProxyConfig.create(**given, health_interval=0)
        backends = BackendService(prefill, self.pool, Upstream(self.agent), config)
        self.metrics = ProxyMetrics()
        kv = KvEvents(self.clock, self.clock, backends.pools(), config)
        self.legs = Legs(backends, kv, self.clock, self.metrics, config)
        self.record = AccessRecord()
        self.tracked: list[Deferred[IResponse]] = []

    def attempt(self, url: str, body: bytes | None = b'{"a": 1}') -> list[Any]:
        """Start one attempt on ``url``; what it ends with lands in the list returned."""
        (instance,) = [i for i in self.pool.instances if i.url == url]
        request = DecodeRequest("/v1/x?q=1", body, Headers({b"x-request-id": [b"r1"]}), 5.0)

        def track(waiting: Deferred[IResponse]) -> Deferred[IResponse]:
            self.tracked.append(waiting)
            return waiting

        ended: list[Any] = []
        sent = decode_attempt(self.legs, instance, NO_ATTEMPT, request, self.record, track)
        ensureDeferred(sent).addBoth(ended.append)
        self.agent.traversal.flush()
        return ended

    def outcomes(self, url: str) -> dict[str, float]:
        return {
            outcome: self.metrics.registry.get_sample_value(
                "nixlproxy_backend_requests_total",
                {"pool": "decode", "instance": url, "outcome": outcome},
            )
            or 0.0
            for outcome in ("answered", "error_status", "timeout")
        }

    def failures(self, url: str) -> int:
        (instance,) = [i for i in self.pool.instances if i.url == url]
        return instance.failures


def test_an_answer_is_the_response_its_body_unread_and_the_instance_counted_up() -> None:
    setup = Setup()
    (response,) = setup.attempt(LIVE)
    assert response.code == 200
    ((method, uri, body, headers),) = setup.decode.seen
    assert (method, uri, body) == (b"POST", b"/v1/x?q=1", b'{"a": 1}')
    assert headers.getRawHeaders(b"x-request-id") == [b"r1"]
    assert setup.record.decode == LIVE
    assert setup.outcomes(LIVE) == {"answered": 1, "error_status": 0, "timeout": 0}
    assert len(setup.tracked) == 1  # what was awaited could have been cancelled


def test_no_body_is_a_get() -> None:
    setup = Setup()
    (response,) = setup.attempt(LIVE, body=None)
    assert response.code == 200
    assert [(method, body) for method, _, body, _ in setup.decode.seen] == [(b"GET", b"")]


def test_an_error_status_is_the_answer_and_the_instance_stays_up() -> None:
    setup = Setup()
    setup.decode.status = 500  # a KV-load failure: the request's, not the instance's
    (response,) = setup.attempt(LIVE)
    assert response.code == 500
    assert setup.outcomes(LIVE) == {"answered": 0, "error_status": 1, "timeout": 0}
    assert setup.failures(LIVE) == 0


def test_an_unreachable_instance_is_a_retry_and_nothing_is_counted_yet() -> None:
    setup = Setup()
    (failure,) = setup.attempt(DEAD)
    assert isinstance(failure, Failure)
    retry = failure.value
    assert isinstance(retry, Retry)
    assert (retry.outcome, retry.error.status, retry.error.code) == (
        "unreachable",
        502,
        ErrorCode.DECODE_UNREACHABLE,
    )
    assert retry.error.detail.startswith(f"decode instance {DEAD} could not be reached: ")
    assert retry.error.message == "a decode instance could not be reached"  # (the client's)
    # send_leg accounts for a Retry: the attempt itself has counted nothing.
    assert setup.outcomes(DEAD) == {"answered": 0, "error_status": 0, "timeout": 0}
    assert setup.failures(DEAD) == 0


def test_no_headers_within_the_timeout_is_a_504_counted_against_the_instance() -> None:
    setup = Setup()
    setup.decode.holding = True
    ended = setup.attempt(LIVE)
    setup.clock.advance(4.9)
    assert ended == []
    setup.clock.advance(0.1)
    setup.agent.traversal.flush()
    (failure,) = ended
    assert isinstance(failure, Failure)
    error = failure.value
    assert isinstance(error, ProxyError)
    assert (error.status, error.code) == (504, ErrorCode.DECODE_TIMEOUT)
    assert error.detail == f"decode instance {LIVE} did not answer within 5 s"
    assert error.message == "a decode instance did not answer within 5 s"
    assert len(setup.decode.cut) == 1  # its connection closed: vLLM aborts the request
    assert setup.outcomes(LIVE) == {"answered": 0, "error_status": 0, "timeout": 1}
    assert setup.failures(LIVE) == 1


def test_cancelling_what_is_awaited_ends_the_attempt_with_nothing_counted() -> None:
    setup = Setup()
    setup.decode.holding = True
    ended = setup.attempt(LIVE)
    (waiting,) = setup.tracked
    waiting.cancel()  # the client left: the exchange cancels what it tracks
    setup.agent.traversal.flush()
    (failure,) = ended
    assert isinstance(failure, Failure) and failure.check(CancelledError)
    assert len(setup.decode.cut) == 1
    assert setup.outcomes(LIVE) == {"answered": 0, "error_status": 0, "timeout": 0}
    assert setup.failures(LIVE) == 0


@pytest.mark.parametrize("url", [LIVE, DEAD])
def test_the_record_names_the_instance_tried(url: str) -> None:
    setup = Setup()
    setup.attempt(url)
    assert setup.record.decode == url
