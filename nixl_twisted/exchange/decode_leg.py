"""A completion's decode leg and its relay: decode's answer to the client as it comes.

One attempt at one instance is ``decode.decode_attempt``, the bytes' path
``relay.relay_body``; this is the leg around them: the handoff's gap
measured, the first byte timed (and the SSE keep-alive stopped by it),
decode's error answer given in-band once the client has its 200, and a
body that breaks off or goes silent ended as such, never passed off as whole.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from twisted.internet.defer import CancelledError
from twisted.logger import Logger
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import Lease
from nixl_twisted.backends.routing import Routing
from nixl_twisted.exchange.decide import Decision, Mode
from nixl_twisted.exchange.decode import DecodeRequest, decode_attempt, note_handoff
from nixl_twisted.exchange.keepalive import KeepAlive
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.relay import StreamSilent, abandon, break_off, relay_body, start_response
from nixl_twisted.exchange.sending import Asked, ByPolicy, reason_of, send_leg
from nixl_twisted.exchange.served import Served
from nixl_twisted.observe.spans import AttemptTrace
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.headers import REQUEST_ID
from nixl_twisted.protocol.phases import Phase
from nixl_twisted.protocol.usage import UsageChunkHidden, read_usage

log = Logger()

#: Given the decode instance's URL, what watches its answer pass (the Responses API's ids).
Watch = Callable[[str], Callable[[bytes], bool]]


class DecodeLeg:
    """Decode for one completion, as decided: its instance's answer relayed to the client."""

    def __init__(
        self,
        legs: Legs,
        completion: Completion,
        routing: Routing,
        served: Served,
        keepalive: KeepAlive | None = None,
        watch: Watch | None = None,
    ) -> None:
        """``keepalive``: the stream's comment frames until its first token (None: none)."""
        self.legs = legs
        self.completion = completion
        self.routing = routing
        self.served = served
        self.keepalive = keepalive
        self.watch = watch
        #: Decode alone computes the prompt (``Mode.DECODE_ONLY``), and when prefill's params
        #: were read otherwise; when the attempt out now was sent.
        self._alone = False
        self._handed_at = 0.0
        self._sent_at = 0.0

    async def send(
        self, sent: DecodeRequest, reserved: Lease, decision: Decision, handed_at: float
    ) -> None:
        """``sent`` to decode (first the ``reserved`` instance, then the pool's choice), and its
        answer relayed; ``handed_at``: when prefill's params were read (a ``Mode.PD`` leg)."""
        legs, served, pool = self.legs, self.served, self.legs.backends.decode
        phases = served.phases
        self._alone, self._handed_at = decision.mode is Mode.DECODE_ONLY, handed_at
        decode, response = await send_leg(
            pool,
            legs.metrics,
            lambda instance, span: self._attempt(instance, span, sent),
            ByPolicy(pool, legs.metrics, self.routing, served.config.retries.decode, served.room),
            Asked(served.trace, served.record, self._wanted),
            reserved,
        )
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
                return
            phases.enter(Phase.RELAY)
            await self._relay(response, decode)
        finally:
            decode.release()

    def _wanted(self) -> bool:
        """A decode-only request has no prefill blocks to free: nobody to answer, no retry."""
        return not (self.served.phases.client_gone and self._alone)

    async def _attempt(
        self, instance: Instance, span: AttemptTrace, sent: DecodeRequest
    ) -> IResponse:
        served, completion = self.served, self.completion
        served.phases.attempting(span)
        self._sent_at = self.legs.clock.seconds()
        if self._alone:  # (computed there on purpose: not an alarm)
            ids = completion.token_ids
            instance.alone_tokens += len(ids) if ids else completion.estimate or 0
        response = await decode_attempt(
            self.legs, instance, span, sent, served.record, served.phases.track
        )
        if not self._alone:
            gap = self._sent_at - self._handed_at
            served.record.handoff_gap_seconds = gap
            warning = served.config.timeouts.handoff_warning
            note_handoff(self.legs.metrics, gap, warning, completion.request_id, instance.url)
        served.record.decode_status = response.code
        return response

    def _first_byte(self, instance: Instance) -> None:
        if self.keepalive is not None:
            self.keepalive.stop()
        waited = self.legs.clock.seconds() - self._sent_at
        self.served.record.decode_first_byte_seconds = waited
        metrics = self.legs.metrics
        metrics.child(metrics.decode_first_byte_seconds, instance.url).observe(waited)

    async def _relay(self, response: IResponse, decode: Lease) -> None:
        served, keepalive = self.served, self.keepalive
        request, phases, timeouts = served.request, served.phases, served.config.timeouts
        if keepalive is not None and keepalive.in_band(response):
            # The client has its 200 already: decode's error answer goes in-band.
            await phases.track(keepalive.answer_in_band(response, timeouts.stream_idle))
            return
        if keepalive is None or not keepalive.opened:
            start_response(request, response)
        try:
            watching = self.watch(decode.instance.url) if self.watch is not None else None
            await phases.track(
                relay_body(
                    request,
                    response,
                    self.legs.clock,
                    timeouts.stream_idle,
                    partial(self._first_byte, decode.instance),
                    watching,
                    self._used,
                    UsageChunkHidden() if self.completion.hides_usage else None,
                )
            )
        except CancelledError:
            raise
        except Exception as error:
            await self._broken(error, decode.instance.url)

    async def _broken(self, error: Exception, url: str) -> None:
        """Decode's body broke off or went silent: a 504 if the client has had nothing, else
        the stream ended so that the client can tell."""
        served, phases = self.served, self.served.phases
        request_id = self.completion.request_id
        silent = isinstance(error, StreamSilent)
        phases.failed(str(error) if silent else f"broke off: {reason_of(error)}", "relay")
        if silent and not served.request.startedWriting:
            served.request.responseHeaders = Headers({REQUEST_ID: [request_id.encode()]})
            raise ProxyError(
                ErrorCode.DECODE_TIMEOUT,
                "the decode instance sent headers, then nothing",
                detail=f"decode instance {url} sent headers, then nothing: {error}",
            ) from None
        log.error(
            "decode body for {request_id} broke off: {reason}",
            request_id=request_id,
            reason=reason_of(error),
        )
        served.record.ended = "broken"
        said = (
            f"decode went silent mid-stream: {error}"
            if silent
            else "decode closed the stream early"
        )
        served.record.error = said
        # The client is told what happened; the detail is in the log line above.
        phases.breaking_off()
        await break_off(
            served.request,
            said,
            ErrorCode.DECODE_TIMEOUT if silent else ErrorCode.DECODE_STREAM_BROKEN,
        )

    def _used(self, tail: bytes) -> None:
        """What decode's answer reported using, from its last chunks."""
        self.served.record.usage = read_usage(tail)
