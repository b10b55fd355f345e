"""A decode answer that failed after its headers, and how its request ends when it does not move.

Decode's body broke off, went silent past ``--stream-idle-timeout``,
answered an in-band error event, or its instance was marked down while it
streamed: a ``Break``. A migration (``migration``) may continue the answer
elsewhere; when none does, ``Break.end`` ends the request so that the
client can tell (``docs/failures.md``): a 504 or 502 if the client has had
nothing yet, else an in-band error event and a connection closed short,
never a complete-looking answer; vLLM's own error event is relayed as it
came.
"""

from __future__ import annotations

from dataclasses import dataclass

from twisted.logger import Logger
from twisted.web.http_headers import Headers

from nixl_twisted.exchange.relay import StreamSilent, break_off
from nixl_twisted.exchange.sending import Retry, reason_of
from nixl_twisted.exchange.served import Served
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.headers import REQUEST_ID

log = Logger()


class ErrorEvent(Exception):
    """Decode answered an in-band error event (vLLM's ``data: {"error": ...}``) mid-answer."""


class InstanceDown(Exception):
    """The decode instance was marked down while its answer streamed."""


@dataclass(frozen=True)
class Break:
    """How one decode answer failed after its headers."""

    error: Exception
    #: The decode instance whose answer it was.
    url: str
    #: The error event caught, and what followed it, as decode sent them (None: none).
    caught: bytes | None = None
    #: The answer was held whole (not streamed): nothing of it reached the client.
    held: bool = False

    @property
    def silent(self) -> bool:
        return isinstance(self.error, StreamSilent)

    @property
    def said(self) -> str:
        """What the client is told, without the instance or the low-level cause."""
        if self.silent:
            return f"decode went silent mid-stream: {self.error}"
        if isinstance(self.error, InstanceDown):
            return "the decode instance was marked down mid-stream"
        return "decode closed the stream early"

    @property
    def reason(self) -> str:
        """What the log and the trace say of it."""
        if self.caught is not None:
            return "answered an error event"
        return str(self.error) if self.silent else f"broke off: {reason_of(self.error)}"

    async def end(self, served: Served) -> None:
        """End the request as it ends without a migration."""
        request, record, phases = served.request, served.record, served.phases
        if self.caught is not None and isinstance(self.error, ErrorEvent):
            request.write(self.caught)  # (vLLM's own event and its end, relayed as they came)
            return
        request_id = record.request_id
        if not request.startedWriting and isinstance(self.error, Retry):
            # Lost before decode's headers: the status the leg would have ended with.
            record.error = self.error.error.message
            raise self.error.error from None
        if not request.startedWriting and (self.silent or self.held):
            # Nothing reached the client: a status says it (a whole answer is held until
            # it is complete, so it never ends short).
            request.responseHeaders = Headers({REQUEST_ID: [str(request_id).encode()]})
            record.error = self.said
            raise ProxyError(
                ErrorCode.DECODE_TIMEOUT if self.silent else ErrorCode.DECODE_STREAM_BROKEN,
                "the decode instance sent headers, then nothing"
                if self.silent
                else "the decode instance broke off its answer",
                detail=f"decode instance {self.url} {self.reason}",
            ) from None
        log.error(
            "decode body for {request_id} broke off: {reason}",
            request_id=request_id,
            reason=self.reason,
        )
        record.ended = "broken"
        record.error = self.said
        if self.caught is not None:
            request.write(self.caught)
        # The client is told what happened; the detail is in the log line above.
        phases.breaking_off()
        await break_off(
            request,
            self.said,
            ErrorCode.DECODE_TIMEOUT if self.silent else ErrorCode.DECODE_STREAM_BROKEN,
        )
