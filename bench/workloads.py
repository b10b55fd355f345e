"""The workloads of ``bench.routing``: seeded conversations, sent ``concurrency`` at a time.

- ``chat``: conversations share a system prompt; each turn repeats its
  whole history and adds a user message.
- ``documents``: many conversations over a few long documents
  (retrieval-augmented chat): each opens with one of the documents and a
  question of its own.
- ``mixed``: a third of each kind of traffic a fleet serves at once:
  conversations of their own whose history grows, conversations over
  shared documents, and short one-off prompts that share nothing.

``conversations`` sends every turn through the ``openai`` client
(streaming), a conversation's turns one after the other and turns of
different conversations interleaved in a seeded order, and measures TTFT.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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


@dataclass
class Workload:
    """Each conversation's history so far, and how many turns it takes."""

    histories: list[list[Any]]
    turns: list[int]


def workload(
    kind: str,
    count: int,
    turns: int,
    documents: int,
    rng: random.Random,
    words: int = 1200,
    opening: int = 900,
) -> Workload:
    """``count`` conversations of ``kind`` (``chat``, ``documents`` or ``mixed``).

    ``words``: each document's; ``opening``: the bytes of a chat's own first message.
    """
    if kind == "mixed":
        chats, docs = count // 3, count // 3
        shorts = count - chats - docs
        mixed = [
            *_chats(chats, rng, opening),
            *_questions(docs, documents, rng, words),
            *_shorts(shorts, rng),
        ]
        order = list(range(count))
        rng.shuffle(order)
        kinds = [turns] * (chats + docs) + [1] * shorts
        return Workload([mixed[n] for n in order], [kinds[n] for n in order])
    made = (
        _chats(count, rng, opening) if kind == "chat" else _questions(count, documents, rng, words)
    )
    return Workload(made, [turns] * count)


def _chats(count: int, rng: random.Random, opening: int = 900) -> list[list[Any]]:
    return [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Conversation {n}. " + rng.choice("abcdefgh") * opening},
        ]
        for n in range(count)
    ]


def _questions(count: int, documents: int, rng: random.Random, words: int) -> list[list[Any]]:
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


def _shorts(count: int, rng: random.Random) -> list[list[Any]]:
    """One-off prompts of 30 to 100 tokens (four bytes each), no system prompt: nothing shared."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [
        [
            {
                "role": "user",
                "content": f"Short {n}: "
                + " ".join(
                    "".join(rng.choice(letters) for _ in range(rng.randint(3, 8)))
                    for _ in range(rng.randint(20, 70))
                ),
            }
        ]
        for n in range(count)
    ]


async def conversations(
    urls: Sequence[str],
    made: Workload,
    concurrency: int,
    rng: random.Random,
    model: str = "fake-model",
    follow_up: int = 80,
) -> dict[str, Any]:
    """Every conversation's turns, interleaved in ``rng``'s order (it drew the workload too).

    With several ``urls`` (proxies), a conversation's turns alternate between them;
    each turn after the first asks ``follow_up`` words more.
    """
    from openai import AsyncOpenAI

    clients = [AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0) for url in urls]
    histories = made.histories
    order = [n for n, turns in enumerate(made.turns) for _ in range(turns)]
    rng.shuffle(order)
    done_turns = [0] * len(histories)
    busy: set[int] = set()
    ttfts: list[float] = []
    failures = 0
    lock = asyncio.Lock()

    async def one_turn(n: int) -> None:
        nonlocal failures
        client = clients[done_turns[n] % len(clients)]
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
                # (the proxy's access events then say which conversation and turn)
                extra_headers={"X-Request-Id": f"c{n}-t{done_turns[n]}-{uuid.uuid4().hex[:8]}"},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.monotonic()
                    text.append(chunk.choices[0].delta.content)
        except Exception:
            failures += 1
            return
        ttfts.append((first or time.monotonic()) - started)
        asked = f"Turn {done_turns[n]}: " + "more " * follow_up
        histories[n] += [
            {"role": "assistant", "content": "".join(text)},
            {"role": "user", "content": asked},
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
