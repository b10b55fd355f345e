"""What handing the prompt's token ids to decode saves, on a real vLLM prefill/decode pair.

Needs real vLLM 0.32 instances (a prefill and a decode with the NIXL
connector, model ``tiny``) and two proxies in front of the same pair, one
with ``--token-ids-to-decode on`` (the default) and one with ``off``. Never
part of CI: it measures a real engine. Two measures, each on long chat
prompts (a conversation of several turns, ``--long-words`` words) and short
ones (one message, ``--short-words``), each prompt new (a random number
first: no prefix cache hit), one request in flight:

1. **Through the proxies**: streamed chat completions, the two proxies
   taking turns request by request (the first of each pair alternating),
   long and short alternating too; TTFT as the client sees it, and the
   decode leg's time to its first byte from each proxy's
   ``nixlproxy_decode_first_byte_seconds`` (decode's work for the request:
   rendering and tokenizing or not, the KV pull, the first token).
2. **Decode's own work, alone**: the same prompt sent to the decode
   instance directly (a plain request, computed there once, then served
   from its prefix cache, ``max_tokens`` 1), with and without its ids in
   ``kv_transfer_params.prompt_token_ids``, alternating: what the template
   and the tokenizer cost decode per request, the rest being equal.

    python -m bench.real_token_ids --on http://127.0.0.1:9100 --off http://127.0.0.1:9101 \\
        --decode http://127.0.0.1:8200 --requests 40
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from bench.real_ttft import WORDS, percentile

FIRST_BYTE = "nixlproxy_decode_first_byte_seconds_"


def conversation(rng: random.Random, words: int, turns: int) -> list[dict[str, str]]:
    """A chat of ``turns`` messages (user, assistant, ..., user), ``words`` words in all."""
    each = max(1, words // turns)
    messages = []
    for turn in range(turns):
        text = " ".join(rng.choices(WORDS, k=each))
        if turn == 0:
            text = f"{rng.randrange(10**9)} {text}"
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": text})
    return messages


def post(url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """A whole answer and the seconds it took."""
    started = time.perf_counter()
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    return time.perf_counter() - started, answer


def streamed_ttft(base: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, int]:
    """TTFT of a streamed chat completion (its first content chunk), and its prompt tokens."""
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        base + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["prompt_tokens"]
            choices = event.get("choices") or []
            if first is None and choices and choices[0]["delta"].get("role") is None:
                first = time.perf_counter()
            if event.get("prompt_token_ids") is not None:
                raise AssertionError("the client got prompt_token_ids it did not ask for")
    assert first is not None, "no token chunk"
    return first - started, tokens


def first_byte(base: str) -> tuple[float, float]:
    """The proxy's decode first-byte histogram: its sum and count, all instances."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
        text = response.read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(FIRST_BYTE + "sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(FIRST_BYTE + "count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def ms(values: Sequence[float], q: float) -> str:
    value = percentile(values, q)
    return "-" if value is None else f"{value * 1000:.1f}"


def through_proxies(args: argparse.Namespace, rng: random.Random) -> None:
    sides = {"on": args.on, "off": args.off}
    lengths = {"long": (args.long_words, args.turns), "short": (args.short_words, 1)}
    ttfts: dict[tuple[str, str], list[float]] = {(s, n): [] for s in sides for n in lengths}
    tokens: dict[str, list[int]] = {n: [] for n in lengths}
    decode_ms: dict[tuple[str, str], list[float]] = {(s, n): [] for s in sides for n in lengths}
    for i in range(args.warmup + args.requests):
        for name, (words, turns) in lengths.items():
            order = list(sides.items()) if i % 2 == 0 else list(sides.items())[::-1]
            for side, base in order:
                before = first_byte(base)
                ttft, prompt = streamed_ttft(base, conversation(rng, words, turns), args.max_tokens)
                after = first_byte(base)
                if i < args.warmup:
                    continue
                ttfts[side, name].append(ttft)
                tokens[name].append(prompt)
                if after[1] - before[1] == 1:
                    decode_ms[side, name].append(after[0] - before[0])
    print(
        f"\nthrough the proxies: streamed chat, max_tokens {args.max_tokens}, one in flight, "
        f"{args.requests} per side and length (after {args.warmup} warm-up)\n"
    )
    print(
        "| prompt | token ids | prompt tokens | TTFT p50 ms | p90 "
        "| decode first byte p50 ms | p90 |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in lengths:
        counts = tokens[name]
        said = f"{statistics.mean(counts):.0f} ({min(counts)}-{max(counts)})"
        for side in sides:
            t, d = ttfts[side, name], decode_ms[side, name]
            row = [name, side, said, ms(t, 50), ms(t, 90), ms(d, 50), ms(d, 90)]
            print("| " + " | ".join(row) + " |")


def decode_alone(args: argparse.Namespace, rng: random.Random) -> None:
    url = args.decode + "/v1/chat/completions"
    print(
        f"\ndecode alone: the same prompt, cached, max_tokens 1, {args.requests} each way, "
        "alternating\n"
    )
    print(
        "| prompt | prompt tokens | without ids p50 ms | p90 "
        "| with ids p50 ms | p90 | saved p50 ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, words, turns in (
        ("long", args.long_words, args.turns),
        ("short", args.short_words, 1),
    ):
        messages = conversation(rng, words, turns)
        body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 1}
        _, answer = post(url, dict(body, return_token_ids=True))  # (computed once, then cached)
        ids = answer["prompt_token_ids"]
        handed = dict(body, kv_transfer_params={"prompt_token_ids": ids})
        plain: list[float] = []
        reused: list[float] = []
        for i in range(args.warmup + args.requests):
            pair = [(plain, body), (reused, handed)]
            for into, sent in pair if i % 2 == 0 else pair[::-1]:
                took, answered = post(url, sent)
                assert answered["usage"]["prompt_tokens"] == len(ids)
                if i >= args.warmup:
                    into.append(took)
        saved = (statistics.median(plain) - statistics.median(reused)) * 1000
        row = [name, str(len(ids)), ms(plain, 50), ms(plain, 90), ms(reused, 50), ms(reused, 90)]
        print("| " + " | ".join(row) + f" | {saved:.1f} |")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--on", required=True, help="a proxy with --token-ids-to-decode on")
    parser.add_argument("--off", required=True, help="a proxy with --token-ids-to-decode off")
    parser.add_argument("--decode", required=True, help="the decode instance, for its own work")
    parser.add_argument("--requests", type=int, default=40, help="measured, per side and length")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--long-words", type=int, default=1130)
    parser.add_argument("--short-words", type=int, default=8)
    parser.add_argument("--turns", type=int, default=9, help="messages of a long prompt")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-proxies", action="store_true", help="decode alone only")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    if not args.skip_proxies:
        through_proxies(args, rng)
    decode_alone(args, rng)


if __name__ == "__main__":
    main()
