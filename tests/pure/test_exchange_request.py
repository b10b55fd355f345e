"""What an exchange serves: a client's own request, or a batch's part, held to one Protocol."""

from __future__ import annotations

from twisted.internet.error import ConnectionDone
from twisted.python.failure import Failure
from twisted.web.server import Request
from twisted.web.test.requesthelper import DummyChannel

from nixl_twisted.exchange.batch import PartRequest
from nixl_twisted.exchange.request import ExchangeRequest, connected


def client() -> Request:
    request = Request(DummyChannel())
    request.uri = request.path = b"/v1/completions"
    return request


def test_a_clients_request_is_connected_until_its_connection_is_lost() -> None:
    request = client()
    served: ExchangeRequest = request
    assert connected(served) is request
    request.connectionLost(Failure(ConnectionDone()))
    assert connected(served) is None


def test_a_batch_part_has_no_connection_to_pause_or_close() -> None:
    written: list[bytes] = []
    part: ExchangeRequest = PartRequest(client(), 0, written.append)
    assert connected(part) is None
    part.setResponseCode(200)
    part.write(b"data")
    assert (written, part.startedWriting) == ([b"data"], True)
