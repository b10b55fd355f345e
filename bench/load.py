"""A load generator: C keep-alive connections, each sending requests back to back.

Measures throughput, latency p50/p99 and, for streams, time to first token
and the gaps between tokens. Plain asyncio and just enough HTTP/1.1, so that
it costs little next to what it measures. It runs for ``--seconds``, or
until ``--requests`` have been answered: a run by count completes the same
work however slow the machine is (a smoke test's choice), a timed one is
how the numbers of docs/performance.md are taken.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Results:
    latencies: list[float] = field(default_factory=list)
    first_tokens: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    errors: int = 0


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _response(reader: asyncio.StreamReader, started: float, results: Results) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = None
    chunked = False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if not chunked:
        await reader.readexactly(length or 0)
        return status
    last = None
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            return status
        await reader.readexactly(size + 2)
        now = time.perf_counter()
        if last is None:
            results.first_tokens.append(now - started)
        else:
            results.gaps.append(now - last)
        last = now


class Budget:
    """Requests left to send, shared by every connection of a run by count."""

    def __init__(self, requests: int) -> None:
        self.left = requests

    def take(self) -> bool:
        """One more request may be sent (the event loop's one thread: no lock)."""
        if self.left <= 0:
            return False
        self.left -= 1
        return True


async def _connection(
    host: str, port: int, request: bytes, more: Callable[[], bool], results: Results
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while more():
            started = time.perf_counter()
            writer.write(request)
            status = await _response(reader, started, results)
            if status != 200:
                results.errors += 1
            results.latencies.append(time.perf_counter() - started)
    except (ConnectionError, asyncio.IncompleteReadError):
        results.errors += 1
    finally:
        writer.close()


def request_bytes(path: str, body: dict[str, Any], api_key: str | None = None) -> bytes:
    """One request, sent as it is on every turn; ``api_key`` as ``Authorization: Bearer``."""
    raw = json.dumps(body).encode()
    key = b"Authorization: Bearer %s\r\n" % api_key.encode() if api_key is not None else b""
    return (
        b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n%s"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), key, len(raw), raw)
    )


async def run(
    host: str,
    port: int,
    request: bytes,
    connections: int,
    seconds: float = 8.0,
    requests: int | None = None,
) -> dict[str, Any]:
    """Load for ``seconds``, or until ``requests`` were sent if given."""
    results = Results()
    started = time.perf_counter()
    deadline = started + seconds
    more = Budget(requests).take if requests is not None else lambda: time.perf_counter() < deadline
    await asyncio.gather(
        *(_connection(host, port, request, more, results) for _ in range(connections))
    )
    elapsed = time.perf_counter() - started
    ms = 1000.0

    def scaled(values: list[float], q: float) -> float | None:
        value = _percentile(values, q)
        return None if value is None else round(value * ms, 3)

    return {
        "requests": len(results.latencies),
        "errors": results.errors,
        "per_second": round(len(results.latencies) / elapsed, 1),
        "p50_ms": scaled(results.latencies, 0.5),
        "p99_ms": scaled(results.latencies, 0.99),
        "ttft_p50_ms": scaled(results.first_tokens, 0.5),
        "ttft_p99_ms": scaled(results.first_tokens, 0.99),
        "gap_p50_ms": scaled(results.gaps, 0.5),
        "gap_p99_ms": scaled(results.gaps, 0.99),
        "mean_ms": round(statistics.fmean(results.latencies) * ms, 3)
        if results.latencies
        else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="http://host:port")
    parser.add_argument("--connections", type=int, default=1)
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--seconds", type=float, default=8.0, help="run this long")
    length.add_argument("--requests", type=int, help="instead: send this many in all, then stop")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--api-key", help="send it as Authorization: Bearer KEY")
    args = parser.parse_args(argv)
    if args.requests is not None and args.requests < 1:
        parser.error("--requests must be at least 1")
    host, port = args.url.removeprefix("http://").rsplit(":", 1)
    if args.stream:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": args.tokens,
        }
        request = request_bytes("/v1/chat/completions", body, args.api_key)
    else:
        completion = {"model": "m", "prompt": "hi", "max_tokens": 16}
        request = request_bytes("/v1/completions", completion, args.api_key)
    ran = run(host, int(port), request, args.connections, args.seconds, args.requests)
    print(json.dumps(asyncio.run(ran)))


if __name__ == "__main__":
    main()
