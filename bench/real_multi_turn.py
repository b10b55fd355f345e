"""What multi-turn reuse saves prefill, on a real vLLM prefill/decode pair with bidirectional KV.

Needs real vLLM 0.32 instances started with ``bidirectional_kv_xfer`` on
both (``../shared/real-vllm``: ``BIDI=1``; ``--enable-scale-out`` for the
chat shape's renders) and two proxies in front of the same pair: one with
``--multi-turn-reuse on``, one without. Never part of CI: it measures a real
engine.

Each conversation runs through both proxies (which goes first alternates),
each run under a ``cache_salt`` of its own, so that neither finds the
other's prompts in a prefix cache (the salt changes no computation: the
answers of the two runs must be the same, token for token). Its turns are
whole answers (vLLM 0.32 answers decode's handle on those only) but the
last, streamed to time its first token. Two shapes:

- ``ids``: text completions whose prompt is token ids, each turn the last
  prompt, its answer's ids and a new user message's: a next prompt that
  extends the last by construction (how a token-in, token-out client talks).
- ``chat``: chat completions of text, each turn the last messages, the
  answer as the assistant's and a new user message, rendered by vLLM: a
  next prompt extends the last only where the template renders the answer
  as it was generated (the tiny random model's byte tokens seldom do).

For each proxy: the prompt tokens prefill computed and read from decode
after the first turns (``vllm:prompt_tokens_by_source_total`` on prefill),
the proxy's ``reuse`` outcomes, the prefill leg's time (the proxy's
``nixlproxy_prefill_seconds``) over the later whole turns, the streamed last
turn's first token, and whether every answer equalled the other run's.

    python -m bench.real_multi_turn --on http://127.0.0.1:9100 --off http://127.0.0.1:9101 \\
        --prefill http://127.0.0.1:8100 --conversations 12 --shape ids
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench.real_ttft import WORDS, percentile

_SAMPLE = re.compile(r"^([a-zA-Z_:]+)(\{[^}]*\})? ([-+.0-9eEinfa]+)$")


def scrape(url: str) -> dict[str, float]:
    """A ``/metrics`` page, every sample by its name and labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if found is not None:
            samples[found.group(1) + (found.group(2) or "")] = float(found.group(3))
    return samples


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def streamed(url: str, body: dict[str, Any]) -> tuple[float, list[int]]:
    """A streamed answer's first token (seconds) and its token ids."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    first: float | None = None
    ids: list[int] = []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                got = choice.get("token_ids") or []
                if got and first is None:
                    first = time.perf_counter() - started
                ids += got
    return (first if first is not None else float("nan")), ids


@dataclass
class Run:
    """One proxy's measures over every conversation."""

    computed: float = 0.0
    read_back: float = 0.0
    cached: float = 0.0
    prefill_seconds: list[float] = field(default_factory=list)
    first_tokens: list[float] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    answers: list[list[int]] = field(default_factory=list)


def _sources(samples: dict[str, float]) -> dict[str, float]:
    found: dict[str, float] = {}
    for name, value in samples.items():
        if name.startswith("vllm:prompt_tokens_by_source_total{"):
            source = re.search(r'source="([a-z_]+)"', name)
            if source is not None:
                found[source.group(1)] = found.get(source.group(1), 0.0) + value
    return found


def _outcomes(samples: dict[str, float]) -> dict[str, float]:
    return {
        name.split('outcome="')[1].rstrip('"}'): value
        for name, value in samples.items()
        if name.startswith("nixlproxy_reuse_lookups_total{")
    }


class Conversation:
    """One conversation's turns, the same for both proxies."""

    def __init__(self, rng: random.Random, shape: str, args: argparse.Namespace) -> None:
        self.shape = shape
        self.args = args
        self.system = [rng.randrange(20, 420) for _ in range(args.system)]
        self.users = [[rng.randrange(20, 420) for _ in range(args.user)] for _ in range(args.turns)]
        self.words = [" ".join(rng.choices(WORDS, k=args.user)) for _ in range(args.turns)]
        self.opening = " ".join(rng.choices(WORDS, k=args.system))

    def run(self, base: str, salt: str, prefill: str, into: Run) -> None:
        args = self.args
        prompt: list[int] = [*self.system]
        messages = [{"role": "system", "content": self.opening}]
        for turn in range(args.turns):
            last = turn == args.turns - 1
            body: dict[str, Any] = {
                "model": "tiny",
                "max_tokens": args.answer,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                "cache_salt": salt,
            }
            if self.shape == "ids":
                prompt = [*prompt, *self.users[turn]]
                body["prompt"] = prompt
                path = "/v1/completions"
            else:
                messages = [*messages, {"role": "user", "content": self.words[turn]}]
                body["messages"] = messages
                path = "/v1/chat/completions"
            before = scrape(base) if turn else {}
            sources = _sources(scrape(prefill)) if turn else {}
            if last:
                body["stream"] = True
                seconds, ids = streamed(base + path, body)
                into.first_tokens.append(seconds)
            else:
                answer = post(base + path, body)
                choice = answer["choices"][0]
                ids = choice["token_ids"]
                text = choice.get("text") or choice.get("message", {}).get("content") or ""
            into.answers.append(ids)
            if turn:
                after = scrape(base)
                moved = _sources(scrape(prefill))
                into.computed += moved.get("local_compute", 0) - sources.get("local_compute", 0)
                into.cached += moved.get("local_cache_hit", 0) - sources.get("local_cache_hit", 0)
                into.read_back += moved.get("external_kv_transfer", 0) - sources.get(
                    "external_kv_transfer", 0
                )
                said = _outcomes(after)
                for outcome, count in said.items():
                    gained = count - _outcomes(before).get(outcome, 0.0)
                    if gained:
                        into.outcomes[outcome] += int(gained)
                if not last:
                    name = "nixlproxy_prefill_seconds_sum"
                    spent = sum(v for k, v in after.items() if k.startswith(name))
                    spent -= sum(v for k, v in before.items() if k.startswith(name))
                    into.prefill_seconds.append(spent)
            if not last:
                prompt = [*prompt, *ids]
                messages = [*messages, {"role": "assistant", "content": text}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--on", required=True, help="the proxy with --multi-turn-reuse on")
    parser.add_argument("--off", required=True, help="the proxy without it")
    parser.add_argument("--prefill", required=True, help="the prefill instance (its /metrics)")
    parser.add_argument("--shape", choices=("ids", "chat"), default="ids")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=400, help="the opening's tokens (words)")
    parser.add_argument("--user", type=int, default=40, help="each user message's (words)")
    parser.add_argument("--answer", type=int, default=100, help="each answer's tokens")
    parser.add_argument("--seed", type=int, default=57)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    runs = {"on": Run(), "off": Run()}
    bases = {"on": args.on, "off": args.off}
    tag = f"{args.seed}-{time.time_ns()}"
    for number in range(args.conversations):
        conversation = Conversation(rng, args.shape, args)
        order = ("on", "off") if number % 2 == 0 else ("off", "on")
        for which in order:
            salt = f"bench-{tag}-{number}-{which}"
            conversation.run(bases[which], salt, args.prefill, runs[which])
    equal = sum(a == b for a, b in zip(runs["on"].answers, runs["off"].answers, strict=True))
    print(
        f"{args.shape}: {args.conversations} conversations x {args.turns} turns "
        f"(opening {args.system}, user {args.user}, answers {args.answer} tokens)"
    )
    for which in ("off", "on"):
        run = runs[which]
        later = run.computed + run.read_back + run.cached
        p50 = statistics.median(run.prefill_seconds) * 1000 if run.prefill_seconds else 0.0
        first = [s * 1000 for s in run.first_tokens]
        print(
            f"  {which:>3}: turns 2+: prefill computed {run.computed:.0f} of {later:.0f} prompt "
            f"tokens, read from decode {run.read_back:.0f}, own cache {run.cached:.0f}; "
            f"prefill leg p50 {p50:.1f} ms; last turn first token p50 "
            f"{percentile(first, 50) or 0:.1f} ms p90 {percentile(first, 90) or 0:.1f} ms; "
            f"reuse {dict(run.outcomes) or '-'}"
        )
    print(f"  answers equal token for token: {equal} of {len(runs['on'].answers)}")


if __name__ == "__main__":
    main()
