"""Log lines people and pipelines can read: the flat JSON schema, the text access line, levels."""

from __future__ import annotations

import ast
import io
import json
import re
from typing import Any

from twisted.internet.task import Clock
from twisted.logger import (
    ILogObserver,
    Logger,
    LogLevel,
    LogPublisher,
    formatEventAsClassicLogText,
)
from twisted.python.failure import Failure

from nixl_twisted import logs
from nixl_twisted.observe.access import access_line, quoted

#: An access event's fields as a completion fills them in.
COMPLETION = {
    "client": "10.20.30.40:54321",
    "method": "POST",
    "path": "/v1/chat/completions",
    "status": 200,
    "bytes": 1834,
    "elapsed_ms": 1250,
    "request_id": "5f0c3a2e9b7d4c1e8a6f2b0d9c8e7f6a",
    "prefill": "http://10.0.0.11:8100",
    "prefill_status": 200,
    "prefill_ms": 412,
    "decode": "http://10.0.0.21:8200",
    "decode_status": 200,
    "decode_ttfb_ms": 35,
}


def emitted(observer: ILogObserver, emit: Any) -> None:
    publisher = LogPublisher(observer)
    emit(Logger(namespace="nixlproxy.access", observer=publisher))


def json_lines_of(emit: Any, worker: int | None = None) -> list[dict[str, Any]]:
    out = io.StringIO()
    observer = logs.json_lines(out)
    emitted(logs.WorkerTagged(observer, worker) if worker is not None else observer, emit)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_an_access_event_is_one_flat_json_line_under_400_bytes() -> None:
    out = io.StringIO()
    emitted(
        logs.WorkerTagged(logs.json_lines(out), 3),
        lambda log: log.info(
            "{access_line}", access_line=access_line(COMPLETION), access=COMPLETION
        ),
    )
    raw = out.getvalue()
    # From about 1.35 KB as Twisted's eventAsJSON had it (worker, long addresses and all).
    assert raw.count("\n") == 1 and len(raw.encode()) < 450
    line = json.loads(raw)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"])
    assert (line["level"], line["logger"], line["worker"]) == ("info", "nixlproxy.access", 3)
    assert line["message"] == "POST /v1/chat/completions 200"
    assert {k: line[k] for k in COMPLETION} == COMPLETION  # every field, top level, once
    assert not [k for k in line if k.startswith("log_") or k in ("access", "access_line")]


def test_an_access_events_attempts_and_parts_are_json_lists() -> None:
    retried = dict(
        COMPLETION, attempts=["prefill http://p1 unreachable", "prefill http://p2 answered"]
    )
    (line,) = json_lines_of(
        lambda log: log.info("{access_line}", access_line=access_line(retried), access=retried)
    )
    assert line["attempts"] == retried["attempts"]
    assert "attempts=[prefill http://p1 unreachable; prefill http://p2 answered]" in (
        access_line(retried)
    )


def test_other_events_have_their_message_rendered_and_their_fields() -> None:
    (line,) = json_lines_of(
        lambda log: log.warn("{role} instance {url} marked down", role="decode", url="http://d:1")
    )
    assert line["message"] == "decode instance http://d:1 marked down"
    assert (line["level"], line["role"], line["url"]) == ("warn", "decode", "http://d:1")
    assert "worker" not in line


def test_a_failure_carries_its_traceback_as_error() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        failure = Failure()
    (line,) = json_lines_of(lambda log: log.failure("serving failed", failure))
    assert line["level"] == "critical" and line["message"] == "serving failed"
    assert "ValueError: boom" in line["error"]


def test_the_text_access_line_leaves_out_what_did_not_happen() -> None:
    assert access_line(COMPLETION) == (
        "10.20.30.40:54321 POST /v1/chat/completions 200 1834B 1250ms "
        "request_id=5f0c3a2e9b7d4c1e8a6f2b0d9c8e7f6a "
        "prefill=http://10.0.0.11:8100 (200, 412ms) "
        "decode=http://10.0.0.21:8200 (200, first byte 35ms)"
    )
    not_found = {
        "client": "1.2.3.4:5",
        "method": "POST",
        "path": "/v2/nope",
        "status": 404,
        "bytes": 120,
        "elapsed_ms": 0,
    }
    assert access_line(not_found) == "1.2.3.4:5 POST /v2/nope 404 120B 0ms"
    left = dict(COMPLETION, ended="client_left")
    del left["decode_status"], left["decode_ttfb_ms"]
    assert access_line(left).endswith("decode=http://10.0.0.21:8200 ended=client_left")
    assert "None" not in access_line(left)


#: What a client may put in the fields it chooses, to forge a line or reach a terminal.
FORGED = dict(
    COMPLETION,
    method="P\x1bOST",
    path="/v1/chat/completions\x1b[2J",
    model="m\r\n10.0.0.1:1 POST /v1/completions 200 1B 1ms request_id=forged",
    tenant="team-a status=200\u202e\x85\ud800",
)


def test_a_clients_strings_cannot_forge_or_break_the_text_access_line() -> None:
    line = access_line(FORGED)
    assert line.isprintable()  # no CR, LF, ESC, NEL, bidirectional override, surrogate
    assert '"P\\x1bOST" "/v1/chat/completions\\x1b[2J" 200 ' in line
    assert 'model="m\\r\\n10.0.0.1:1 POST /v1/completions 200 1B 1ms request_id=forged"' in line
    assert 'tenant="team-a status=200\\u202e\\x85\\ud800"' in line
    # What is plain stays as it was, and every escape reads back as what was sent.
    assert access_line(COMPLETION).startswith("10.20.30.40:54321 POST /v1/chat/completions ")
    for sent in (
        "fake-model",
        "café",
        "",
        'say "hi"\\',
        "a\tb c",
        "\U000e0041",
        str(FORGED["tenant"]),
    ):
        shown = quoted(sent)
        assert shown == sent or ast.literal_eval(shown) == sent  # (a Python string literal)


def test_the_json_access_line_escapes_what_the_client_chose_by_its_format() -> None:
    out = io.StringIO()
    emitted(
        logs.json_lines(out),
        lambda log: log.info("{access_line}", access_line=access_line(FORGED), access=FORGED),
    )
    (line,) = out.getvalue().splitlines()
    assert line.isascii() and line.isprintable()
    read = json.loads(line)
    assert (read["model"], read["tenant"], read["path"]) == (
        FORGED["model"],
        FORGED["tenant"],
        FORGED["path"],
    )


def test_the_level_filter_drops_what_is_less_severe_and_a_reload_changes_it() -> None:
    out = io.StringIO()
    levels = logs.LogLevels("warn")
    chosen = logs.observer("json", levels, None, lambda: out)
    assert chosen is not None
    emitted(chosen, lambda log: (log.info("dropped"), log.warn("kept"), log.error("kept too")))
    levels.set("error")
    emitted(chosen, lambda log: (log.warn("dropped now"), log.error("kept still")))
    levels.set("debug")
    emitted(chosen, lambda log: log.debug("kept at debug"))
    assert [json.loads(line)["message"] for line in out.getvalue().splitlines()] == [
        "kept",
        "kept too",
        "kept still",
        "kept at debug",
    ]


def test_a_librarys_retry_chatter_is_shown_at_debug_only() -> None:
    out = io.StringIO()
    levels = logs.LogLevels("info")
    chosen = logs.observer("json", levels, None, lambda: out)
    assert chosen is not None
    namespace = "twisted.application._client_service.ClientService"
    retries = Logger(namespace=namespace, observer=LogPublisher(chosen))
    retries.info("Scheduling retry 1")
    retries.warn("kept")
    levels.set("debug")
    retries.info("Scheduling retry 2")
    messages = [json.loads(line)["message"] for line in out.getvalue().splitlines()]
    assert messages == ["kept", "Scheduling retry 2"]


def test_lifecycle_lines_are_shown_at_any_level() -> None:
    out = io.StringIO()
    chosen = logs.observer("text", logs.LogLevels("critical"), None, lambda: out)
    assert chosen is not None
    lifecycle = Logger(namespace=logs.LIFECYCLE, observer=LogPublisher(chosen))
    lifecycle.info("nixlproxy listening on {address}", address="127.0.0.1:8000")
    emitted(chosen, lambda log: log.error("dropped"))
    assert "listening on 127.0.0.1:8000" in out.getvalue()
    assert "dropped" not in out.getvalue()


def test_text_is_ours_unless_twistd_logs_to_syslog_or_an_operators_logger() -> None:
    out = io.StringIO()
    chosen = logs.observer("text", logs.LogLevels("info"), None, lambda: out)
    assert chosen is not None
    emitted(chosen, lambda log: log.info("listening"))
    assert "listening" in out.getvalue()
    assert logs.observer("text", logs.LogLevels("info"), None, lambda: None) is None
    assert logs.log_file({"logger": "my.observer"}) is None
    out = io.StringIO()
    tagged = logs.observer("text", logs.LogLevels("info"), 1, lambda: out)
    assert tagged is not None
    emitted(tagged, lambda log: log.info("listening"))
    assert "[worker 1 nixlproxy.access#info] listening" in out.getvalue()


def test_where_twistd_would_log() -> None:
    assert logs.log_file({"logfile": "-"}) is not None
    assert logs.log_file({"syslog": True}) is None


class _Turns(Clock):
    """A clock that says whether its reactor runs, as ``TurnBuffered`` asks."""

    running = True


class _Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def test_a_turns_lines_are_written_together_at_its_end() -> None:
    reactor, out = _Turns(), _Writes()
    chosen = logs.observer("text", logs.LogLevels("info"), None, lambda: out, reactor)
    assert chosen is not None
    for n in range(3):
        emitted(chosen, lambda log, n=n: log.info("line {n}", n=n))
    assert out.getvalue() == ""
    reactor.advance(0)
    assert out.writes == 1
    assert [line.split("] ", 1)[1] for line in out.getvalue().splitlines()] == [
        "line 0",
        "line 1",
        "line 2",
    ]
    emitted(chosen, lambda log: log.info("next turn"))
    reactor.advance(0)
    assert out.writes == 2 and out.getvalue().endswith("] next turn\n")


def test_once_the_reactor_stops_lines_are_written_at_once_after_those_held() -> None:
    reactor, out = _Turns(), _Writes()
    chosen = logs.observer("json", logs.LogLevels("info"), None, lambda: out, reactor)
    assert chosen is not None
    emitted(chosen, lambda log: log.info("held"))
    reactor.running = False
    emitted(chosen, lambda log: log.info("stopped"))
    assert [json.loads(line)["message"] for line in out.getvalue().splitlines()] == [
        "held",
        "stopped",
    ]
    reactor.advance(0)  # (the turn's write, still scheduled, finds nothing left)
    assert len(out.getvalue().splitlines()) == 2


def test_the_text_stamp_is_twisteds_own_to_the_second() -> None:
    out = io.StringIO()
    chosen = logs.observer("text", logs.LogLevels("info"), None, lambda: out)
    assert chosen is not None
    for when in (1_700_000_000.0, 1_700_000_000.999, 1_700_000_001.5):
        event = {"log_time": when, "log_format": "x", "log_level": LogLevel.info}
        chosen(dict(event, log_namespace="n"))
        twisteds = formatEventAsClassicLogText(dict(event, log_namespace="n"))
        assert twisteds is not None
        assert out.getvalue().splitlines()[-1] == twisteds.rstrip("\n")


def test_an_access_line_is_written_as_twisteds_formatter_writes_it() -> None:
    event = {
        "log_time": 1_700_000_000.25,
        "log_format": "{access_line}",
        "access_line": access_line(COMPLETION),
        "access": COMPLETION,
        "log_level": LogLevel.info,
        "log_namespace": "nixlproxy.access",
    }
    for shown in (event, dict(event, log_system="worker 2 nixlproxy.access#info")):
        twisteds = formatEventAsClassicLogText(shown)
        assert twisteds is not None and "[" in twisteds
        assert logs.classic_text(shown) == twisteds


def test_an_access_event_through_the_observer_is_one_line_of_twisteds_shape() -> None:
    out = io.StringIO()
    chosen = logs.observer("text", logs.LogLevels("info"), 2, lambda: out)
    assert chosen is not None
    line = access_line(COMPLETION)
    emitted(chosen, lambda log: log.info("{access_line}", access_line=line, access=COMPLETION))
    stamp, rest = out.getvalue().split(" ", 1)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", stamp)
    assert rest == f"[worker 2 nixlproxy.access#info] {line}\n"
