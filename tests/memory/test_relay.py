"""The relay's clock: decode's silence against a client that stopped reading, and a stream's end.

A client whose connection paused decode (its buffer full) holds decode
silent: that silence is the client's, never decode's (``StreamSilent``
would move the answer to another instance and count against this one);
a client that reads nothing for the whole timeout is ``ClientSlow``.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss, Request
from twisted.web.test.requesthelper import DummyChannel

from nixl_twisted.exchange.relay import ClientSlow, StreamCutShort, StreamSilent, relay
from nixl_twisted.exchange.relay_parts import NO_PASSES, Seen, Silence
from nixl_twisted.protocol import events, routes

IDLE = 10.0


class _Body:
    """Decode's response as far as the relay reads it: a body delivered over a transport."""

    def __init__(self) -> None:
        self.transport = StringTransport()
        self.protocol: Protocol | None = None

    def deliverBody(self, protocol: Protocol) -> None:
        self.protocol = protocol
        protocol.makeConnection(self.transport)


def _relayed(terminal: tuple[bytes, ...] = ()) -> tuple[Clock, Request, _Body, Deferred[None]]:
    clock = Clock()
    request = Request(cast(Any, DummyChannel()))
    body = _Body()
    seen = Seen(terminal=terminal)
    finished = relay(request, cast(Any, body), Silence(clock, IDLE), NO_PASSES, seen)
    return clock, request, body, finished


def _failure(finished: Deferred[None]) -> Failure:
    failures: list[Failure] = []
    finished.addErrback(failures.append)
    assert failures, "the relay had not ended"
    return failures[0]


def test_a_client_that_reads_nothing_is_slow_not_decode_silent() -> None:
    clock, request, body, finished = _relayed()
    cast(IPushProducer, request.producer).pauseProducing()  # the client's buffer is full
    assert body.transport.producerState == "paused"
    clock.advance(IDLE - 0.001)
    assert not finished.called
    clock.advance(0.001)
    assert _failure(finished).check(ClientSlow)
    assert body.transport.producerState == "stopped"  # (decode's connection closed)


def test_decode_silence_is_counted_from_when_the_client_reads_again() -> None:
    clock, request, _, finished = _relayed()
    producer = cast(IPushProducer, request.producer)
    clock.advance(IDLE * 0.5)
    producer.pauseProducing()
    clock.advance(IDLE * 0.9)  # (past decode's timeout since its last byte: paused, not silent)
    assert not finished.called
    producer.resumeProducing()
    clock.advance(IDLE - 0.001)
    assert not finished.called
    clock.advance(0.001)
    assert _failure(finished).check(StreamSilent)


def test_decode_silent_while_the_client_reads_is_decode_silent() -> None:
    clock, _, _, finished = _relayed()
    clock.advance(IDLE)
    assert _failure(finished).check(StreamSilent)


@pytest.mark.parametrize(
    ("path", "last"),
    [
        (routes.CHAT_COMPLETIONS, b"data: [DONE]\n\n"),
        (routes.COMPLETIONS, b"data: [DONE]\n\n"),
        (routes.MESSAGES, b'event: message_stop\ndata: {"type":"message_stop"}\n\n'),
        (routes.RESPONSES, b'event: response.completed\ndata: {"type":"response.completed"}\n\n'),
    ],
)
@pytest.mark.parametrize("ending", [ResponseDone, PotentialDataLoss])
def test_a_stream_is_whole_only_with_its_routes_last_event(
    path: str, last: bytes, ending: type[Exception]
) -> None:
    _, _, body, finished = _relayed(events.terminal(path))
    assert body.protocol is not None
    body.protocol.dataReceived(b'data: {"a": 1}\n\n')
    body.protocol.connectionLost(Failure(ending()))
    assert _failure(finished).check(StreamCutShort)

    _, _, body, finished = _relayed(events.terminal(path))
    assert body.protocol is not None
    body.protocol.dataReceived(b'data: {"a": 1}\n\n' + last[:7])
    body.protocol.dataReceived(last[7:])  # (its last event split across two reads)
    body.protocol.connectionLost(Failure(ending()))
    assert finished.called and finished.result is None


def test_the_last_events_words_inside_a_token_do_not_end_the_stream() -> None:
    _, _, body, finished = _relayed(events.terminal(routes.CHAT_COMPLETIONS))
    assert body.protocol is not None
    body.protocol.dataReceived(b'data: {"content": "data: [DONE]"}\n\n')
    body.protocol.connectionLost(Failure(PotentialDataLoss()))
    assert _failure(finished).check(StreamCutShort)
