"""The workloads of ``bench.routing``: seeded conversations, sent ``concurrency`` at a time.

- ``chat``: conversations share a long system prompt; each turn repeats
  its whole history and adds a user message.
- ``documents``: many conversations over a few long documents
  (retrieval-augmented chat): each opens with one of the documents and a
  question of its own.
- ``mixed``: a third of each kind of traffic a fleet serves at once:
  conversations of their own whose history grows, conversations over
  shared documents, and short one-off prompts that share nothing.
- ``prefix_repetition``: vLLM's own ``vllm bench serve --dataset-name
  prefix_repetition``: a few long prefixes, each prompt one of them and a
  random suffix, sent as completions (no chat template).

``SHAPES`` names the shapes a user runs, each as the routing issue measured
it (its instances and requests in flight); ``bench.routing --shapes`` runs
them all, and ``bench.replay`` replays them in memory for the suite's guard.

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
from dataclasses import dataclass, replace
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
#: What a turn's answer is taken to be where no instance answers (``bench.replay``).
ANSWER = "The prefill instance computes the prompt, and decode pulls its KV cache over NIXL."


@dataclass
class Workload:
    """Each conversation's history so far (chat messages, or a completion's prompt), and
    how many turns it takes."""

    histories: list[Any]
    turns: list[int]


@dataclass(frozen=True)
class Sizes:
    """How long a shape's texts are: the fakes count four bytes a token, vLLM's tiny test
    model's tokenizer fewer, so that real vLLM runs take ``REAL`` within a 2,048 context."""

    #: Words of each shared document.
    doc_words: int = 200
    #: Bytes of a growing conversation's own first message.
    opening: int = 900
    #: Words each turn after the first adds.
    follow_up: int = 80
    #: ``prefix_repetition``: words of each shared prefix, and of each prompt's own suffix.
    prefix_words: int = 300
    suffix_words: int = 120


FAKES = Sizes()
REAL = Sizes(doc_words=120, opening=500, follow_up=30, prefix_words=80, suffix_words=40)


@dataclass(frozen=True)
class Shape:
    """A workload shape as a user runs it: what, on how many instances, how many at once."""

    name: str
    kind: str
    conversations: int
    turns: int
    documents: int
    instances: int
    concurrency: int
    what: str

    def made(self, rng: random.Random, sizes: Sizes = FAKES) -> Workload:
        """This shape's seeded workload."""
        return workload(
            self.kind,
            self.conversations,
            self.turns,
            self.documents,
            rng,
            sizes.doc_words,
            sizes.opening,
            sizes,
        )


#: The shapes of the routing issue (#45), each at its own instances and requests in flight.
SHAPES = (
    Shape(
        "documents",
        "documents",
        24,
        1,
        4,
        2,
        1,
        "4 documents of ~200 words, 6 questions each by new conversations, interleaved",
    ),
    Shape(
        "chat",
        "chat",
        8,
        4,
        0,
        4,
        4,
        "8 conversations of 4 turns whose history grows, a long system prompt shared",
    ),
    Shape(
        "prefix_repetition",
        "prefix_repetition",
        64,
        1,
        4,
        2,
        4,
        "vLLM's prefix_repetition: 4 long prefixes, 64 completions with suffixes of their own",
    ),
    Shape(
        "mixed",
        "mixed",
        37,
        4,
        3,
        4,
        4,
        "6 growing conversations, 3 documents x 5 questions, 16 short prompts",
    ),
)


def shape(name: str) -> Shape:
    """The shape of this name."""
    for known in SHAPES:
        if known.name == name:
            return known
    raise KeyError(name)


def at(known: Shape, instances: int, concurrency: int) -> Shape:
    """``known`` on another count of instances, at another count of requests in flight."""
    return replace(known, instances=instances, concurrency=concurrency)


def workload(
    kind: str,
    count: int,
    turns: int,
    documents: int,
    rng: random.Random,
    words: int = 1200,
    opening: int = 900,
    sizes: Sizes = FAKES,
) -> Workload:
    """``count`` conversations of ``kind`` (``chat``, ``documents``, ``mixed`` or
    ``prefix_repetition``).

    ``words``: each document's; ``opening``: the bytes of a chat's own first message.
    ``mixed`` takes six growing conversations, ``documents`` x 5 questions (one turn
    each), and short one-off prompts for the rest of ``count``.
    """
    if kind == "mixed":
        chats, docs = 6, documents * 5
        shorts = max(0, count - chats - docs)
        mixed = [
            *_chats(chats, rng, opening),
            *_questions(docs, documents, rng, words),
            *_shorts(shorts, rng),
        ]
        kinds = [turns] * chats + [1] * (docs + shorts)
        order = list(range(len(mixed)))
        rng.shuffle(order)
        return Workload([mixed[n] for n in order], [kinds[n] for n in order])
    if kind == "prefix_repetition":
        return Workload(_repetitions(count, documents, rng, sizes), [1] * count)
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
    # Each document is asked count / documents times, in a seeded order (interleaved).
    asked = [texts[n % documents] for n in range(count)]
    rng.shuffle(asked)
    return [
        [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"Document:\n{text}\n\nQuestion {n}: what does it "
                f"say about {rng.choice(WORDS)} and {rng.choice(WORDS)}?",
            },
        ]
        for n, text in enumerate(asked)
    ]


def _words(rng: random.Random, count: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join(
        "".join(rng.choice(letters) for _ in range(rng.randint(3, 8))) for _ in range(count)
    )


def _shorts(count: int, rng: random.Random) -> list[list[Any]]:
    """One-off prompts of 30 to 100 tokens (four bytes each), no system prompt: nothing shared."""
    return [
        [{"role": "user", "content": f"Short {n}: " + _words(rng, rng.randint(20, 70))}]
        for n in range(count)
    ]


def _repetitions(count: int, prefixes: int, rng: random.Random, sizes: Sizes) -> list[str]:
    """vLLM's prefix_repetition: ``prefixes`` random prefixes, each prompt one of them (in a
    seeded order) and a random suffix of its own, as completions' prompts."""
    texts = [_words(rng, sizes.prefix_words) for _ in range(prefixes)]
    chosen = [texts[n % prefixes] for n in range(count)]
    rng.shuffle(chosen)
    return [f"{text} {_words(rng, sizes.suffix_words)}" for text in chosen]


def next_turn(history: Any, number: int, answer: str, follow_up: int) -> Any:
    """A conversation's history after a turn answered ``answer`` and the next question."""
    asked = f"Turn {number}: " + "more " * follow_up
    if isinstance(history, str):
        return f"{history}{answer}\n{asked}"
    return [*history, {"role": "assistant", "content": answer}, {"role": "user", "content": asked}]


def body(history: Any, model: str, conversation: int, stream: bool = True) -> dict[str, Any]:
    """A turn's request body: a chat completion, or a completion for a prompt."""
    said: dict[str, Any] = {
        "model": model,
        "max_tokens": 16,
        "stream": stream,
        "user": f"conversation-{conversation}",
    }
    if isinstance(history, str):
        return {**said, "prompt": history}
    return {**said, "messages": history}


def order(made: Workload, rng: random.Random) -> list[int]:
    """Every turn as its conversation's number, interleaved in ``rng``'s order."""
    turns = [n for n, count in enumerate(made.turns) for _ in range(count)]
    rng.shuffle(turns)
    return turns


async def conversations(
    urls: Sequence[str],
    made: Workload,
    concurrency: int,
    rng: random.Random,
    model: str = "fake-model",
    follow_up: int = 80,
    assign: random.Random | None = None,
) -> dict[str, Any]:
    """Every conversation's turns, interleaved in ``rng``'s order (it drew the workload too).

    With several ``urls`` (proxies), a conversation's turns alternate between them, or
    with ``assign`` each turn goes to one drawn at random from it (drawn before the
    first is sent, so that the draw does not depend on which turn ends first); each turn
    after the first asks ``follow_up`` words more.
    """
    from openai import AsyncOpenAI

    clients = [AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0) for url in urls]
    drawn = [
        [assign.randrange(len(clients)) if assign else t % len(clients) for t in range(count)]
        for count in made.turns
    ]
    histories = made.histories
    waiting = order(made, rng)
    done_turns = [0] * len(histories)
    busy: set[int] = set()
    ttfts: list[float] = []
    failures = 0
    #: Why turns failed, each reason once, as the client said it.
    why: list[str] = []
    lock = asyncio.Lock()

    async def one_turn(n: int) -> None:
        nonlocal failures
        client = clients[drawn[n][done_turns[n]]]
        started = time.monotonic()
        first: float | None = None
        text = []
        sent = body(histories[n], model, n)
        # (the proxy's access events then say which conversation and turn)
        headers = {"X-Request-Id": f"c{n}-t{done_turns[n]}-{uuid.uuid4().hex[:8]}"}
        try:
            if "prompt" in sent:
                stream: Any = await client.completions.create(
                    model=model,
                    prompt=sent["prompt"],
                    stream=True,
                    max_tokens=16,
                    user=sent["user"],
                    extra_headers=headers,
                )
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        first = first or time.monotonic()
                        text.append(chunk.choices[0].text)
            else:
                stream = await client.chat.completions.create(
                    model=model,
                    messages=sent["messages"],
                    stream=True,
                    max_tokens=16,
                    user=sent["user"],
                    extra_headers=headers,
                )
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first or time.monotonic()
                        text.append(chunk.choices[0].delta.content)
        except Exception as error:
            failures += 1
            said = f"{type(error).__name__}: {error}"[:300]
            if said not in why:
                why.append(said)
            return
        ttfts.append((first or time.monotonic()) - started)
        histories[n] = next_turn(histories[n], done_turns[n], "".join(text), follow_up)
        done_turns[n] += 1

    async def worker() -> None:
        while True:
            async with lock:
                pick = next((i for i, n in enumerate(waiting) if n not in busy), None)
                if pick is None:
                    if not waiting:
                        return
                    n = None
                else:
                    n = waiting.pop(pick)
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
        "why_failed": why,
        "turns": len(ttfts),
    }
