"""The exchange's decode leg and its relay: decode's answer to the client as it comes.

One attempt at one instance is ``Legs.decode_attempt``, the bytes' path
``relay.relay_body``; this is the leg around them: the handoff's gap
measured, the first byte timed (and the SSE keep-alive stopped by it),
decode's error answered in-band once the client has its 200, and a body
that breaks off or goes silent ended as such, never passed off as whole.
"""

from __future__ import annotations

from functools import partial

from twisted.internet.defer import CancelledError
from twisted.logger import Logger
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import Lease
from nixl_twisted.exchange.decide import Mode
from nixl_twisted.exchange.legs import DecodeRequest, note_handoff
from nixl_twisted.exchange.phased import PhasedExchange
from nixl_twisted.exchange.relay import StreamSilent, break_off, relay_body, start_response
from nixl_twisted.exchange.sending import reason_of
from nixl_twisted.observe.spans import LegTrace
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.headers import REQUEST_ID
from nixl_twisted.protocol.usage import UsageChunkHidden, read_usage

log = Logger()


class DecodeLeg(PhasedExchange):
    """What a completion does from its decode request on: send, time, relay."""

    def _decode_wanted(self) -> bool:
        """A decode-only request has no prefill blocks to free: nobody to answer, no retry."""
        return not (self.client_gone and self.decision.mode is Mode.DECODE_ONLY)

    async def _decode(
        self, instance: Instance, leg: LegTrace, completed: DecodeRequest
    ) -> IResponse:
        self._leg = leg
        self._decode_sent = self.clock.seconds()
        if self.decision.mode is Mode.DECODE_ONLY:  # (computed there on purpose: not an alarm)
            token_ids = self.completion.token_ids
            instance.alone_tokens += len(token_ids) if token_ids else self.completion.estimate or 0
        response = await self.legs.decode_attempt(
            instance, leg, completed, self.record, self._track
        )
        if self.decision.mode is Mode.PD:
            self._handoff_gap(instance)
        self.record.decode_status = response.code
        return response

    def _handoff_gap(self, instance: Instance) -> None:
        gap = self._decode_sent - self._params_at
        self.record.handoff_gap_seconds = gap
        note_handoff(
            self.metrics, gap, self.timeouts.handoff_warning, self.request_id, instance.url
        )

    def _first_byte(self, instance: Instance) -> None:
        if self.keepalive is not None:
            self.keepalive.stop()
        waited = self.clock.seconds() - self._decode_sent
        self.record.decode_first_byte_seconds = waited
        self.metrics.child(self.metrics.decode_first_byte_seconds, instance.url).observe(waited)

    async def _relay(self, response: IResponse, decode: Lease) -> None:
        keepalive = self.keepalive
        if keepalive is not None and keepalive.in_band(response):
            # The client has its 200 already: decode's error answer goes in-band.
            idle = self.timeouts.stream_idle
            await self._track(keepalive.answer_in_band(response, idle))
            return
        if keepalive is None or not keepalive.opened:
            start_response(self.request, response)
        try:
            watching = self.watch(decode.instance.url) if self.watch is not None else None
            await self._track(
                relay_body(
                    self.request,
                    response,
                    self.clock,
                    self.timeouts.stream_idle,
                    partial(self._first_byte, decode.instance),
                    watching,
                    self._used,
                    UsageChunkHidden() if self.completion.hides_usage else None,
                )
            )
        except CancelledError:
            raise
        except Exception as error:
            silent = isinstance(error, StreamSilent)
            self._leg.fail(str(error) if silent else f"broke off: {reason_of(error)}", "relay")
            if silent and not self.request.startedWriting:
                self.request.responseHeaders = Headers({REQUEST_ID: [self.request_id.encode()]})
                url = decode.instance.url
                raise ProxyError(
                    ErrorCode.DECODE_TIMEOUT,
                    "the decode instance sent headers, then nothing",
                    detail=f"decode instance {url} sent headers, then nothing: {error}",
                ) from None
            log.error(
                "decode body for {request_id} broke off: {reason}",
                request_id=self.request_id,
                reason=reason_of(error),
            )
            self.record.ended = "broken"
            said = (
                f"decode went silent mid-stream: {error}"
                if silent
                else "decode closed the stream early"
            )
            self.record.error = said
            # The client is told what happened; the detail is in the log line above.
            self.broke_off = True
            await break_off(
                self.request,
                said,
                ErrorCode.DECODE_TIMEOUT if silent else ErrorCode.DECODE_STREAM_BROKEN,
            )

    def _used(self, tail: bytes) -> None:
        """What decode's answer reported using, from its last chunks."""
        self.record.usage = read_usage(tail)
