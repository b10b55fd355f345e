"""How cheaply this stack can relay a streamed chat completion, with none of the proxy's work.

The floor server (``web-agent``) is a bare ``twisted.web`` resource and
Twisted's ``Agent``, both legs: it parses the client's JSON, POSTs a lowered
copy to prefill and reads its answer whole, puts prefill's
``kv_transfer_params`` into the decode body, POSTs it, and relays decode's
SSE stream chunk in, chunk out (``deliverBody``, the backend's transport
registered as the client's producer). No retries, health, metrics, log or
idle timer. ``klein-upstream`` does the same with the design's own stack:
a Klein route, and treq as the proxy's client uses it
(``nixl_twisted.backends.upstream``). Beside them the real ``twistd
nixlproxy``, on the same core, the same fast fake backends (a prefill
instance and a decode instance, as in a P/D fleet) and the same
streaming loads as ``bench.run`` (64 tokens, 64 connections, back to back
and at 5 ms a token), and direct to
the backend for the first-token baseline; with ``--vllm-router PATH``,
vllm-project/router's binary in P/D mode beside them, the peer to compare
with (never a dependency: ``pip install vllm-router`` in a scratch venv).

    python -m bench.stream_ceiling                 # 8 s per load
    python -m bench.stream_ceiling --requests 64   # a smoke run: 64 streams per load
    python -m bench.stream_ceiling --loads paced --vllm-router /tmp/vr/bin/vllm-router
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

from bench.ceiling import _Bytes, _completed, _lowered, _NoForms, _pooled_agent
from bench.run import LOADS as RUN_LOADS
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
    other_cores,
)

#: ``bench.run``'s two streaming loads.
LOADS = tuple(load for load in RUN_LOADS if load.stream)
TOKENS = 64
KINDS = ("web-agent", "klein-upstream", "nixlproxy", "vllm-router")
FLOORS = KINDS[:2]
LOAD_NAMES = {"back-to-back": LOADS[0], "paced": LOADS[1]}


def serve(kind: str, port: int, prefill: str, decode: str) -> None:
    """Run a floor server until it is terminated: ``web-agent`` or ``klein-upstream``."""
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

    urls = {
        leg: (backend + "/v1/chat/completions").encode()
        for leg, backend in (("prefill", prefill), ("decode", decode))
    }
    headers = Headers({b"Content-Type": [b"application/json"]})
    agent = _pooled_agent(reactor)

    class _Relay(Protocol):
        """Decode's body to the client: each chunk written as it arrives."""

        def __init__(self, request: Any, done: Deferred[None]) -> None:
            self.request = request
            self.done = done

        def connectionMade(self) -> None:
            self.request.registerProducer(self.transport, True)

        def dataReceived(self, data: bytes) -> None:
            self.request.write(data)

        def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
            self.request.unregisterProducer()
            self.done.callback(None)

    if kind == "klein-upstream":
        # The design's own stack: Klein, and treq as the proxy's client uses it.
        from nixl_twisted.backends.upstream import pooled_upstream, read_body

        upstream = pooled_upstream(reactor, 10.0, 512, 240.0)  # (as bench.ceiling's)

        async def post(url: bytes, data: bytes) -> IResponse:
            return await upstream.post(url.decode(), data, headers)

        def read(response: IResponse) -> Deferred[bytes]:
            return read_body(response)

    else:

        async def post(url: bytes, data: bytes) -> IResponse:
            return await agent.request(b"POST", url, headers, _Bytes(data))

        def read(response: IResponse) -> Deferred[bytes]:
            return readBody(response)

    async def relay(request: Any) -> None:
        body = json.loads(request.content.read())
        answer = await read(await post(urls["prefill"], _lowered(body)))
        decoded = await post(urls["decode"], _completed(body, answer))
        request.setHeader(b"Content-Type", b"text/event-stream")
        done: Deferred[None] = Deferred()
        decoded.deliverBody(_Relay(request, done))
        await done

    if kind == "klein-upstream":
        from klein import Klein

        app = Klein()
        app.route("/v1/chat/completions", methods=["POST"])(relay)
        site = Site(app.resource())
    else:

        async def respond(request: Any) -> None:
            await relay(request)
            request.finish()

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
def _serving(kind: str, prefill: str, decode: str, router: str) -> Iterator[tuple[str, list[int]]]:
    """The floor server (nixlproxy, vllm-router) on core 0: its URL and its processes."""
    if kind == "nixlproxy":
        args = ["--health-interval", "0", "--prefill", prefill, "--decode", decode]
        with nixlproxy(args, "0") as (running, url):
            yield url, _descendants(running.process.pid)
        return
    port = _free_port()
    if kind == "vllm-router":
        command = [router, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation"]
        command += ["--prefill", prefill, "--decode", decode]
        command += ["--log-level", "error", "--prometheus-port", str(_free_port())]
        with _process(_pinned("0", command), port) as process:
            yield f"http://127.0.0.1:{port}", _descendants(process.pid)
        return
    command = [sys.executable, "-m", "bench.stream_ceiling", "--serve", kind, "--port", str(port)]
    command += ["--prefill-backend", prefill, "--backend", decode]
    with _process(_pinned("0", command), port) as process:
        # taskset execs the server: the pid is the server's own.
        yield f"http://127.0.0.1:{port}", [process.pid]


def measure(
    kinds: Sequence[str], length: Length, loads: Sequence[Load] = LOADS, router: str = ""
) -> list[dict[str, Any]]:
    """Each load direct, then through each server, with the server's CPU per stream."""
    others = other_cores()
    rows = []
    for load in loads:
        # As in a P/D fleet, prefill and decode are instances of their own: a
        # prefill answer never waits behind the decode streams' tokens.
        ports = {"prefill": _free_port(), "decode": _free_port()}
        backend = [sys.executable, "-m", "bench.backend"]
        paced = ["--token-interval", str(load.token_interval)]
        decode = [*backend, "--port", str(ports["decode"]), "--processes", "2", *paced]
        prefill = [*backend, "--port", str(ports["prefill"])]
        with (
            _process(_pinned(others, decode), ports["decode"]),
            _process(_pinned(others, prefill), ports["prefill"]),
        ):
            url = {leg: f"http://127.0.0.1:{port}" for leg, port in ports.items()}
            direct = _load(url["decode"], load, length, others)
            for kind in kinds:
                with _serving(kind, url["prefill"], url["decode"], router) as (served, pids):
                    before = sum(_cpu_seconds(pid) for pid in pids)
                    result = _load(served, load, length, others)
                    cpu = sum(_cpu_seconds(pid) for pid in pids) - before
                    pauses = _full_collections(served) if kind == "nixlproxy" else None
                streams = max(1, result["requests"])
                rows.append(
                    {
                        "server": kind,
                        "load": load.name,
                        "direct": direct,
                        **result,
                        "cpu_ms_per_stream": round(cpu / streams * 1000, 3),
                        "cpu_us_per_token": round(cpu / streams / TOKENS * 1e6, 1),
                        "full_collections": pauses,
                    }
                )
    return rows


def _full_collections(url: str) -> dict[str, float]:
    """The proxy's full garbage collections so far, from its ``/metrics``: how many,
    their seconds in all, and how many held it longer than 25 ms."""
    time.sleep(1.5)  # (the proxy gives its histogram the pauses once a second)
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = {"count": 0.0, "sum": 0.0, "le_0.025": 0.0}
    prefix = "nixlproxy_gc_pause_seconds_"
    for line in text.splitlines():
        if not line.startswith(prefix) or 'generation="2"' not in line:
            continue
        value = float(line.rsplit(" ", 1)[1])
        kind = line[len(prefix) :].split("{", 1)[0]
        if kind in ("count", "sum"):
            found[kind] = value
        elif 'le="0.025"' in line:
            found["le_0.025"] = value
    return {
        "count": found["count"],
        "seconds": round(found["sum"], 4),
        "over_25ms": found["count"] - found["le_0.025"],
    }


def pauses(rows: list[dict[str, Any]]) -> str:
    """The proxy's full collections during each load (none of the other servers say)."""
    lines = [
        "| server | load | full collections | their seconds | over 25 ms |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if row["full_collections"] is not None:
            gc = row["full_collections"]
            lines.append(
                f"| {row['server']} | {row['load']} | {gc['count']:.0f} | {gc['seconds']} "
                f"| {gc['over_25ms']:.0f} |"
            )
    return "\n".join(lines)


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
    parser.add_argument(
        "--servers", nargs="+", choices=KINDS, default=["web-agent", "klein-upstream", "nixlproxy"]
    )
    parser.add_argument("--loads", nargs="+", choices=list(LOAD_NAMES), default=list(LOAD_NAMES))
    parser.add_argument(
        "--vllm-router", default="", metavar="PATH", help="vllm-router's binary, run beside"
    )
    parser.add_argument("--serve", choices=FLOORS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--prefill-backend", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port, args.prefill_backend or args.backend, args.backend)
        return 0
    servers = list(args.servers)
    if args.vllm_router and "vllm-router" not in servers:
        servers.append("vllm-router")
    if "vllm-router" in servers and not args.vllm_router:
        parser.error("--servers vllm-router needs --vllm-router PATH")
    loads = [LOAD_NAMES[name] for name in args.loads]
    rows = measure(servers, length_of(parser, args), loads, args.vllm_router)
    print(table(rows))
    if any(row["full_collections"] is not None for row in rows):
        print("\n" + pauses(rows))
    failed = [row for row in rows if row["errors"] or not row["requests"]]
    for row in failed:
        print(f"failed: {row['server']}, {row['load']}: {failure(row)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
