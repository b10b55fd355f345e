"""kv-aware with tenants' cache salts, on one real vLLM prefill instance: who hits whose prefixes.

Needs a real vLLM prefill instance with KV events, its render endpoints and
``VLLM_SERVER_DEV_MODE=1`` (``POST /reset_prefix_cache``), and a proxy in
front of it with ``--prefill-policy kv-aware``, ``--tenant-header x-team``,
``--tenant-salt-secret-file`` and two tenants ``shared-1`` and ``shared-2``
given one ``cache-salt``. Never part of CI: it measures a real engine.

The prefix cache is reset, then phases of four chat completions, one per
shared document, each with a question after it, are sent one at a time:
tenants, salts and questions as the rows say. Each row prints the phase's
prompt tokens and cached tokens by the instance's own counters
(``vllm:prefix_cache_queries_total`` and ``_hits_total``), and what
kv-aware decided and said the instance held (the proxy's ``/metrics``).

    python -m bench.real_salts --proxy http://127.0.0.1:9200 --prefill http://127.0.0.1:8102
"""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.request

TOPICS = ("prefill and decode", "KV blocks moving over NIXL", "a prefix cache", "routing by cache")
DOCUMENTS = tuple(
    f"Document {n} about {topic}. "
    + f"This paragraph explains {topic} in detail, sentence {n}. " * 12
    for n, topic in enumerate(TOPICS)
)
#: (row, tenant, the client's own salt, question).
PHASES: tuple[tuple[str, str | None, str | None, str], ...] = (
    ("1. team-a, first questions", "team-a", None, "What is it about?"),
    ("2. team-a, new questions", "team-a", None, "Why does it matter?"),
    ("3. team-b, the same documents", "team-b", None, "What is it about?"),
    ("4. team-b, new questions", "team-b", None, "Why does it matter?"),
    ("5. shared-1 (cache-salt shared-docs)", "shared-1", None, "What is it about?"),
    ("6. shared-2 (the same cache-salt)", "shared-2", None, "Why does it matter?"),
    ("7. team-a, its client's own salt alice", "team-a", "alice", "Who wrote it?"),
    ("8. no tenant, salt alice", None, "alice", "Who wrote it?"),
    ("9. no tenant, no salt", None, None, "What is it about?"),
    ("10. no tenant, no salt, new questions", None, None, "Why does it matter?"),
)
#: Seconds for the instance's counters and events to land after a phase (a manual run).
SETTLE = 1.0


def post(url: str, body: object, headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode() if body is not None else b""
    sent = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data, sent, method="POST")
    with urllib.request.urlopen(request, timeout=120) as answer:
        answer.read()


def scraped(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        return str(answer.read().decode())


def summed(text: str, name: str, having: str = "") -> float:
    lines = re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M)
    return sum(float(value) for labels, value in lines if having in labels)


def decisions(proxy: str) -> dict[str, float]:
    text = scraped(proxy)
    found: dict[str, float] = {}
    pattern = r"^nixlproxy_routing_decisions_total\{([^}]*)\} (\S+)$"
    for labels, value in re.findall(pattern, text, re.M):
        if 'pool="prefill"' in labels:
            decision = re.search(r'decision="([^"]+)"', labels)
            if decision is not None:
                found[decision.group(1)] = found.get(decision.group(1), 0.0) + float(value)
    found["held"] = summed(text, "nixlproxy_kv_matched_tokens_sum", 'pool="prefill"')
    return found


def phase(proxy: str, prefill: str, row: tuple[str, str | None, str | None, str]) -> str:
    name, tenant, salt, question = row
    before = scraped(prefill)
    said = decisions(proxy)
    for document in DOCUMENTS:
        content = f"{document}\n\nQuestion: {question}"
        body: dict[str, object] = {
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 2,
        }
        if salt is not None:
            body["cache_salt"] = salt
        post(proxy + "/v1/chat/completions", body, {"x-team": tenant} if tenant else {})
    time.sleep(SETTLE)
    after, now = scraped(prefill), decisions(proxy)
    queries = summed(after, "vllm:prefix_cache_queries_total") - summed(
        before, "vllm:prefix_cache_queries_total"
    )
    hits = summed(after, "vllm:prefix_cache_hits_total") - summed(
        before, "vllm:prefix_cache_hits_total"
    )
    moved = {k: int(v - said.get(k, 0.0)) for k, v in now.items() if v != said.get(k, 0.0)}
    held = moved.pop("held", 0)
    choices = ", ".join(f"{k} {v}" for k, v in sorted(moved.items()))
    rate = hits / queries if queries else 0.0
    return f"| {name} | {int(queries)} | {int(hits)} | {rate:.2f} | {choices} | {held} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proxy", default="http://127.0.0.1:9200")
    parser.add_argument("--prefill", default="http://127.0.0.1:8102")
    options = parser.parse_args()
    post(options.prefill + "/reset_prefix_cache", None)
    time.sleep(SETTLE)
    print("| phase | prompt tokens | cached (vLLM) | hit rate | kv-aware chose | said held |")
    print("|---|---|---|---|---|---|")
    for row in PHASES:
        print(phase(options.proxy, options.prefill, row), flush=True)


if __name__ == "__main__":
    main()
