"""A decode instance killed mid-stream on real vLLM: the answer through the proxy is one
instance's, token for token, and what the move cost.

Needs real vLLM 0.32 instances (model ``tiny``, the NIXL connector): a prefill, two decodes,
and ``twistd nixlproxy`` in front of them whose first decode leg goes to the one to kill
(round-robin: the first decode listed, on a proxy that has served nothing yet). Never part of
CI: it kills a real engine. One streamed chat completion, temperature 0, through the proxy;
after ``--kill-after`` tokens the decode serving it is killed (SIGKILL, its engine process
too); the stream goes on. Then the same request to ``--reference`` directly (a plain request:
one instance computes it all). Printed: whether the two answers are the same tokens (their
ids, with ``--ids``: the client asks ``return_token_ids``), the same text, the same finish and
usage, one ``[DONE]`` and one id; the median gap between two tokens and the largest (the
move's: the client reads what the proxy relayed before the kill at once, then waits for the
continuation), and the whole answer's time against the same request through the proxy again
(uninterrupted: the killed instance is refused, the other serves it).

    python -m bench.real_migration --proxy http://127.0.0.1:8399 \\
        --reference http://127.0.0.1:8312 --kill-pid 12345 --kill-after 40 --max-tokens 200 --ids

With ``--whole SECONDS`` the request is not streamed, and the decode is killed that long after
it was sent, while it generates (vLLM sends a whole answer only once it is generated: the
connection is lost before any header): the proxy sends the request again, with a prefill of
its own, and the answer is compared whole.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

MESSAGES = [{"role": "user", "content": "Tell me, slowly and at length, how KV caches move."}]


def request(max_tokens: int, ids: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return dict(body, return_token_ids=True) if ids else body


def events(base: str, body: dict[str, Any]) -> Iterator[tuple[float, bytes]]:
    """Each SSE event of a streamed chat completion, and when it arrived."""
    where = urlsplit(base)
    connection = http.client.HTTPConnection(str(where.hostname), where.port, timeout=300)
    connection.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200, response.read()
    held = b""
    while chunk := response.read1(65536):
        held += chunk
        *whole, held = held.split(b"\n\n")
        for event in whole:
            yield time.perf_counter(), event
    connection.close()


def kill(pid: int) -> None:
    """SIGKILL the vLLM API server and its engine processes (as a crash or an OOM kill)."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    for each in [pid, *map(int, children.stdout.split())]:
        os.kill(each, signal.SIGKILL)


def answer(stream: Iterator[tuple[float, bytes]], kill_after: int, pid: int | None) -> Any:
    """The answer's tokens, text, finish, usage, ids, ``[DONE]`` count, the times of its
    tokens and when the kill was sent."""
    said: dict[str, Any] = {"ids": [], "text": [], "times": [], "answers": set(), "done": 0}
    killed_at = None
    for at, event in stream:
        if event == b"data: [DONE]":
            said["done"] += 1
            continue
        chunk = json.loads(event.removeprefix(b"data: "))
        said["answers"].add(chunk["id"])
        if chunk.get("usage"):
            said["usage"] = chunk["usage"]
        for choice in chunk["choices"]:
            if "role" in choice["delta"]:
                continue
            said["ids"] += choice.get("token_ids") or []
            said["text"].append(choice["delta"].get("content", ""))
            said["times"].append(at)
            if choice.get("finish_reason"):
                said["finish"] = choice["finish_reason"]
        if pid is not None and killed_at is None and len(said["times"]) >= kill_after:
            kill(pid)
            killed_at = time.perf_counter()
    said["killed_at"] = killed_at
    return said


def whole(base: str, body: dict[str, Any], kill_in: float, pid: int | None) -> Any:
    """A chat completion not streamed, its decode killed ``kill_in`` seconds after it was
    sent (``pid`` None: not), and the seconds it took."""
    where = urlsplit(base)
    connection = http.client.HTTPConnection(str(where.hostname), where.port, timeout=300)
    sent = dict(body, stream=False)
    sent.pop("stream_options", None)
    started = time.perf_counter()
    connection.request(
        "POST", "/v1/chat/completions", json.dumps(sent), {"Content-Type": "application/json"}
    )
    if pid is not None:
        time.sleep(kill_in)
        kill(pid)
    response = connection.getresponse()
    answer = json.loads(response.read())
    assert response.status == 200, answer
    return answer, time.perf_counter() - started


def compare_whole(args: argparse.Namespace) -> None:
    body = request(args.max_tokens, True)
    moved, took = whole(args.proxy, body, args.whole, args.kill_pid)
    reference, _ = whole(args.reference, body, 0, None)
    again, uninterrupted = whole(args.proxy, body, 0, None)
    mine, theirs = moved["choices"][0], reference["choices"][0]
    print(f"same token ids: {mine['token_ids'] == theirs['token_ids']}")
    print(f"same text: {mine['message']['content'] == theirs['message']['content']}")
    print(f"same finish: {mine['finish_reason'] == theirs['finish_reason']}")
    print(f"usage: {moved['usage']} (directly: {reference['usage']})")
    print(f"whole answer: {took:.2f} s moved, {uninterrupted:.2f} s uninterrupted (proxy)")
    print(f"same as uninterrupted: {again['choices'][0]['token_ids'] == mine['token_ids']}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.real_migration")
    parser.add_argument("--proxy", required=True)
    parser.add_argument("--reference", required=True, help="a vLLM instance, asked directly")
    parser.add_argument("--kill-pid", type=int, required=True, help="the decode's API server")
    parser.add_argument("--kill-after", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--ids", action="store_true", help="the client asks for token ids")
    parser.add_argument(
        "--whole", type=float, metavar="SECONDS", help="not streamed: kill this long after"
    )
    args = parser.parse_args(argv)
    if args.whole is not None:
        compare_whole(args)
        return

    body = request(args.max_tokens, args.ids)
    started = time.perf_counter()
    moved = answer(events(args.proxy, body), args.kill_after, args.kill_pid)
    took = time.perf_counter() - started
    reference = answer(events(args.reference, request(args.max_tokens, True)), 0, None)

    started = time.perf_counter()
    again = answer(events(args.proxy, body), 0, None)
    uninterrupted = time.perf_counter() - started

    times = moved["times"]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    print(f"tokens: {len(times)} through the proxy, {len(reference['times'])} directly")
    if args.ids:
        print(f"same token ids: {moved['ids'] == reference['ids']}")
    print(f"same text: {''.join(moved['text']) == ''.join(reference['text'])}")
    print(f"same finish: {moved.get('finish') == reference.get('finish')}")
    print(f"usage: {moved.get('usage')} (directly: {reference.get('usage')})")
    print(f"[DONE]: {moved['done']}, answer ids: {len(moved['answers'])}")
    print(f"killed after the client had {args.kill_after} tokens")
    print(f"gap between tokens: median {statistics.median(gaps):.4f} s, largest {max(gaps):.3f} s")
    print(f"whole answer: {took:.2f} s moved, {uninterrupted:.2f} s uninterrupted (proxy)")
    print(f"same as uninterrupted: {''.join(again['text']) == ''.join(moved['text'])}")


if __name__ == "__main__":
    main()
