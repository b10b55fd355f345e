"""The single-leg routes: relayed to the next decode instance as they are.

``GET /v1/models``, ``POST /tokenize`` and ``POST /detokenize`` need no
prefill: one leg to a decode instance, with the same guarantees as a
completion's decode leg (retries before the first byte, ``--decode-timeout``
for the headers, ``--stream-idle-timeout`` for the body, a body that breaks
off never passed off as complete). A JSON body's ``kv_transfer_params`` is
the proxy's to set, never the client's: it is dropped before the leg.
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.iweb import IResponse
from twisted.web.server import Request

from nixl_twisted import lowering
from nixl_twisted.access import record_of
from nixl_twisted.backends import BackendService
from nixl_twisted.config import ProxyConfig
from nixl_twisted.headers import REQUEST_ID, backend_request_headers, for_rank
from nixl_twisted.legs import account, describe, send_leg, timed_out, unreachable
from nixl_twisted.metrics import ProxyMetrics
from nixl_twisted.pools import Instance
from nixl_twisted.relay import break_off, relay_body, start_response

log = Logger()

#: The routes served by one leg to decode, and their methods.
ROUTES = {"/v1/models": b"GET", "/tokenize": b"POST", "/detokenize": b"POST"}


class OneLeg:
    """Serves a single-leg route: the request to the next decode instance, its answer back."""

    def __init__(
        self,
        config: ProxyConfig,
        backends: BackendService,
        metrics: ProxyMetrics,
        clock: IReactorTime,
    ) -> None:
        self.config = config
        self.backends = backends
        self.metrics = metrics
        self.clock = clock

    async def serve(self, request: Request, path: str, body: bytes | None) -> None:
        """Relay ``request`` to decode's ``path``; ``body`` is JSON to pass on (POST)."""
        request_id = lowering.new_request_id()
        request.setHeader(REQUEST_ID, request_id.encode("ascii"))
        record_of(request).request_id = request_id
        raw: bytes | None = None
        if body is not None:
            parsed = lowering.parse_client_body(body)  # a 400 before any backend
            parsed.pop("kv_transfer_params", None)
            raw = lowering.encode(parsed)
        headers = backend_request_headers(
            request.requestHeaders, request_id, self.config.backend_api_key,
            json_body=raw is not None,
        )  # fmt: skip
        timeout = self.config.timeouts.decode
        upstream = self.backends.upstream

        async def attempt(instance: Instance) -> IResponse:
            record_of(request).decode = instance.url
            url, ranked = instance.base + path, for_rank(headers, instance.rank)
            sent = upstream.get(url, ranked) if raw is None else upstream.post(url, raw, ranked)
            try:
                response = await sent.addTimeout(timeout, self.clock)
            except TimeoutError:
                account(self.metrics, pool, instance, "timeout", "decode timed out")
                raise timed_out(instance, timeout) from None
            except CancelledError:
                raise
            except Exception as error:
                raise unreachable(instance, error) from None
            account(
                self.metrics, pool, instance, "answered" if response.code < 400 else "error_status"
            )
            return response

        pool = self.backends.decode
        lease, response = await send_leg(pool, self.config.retries.decode, self.metrics, attempt)
        record_of(request).decode_status = response.code
        try:
            start_response(request, response)
            await relay_body(request, response, self.clock, self.config.timeouts.stream_idle)
        except CancelledError:
            raise
        except Exception as error:
            log.error("{path} from {url} broke off: {reason}",
                      path=path, url=lease.instance.url, reason=describe(error))  # fmt: skip
            await break_off(request, "decode closed its answer early", "decode_broken")
        finally:
            lease.release()
