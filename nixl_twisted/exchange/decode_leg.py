"""A completion's decode leg and its relay: decode's answer to the client as it comes.

One attempt at one instance is ``decode.decode_attempt``, the bytes' path
``relay.relay``; this is the leg around them: the handoff's gap
measured, the first byte timed (and the SSE keep-alive stopped by it),
decode's error answer given in-band once the client has its 200, and a
body that breaks off, goes silent, answers an error event or whose instance
is marked down moved to another instance or ended as such (``broken``),
never passed off as whole. A move is the leg's answer, not an exception:
``send`` returns ``migration.Moved`` (what continues the answer, and the
instance that failed it), and the exchange alone decides where it goes.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import Lease
from nixl_twisted.backends.routing import Routing
from nixl_twisted.exchange.broken import Break, ErrorEvent, InstanceDown
from nixl_twisted.exchange.decide import Decision, Mode
from nixl_twisted.exchange.decode import DecodeRequest, decode_attempt, note_handoff
from nixl_twisted.exchange.keepalive import KeepAlive
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.migration import Migrations, Moved, NextLeg
from nixl_twisted.exchange.relay import ClientSlow, abandon, close_slow, relay, start_response
from nixl_twisted.exchange.relay_parts import Filter, Passes, Seen, Silence
from nixl_twisted.exchange.sending import Asked, ByPolicy, Retry, account, send_leg
from nixl_twisted.exchange.served import Served
from nixl_twisted.observe.spans import AttemptTrace
from nixl_twisted.protocol import events
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.decode_handle import HandleTaker, resizing
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.headers import REQUEST_ID
from nixl_twisted.protocol.held import Whole
from nixl_twisted.protocol.phases import Phase
from nixl_twisted.protocol.routes import CHAT_COMPLETIONS
from nixl_twisted.protocol.transcript import Transcript
from nixl_twisted.protocol.usage import UsageChunkHidden, read_usage

log = Logger()

#: What a decode attempt's span says when its lost connection moves the answer.
MOVING = "moving to another decode instance"

#: Given the decode instance's URL, what watches its answer pass (the Responses API's ids).
Watch = Callable[[str], Callable[[bytes], bool]]


class DecodeLeg:
    """Decode for one completion, as decided: its instance's answer relayed to the client."""

    #: The instance whose answer is relayed now (its first byte is timed by its URL).
    _relaying_from: Instance

    def __init__(
        self,
        legs: Legs,
        completion: Completion,
        routing: Routing,
        served: Served,
        keepalive: KeepAlive | None = None,
        watch: Watch | None = None,
        moves: Migrations | None = None,
        collect: bool = False,
    ) -> None:
        """``keepalive``: the stream's comment frames until its first token (None: none);
        ``moves``: the completion's migrations (None: off); ``collect``: the ids of decode's
        answer are read with its handle (multi-turn reuse)."""
        self.legs = legs
        self.completion = completion
        self.routing = routing
        self.served = served
        self.keepalive = keepalive
        self.watch = watch
        self.moves = moves
        #: The relay out now, and whether its instance was marked down meanwhile.
        self._relaying: Deferred[None] | None = None
        self._down = False
        #: Decode alone computes the prompt (``Mode.DECODE_ONLY``), and when prefill's params
        #: were read otherwise; when the attempt out now was sent.
        self._alone = False
        self._handed_at = 0.0
        self._sent_at = 0.0
        self.collect = collect
        #: What took decode's handle out of its answer, and the instance that answered it,
        #: once an answer ended whole (None: none did).
        self.answered: tuple[HandleTaker, Instance] | None = None
        self._taken: HandleTaker | None = None

    async def send(
        self, sent: DecodeRequest, reserved: Lease, decision: Decision, handed_at: float
    ) -> Moved | None:
        """``sent`` to decode (first the ``reserved`` instance, then the pool's choice), and its
        answer relayed; ``handed_at``: when prefill's params were read (a ``Mode.PD`` leg).

        Returns what continues the answer on another decode instance (None: it ended,
        whole or broken off as such)."""
        legs, served, pool = self.legs, self.served, self.legs.backends.decode
        phases = served.phases
        self._alone, self._handed_at = decision.mode is Mode.DECODE_ONLY, handed_at
        retries = served.config.retries.decode
        order = _MayMove(pool, legs.metrics, self.routing, retries, served.room)
        decode, response = await send_leg(
            pool,
            legs.metrics,
            lambda instance, span: self._attempt(instance, span, sent),
            order,
            Asked(served.trace, served.record, self._wanted),
            reserved,
        )
        if isinstance(response, Moved):  # (lost once it had the request: the attempt failed)
            decode.release()
            order.failed(decode.instance)
            return response
        served.record.decode_route = decode.decision
        served.record.decode_matched_tokens = self.routing.matched.get("decode")
        try:
            if phases.client_gone:
                phases.failed(f"{phases.client_gone}: decode's answer abandoned")
                abandon(response)
                log.info(
                    "decode for {request_id} abandoned, unread: {why}",
                    request_id=self.completion.request_id,
                    why=phases.client_gone,
                )
                return None
            phases.enter(Phase.RELAY)
            return await self._relay(response, decode)
        finally:
            decode.release()

    def _wanted(self) -> bool:
        """A decode-only request has no prefill blocks to free: nobody to answer, no retry."""
        return not (self.served.phases.client_gone and self._alone)

    async def _attempt(
        self, instance: Instance, span: AttemptTrace, sent: DecodeRequest
    ) -> IResponse | Moved:
        served, completion = self.served, self.completion
        served.phases.attempting(span)
        self._sent_at = self.legs.clock.seconds()
        if self._alone:  # (computed there on purpose: not an alarm)
            ids = completion.token_ids
            instance.alone_tokens += len(ids) if ids else completion.estimate or 0
        if self.moves is not None:
            self.moves.sent_to(instance)
        try:
            response = await decode_attempt(
                self.legs, instance, span, sent, served.record, served.phases.track
            )
        except Retry as retry:
            moved = self._lost(retry, instance) if retry.sent else None
            if moved is None:
                raise
            span.fail(MOVING)
            return moved
        if not self._alone:
            gap = self._sent_at - self._handed_at
            served.record.handoff_gap_seconds = gap
            warning = served.config.timeouts.handoff_warning
            note_handoff(self.legs.metrics, gap, warning, completion.request_id, instance.url)
        served.record.decode_status = response.code
        return response

    def _first_byte(self) -> None:
        if self.keepalive is not None:
            self.keepalive.stop()
        waited = self.legs.clock.seconds() - self._sent_at
        if self.moves is None or self.moves.leg is NextLeg.FIRST:  # (the first leg's, kept)
            self.served.record.decode_first_byte_seconds = waited
        else:
            self.moves.first_byte()
        metrics = self.legs.metrics
        url = self._relaying_from.url
        metrics.child(metrics.decode_first_byte_seconds, url).observe(waited)

    async def _relay(self, response: IResponse, decode: Lease) -> Moved | None:
        served, keepalive, moves = self.served, self.keepalive, self.moves
        request, phases, timeouts = served.request, served.phases, served.config.timeouts
        leg = moves.leg if moves is not None else NextLeg.FIRST
        resuming = leg is NextLeg.RESUMING
        if resuming and response.code != 200:
            abandon(response)  # (the client has part of an answer: this one cannot be it)
            raise ProxyError(
                ErrorCode.DECODE_STREAM_BROKEN,
                "the decode instance broke off its answer",
                detail=f"a continuation's decode answered {response.code}",
            )
        if not resuming and keepalive is not None and keepalive.in_band(response):
            # The client has its 200 already: decode's error answer goes in-band.
            await phases.track(keepalive.answer_in_band(response, timeouts.stream_idle))
            return None
        if not resuming and (keepalive is None or not keepalive.opened):
            if leg is NextLeg.AFRESH:  # (an answer again: the first one's headers go)
                request.responseHeaders = Headers({REQUEST_ID: [self._request_id]})
            start_response(request, response)
        filtered = moves.filtered() if moves is not None else None
        instance = decode.instance
        if filtered is not None:
            instance.on_down.add(self._marked_down)
        try:
            failed = await self._relayed(response, decode, filtered)
        finally:
            instance.on_down.discard(self._marked_down)
        pool = self.legs.backends.decode
        if isinstance(failed, ClientSlow):
            await self._slow(failed)  # (the client's doing: decode is not judged by it)
            return None
        if failed is None:
            if self._taken is not None:
                self.answered = (self._taken, instance)
            if response.code < 500:  # (a 5xx was counted as its leg's error: ``decode``)
                pool.record_success(instance)  # (judged once its answer ended whole)
            if moves is not None:
                moves.completed()
            return None
        caught = filtered.error if filtered is not None else None
        # (nothing of it was sent: a whole answer held until complete)
        held = isinstance(filtered, Whole) and not filtered.done
        held = held or (self._taken is not None and self._taken.holding)
        broke = Break(failed, instance.url, caught, held)
        if not isinstance(failed, InstanceDown):
            # A broken answer counts toward marking its instance down, as any failed leg.
            said = f"stalled ({broke.reason})" if broke.silent else broke.reason
            pool.record_failure(instance, f"its answer {said}")
        return await self._broken(broke, instance)

    async def _relayed(
        self, response: IResponse, decode: Lease, filtered: Filter | None
    ) -> Exception | None:
        """Decode's body relayed; what failed it after its headers (None: it ended whole)."""
        served = self.served
        self._relaying_from = decode.instance
        watching = self.watch(decode.instance.url) if self.watch is not None else None
        kind = response.headers.getRawHeaders(b"content-type", [b""])[0]
        streamed = kind.startswith(b"text/event-stream")
        self._taken = taken = self._taker(streamed, filtered)
        self._relaying = relay(
            served.request,
            response,
            Silence(self.legs.clock, served.config.timeouts.stream_idle),
            Passes(filtered, UsageChunkHidden() if self.completion.hides_usage else None, taken),
            Seen(
                self._first_byte,
                watching,
                self._used,
                events.terminal(self.completion.path) if streamed else (),
            ),
        )
        try:
            await served.phases.track(self._relaying)
        except CancelledError:
            if not self._down:
                raise
            return InstanceDown(f"decode instance {decode.instance.url} marked down")
        except Exception as error:
            if filtered is None or filtered.error is None or isinstance(error, ClientSlow):
                return error
        if filtered is not None and filtered.error is not None:
            return ErrorEvent("an error event")
        return None

    def _taker(self, streamed: bool, filtered: Filter | None) -> HandleTaker:
        """What takes decode's handle out of its answer (always: it is no client's), and with
        ``collect`` reads its ids, shown as the client asked (a migration's transcript
        shows them so itself)."""
        completion, collect = self.completion, self.collect
        asked = completion.body.get("return_token_ids") is True
        strip = collect and not asked and not isinstance(filtered, Transcript)
        resized = resizing(self.served.request.responseHeaders)
        chat = completion.path == CHAT_COMPLETIONS
        return HandleTaker(streamed, resized, collect, strip, chat)

    async def _slow(self, slow: ClientSlow) -> None:
        """The client stopped reading: its answer ends as its own doing, never decode's (no
        move, no failure counted against the instance)."""
        served = self.served
        served.phases.failed(str(slow), "relay")
        served.phases.breaking_off()
        log.info(
            "client of {request_id} read nothing of its answer for {seconds:g} s: "
            "closed (client_slow)",
            request_id=self.completion.request_id,
            seconds=served.config.timeouts.stream_idle,
        )
        served.record.ended = "client_slow"
        await close_slow(served.request)

    def _lost(self, retry: Retry, instance: Instance) -> Moved | None:
        """Decode's connection was lost once it had the request: it may have pulled prefill's
        KV, which prefill then frees, so the answer moves whole, with a prefill of its own,
        rather than the same params going to another instance (the retry, when it cannot:
        None)."""
        moves = self.moves
        if moves is None or not moves.movable():
            return None
        moved = moves.move(Break(retry, instance.url), instance)
        if moved is not None:  # (else the leg's retry counts the failure, once)
            account(
                self.legs.metrics, self.legs.backends.decode, instance, retry.outcome, retry.down
            )
        return moved

    def _marked_down(self) -> None:
        """The instance streaming this answer was marked down: the answer moves now, if it
        can (else it streams on for as long as the instance sends it)."""
        relaying = self._relaying
        if relaying is None or relaying.called or self.moves is None:
            return
        if self.moves.movable():
            self._down = True
            relaying.cancel()

    @property
    def _request_id(self) -> bytes:
        return self.completion.request_id.encode()

    async def _broken(self, broke: Break, instance: Instance) -> Moved | None:
        """Decode's answer failed after its headers: it moves to another instance
        (``Moved``), or ends so that the client can tell (``Break.end``)."""
        self.served.phases.failed(broke.reason, "relay")
        if self.moves is not None:
            moved = self.moves.move(broke, instance)
            if moved is not None:
                return moved
        await broke.end(self.served)
        return None

    def _used(self, tail: bytes) -> None:
        """What decode's answer reported using, from its last chunks."""
        self.served.record.usage = read_usage(tail)


class _MayMove(ByPolicy):
    """The decode pool's order: an attempt whose lost connection moved the answer is noted
    as failed in the access event, as every failed attempt."""

    def answered(self, served: object) -> str:
        return "failed" if served.__class__ is Moved else "answered"
