"""Routing policies side by side on seeded chat workloads.

``--workload chat``: conversations share a system prompt; each turn repeats
its whole history and adds a user message. ``--workload documents``: many
conversations over a few long documents (retrieval-augmented chat): each
opens with one of ``--documents`` documents and a question of its own.
Turns of different conversations interleave at random (seeded),
``--concurrency`` at a time. The fakes (one process, one
shared ledger, pinned off the proxy's core) model vLLM's prefix cache and
take ``--cost`` seconds per prompt token they had to compute. For each run
it prints the prefill prefix-cache hit rate (hits / queries in tokens, from
the fakes' own ``/metrics``), TTFT p50/p99 as the client saw it (streaming),
how the legs spread over the prefill instances, and failures:

- ``ideal``: one prefill instance, where every turn finds its history;
- each policy with 2 prefill instances, and round-robin and cache-aware with 4;
- cache-aware under ``--workers 2``, and with two proxies taking turns of
  the same conversations;
- skew: one of two prefill instances 4x slower (least-loaded and load must
  send it less than round-robin).

    python -m bench.routing [--workload chat|documents] [--conversations 24] [--turns 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from bench.run import nixlproxy, served_fakes

SYSTEM = "You are a careful assistant for people who run disaggregated LLM serving. " * 8
#: A few words to make documents of: each document is its own seeded draw.
WORDS = [
    "prefill",
    "decode",
    "cache",
    "block",
    "token",
    "instance",
    "request",
    "latency",
    "queue",
    "model",
    "engine",
    "transfer",
    "memory",
    "network",
    "kernel",
    "batch",
    "stream",
    "schedule",
    "router",
    "policy",
    "prefix",
]


@dataclass(frozen=True)
class Run:
    name: str
    prefills: int = 2
    policy: str = "round-robin"
    workers: int = 1
    proxies: int = 1
    slow: bool = False


RUNS = (
    Run("ideal (1 prefill)", prefills=1),
    *(
        Run(f"{p}, 2 prefills", policy=p)
        for p in ("round-robin", "least-loaded", "load", "cache-aware", "session")
    ),
    Run("kv-aware, 2 prefills", policy="kv-aware"),
    Run("round-robin, 4 prefills", prefills=4),
    Run("cache-aware, 4 prefills", prefills=4, policy="cache-aware"),
    Run("kv-aware, 4 prefills", prefills=4, policy="kv-aware"),
    Run("cache-aware, 2 prefills, --workers 2", policy="cache-aware", workers=2),
    Run("kv-aware, 2 prefills, --workers 2", policy="kv-aware", workers=2),
    Run("cache-aware, 2 prefills, 2 proxies", policy="cache-aware", proxies=2),
    *(
        Run(f"skew: {p}, one prefill 4x slower", policy=p, slow=True)
        for p in ("round-robin", "least-loaded", "load")
    ),
)


# -- the fakes, served by a child process --------------------------------------


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


# -- the workload --------------------------------------------------------------


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


def openings(
    workload: str, count: int, documents: int, rng: random.Random, words: int = 1200
) -> list[list[Any]]:
    """Each conversation's first messages: a chat of its own, or a question on a document."""
    if workload == "chat":
        return [
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Conversation {n}. " + rng.choice("abcdefgh") * 900},
            ]
            for n in range(count)
        ]
    texts = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(documents)]
    return [
        [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"Document:\n{rng.choice(texts)}\n\nQuestion {n}: what does it "
                f"say about {rng.choice(WORDS)} and {rng.choice(WORDS)}?",
            },
        ]
        for n in range(count)
    ]


async def conversations(
    urls: Sequence[str],
    histories: list[list[Any]],
    turns: int,
    concurrency: int,
    rng: random.Random,
    model: str = "fake-model",
) -> dict[str, Any]:
    """Every conversation's turns, interleaved in ``rng``'s order (it drew the openings too)."""
    from openai import AsyncOpenAI

    clients = [AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0) for url in urls]
    count = len(histories)
    order = [n for n in range(count) for _ in range(turns)]
    rng.shuffle(order)
    done_turns = [0] * count
    busy: set[int] = set()
    ttfts: list[float] = []
    failures = 0
    lock = asyncio.Lock()

    async def one_turn(n: int) -> None:
        nonlocal failures
        client = clients[done_turns[n] % len(clients)]  # turns alternate between proxies
        started = time.monotonic()
        first: float | None = None
        text = []
        try:
            stream = await client.chat.completions.create(
                model=model,
                messages=histories[n],
                stream=True,
                max_tokens=16,
                user=f"conversation-{n}",
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.monotonic()
                    text.append(chunk.choices[0].delta.content)
        except Exception:
            failures += 1
            return
        ttfts.append((first or time.monotonic()) - started)
        follow_up = f"Turn {done_turns[n]}: " + "more " * 80
        histories[n] += [
            {"role": "assistant", "content": "".join(text)},
            {"role": "user", "content": follow_up},
        ]
        done_turns[n] += 1

    async def worker() -> None:
        while True:
            async with lock:
                pick = next((i for i, n in enumerate(order) if n not in busy), None)
                if pick is None:
                    if not order:
                        return
                    n = None
                else:
                    n = order.pop(pick)
                    busy.add(n)
            if n is None:
                await asyncio.sleep(0.005)
                continue
            await one_turn(n)
            busy.discard(n)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    for client in clients:
        await client.close()
    ttfts.sort()
    return {
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
        "ttft_p99_ms": round(ttfts[int(0.99 * (len(ttfts) - 1))] * 1000, 1) if ttfts else None,
        "failures": failures,
        "turns": len(ttfts),
    }


def _prefix_cache(urls: Sequence[str]) -> tuple[float, float]:
    """The prefill instances' prefix-cache counters now: (hits, queries), in tokens."""
    hits = queries = 0.0
    for url in urls:
        metrics = asyncio.run(_get(url.split("#", 1)[0] + "/metrics"))
        hits += sum(v for _, v in _samples(metrics, "vllm:prefix_cache_hits_total"))
        queries += sum(v for _, v in _samples(metrics, "vllm:prefix_cache_queries_total"))
    return hits, queries


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


def measure(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    with instances(run, args) as urls, ExitStack() as stack:
        if run.policy != "kv-aware":  # (only kv-aware reads the events)
            urls = {role: [u.split("#", 1)[0] for u in found] for role, found in urls.items()}
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
        ]
        proxies = [
            stack.enter_context(nixlproxy(proxy_args, "0", run.workers))[1]
            for _ in range(run.proxies)
        ]
        hits_before, queries_before = _prefix_cache(urls["prefill"])
        rng = random.Random(args.seed)
        histories = openings(args.workload, args.conversations, args.documents, rng, args.doc_words)
        result = asyncio.run(
            conversations(proxies, histories, args.turns, args.concurrency, rng, args.model)
        )
        hits, queries = _prefix_cache(urls["prefill"])
        hits, queries = hits - hits_before, queries - queries_before
        legs = []
        for proxy in proxies:
            metrics = asyncio.run(_get(proxy + "/metrics"))
            for labels, value in _samples(metrics, "nixlproxy_backend_requests_total"):
                if 'pool="prefill"' in labels:
                    legs.append((labels.split('instance="')[1].split('"')[0], value))
    spread: dict[str, float] = {}
    for instance, value in legs:
        spread[instance] = spread.get(instance, 0) + value
    ordered = [int(spread.get(u.split("#", 1)[0], 0)) for u in urls["prefill"]]
    return {
        "run": run.name,
        "hit_rate": round(hits / queries, 3) if queries else None,
        **result,
        "prefill_legs": ordered,
    }


def index_memory(prompts: int = 100_000) -> dict[str, Any]:
    """What cache-aware keeps after choosing for ``prompts`` distinct prompts (tracemalloc):
    its memory of prefixes sent, full at ``--cache-aware-entries``."""
    import tracemalloc

    from twisted.internet.task import Clock

    from nixl_twisted.backends import routing
    from nixl_twisted.backends.pools import BackendPool
    from nixl_twisted.backends.prompt_keys import routing_for
    from nixl_twisted.config.settings import BY_NAME
    from nixl_twisted.protocol.completion import Completion

    pool = BackendPool("prefill", [f"http://p{i}:1" for i in range(4)], Clock())
    balance = BY_NAME["cache-aware-balance"].default
    pool.sent.resize(BY_NAME["cache-aware-entries"].default)
    pool.policy = routing.policy("cache-aware", balance, pool.sent)
    pool.policy_name = "cache-aware"
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for n in range(prompts):
        body = {"messages": [{"role": "user", "content": f"distinct prompt {n} " * 20}]}
        chat = Completion("/v1/chat/completions", body, str(n))
        pool.choose(routing=routing_for({"cache-aware"}, 512, None, chat))
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"prompts": prompts, "entries": len(pool.sent), "retained_bytes": after - before}


def kv_index_memory(blocks: int = 200_000, size: int = 16) -> dict[str, Any]:
    """What kv-aware's index keeps per block, two instances holding each (tracemalloc),
    with vLLM's 64-bit hashes and with the longest hash an event may carry, and the time
    to match an 8k-token prompt against it."""
    from nixl_twisted.kv.wire import MAX_HASH

    longest, *_ = _kv_index_held(blocks, size, lambda rng: rng.randbytes(MAX_HASH))
    held, index, prompt, urls = _kv_index_held(blocks, size, lambda rng: rng.getrandbits(64))
    started = time.perf_counter()
    for _ in range(100):
        index.matched(prompt, urls)
    return {
        "blocks_per_instance": blocks,
        "bytes_per_block_per_instance": round(held / (2 * blocks)),
        f"bytes_per_block_per_instance_{MAX_HASH}_byte_hashes": round(longest / (2 * blocks)),
        "match_8800_tokens_us": round((time.perf_counter() - started) / 100 * 1e6),
    }


def _kv_index_held(
    blocks: int, size: int, new_hash: Callable[[random.Random], Any]
) -> tuple[int, Any, tuple[int, ...], tuple[str, str]]:
    import tracemalloc

    from nixl_twisted.kv.index import KvIndex, Stored

    index = KvIndex(blocks)
    rng = random.Random(1)
    urls = ("http://a:8100", "http://b:8100")
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    tokens: tuple[int, ...] = ()
    for _ in range(blocks // 50):
        tokens = tuple(rng.randrange(32000) for _ in range(size * 50))
        hashes = tuple(new_hash(rng) for _ in range(50))
        for url in urls:
            index.apply(url, [Stored(hashes, None, tokens, size, None, "GPU")])
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held, index, tokens * 11, urls  # the prompt: 8,800 tokens, its first 800 held


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("chat", "documents"), default="chat")
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--documents", type=int, default=6, help="documents: how many")
    parser.add_argument("--doc-words", type=int, default=1200, help="documents: words each")
    parser.add_argument(
        "--real-prefill",
        action="append",
        default=[],
        help="a real vLLM prefill instance instead of the fakes (repeat; #kv-events=PORT)",
    )
    parser.add_argument("--real-decode", action="append", default=[], help="with --real-prefill")
    parser.add_argument("--model", default="fake-model", help="the model name the requests ask for")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cost", type=float, default=0.0001, help="s per uncached token")
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--only", default="", help="runs whose name contains this")
    parser.add_argument("--serve-fakes", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--slow", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--index-memory",
        action="store_true",
        help="what cache-aware keeps after 100k distinct prompts",
    )
    parser.add_argument(
        "--kv-index-memory",
        action="store_true",
        help="what kv-aware's index keeps per block, and the time to match a prompt",
    )
    args = parser.parse_args(argv)
    if args.kv_index_memory:
        print(json.dumps(kv_index_memory()))
        return 0
    if args.index_memory:
        print(json.dumps(index_memory()))
        return 0
    if args.serve_fakes:
        serve_fakes(args.serve_fakes, 2, args.cost, args.slow)
        return 0
    print("| run | prefill hit rate | TTFT p50 | TTFT p99 | prefill legs | failed |")
    print("|---|---|---|---|---|---|")
    for run in RUNS:
        if args.only and args.only not in run.name:
            continue
        r = measure(run, args)
        cells = [
            r["run"],
            f"{r['hit_rate']:.1%}",
            f"{r['ttft_p50_ms']} ms",
            f"{r['ttft_p99_ms']} ms",
            str(r["prefill_legs"]),
            str(r["failures"]),
        ]
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
