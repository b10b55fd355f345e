"""The mixed workload of ``bench.decide``: short and long prompts and conversations, streamed.

``workload`` makes the jobs, seeded (pure); ``drive`` sends them through a
proxy with the ``openai`` client, ``concurrency`` at a time, a
conversation's turns one after the other, and measures what the client saw:
TTFT by kind of prompt, the gaps between consecutive tokens, failures.
A token is four bytes of text, as the proxy estimates a prompt and as the
fakes count one.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

BYTES_PER_TOKEN = 4
SHORT_SHARE, LONG_SHARE = 0.70, 0.15


def _text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of words no other prompt starts with (no prefix cache hit)."""
    words: list[str] = []
    size = 0
    while size < tokens * BYTES_PER_TOKEN:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


@dataclass(frozen=True)
class Job:
    """One request to send: a short or long prompt, or the next turn of a conversation."""

    kind: str  # "short", "long" or "turn"
    prompt: str = ""
    conversation: int | None = None


@dataclass
class Workload:
    jobs: list[Job]
    #: Each conversation's history so far (a turn appends its answer and the next question).
    histories: list[list[ChatCompletionMessageParam]]
    #: Each conversation's questions after the first, in turn order.
    follow_ups: list[list[str]] = field(default_factory=list)


def workload(requests: int, turns: int, seed: int) -> Workload:
    """``requests`` jobs (a few more when the conversations' turns round up), shuffled."""
    rng = random.Random(seed)
    shorts = round(requests * SHORT_SHARE)
    longs = round(requests * LONG_SHARE)
    conversations = max(1, round((requests - shorts - longs) / turns))
    system = "You answer questions about serving LLMs. " + _text(rng, 150)
    jobs = [Job("short", _text(rng, rng.randint(30, 100))) for _ in range(shorts)]
    jobs += [Job("long", _text(rng, rng.randint(1500, 3000))) for _ in range(longs)]
    jobs += [Job("turn", conversation=n) for n in range(conversations) for _ in range(turns)]
    rng.shuffle(jobs)
    histories: list[list[ChatCompletionMessageParam]] = [
        [
            {"role": "system", "content": system},
            {"role": "user", "content": _text(rng, rng.randint(200, 400))},
        ]
        for _ in range(conversations)
    ]
    follow_ups = [[_text(rng, rng.randint(50, 100)) for _ in range(turns)] for _ in histories]
    return Workload(jobs, histories, follow_ups)


def percentile(values: Sequence[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[round(share * (len(ordered) - 1))]


@dataclass
class Measured:
    ttfts: dict[str, list[float]] = field(
        default_factory=lambda: {"short": [], "long": [], "turn": []}
    )
    gaps: list[float] = field(default_factory=list)
    failures: int = 0


async def drive(url: str, work: Workload, concurrency: int, max_tokens: int) -> Measured:
    """Send every job, ``concurrency`` at a time, a conversation's turns one after the other."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=120)
    measured = Measured()
    pending = list(work.jobs)
    busy: set[int] = set()
    turns_done = [0] * len(work.histories)
    changed = asyncio.Condition()

    async def next_job() -> Job | None:
        async with changed:
            while pending:
                for index, job in enumerate(pending):
                    if job.conversation is None or job.conversation not in busy:
                        if job.conversation is not None:
                            busy.add(job.conversation)
                        return pending.pop(index)
                await changed.wait()  # only turns of conversations under way are left
            return None

    async def send(job: Job) -> None:
        n = job.conversation
        messages: list[ChatCompletionMessageParam]
        if n is None:
            messages = [{"role": "user", "content": job.prompt}]
        else:
            messages = list(work.histories[n])
        started = time.monotonic()
        times: list[float] = []
        text: list[str] = []
        try:
            stream = await client.chat.completions.create(
                model="fake-model", messages=messages, stream=True, max_tokens=max_tokens
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    times.append(time.monotonic())
                    text.append(chunk.choices[0].delta.content)
        except Exception:
            measured.failures += 1
            return
        if not times:
            measured.failures += 1
            return
        measured.ttfts[job.kind].append(times[0] - started)
        measured.gaps += [later - earlier for earlier, later in itertools.pairwise(times)]
        if n is not None:
            question = work.follow_ups[n][turns_done[n]]
            work.histories[n] += [
                {"role": "assistant", "content": "".join(text)},
                {"role": "user", "content": question},
            ]
            turns_done[n] += 1

    async def worker() -> None:
        while (job := await next_job()) is not None:
            await send(job)
            if job.conversation is not None:
                async with changed:
                    busy.discard(job.conversation)
                    changed.notify_all()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return measured
