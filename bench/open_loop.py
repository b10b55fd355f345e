"""Open-loop arrivals of streaming chat completions, and the engines' queues sampled meanwhile.

Each request goes at its own arrival time on a connection of its own,
whether or not the earlier ones were answered (as many independent clients
do; a closed loop of N connections would slow down with the server and
never overload it). For each it keeps the tenant, the status, whether a
refusal said ``Retry-After``, and for a stream that ended with ``[DONE]``
its time to first token: to the first event whose delta has content (the
role event before it carries none). Plain asyncio and just enough HTTP/1.1,
as ``bench.load``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Outcome:
    """What one request got: ``status`` 0 when the connection failed or timed out."""

    tenant: str
    status: int = 0
    ttft: float | None = None
    #: When its first token came, in seconds from the load's start.
    first_at: float | None = None
    served: bool = False
    retry_after: bool = False
    #: How late it left against its arrival time (the generator falling behind).
    lag: float = 0.0
    #: Seconds from its leaving to its answer's status line (None: no answer began).
    answered: float | None = None
    #: A refusal's error code, as its body says it ("" for none).
    code: str = ""


@dataclass(frozen=True)
class Arrival:
    at: float
    tenant: str
    body: bytes
    #: Which of the targets' URLs it goes to (``bench.replicas``: a replica of the proxy).
    target: int = 0
    #: Headers it carries besides its tenant's (``bench.goodput``: its first-token target).
    headers: tuple[tuple[str, str], ...] = ()


def arrivals(
    rate: float, tenants: Sequence[str], seed: int, body: Any, seconds: float, count: int | None
) -> list[Arrival]:
    """Poisson arrivals at ``rate`` per second (seeded) for ``seconds``, or ``count`` of
    them; tenants take turns, so that each sends the same amount. ``body(i, tenant)``
    makes request ``i``'s JSON body."""
    rng = random.Random(seed)
    made: list[Arrival] = []
    at = 0.0
    while True:
        at += rng.expovariate(rate)
        if (count is not None and len(made) >= count) or (count is None and at > seconds):
            return made
        tenant = tenants[len(made) % len(tenants)]
        made.append(Arrival(at, tenant, json.dumps(body(len(made), tenant)).encode()))


def _request(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    ).encode() + body


def _first_token(buffer: bytes) -> bool:
    """Whether the SSE events in ``buffer`` hold one whose delta has content."""
    for line in buffer.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        try:
            choices = json.loads(line[6:]).get("choices") or [{}]
        except ValueError:
            continue
        if (choices[0].get("delta") or {}).get("content"):
            return True
    return False


async def _exchange(
    host: str, port: int, raw: bytes, begun: float, started: float, outcome: Outcome
) -> None:
    """One request on a connection of its own, read to the end; its first token timed as
    it arrives (chunk framing left in: an event's line is found whole all the same)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(raw)
        head = await reader.readuntil(b"\r\n\r\n")
        outcome.answered = time.perf_counter() - started
        outcome.status = int(head.split(b" ", 2)[1])
        lines = [line.lower() for line in head.split(b"\r\n")[1:]]
        outcome.retry_after = any(line.startswith(b"retry-after:") for line in lines)
        seen = b""
        while True:
            piece = await reader.read(65536)
            if not piece:
                break
            if outcome.status == 200 and outcome.ttft is None:
                seen += piece
                if _first_token(seen):
                    now = time.perf_counter()
                    outcome.ttft, outcome.first_at = now - started, now - begun
                    seen = seen[-64:]
            elif outcome.status == 200:
                seen = seen[-64:] + piece
            else:
                seen += piece
        outcome.served = outcome.status == 200 and b"data: [DONE]" in seen
        if outcome.status != 200:
            said = re.search(rb'"code"\s*:\s*"([a-z_]+)"', seen)
            outcome.code = said.group(1).decode() if said else ""
    finally:
        writer.close()


async def send_all(
    url: str | Sequence[str],
    path: str,
    planned: Sequence[Arrival],
    header: str,
    timeout: float,
) -> list[Outcome]:
    """Send every arrival at its time (``header`` names its tenant), to its target's URL;
    each outcome once answered, refused, failed or past ``timeout`` seconds."""
    urls = [url] if isinstance(url, str) else list(url)
    where = [u.removeprefix("http://").rsplit(":", 1) for u in urls]
    outcomes = [Outcome(arrival.tenant) for arrival in planned]
    begun = time.perf_counter()

    async def one(arrival: Arrival, outcome: Outcome) -> None:
        await asyncio.sleep(max(0.0, begun + arrival.at - time.perf_counter()))
        started = time.perf_counter()
        outcome.lag = started - (begun + arrival.at)
        raw = _request(path, arrival.body, {header: arrival.tenant, **dict(arrival.headers)})
        host, port = where[arrival.target % len(where)]
        try:
            exchange = _exchange(host, int(port), raw, begun, started, outcome)
            await asyncio.wait_for(exchange, timeout)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError):
            outcome.served = False  # (status: 0 if no answer began, else the one that broke)

    await asyncio.gather(*(one(a, o) for a, o in zip(planned, outcomes, strict=True)))
    return outcomes


@dataclass
class Gauges:
    """``vllm:num_requests_waiting`` (and ``_running``) summed over each role's instances,
    one value per sample."""

    waiting: dict[str, list[float]] = field(default_factory=dict)
    running: dict[str, list[float]] = field(default_factory=dict)


async def _metrics(url: str) -> str:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
    raw = await reader.read()
    writer.close()
    return raw.partition(b"\r\n\r\n")[2].decode()


def waiting_in(text: str, gauge: str = "vllm:num_requests_waiting") -> float:
    """``gauge`` in one ``/metrics`` text (every engine's, summed)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(gauge + "{") or line.startswith(gauge + " ")
    )


async def sample(urls: dict[str, list[str]], every: float, done: asyncio.Event) -> Gauges:
    """Each role's instances' waiting requests, every ``every`` seconds until ``done``."""
    gauges = Gauges({role: [] for role in urls}, {role: [] for role in urls})
    while not done.is_set():
        for role, found in urls.items():
            texts = await asyncio.gather(*(_metrics(url) for url in found))
            gauges.waiting[role].append(sum(waiting_in(text) for text in texts))
            running = (waiting_in(text, "vllm:num_requests_running") for text in texts)
            gauges.running[role].append(sum(running))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), every)
    return gauges


async def run(
    url: str | Sequence[str],
    planned: Sequence[Arrival],
    fakes: dict[str, list[str]],
    header: str,
    timeout: float,
    every: float = 0.25,
) -> tuple[list[Outcome], Gauges, float]:
    """The arrivals through ``url``, the fakes' queues sampled meanwhile; and how long
    it took from the first arrival's time to the last answer."""
    done = asyncio.Event()
    sampler = asyncio.ensure_future(sample(fakes, every, done))
    started = time.perf_counter()
    outcomes = await send_all(url, "/v1/chat/completions", planned, header, timeout)
    elapsed = time.perf_counter() - started
    done.set()
    return outcomes, await sampler, elapsed
