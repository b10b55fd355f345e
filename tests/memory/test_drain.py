"""A stopping proxy hands its clients over (``TrackingSite.hand_over``, from SIGTERM): every
answer says ``Connection: close`` and closes its connection, an idle kept-alive connection
is closed at once, so that clients reconnect through their balancer to another replica."""

from __future__ import annotations

import json

from nixl_twisted.testing import InMemoryClient
from nixl_twisted.testing.memory import Answer, parse_answer
from tests.memory.support import CHAT, Setup, assert_error

BODY = json.dumps(CHAT).encode()
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy.memory\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


def ask(client: InMemoryClient) -> Answer:
    """One more chat request on ``client``'s connection: its answer, once it has one."""
    before = len(client.received())
    client.send(REQUEST)
    return parse_answer(client.received()[before:])


def test_from_the_hand_over_every_answer_closes_its_connection_and_idle_ones_close() -> None:
    setup = Setup()
    idle = setup.proxy.connect()
    kept = ask(idle)
    assert (kept.status, kept.values("connection")) == (200, [])  # kept alive before
    assert not idle.transport.disconnecting
    opened = setup.proxy.connect()  # a connection whose first request is on its way
    setup.decode.hold_answers()
    in_flight = setup.post("/v1/chat/completions", CHAT)
    assert in_flight.received() == b""

    setup.proxy.service.site.hand_over()
    setup.proxy.flush()
    assert idle.lost  # idle between requests: closed now
    assert not opened.transport.disconnecting  # (its request, when it comes, is answered)
    assert not in_flight.transport.disconnecting
    setup.decode.release()
    setup.proxy.flush()
    answer = in_flight.answer()
    assert (answer.status, answer.values("connection")) == (200, ["close"])
    assert in_flight.lost  # closed once its answer was written
    answer = ask(opened)
    assert (answer.status, answer.values("connection")) == (200, ["close"])
    assert opened.lost
    fresh = setup.post("/v1/chat/completions", CHAT)  # (during --shutdown-delay: served)
    assert (fresh.answer().status, fresh.answer().values("connection")) == (200, ["close"])
    assert fresh.lost


def test_a_request_refused_while_draining_closes_its_connection() -> None:
    setup = Setup()
    opened = setup.proxy.connect()
    # What SIGTERM does, once the shutdown delay ends: an open connection's next request ...
    setup.proxy.service.site.hand_over()
    setup.proxy.app.admission.start_draining()
    answer = ask(opened)
    # ... is refused, and its client's pool told to connect again (through the balancer).
    assert_error(answer, 503, "draining")
    assert answer.values("connection") == ["close"]
    assert answer.values("retry-after") == ["1"]
    assert opened.lost
