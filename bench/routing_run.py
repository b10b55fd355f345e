"""One run of the routing bench (``bench.routing``): its fakes or real vLLM instances, the
proxies in front of them (a Redis for shared routes), the workload sent and what it measured.
``bench.routing`` prints runs side by side; ``bench.replicas_routing`` runs them as replicas."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from bench.run import _free_port, _pinned, _process, nixlproxy, served_fakes
from bench.workloads import FAKES, REAL, Shape, conversations, workload


@dataclass(frozen=True)
class Run:
    name: str
    prefills: int = 2
    policy: str = "round-robin"
    workers: int = 1
    proxies: int = 1
    slow: bool = False
    #: vllm-project/router instead of nixlproxy (its policy name).
    router: str | None = None
    #: With several proxies: each turn to one drawn at random (seeded), not in turn.
    at_random: bool = False
    #: With several proxies: one routing view through a redis-server of the run's own.
    shared: bool = False


def serve_fakes(prefills: int, decodes: int, cost: float, slow: bool) -> None:
    from twisted.internet import reactor
    from twisted.internet.defer import ensureDeferred

    from nixl_twisted.testing import FakeVLLM, TransferLedger

    async def serve() -> None:
        ledger = TransferLedger()
        urls: dict[str, list[str]] = {"prefill": [], "decode": []}
        for i in range(prefills):
            factor = 4 if slow and i == 0 else 1
            fake = FakeVLLM(
                name=f"prefill-{i}",
                ledger=ledger,
                tokens=16,
                prefill_cost_per_token=cost * factor,
                kv_events=True,
                kv_replay=True,
            )
            url = await fake.listen("tcp:0:interface=127.0.0.1", reactor)
            urls["prefill"].append(
                f"{url}#kv-events={fake.kv_events_port}&kv-replay={fake.kv_replay_port}"
            )
        for i in range(decodes):
            fake = FakeVLLM(name=f"decode-{i}", ledger=ledger, tokens=16)
            urls["decode"].append(await fake.listen("tcp:0:interface=127.0.0.1", reactor))
        print(json.dumps(urls), flush=True)

    reactor.callWhenRunning(lambda: ensureDeferred(serve()))
    reactor.run()


@contextmanager
def fakes(run: Run, cost: float) -> Iterator[dict[str, list[str]]]:
    command = [
        sys.executable,
        "-m",
        "bench.routing",
        "--serve-fakes",
        str(run.prefills),
        "--cost",
        str(cost),
    ] + (["--slow"] if run.slow else [])
    with served_fakes(command) as urls:
        yield urls


# -- what the instances say ----------------------------------------------------


async def _get(url: str) -> str:
    host, port = url.removeprefix("http://").split("/", 1)[0].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    path = "/" + url.removeprefix("http://").split("/", 1)[1]
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    raw = await reader.read()
    writer.close()
    return raw.partition(b"\r\n\r\n")[2].decode()


def _samples(text: str, name: str) -> list[tuple[str, float]]:
    found = []
    for line in text.splitlines():
        if line.startswith(name):
            labels, _, value = line.rpartition(" ")
            found.append((labels, float(value)))
    return found


def _counters(urls: Sequence[str]) -> list[tuple[float, float, float]]:
    """Each instance's prefix-cache hits and queries (tokens) and requests served, now."""
    found = []
    for url in urls:
        metrics = asyncio.run(_get(url.split("#", 1)[0] + "/metrics"))
        found.append(
            tuple(
                sum(v for _, v in _samples(metrics, name))
                for name in (
                    "vllm:prefix_cache_hits_total",
                    "vllm:prefix_cache_queries_total",
                    "vllm:request_success_total",
                )
            )
        )
    return found  # type: ignore[return-value]


async def _reset(url: str) -> None:
    """vLLM's ``POST /reset_prefix_cache`` (only with ``VLLM_SERVER_DEV_MODE=1``), so one
    run does not find what the run before it computed."""
    host, port = url.removeprefix("http://").split("/", 1)[0].split("#", 1)[0].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /reset_prefix_cache HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
        b"Connection: close\r\n\r\n"
    )
    await reader.read()
    writer.close()


@contextmanager
def instances(run: Run, args: argparse.Namespace) -> Iterator[dict[str, list[str]]]:
    """The fakes for this run, or the real vLLM instances given (``--real-prefill``)."""
    if not args.real_prefill:
        with fakes(run, args.cost) as urls:
            yield urls
        return
    prefill = args.real_prefill[: run.prefills]
    if len(prefill) < run.prefills:
        raise SystemExit(f"{run.name}: needs {run.prefills} --real-prefill URLs")
    for url in prefill:
        asyncio.run(_reset(url))
    yield {"prefill": prefill, "decode": args.real_decode}


@contextmanager
def redis_server() -> Iterator[str]:
    """A redis-server of its own for one run (nothing kept from the run before), off the
    proxies' core, and its URL."""
    port = _free_port()
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    command += ["--appendonly", "no"]
    with _process(_pinned("1", command), port):
        yield f"redis://127.0.0.1:{port}/0"


@contextmanager
def vllm_router(binary: str, policy: str, urls: dict[str, list[str]]) -> Iterator[str]:
    """vllm-project/router in P/D mode in front of the instances, pinned to the proxy's core."""
    port = _free_port()
    command = [
        binary,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--vllm-pd-disaggregation",
        *[a for u in urls["prefill"] for a in ("--prefill", u)],
        *[a for u in urls["decode"] for a in ("--decode", u)],
        "--prefill-policy",
        policy,
        "--decode-policy",
        "round_robin",
        "--disable-retries",
        "--log-level",
        "error",
    ]
    with _process(_pinned("0", command), port, subprocess.DEVNULL):
        yield f"http://127.0.0.1:{port}"


def measure(run: Run, args: argparse.Namespace, known: Shape | None = None) -> dict[str, Any]:
    """One run of ``args``'s workload, or of the shape ``known`` (at its own in flight)."""
    with instances(run, args) as urls, ExitStack() as stack:
        if run.policy != "kv-aware":  # (only kv-aware reads the events)
            urls = {role: [u.split("#", 1)[0] for u in found] for role, found in urls.items()}
        if run.router is not None:
            fronts = [stack.enter_context(vllm_router(args.vllm_router, run.router, urls))]
        else:
            proxy_args = [
                "--health-interval",
                "1",
                "--access-log",
                "off",
                "--prefill-policy",
                run.policy,
                "--workers",
                str(run.workers),
                *[a for u in urls["prefill"] for a in ("--prefill", u)],
                *[a for u in urls["decode"] for a in ("--decode", u)],
                *args.proxy_arg,
            ]
            if run.shared:
                proxy_args += ["--replicas-redis", stack.enter_context(redis_server())]
            fronts = [
                stack.enter_context(nixlproxy(proxy_args, "0", run.workers))[1]
                for _ in range(run.proxies)
            ]
        before = _counters(urls["prefill"])
        rng = random.Random(args.seed)
        if known is not None:
            sizes = REAL if args.real_prefill else FAKES
            made, concurrency, follow_up = (
                known.made(rng, sizes),
                known.concurrency,
                sizes.follow_up,
            )
        else:
            made = workload(
                args.workload,
                args.conversations,
                args.turns,
                args.documents,
                rng,
                args.doc_words,
                args.opening_bytes,
            )
            concurrency, follow_up = args.concurrency, args.follow_up_words
        assign = random.Random(f"assign-{args.seed}") if run.at_random else None
        result = asyncio.run(
            conversations(fronts, made, concurrency, rng, args.model, follow_up, assign)
        )
        after = _counters(urls["prefill"])
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    legs = [int(a[2] - b[2]) for a, b in zip(after, before, strict=True)]
    computed = [(a[1] - b[1]) - (a[0] - b[0]) for a, b in zip(after, before, strict=True)]
    return {
        "run": run.name,
        "hit_rate": round(hits / queries, 3) if queries else None,
        **result,
        "prefill_legs": legs,
        "busiest": round(max(legs) / (sum(legs) / len(legs)), 2) if sum(legs) else None,
        # The tokens the busiest instance had to compute (its prefix cache missed): the work
        # a miss costs, where a leg that hits costs next to nothing.
        "most_computed": int(max(computed)),
    }
