"""Tracing's configuration and its off state: from the command line and the SDK's variables."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import SpanContext, TraceFlags, set_span_in_context
from opentelemetry.trace.span import NonRecordingSpan
from twisted.logger import ILogObserver, Logger, LogLevel, formatEvent, globalLogPublisher
from twisted.python import usage
from twisted.web.http import Request
from twisted.web.http_headers import Headers
from twisted.web.test.requesthelper import DummyChannel, DummyRequest
from zope.interface import provider

from nixl_twisted.backends.instances import Instance
from nixl_twisted.config import ProxyConfig, Traces
from nixl_twisted.observe import spans, tracing
from nixl_twisted.observe.access import AccessRecord
from nixl_twisted.protocol import routes
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.run import needs
from nixl_twisted.tap import Options

POOLS = ["--prefill", "http://p1:8100", "--decode", "http://d1:8200"]
COLLECTOR = "http://collector:4318/v1/traces"


def traces(**settings: object) -> Traces:
    """Tracing as these settings make it, the table's defaults for the rest."""
    return ProxyConfig.create(prefill=["http://p:1"], decode=["http://d:1"], **settings).traces


def parse(*args: str) -> ProxyConfig:
    options = Options()
    options.parseOptions(list(args))
    assert options.config is not None
    return options.config


@pytest.fixture(autouse=True)
def no_otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test says which of the SDK's variables are set."""
    for name in (
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_SDK_DISABLED",
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def sdk_logs_given_back() -> Iterator[None]:
    """``provider_for`` routes the SDK's log records; no test leaves them routed for the next."""
    yield
    tracing.unroute_sdk_logs()


def test_off_by_default() -> None:
    traces = parse(*POOLS).traces
    assert traces == Traces(endpoint=None, protocol="http/protobuf", sampling_ratio=None)
    assert not tracing.enabled(traces, {})


def grpc_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if the extra were installed: these read the options, not what is installed
    (``test_needs``: grpc refused without the extra)."""
    monkeypatch.setattr(needs, "findable", lambda module: True)


def test_the_options_and_their_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    grpc_installed(monkeypatch)
    traces = parse(
        *POOLS,
        "--otlp-traces-endpoint",
        COLLECTOR,
        "--otel-sampling-ratio",
        "0.1",
        "--otlp-traces-protocol",
        "grpc",
    ).traces
    assert traces == Traces(endpoint=COLLECTOR, protocol="grpc", sampling_ratio=0.1)
    assert tracing.enabled(traces, {})
    for args, message in (
        (["--otel-sampling-ratio", "1.5"], "--otel-sampling-ratio must be from 0 to 1"),
        (["--otlp-traces-endpoint", "collector:4318"], "must start with http:// or https://"),
        (["--otlp-traces-endpoint", "http://collector:port"], "is not a valid URL"),
        (["--otlp-traces-protocol", "http/json"], "must be one of http/protobuf, grpc"),
    ):
        with pytest.raises(usage.UsageError, match=message):
            parse(*POOLS, *args)


def test_the_sdks_variables_are_read_and_the_command_line_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grpc_installed(monkeypatch)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", COLLECTOR)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert parse(*POOLS).traces == traces(
        otlp_traces_endpoint=COLLECTOR, otlp_traces_protocol="grpc"
    )
    given = parse(*POOLS, "--otlp-traces-endpoint", "http://other:4318/v1/traces").traces
    assert given.endpoint == "http://other:4318/v1/traces"
    # The signal's own variable wins over the generic one.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert parse(*POOLS).traces.protocol == "http/protobuf"


def test_a_bad_variable_is_a_usage_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(
        usage.UsageError,
        match=r"OTEL_EXPORTER_OTLP_PROTOCOL \(for "
        r"--otlp-traces-protocol\) must be one of",
    ):
        parse(*POOLS)


def test_the_generic_endpoint_turns_it_on_and_sdk_disabled_off() -> None:
    assert tracing.enabled(traces(), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    disabled = {"OTEL_SDK_DISABLED": "true"}
    assert not tracing.enabled(traces(otlp_traces_endpoint=COLLECTOR), disabled)


def test_a_worker_gets_the_tracing_settings() -> None:
    config = parse(*POOLS, "--otlp-traces-endpoint", COLLECTOR, "--otel-sampling-ratio", "0.5")
    worker = config.for_worker(0, ("tcp:4321",), None)
    assert ProxyConfig.from_json(worker.to_json()).traces == config.traces


def test_the_sampler_is_parent_based_on_the_ratio() -> None:
    provider = tracing.provider_for(
        traces(otlp_traces_endpoint=COLLECTOR, otel_sampling_ratio=0.0), None
    )
    sampler = provider.sampler
    assert "ParentBased" in sampler.get_description()
    trace_id = 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert sampler.should_sample(None, trace_id, "new").decision is Decision.DROP
    flags = TraceFlags(TraceFlags.SAMPLED)
    parent = NonRecordingSpan(SpanContext(trace_id, 0xF067AA0BA902B7, True, trace_flags=flags))
    followed = sampler.should_sample(set_span_in_context(parent), trace_id, "child")
    assert followed.decision is Decision.RECORD_AND_SAMPLE


def test_unset_the_sdk_chooses_the_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    provider = tracing.provider_for(traces(otlp_traces_endpoint=COLLECTOR), None)
    assert provider.sampler.get_description() == "AlwaysOffSampler"


def test_the_service_is_named_unless_the_environment_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ours = tracing.provider_for(traces(otlp_traces_endpoint=COLLECTOR), 3).resource.attributes
    assert (ours["service.name"], ours["nixlproxy.worker"]) == ("nixl-twisted", 3)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge")
    assert tracing.provider_for(traces(otlp_traces_endpoint=COLLECTOR), None).resource.attributes[
        "service.name"
    ] == ("edge")


def test_grpc_without_its_exporter_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(SystemExit, match=r"pip install 'nixl-twisted\[otlp-grpc\]'"):
        tracing.exporter_for(traces(otlp_traces_endpoint=COLLECTOR, otlp_traces_protocol="grpc"))


def test_off_is_the_same_no_op_objects_every_time() -> None:
    off = tracing.Tracing(None)
    assert not off.enabled
    request = DummyRequest([b"v1", b"chat", b"completions"])
    trace = off.request(request, 0.0)  # type: ignore[arg-type]
    assert trace is spans.NO_TRACE
    span = trace.attempt(None, "next", "round-robin", 1)  # type: ignore[arg-type]
    assert span is spans.NO_ATTEMPT
    headers = Headers({b"traceparent": [b"00-client-trace-01"]})
    assert span.headers("http://d1:8200/v1/models", headers) is headers  # not even copied


def new_request(*headers: tuple[bytes, bytes]) -> Request:
    """A client's request as the proxy gets it, with these headers."""
    request = Request(DummyChannel())  # type: ignore[arg-type]
    request.method, request.path = b"POST", b"/v1/chat/completions"
    for name, value in headers:
        request.requestHeaders.setRawHeaders(name, [value])
    return request


@pytest.fixture
def twisted_events() -> Iterator[list[dict[str, Any]]]:
    """The events logged through ``twisted.logger`` while the test runs."""
    events: list[dict[str, Any]] = []

    @provider(ILogObserver)
    def observe(event: dict[str, Any]) -> None:
        events.append(event)

    globalLogPublisher.addObserver(observe)
    yield events
    globalLogPublisher.removeObserver(observe)


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize(
    "traceparent",
    [
        # A later version may be longer than 00's 55 characters, but not this long.
        f"01-{TRACE_ID}-00f067aa0ba902b7-01-" + "a" * 544,
        f"00-{TRACE_ID.upper()}-00f067aa0ba902b7-01",
        "not a traceparent",
    ],
    ids=["600 characters", "upper case", "garbage"],
)
def test_an_invalid_traceparent_is_absent_and_nothing_is_logged(
    traceparent: str,
    caplog: pytest.LogCaptureFixture,
    twisted_events: list[dict[str, Any]],
) -> None:
    exported = InMemorySpanExporter()
    traced = TracerProvider()
    traced.add_span_processor(SimpleSpanProcessor(exported))
    request = new_request((b"traceparent", traceparent.encode()))
    caplog.set_level(logging.WARNING)
    trace = tracing.Tracing(traced).request(request, 0.0)
    trace.end(request, AccessRecord())
    (span,) = exported.get_finished_spans()
    assert span.parent is None  # a new trace
    assert span.context is not None and format(span.context.trace_id, "032x") != TRACE_ID
    assert caplog.records == []
    assert [e for e in twisted_events if e["log_level"] >= LogLevel.warn] == []


TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
#: Each past one limit only: 21 well-formed members of 24 characters, 33 short ones, ...
TRACESTATE_524 = ",".join(f"k{i:02d}={'v' * 20}" for i in range(21))
MEMBERS_33 = ",".join(f"k{i}=v" for i in range(33))
BAGGAGE_8193 = "k=" + "v" * 4094 + ",l=" + "v" * 4094
BAGGAGE_181 = ",".join(f"k{i}=v" for i in range(181))


def through_a_leg(*headers: tuple[bytes, bytes]) -> tuple[Headers, str]:
    """What a leg sends vLLM of the client's context (no client header copied), and its trace id."""
    exported = InMemorySpanExporter()
    traced = TracerProvider()
    traced.add_span_processor(SimpleSpanProcessor(exported))
    request = new_request(*headers)
    trace = tracing.Tracing(traced).request(request, 0.0)
    attempt = trace.attempt(Instance("http://d1:8200", "decode"), "next", "round-robin", 1)
    sent = attempt.headers("http://d1:8200/v1/completions", Headers())
    attempt.end()
    trace.end(request, AccessRecord())
    span = next(s for s in exported.get_finished_spans() if s.kind.name == "SERVER")
    assert span.context is not None
    return sent, format(span.context.trace_id, "032x")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("tracestate", TRACESTATE_524.encode()),
        ("tracestate", MEMBERS_33.encode()),
        ("tracestate", b"Upper=case"),
        ("tracestate", b"k=v,l="),
        ("baggage", BAGGAGE_8193.encode()),
        ("baggage", BAGGAGE_181.encode()),
        ("baggage", b"k=" + b"v" * 4095 + b",l=v"),
        ("baggage", b"no equals sign"),
        ("baggage", b"k=v;"),
        ("baggage", "k=café".encode()),
        ("baggage", b" "),
        ("baggage", b"k=\xff"),
        ("baggage", b"k=" + b"%" * 2000),
        ("baggage", b",".join(b"k%d=" % i + b"%" * 1000 for i in range(3))),
        ("traceparent", TRACEPARENT.encode() + b"\xff"),
    ],
    ids=[
        "tracestate 524 characters",
        "tracestate 33 members",
        "tracestate malformed",
        "tracestate empty value",
        "baggage 8193 bytes",
        "baggage 181 members",
        "baggage member 4097 bytes",
        "baggage malformed",
        "baggage empty property",
        "baggage not ASCII",
        "baggage blank",
        "baggage not UTF-8",
        "baggage member 6 KB once re-encoded",
        "baggage 9 KB once re-encoded",
        "traceparent not UTF-8",
    ],
)
def test_a_tracestate_or_baggage_past_w3c_limits_is_absent_and_nothing_is_logged(
    name: str,
    value: bytes,
    caplog: pytest.LogCaptureFixture,
    twisted_events: list[dict[str, Any]],
) -> None:
    caplog.set_level(logging.WARNING)
    headers = {b"traceparent": TRACEPARENT.encode(), name.encode(): value}
    sent, trace_id = through_a_leg(*headers.items())
    if name != "traceparent":
        assert trace_id == TRACE_ID  # the client's traceparent is still followed
    assert sent.getRawHeaders(b"tracestate") is None
    assert sent.getRawHeaders(b"baggage") is None
    assert caplog.records == []
    assert [e for e in twisted_events if e["log_level"] >= LogLevel.warn] == []


def test_a_tracestate_and_baggage_at_w3c_limits_are_followed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    tracestate = ",".join([f"k{i:02d}=" + "v" * 11 for i in range(31)] + ["k31=" + "v" * 12])
    small = [f"k{i:03d}=v" for i in range(178)]
    baggage = ",".join([*small, "k178=" + "v" * 4091, "k179=" + "v" * 2844])
    assert (len(tracestate), len(baggage)) == (512, 8192)  # each at its limit, no further
    sent, trace_id = through_a_leg(
        (b"traceparent", TRACEPARENT.encode()),
        (b"tracestate", tracestate.encode()),
        (b"baggage", baggage.encode()),
    )
    assert trace_id == TRACE_ID
    assert sent.getRawHeaders(b"tracestate") == [tracestate.encode()]
    assert sent.getRawHeaders(b"baggage") == [baggage.encode()]
    # Properties and optional whitespace are W3C's too (the SDK sends them encoded).
    sent, _ = through_a_leg((b"traceparent", TRACEPARENT.encode()), (b"baggage", b"k = v ;p; q=r"))
    assert sent.getRawHeaders(b"baggage") == [b"k=v+%3Bp%3B+q%3Dr"]
    assert caplog.records == []


#: What a client may put in the headers: W3C's delimiters, both cases, blanks, non-ASCII.
_TRACE_TEXT = st.text(alphabet=st.sampled_from(list('ab0Z=,;@*/ \t-_%\u00e9\x7f"')), max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    tracestate=_TRACE_TEXT,
    baggage=_TRACE_TEXT,
    # Enough copies to pass each limit: 512 characters, 32 members, 8192 bytes, 180 members.
    tracestates=st.integers(1, 40),
    baggages=st.integers(1, 250),
)
def test_no_tracestate_or_baggage_makes_the_sdk_log(
    tracestate: str, baggage: str, tracestates: int, baggages: int
) -> None:
    with warnings_logged() as logged:
        through_a_leg(
            (b"traceparent", TRACEPARENT.encode()),
            (b"tracestate", ",".join([tracestate] * tracestates).encode("utf-8")),
            (b"baggage", ",".join([baggage] * baggages).encode("utf-8")),
        )
    assert logged == []


@contextmanager
def warnings_logged() -> Iterator[list[str]]:
    """What is logged at warning or above, through stdlib logging or ``twisted.logger``."""
    logged: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    @provider(ILogObserver)
    def observe(event: dict[str, Any]) -> None:
        if event["log_level"] >= LogLevel.warn:
            logged.append(formatEvent(event))

    handler = Handler(logging.WARNING)
    logging.getLogger().addHandler(handler)
    globalLogPublisher.addObserver(observe)
    try:
        yield logged
    finally:
        globalLogPublisher.removeObserver(observe)
        logging.getLogger().removeHandler(handler)


@pytest.mark.parametrize(
    ("instance", "sent", "address", "port", "full"),
    [
        (
            "http://[::1]:8100/vllm#rank=2",
            "http://[::1]:8100/vllm/v1/completions?x=secret",
            "::1",
            8100,
            "http://[::1]:8100/vllm/v1/completions",
        ),
        (
            "https://Decode.example",
            "https://Decode.example/v1/completions",
            "decode.example",
            443,
            "https://Decode.example/v1/completions",
        ),
        (
            "http://10.0.0.2",
            "http://10.0.0.2/v1/completions",
            "10.0.0.2",
            80,
            "http://10.0.0.2/v1/completions",
        ),
    ],
    ids=["IPv6, a path and a rank", "https's port", "http's port"],
)
def test_a_leg_names_its_server_by_host_and_port_and_its_url(
    instance: str, sent: str, address: str, port: int, full: str
) -> None:
    exported = InMemorySpanExporter()
    traced = TracerProvider()
    traced.add_span_processor(SimpleSpanProcessor(exported))
    trace = tracing.Tracing(traced).request(new_request(), 0.0)
    attempt = trace.attempt(Instance(instance, "decode"), "next", "round-robin", 1)
    attempt.headers(sent, Headers())
    attempt.end()
    (span,) = exported.get_finished_spans()
    attributes = dict(span.attributes or {})
    assert attributes["server.address"] == address
    assert attributes["server.port"] == port
    assert attributes["url.full"] == full
    assert attributes["nixlproxy.instance"] == instance


def test_a_model_with_a_lone_surrogate_is_escaped_and_its_spans_still_export() -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    exported = InMemorySpanExporter()
    traced = TracerProvider()
    traced.add_span_processor(SimpleSpanProcessor(exported))
    trace = tracing.Tracing(traced).request(new_request(), 0.0)
    trace.note_request(Completion(routes.CHAT_COMPLETIONS, {"model": "m\ud800"}, "r"))
    trace.end(new_request(), AccessRecord())
    (span,) = exported.get_finished_spans()
    assert dict(span.attributes or {})["gen_ai.request.model"] == "m\\ud800"
    assert encode_spans([span]).SerializeToString()  # the OTLP encoding does not fail


EXPORTER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"


def test_what_the_sdk_logs_becomes_twisted_events_and_never_reaches_stderr(
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    twisted_events: list[dict[str, Any]],
) -> None:
    tracing.provider_for(traces(otlp_traces_endpoint=COLLECTOR), None)
    exporter = logging.getLogger(EXPORTER)
    exporter.warning(
        "Transient error %s encountered while exporting span batch, retrying in %ss.",
        "Service Unavailable",
        1,
    )
    exporter.error("Failed to export span batch code: %s, reason: %s", 503, "unavailable")
    logging.getLogger("opentelemetry.sdk").critical("{not a format}")
    ours = [e for e in twisted_events if e["log_namespace"] == "nixlproxy.tracing"]
    assert [(e["log_level"], formatEvent(e), e["sdk_logger"]) for e in ours] == [
        (
            LogLevel.warn,
            "Transient error Service Unavailable encountered while exporting span "
            "batch, retrying in 1s.",
            EXPORTER,
        ),
        (LogLevel.error, "Failed to export span batch code: 503, reason: unavailable", EXPORTER),
        (LogLevel.critical, "{not a format}", "opentelemetry.sdk"),
    ]
    # Not on to the root logger's handlers (pytest's here), nor to logging.lastResort.
    assert caplog.records == []
    assert capsys.readouterr().err == ""


def test_the_sdks_exception_is_a_failure_at_its_level() -> None:
    events: list[dict[str, Any]] = []
    observe = provider(ILogObserver)(lambda event: events.append(event))
    record = logging.LogRecord(
        EXPORTER, logging.ERROR, __file__, 1, "Exception while exporting %s.", ("Span",), None
    )
    try:
        raise ConnectionResetError("collector hung up")
    except ConnectionResetError:
        record.exc_info = sys.exc_info()
    tracing.SDKLogs(Logger(observer=observe)).emit(record)
    (event,) = events
    assert (event["log_level"], formatEvent(event)) == (
        LogLevel.error,
        "Exception while exporting Span.",
    )
    assert event["log_failure"].check(ConnectionResetError)
