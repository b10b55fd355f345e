"""OpenTelemetry for the proxy: the tracer, its SDK set up from the configuration, its flush.

Off unless an OTLP endpoint is configured (``docs/tracing.md``): then every
request gets the no-op trace of ``nixl_twisted.observe.spans`` and the SDK is never
imported. On, the SDK's ``BatchSpanProcessor`` takes each ended span into a
bounded queue and exports from its own thread, so a slow or dead collector
never holds the reactor (a full queue drops spans; it never waits). What
the SDK logs (through the standard library's ``logging``) is routed into
``twisted.logger`` while tracing is on (``SDKLogs``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from twisted.web.http import Request

from nixl_twisted import __version__
from nixl_twisted.observe.spans import NO_TRACE, RequestTrace, ServerSpan

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from nixl_twisted.config import Traces

log = Logger()
#: Where the SDK's own log records go (``SDKLogs``).
sdk_log = Logger(namespace="nixlproxy.tracing")

#: Seconds a stopping proxy gives the exporter thread to send what is queued.
FLUSH_TIMEOUT = 5.0
#: The standard variable that also turns tracing on (the exporter adds /v1/traces).
GENERIC_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
SERVICE_NAME = "nixl-twisted"
#: The standard-library logger above every logger of the SDK and its exporters.
SDK_LOGGER = "opentelemetry"


class Tracing(Service):
    """The proxy's tracer, or none: starts each request's trace, flushes at stop."""

    def __init__(
        self,
        provider: TracerProvider | None,
        reactor: Any = None,
        clock: IReactorTime | None = None,
    ) -> None:
        self._provider = provider
        self._reactor = reactor
        self._clock = clock
        self._tracer = (
            None if provider is None else provider.get_tracer("nixl_twisted", __version__)
        )

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def request(self, request: Request, arrived: float) -> RequestTrace:
        """The trace of a client request that arrived at ``arrived`` (``time.monotonic``)."""
        if self._tracer is None:
            return NO_TRACE
        return ServerSpan(self._tracer, request, arrived)

    def stopService(self) -> Deferred[None] | None:
        """Send what is queued, from a thread of its own, for at most ``FLUSH_TIMEOUT``."""
        super().stopService()
        provider = self._provider
        if provider is None or self._reactor is None:
            unroute_sdk_logs()
            return None
        flushed: Deferred[None] = Deferred()

        def done() -> None:
            if not flushed.called:  # else the wait timed out already
                flushed.callback(None)

        def flush() -> None:
            try:
                provider.shutdown()
            finally:
                self._reactor.callFromThread(done)

        # A daemon thread: a collector that never answers cannot keep the process alive.
        threading.Thread(target=flush, name="nixlproxy-trace-flush", daemon=True).start()
        clock = self._clock if self._clock is not None else self._reactor
        flushed.addTimeout(FLUSH_TIMEOUT, clock)
        flushed.addErrback(self._unsent)
        # Only once the flush is over: what it could not send is logged with the rest.
        flushed.addBoth(lambda _: unroute_sdk_logs())
        return flushed

    def _unsent(self, _: object) -> None:
        log.warn(
            "traces not all sent: the collector did not take them within {seconds} s",
            seconds=FLUSH_TIMEOUT,
        )


class SDKLogs(logging.Handler):
    """The SDK's standard-library log records, as ``twisted.logger`` events.

    Without a handler, ``logging.lastResort`` writes them to stderr, which
    twistd shows as bare ``[stderr#error]`` lines, outside ``--log-format``
    and ``--log-level``. Records arrive on the exporter's thread too: a
    ``twisted.logger`` event is observed on the thread that emits it, as the
    events of Twisted's own thread pool are.
    """

    def __init__(self, logger: Logger = sdk_log) -> None:
        super().__init__()
        self._log = logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # the SDK's own format and arguments did not agree
            message = str(record.msg)
        level = twisted_level(record.levelno)
        fields = {"message": message, "sdk_logger": record.name}
        exc_info = record.exc_info
        if exc_info is not None and exc_info[1] is not None:
            failure = Failure(exc_info[1], exc_info[0], exc_info[2])
            self._log.failure("{message}", failure, level, **fields)
        else:
            self._log.emit(level, "{message}", **fields)


def twisted_level(levelno: int) -> LogLevel:
    """The ``twisted.logger`` level of a standard-library one (a custom level: the one below)."""
    if levelno >= logging.CRITICAL:
        return LogLevel.critical
    if levelno >= logging.ERROR:
        return LogLevel.error
    if levelno >= logging.WARNING:
        return LogLevel.warn
    if levelno >= logging.INFO:
        return LogLevel.info
    return LogLevel.debug


def route_sdk_logs() -> None:
    """Send what the SDK logs into ``twisted.logger``, and not on to the root logger's handlers."""
    sdk = logging.getLogger(SDK_LOGGER)
    if not any(isinstance(handler, SDKLogs) for handler in sdk.handlers):
        sdk.addHandler(SDKLogs())
    sdk.propagate = False


def unroute_sdk_logs() -> None:
    """Undo ``route_sdk_logs`` (tracing stopped)."""
    sdk = logging.getLogger(SDK_LOGGER)
    for handler in [h for h in sdk.handlers if isinstance(h, SDKLogs)]:
        sdk.removeHandler(handler)
    sdk.propagate = True


def enabled(traces: Traces, environ: Mapping[str, str]) -> bool:
    """Whether to trace: an endpoint given, or the SDK's generic one set; never when disabled."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return traces.endpoint is not None or bool(environ.get(GENERIC_ENDPOINT_ENV))


def provider_for(traces: Traces, worker: int | None) -> TracerProvider:
    """The SDK's provider: the configured sampler, a batching processor, the OTLP exporter.

    From here on, what the SDK logs goes to ``twisted.logger`` (``Tracing`` undoes it at stop).
    """
    route_sdk_logs()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    attributes: dict[str, str | int] = {"service.version": __version__}
    if worker is not None:
        attributes["nixlproxy.worker"] = worker
    resource = Resource.create(attributes)
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over our name.
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    sampler = None
    if traces.sampling_ratio is not None:
        sampler = ParentBased(TraceIdRatioBased(traces.sampling_ratio))
    # No sampler given: the SDK reads OTEL_TRACES_SAMPLER (parentbased_always_on by default).
    provider = TracerProvider(resource=resource, sampler=sampler, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter_for(traces)))
    return provider


def exporter_for(traces: Traces) -> Any:
    """The SDK's OTLP span exporter for the configured protocol."""
    if traces.protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GRPCExporter,
            )
        except ImportError:
            raise SystemExit(
                "nixlproxy: OTLP over grpc needs the SDK's gRPC exporter: "
                "pip install 'nixl-twisted[otlp-grpc]'"
            ) from None
        return GRPCExporter(endpoint=traces.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    # None: the exporter reads OTEL_EXPORTER_OTLP_ENDPOINT and adds /v1/traces.
    return OTLPSpanExporter(endpoint=traces.endpoint)
