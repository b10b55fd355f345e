"""A rolling restart of three replicas under load near capacity, against the same load without it.

R ``twistd nixlproxy`` replicas share ``--replicas-redis`` on a real
``redis-server`` before ``bench.overload``'s fakes (the caps at the engines'
``--max-num-seqs``, its queue and tenants' weights), each with
``--shutdown-delay``. Clients keep their connections alive, one pool per
tenant, as an application's HTTP client does behind a Kubernetes Service:
a new connection goes to a replica in rotation (the Service's endpoints),
a connection is used again until the server closes it or answers
``Connection: close``, and nothing is retried. Open-loop arrivals
(``bench.open_loop``), the same seed for both runs.

With ``--roll``, ``--roll-at`` seconds into the load each replica in turn
is replaced as a Deployment with ``maxSurge: 1, maxUnavailable: 0`` does: a
new replica started and, once it shares the fleet's state, put in
rotation; then the old one sent SIGTERM and taken out of rotation
``--endpoint-lag`` seconds later (the endpoints' update, within its
shutdown delay); the next once the old one has exited. Printed for each
run: requests, served, refused (by status), lost (no answer, or a stream
broken off), the connections the clients opened, TTFT; and the roll's
timeline.

    python -m bench.rolling                  # the load, then the same load with the roll
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from bench import open_loop
from bench.overload import TENANT_HEADER, TENANTS, Fleet, arguments, fakes, weights_file
from bench.overload_targets import Log, _off_core, _pinned, _wait_for_port, nixlproxy
from bench.replicas import redis_server

#: The line a replica says once it shares the fleet's state through Redis.
SHARES = b"shares caps, queue and tenants with"


class Rotation:
    """The replicas a new connection may reach now (a Service's ready endpoints)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._addresses: list[str] = []
        self._rng = random.Random(7)

    def add(self, address: str) -> None:
        with self._lock:
            self._addresses.append(address)

    def remove(self, address: str) -> None:
        with self._lock:
            self._addresses.remove(address)

    def pick(self) -> str:
        with self._lock:
            return self._rng.choice(self._addresses)


@dataclass
class Got:
    """What one request got: ``status`` 0 when no answer began."""

    tenant: str
    status: int = 0
    served: bool = False
    ttft: float | None = None
    reused: bool = False
    error: str = ""
    #: A refusal's error code (``queue_timeout``, ``draining``, ...).
    code: str = ""


@dataclass
class Pool:
    """One client's kept-alive connections: used again until the server closes one."""

    rotation: Rotation
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = field(default_factory=list)
    opened: int = 0

    async def connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        while self.idle:
            reader, writer = self.idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer, True
            writer.close()
        host, port = self.rotation.pick().rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        self.opened += 1
        return reader, writer, False

    async def exchange(self, raw: bytes, got: Got, started: float) -> None:
        reader, writer, got.reused = await self.connection()
        keep = False
        try:
            writer.write(raw)
            head = await reader.readuntil(b"\r\n\r\n")
            got.status = int(head.split(b" ", 2)[1])
            headers = {
                name.strip().lower(): value.strip()
                for name, _, value in (line.partition(b":") for line in head.split(b"\r\n")[1:])
            }
            body = await _body(reader, headers, got, started)
            got.served = got.status == 200 and b"data: [DONE]" in body
            if got.status != 200:
                got.code = _code(body)
            keep = headers.get(b"connection") != b"close"
        finally:
            if keep:
                self.idle.append((reader, writer))
            else:
                writer.close()


def _code(body: bytes) -> str:
    """An error body's ``code`` (its status alone when it has none)."""
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return ""


async def _body(
    reader: asyncio.StreamReader, headers: dict[bytes, bytes], got: Got, started: float
) -> bytes:
    """The answer's body, whole (its first token timed as it comes): by its length, or
    chunk by chunk to the last chunk."""
    if b"content-length" in headers:
        return await reader.readexactly(int(headers[b"content-length"]))
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return body
        body += chunk[:-2]
        if got.ttft is None and open_loop._first_token(body[-4096:]):
            got.ttft = time.perf_counter() - started


async def load(
    planned: Sequence[open_loop.Arrival], rotation: Rotation, timeout: float
) -> tuple[list[Got], int]:
    """Every arrival at its time, through its tenant's pool: what each got, and the
    connections opened."""
    pools = {tenant: Pool(rotation) for tenant in TENANTS}
    begun = time.perf_counter()

    async def one(arrival: open_loop.Arrival) -> Got:
        await asyncio.sleep(max(0.0, begun + arrival.at - time.perf_counter()))
        got = Got(arrival.tenant)
        raw = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(arrival.body)}\r\n"
            f"{TENANT_HEADER}: {arrival.tenant}\r\n\r\n"
        ).encode() + arrival.body
        try:
            await asyncio.wait_for(
                pools[arrival.tenant].exchange(raw, got, time.perf_counter()), timeout
            )
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as error:
            got.served, got.error = False, type(error).__name__
        return got

    gots = await asyncio.gather(*(one(arrival) for arrival in planned))
    return list(gots), sum(pool.opened for pool in pools.values())


class Fleet3:
    """Redis, the fakes and the replicas, each replica replaced in turn on demand."""

    def __init__(self, stack: ExitStack, fleet: Fleet, args: argparse.Namespace, folder: str):
        self.urls = stack.enter_context(fakes(fleet))
        redis_url = stack.enter_context(redis_server())[0]
        cap = str(fleet.max_num_seqs)
        self.target = nixlproxy(
            [
                *("--tenant-header", TENANT_HEADER, "--config", weights_file(folder)),
                *("--decode-max-in-flight", cap, "--prefill-max-in-flight", cap),
                *("--queue-size", str(args.queue_size)),
                *("--queue-timeout", f"{args.queue_timeout:g}"),
                *("--shutdown-delay", f"{args.shutdown_delay:g}", "--replicas-redis", redis_url),
                *args.proxy_arg,
            ]
        )
        self.rotation = Rotation()
        self.logs: list[Log] = []
        stack.callback(self.stop)
        _off_core()
        self.live = [self.start() for _ in range(args.replicas)]
        self.timeline: list[str] = []

    def start(self) -> Log:
        """A new replica, in rotation once it shares the fleet's state."""
        log = Log(_pinned(self.target.command(self.urls)), self.target.ready, b"SIGTERM")
        self.logs.append(log)
        url = log.wait_ready()
        _wait_for_port(url)
        while not any(SHARES in line for line in log.lines):
            time.sleep(0.02)
        self.rotation.add(url.removeprefix("http://"))
        return log

    def roll(self, lag: float, begun: float) -> None:
        """Each replica replaced in turn: the new one in rotation first, then the old one
        stopped and taken out of rotation ``lag`` s later, until it has exited."""
        for n, old in enumerate(list(self.live)):
            new = self.start()
            at = time.perf_counter() - begun
            old.process.send_signal(signal.SIGTERM)
            time.sleep(lag)
            assert old.url is not None
            self.rotation.remove(old.url.removeprefix("http://"))
            code = old.process.wait(60)
            self.live[n] = new
            took = time.perf_counter() - begun - at
            self.timeline.append(
                f"replica {n}: SIGTERM at {at:.1f} s, exit {code} {took:.1f} s later"
            )

    def stop(self) -> None:
        for log in self.logs:
            log.stop()

    def said(self, marker: bytes) -> int:
        return sum(1 for log in self.logs for line in log.lines if marker in line)


def measure(fleet: Fleet, args: argparse.Namespace, roll: bool, folder: str) -> dict[str, Any]:
    rate = args.load * fleet.capacity
    planned = open_loop.arrivals(
        rate, list(TENANTS), args.seed, fleet.body, args.seconds, args.requests
    )
    with ExitStack() as stack:
        three = Fleet3(stack, fleet, args, folder)
        begun = time.perf_counter()
        rolling = None
        if roll:
            rolling = threading.Timer(args.roll_at, three.roll, (args.endpoint_lag, begun))
            rolling.start()
        gots, opened = asyncio.run(load(planned, three.rotation, args.client_timeout))
        if rolling is not None:
            rolling.join()
        timeline = three.timeline
        warnings = three.said(b"replicas#warn") + three.said(b"could not be reached")
    statuses = Counter(f"{g.status} {g.code}".strip() for g in gots if g.status not in (0, 200))
    ttfts = sorted(g.ttft for g in gots if g.served and g.ttft is not None)
    return {
        "run": "rolling restart" if roll else "no restart",
        "requests": len(gots),
        "served": sum(g.served for g in gots),
        "refused": dict(sorted(statuses.items())),
        "lost": sum(1 for g in gots if not g.served and g.status in (0, 200)),
        "lost_errors": dict(Counter(g.error for g in gots if g.error)),
        "opened": opened,
        "ttft": [_at(ttfts, 0.5), _at(ttfts, 0.99)],
        "timeline": timeline,
        "redis_warnings": warnings,
    }


def _at(ordered: Sequence[float], q: float) -> float | None:
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2) if ordered else None


def row(result: dict[str, Any]) -> str:
    refused = ", ".join(f"{n} x {s}" for s, n in result["refused"].items()) or "0"
    p50, p99 = result["ttft"]
    return (
        f"| {result['run']} | {result['requests']} | {result['served']} | {refused} "
        f"| {result['lost']} | {result['opened']} | {p50} / {p99} s |"
    )


HEADER = (
    "| run | requests | served | refused | lost | connections opened | served TTFT p50 / p99 |\n"
    "|---|---|---|---|---|---|---|"
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = arguments()
    parser.description = __doc__.splitlines()[0]
    parser.set_defaults(seconds=30.0)
    parser.add_argument("--load", type=float, default=0.9, help="of the fleet's capacity")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--roll", action="store_true", help="only the run with the roll")
    parser.add_argument("--roll-at", type=float, default=3.0, metavar="SECONDS")
    parser.add_argument("--shutdown-delay", type=float, default=1.0, metavar="SECONDS")
    parser.add_argument("--endpoint-lag", type=float, default=0.5, metavar="SECONDS")
    args = parser.parse_args(argv)
    fleet = Fleet.of(args)
    if args.serve_fakes:
        from bench.overload import serve_fakes

        serve_fakes(fleet)
        return 0
    print(fleet.describe())
    print(
        f"{args.replicas} replicas through Redis, --shutdown-delay {args.shutdown_delay:g}, "
        f"load {args.load:g}x, kept-alive clients"
    )
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for roll in [True] if args.roll else [False, True]:
            result = measure(fleet, args, roll, folder)
            print(row(result), flush=True)
            for line in result["timeline"]:
                print(f"  {line}")
            if result["lost_errors"]:
                print(f"  lost: {result['lost_errors']}")
            print(f"  Redis warnings in the replicas' logs: {result['redis_warnings']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
