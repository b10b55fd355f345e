"""How cheaply this stack can relay a streamed chat completion, with none of the proxy's work.

The floor server (``web-agent``) is a bare ``twisted.web`` resource and
Twisted's ``Agent``, both legs: it parses the client's JSON, POSTs a lowered
copy to prefill and reads its answer whole, puts prefill's
``kv_transfer_params`` into the decode body, POSTs it, and relays decode's
SSE stream chunk in, chunk out (``deliverBody``, the backend's transport
registered as the client's producer). No retries, health, metrics, log or
idle timer. Beside it the real ``twistd nixlproxy``, on the same core, the
same fast fake backend and the same streaming loads as ``bench.run`` (64
tokens, 64 connections, back to back and at 5 ms a token), and direct to
the backend for the first-token baseline.

    python -m bench.stream_ceiling                 # 8 s per load
    python -m bench.stream_ceiling --requests 64   # a smoke run: 64 streams per load
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

from bench.ceiling import _Bytes, _completed, _lowered, _NoForms, _pooled_agent
from bench.run import (
    Length,
    Load,
    _added,
    _cpu_seconds,
    _descendants,
    _free_port,
    _load,
    _pinned,
    _process,
    add_length_options,
    failure,
    length_of,
    nixlproxy,
)

LOADS = (
    Load("streaming chat, 64 tokens back to back, 64 connections", 64, True),
    Load("streaming chat, 64 tokens at 5 ms, 64 connections", 64, True, 0.005),
)
TOKENS = 64
KINDS = ("web-agent", "nixlproxy")


def serve(port: int, backend: str) -> None:
    """Run the floor server until it is terminated."""
    from twisted.internet import reactor
    from twisted.internet.defer import Deferred
    from twisted.internet.endpoints import serverFromString
    from twisted.internet.interfaces import IReactorCore
    from twisted.internet.protocol import Protocol
    from twisted.python.failure import Failure
    from twisted.web.client import readBody
    from twisted.web.http_headers import Headers
    from twisted.web.iweb import IResponse
    from twisted.web.resource import Resource
    from twisted.web.server import NOT_DONE_YET, Site

    url = (backend + "/v1/chat/completions").encode()
    headers = Headers({b"Content-Type": [b"application/json"]})
    agent = _pooled_agent(reactor)

    class _Relay(Protocol):
        """Decode's body to the client: each chunk written as it arrives."""

        def __init__(self, request: Any) -> None:
            self.request = request

        def connectionMade(self) -> None:
            self.request.registerProducer(self.transport, True)

        def dataReceived(self, data: bytes) -> None:
            self.request.write(data)

        def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
            self.request.unregisterProducer()
            self.request.finish()

    async def respond(request: Any) -> None:
        body = json.loads(request.content.read())
        prefill = await agent.request(b"POST", url, headers, _Bytes(_lowered(body)))
        answer = await readBody(prefill)
        decode: IResponse = await agent.request(
            b"POST", url, headers, _Bytes(_completed(body, answer))
        )
        request.setHeader(b"Content-Type", b"text/event-stream")
        decode.deliverBody(_Relay(request))

    class _Chat(Resource):
        isLeaf = True

        def render_POST(self, request: Any) -> int:
            Deferred.fromCoroutine(respond(request))
            return NOT_DONE_YET

    site = Site(_Chat())
    site.requestFactory = _NoForms
    serverFromString(reactor, f"tcp:{port}:interface=127.0.0.1").listen(site)
    cast(IReactorCore, reactor).run()


@contextmanager
def _serving(kind: str, backend: str) -> Iterator[tuple[str, list[int]]]:
    """The floor server (or nixlproxy itself) on core 0: its URL and its processes."""
    if kind == "nixlproxy":
        args = ["--health-interval", "0", "--prefill", backend, "--decode", backend]
        with nixlproxy(args, "0") as (running, url):
            yield url, _descendants(running.process.pid)
        return
    port = _free_port()
    command = [sys.executable, "-m", "bench.stream_ceiling", "--serve", "--port", str(port)]
    with _process(_pinned("0", [*command, "--backend", backend]), port) as process:
        # taskset execs the server: the pid is the server's own.
        yield f"http://127.0.0.1:{port}", [process.pid]


def measure(kinds: Sequence[str], length: Length) -> list[dict[str, Any]]:
    """Each load direct, then through each server, with the server's CPU per stream."""
    cores = os.cpu_count() or 2
    others = "1" if cores == 2 else f"1-{cores - 1}"
    rows = []
    for load in LOADS:
        port = _free_port()
        backend = [sys.executable, "-m", "bench.backend", "--port", str(port)]
        backend += ["--processes", "2", "--token-interval", str(load.token_interval)]
        with _process(_pinned(others, backend), port):
            url = f"http://127.0.0.1:{port}"
            direct = _load(url, load, length, others)
            for kind in kinds:
                with _serving(kind, url) as (served, pids):
                    before = sum(_cpu_seconds(pid) for pid in pids)
                    result = _load(served, load, length, others)
                    cpu = sum(_cpu_seconds(pid) for pid in pids) - before
                streams = max(1, result["requests"])
                rows.append(
                    {
                        "server": kind,
                        "load": load.name,
                        "direct": direct,
                        **result,
                        "cpu_ms_per_stream": round(cpu / streams * 1000, 3),
                        "cpu_us_per_token": round(cpu / streams / TOKENS * 1e6, 1),
                    }
                )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| server | load | streams/s | CPU ms per stream | CPU us per token "
        "| TTFT p50 added | TTFT p99 added | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        direct = row["direct"]
        lines.append(
            f"| {row['server']} | {row['load']} | {row['per_second']}/s "
            f"| {row['cpu_ms_per_stream']} | {row['cpu_us_per_token']} "
            f"| {_added(row['ttft_p50_ms'], direct['ttft_p50_ms'])} "
            f"| {_added(row['ttft_p99_ms'], direct['ttft_p99_ms'])} | {row['errors']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_length_options(parser)
    parser.add_argument("--servers", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.port, args.backend)
        return 0
    rows = measure(args.servers, length_of(parser, args))
    print(table(rows))
    failed = [row for row in rows if row["errors"] or not row["requests"]]
    for row in failed:
        print(f"failed: {row['server']}, {row['load']}: {failure(row)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
