"""How fast two legs can go on this stack with none of the proxy's work.

Each floor server does only what a completion must: parse the client's JSON,
POST a lowered copy to prefill, parse its answer, POST the body plus
``kv_transfer_params`` to decode and return decode's body. No retries, no
health, no metrics, no access log. Run against the same fast fake backend
and load as ``bench.run``'s non-streaming loads, pinned the same way:

- ``web-agent``: a bare ``twisted.web`` resource and ``Agent``: the floor
  under Twisted;
- ``klein-agent`` and ``web-treq``: Klein or treq alone on top of it;
- ``klein-treq``: Klein and treq, used as a first version would use them;
- ``klein-upstream``: Klein and the proxy's own treq client
  (``nixl_twisted.backends.upstream``), to show what is left of treq's cost;
- ``nixlproxy``: the real ``twistd nixlproxy``, for comparison.

All the floors parse no forms and pool connections, as the proxy does.

    python -m bench.ceiling                 # 8 s per load
    python -m bench.ceiling --requests 64   # a smoke run: 64 requests per load
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

from twisted.internet.defer import Deferred, succeed
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.iweb import IBodyProducer
from twisted.web.server import Request
from zope.interface import implementer

from bench.run import (
    Length,
    Load,
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

LOADS = (
    Load("non-streaming completions, 1 connection", 1, False),
    Load("non-streaming completions, 64 connections", 64, False),
)
KINDS = ("web-agent", "klein-agent", "web-treq", "klein-treq", "klein-upstream", "nixlproxy")
_KV = {"do_remote_decode": True, "do_remote_prefill": False}


def _lowered(body: dict[str, Any]) -> bytes:
    return json.dumps(dict(body, stream=False, max_tokens=1, kv_transfer_params=_KV)).encode()


def _completed(body: dict[str, Any], answer: bytes) -> bytes:
    params = json.loads(answer)["kv_transfer_params"]
    return json.dumps(dict(body, kv_transfer_params=params)).encode()


class _NoForms(Request):
    parsePOSTFormSubmission = False


@implementer(IBodyProducer)
class _Bytes:
    """The whole body in one write (FileBodyProducer would add a cooperator)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.length = data, len(data)

    def startProducing(self, consumer: Any) -> Deferred[None]:
        consumer.write(self.data)
        return succeed(None)

    def pauseProducing(self) -> None: ...
    def stopProducing(self) -> None: ...
    def resumeProducing(self) -> None: ...


def _pooled_agent(reactor: Any) -> Agent:
    """Twisted's ``Agent`` with a pool of 512 connections per backend, as the proxy has."""
    pool = HTTPConnectionPool(reactor)
    pool.maxPersistentPerHost = 512
    return Agent(reactor, pool=pool)


def serve(kind: str, port: int, backend: str) -> None:
    """Run one floor server until it is terminated."""
    from twisted.internet import reactor
    from twisted.internet.endpoints import serverFromString
    from twisted.internet.interfaces import IReactorCore
    from twisted.web.client import readBody
    from twisted.web.http_headers import Headers
    from twisted.web.resource import Resource
    from twisted.web.server import NOT_DONE_YET, Site

    url = (backend + "/v1/completions").encode()
    headers = Headers({b"Content-Type": [b"application/json"]})
    agent = _pooled_agent(reactor)

    server, client = kind.split("-")

    if client == "upstream":
        from nixl_twisted.backends.upstream import pooled_upstream, read_body

        # (512 idle connections per backend, as _pooled_agent; Twisted's 240 s idle)
        upstream = pooled_upstream(reactor, 10.0, 512, 240.0)

        async def post(data: bytes) -> bytes:
            response = await upstream.post(url.decode(), data, headers)
            return bytes(await read_body(response))

    elif client == "agent":

        async def post(data: bytes) -> bytes:
            response = await agent.request(b"POST", url, headers, _Bytes(data))
            return bytes(await readBody(response))
    else:
        import treq.client

        http = treq.client.HTTPClient(agent)

        async def post(data: bytes) -> bytes:
            response = await http.post(url, data=data, headers=headers)
            return bytes(await response.content())

    async def two_legs(request: Any) -> bytes:
        body = json.loads(request.content.read())
        answer = await post(_lowered(body))
        decoded = await post(_completed(body, answer))
        request.setHeader(b"Content-Type", b"application/json")
        return decoded

    if server == "web":

        async def respond(request: Any) -> None:
            request.write(await two_legs(request))
            request.finish()

        class _Completions(Resource):
            isLeaf = True

            def render_POST(self, request: Any) -> int:
                Deferred.fromCoroutine(respond(request))
                return NOT_DONE_YET

        site = Site(_Completions())
    else:
        from klein import Klein

        app = Klein()
        app.route("/v1/completions", methods=["POST"])(two_legs)
        site = Site(app.resource())
    site.requestFactory = _NoForms
    serverFromString(reactor, f"tcp:{port}:interface=127.0.0.1").listen(site)
    cast(IReactorCore, reactor).run()


def _server(kind: str, port: int, backend: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bench.ceiling",
        "--serve",
        kind,
        "--port",
        str(port),
        "--backend",
        backend,
    ]


@contextmanager
def _serving(kind: str, backend: str) -> Iterator[str]:
    """One floor server (or nixlproxy itself) on core 0, and its URL."""
    if kind == "nixlproxy":
        with nixlproxy(
            ["--health-interval", "0", "--prefill", backend, "--decode", backend], "0"
        ) as (_, url):
            yield url
        return
    port = _free_port()
    with _process(_pinned("0", _server(kind, port, backend)), port):
        yield f"http://127.0.0.1:{port}"


def measure(kinds: Sequence[str], length: Length) -> list[dict[str, Any]]:
    others = other_cores()
    backend_port = _free_port()
    backend = [
        sys.executable,
        "-m",
        "bench.backend",
        "--port",
        str(backend_port),
        "--processes",
        "2",
    ]
    rows = []
    with _process(_pinned(others, backend), backend_port):
        for kind in kinds:
            with _serving(kind, f"http://127.0.0.1:{backend_port}") as url:
                for load in LOADS:
                    result = _load(url, load, length, others)
                    rows.append({"server": kind, "load": load.name, **result})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| server | load | req/s | p50 | p99 | errors |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['server']} | {row['load']} | {row['per_second']}/s | {row['p50_ms']} ms "
            f"| {row['p99_ms']} ms | {row['errors']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_length_options(parser)
    parser.add_argument("--servers", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--serve", choices=KINDS[:-1], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port, args.backend)
        return 0
    rows = measure(args.servers, length_of(parser, args))
    print(table(rows))
    failed = [row for row in rows if row["errors"] or not row["requests"]]
    for row in failed:
        print(f"failed: {row['server']}, {row['load']}: {failure(row)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
