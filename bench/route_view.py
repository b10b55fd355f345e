"""What one routing view across replicas costs: bytes in Redis, CPU per choice, and delay.

Against a redis-server of its own (started and stopped here): each kind of
entry's size as told and as Redis holds it (``MEMORY USAGE`` of a stream
filled to its bound, over its entries), a stored response's key, the
streams' whole memory at their bounds; the CPU one choice costs the replica
that tells it and each replica that applies it; and the time from a
replica's call (``SHARE``) to another replica's reader applying the entry,
one at a time, p50 and p99.

    python -m bench.route_view [--prompt-bytes 8192] [--tokens 2048] [--trips 500]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.routing_run import redis_server
from nixl_twisted.backends.prefixes import SentPrefixes, pieces
from nixl_twisted.fleet import messages, route_scripts
from nixl_twisted.fleet.messages import Predicted, Sent
from nixl_twisted.fleet.replicas import prefix_of

URL = "http://10.0.0.5:8100"


def _per_call_us(work: Callable[[], object], times: int) -> float:
    started = time.perf_counter()
    for _ in range(times):
        work()
    return (time.perf_counter() - started) / times * 1e6


def _told(told: Sent | Predicted) -> str:
    return messages.entry("r1", [messages.line(told) or ""])


def cpu(prompt_bytes: int, tokens: int) -> dict[str, Any]:
    """Microseconds one choice costs: told (its line and entry), heard (read and applied)."""
    from twisted.internet.task import Clock

    from nixl_twisted.config import ProxyConfig
    from nixl_twisted.kv.blocks import Stored
    from nixl_twisted.kv.events import KvEvents

    chain = pieces(bytes(range(256)) * (prompt_bytes // 256))
    ids = tuple(range(1000, 1000 + tokens))
    sent, predicted = Sent("prefill", URL, chain), Predicted("prefill", URL, ids)
    sent_entry = messages.entry("r1", [messages.line(sent) or ""])
    predicted_entry = messages.entry("r1", [messages.line(predicted) or ""])
    memory = SentPrefixes(100_000)
    clock = Clock()
    config = ProxyConfig.create(prefill=[URL], decode=["http://d:1"])
    kv = KvEvents(clock, clock, (), config)
    kv.index("prefill").apply("http://x", [Stored((1,), None, tuple(range(16)), 16)])

    def hear_sent() -> None:
        for told in messages.read(sent_entry)[1]:
            assert isinstance(told, Sent)
            memory.remember(told.chain, told.url)

    def hear_predicted() -> None:
        for told in messages.read(predicted_entry)[1]:
            assert isinstance(told, Predicted)
            kv.foretold("prefill", told.url, told.tokens, told.salt, 0.0)

    return {
        "sent_bytes": len(sent_entry),
        "predicted_bytes": len(predicted_entry),
        "tell_sent_us": _per_call_us(lambda: _told(sent), 2000),
        "tell_predicted_us": _per_call_us(lambda: _told(predicted), 500),
        "hear_sent_us": _per_call_us(hear_sent, 2000),
        "hear_predicted_us": _per_call_us(hear_predicted, 200),
        "entries": (sent_entry, predicted_entry),
    }


def redis_side(url: str, entries: Sequence[str], trips: int) -> dict[str, Any]:
    """Bytes Redis holds per entry at the streams' bounds, and the delay from one replica's
    call to another replica's reader applying it."""
    from twisted.internet import reactor
    from twisted.internet.defer import Deferred, ensureDeferred

    from nixl_twisted.fleet.link import RedisLink
    from nixl_twisted.fleet.route_reader import StreamReader

    prefix = prefix_of(url)
    found: dict[str, Any] = {}

    async def run() -> None:
        link = RedisLink(url, reactor, lambda why: None)
        connected = link.connected()
        link.start()
        await connected
        sent_entry, predicted_entry = entries
        for _ in range(route_scripts.SENT_ENTRIES // 256 + 2):
            args = [prefix, "r1", *route_scripts.share_args([sent_entry] * 256, [])]
            await link.eval(route_scripts.SHARE, [], args)
        for _ in range(3):
            args = [prefix, "r1", *route_scripts.share_args([], [predicted_entry] * 128)]
            await link.eval(route_scripts.SHARE, [], args)
        stored = [route_scripts.StoredResponse("resp_" + "x" * 24, URL)]
        args = [prefix, "r1", *route_scripts.share_args([], [], stored)]
        await link.eval(route_scripts.SHARE, [], args)
        for name, stream in (("sent", route_scripts.SENT), ("predicted", route_scripts.PREDICTED)):
            length = await link.command("XLEN", prefix + stream)
            used = await link.command("MEMORY", "USAGE", prefix + stream, "SAMPLES", "0")
            found[f"{name}_entries"] = length
            found[f"{name}_stream_bytes"] = used
        response = await link.command("MEMORY", "USAGE", prefix + "response:resp_" + "x" * 24)
        found["response_bytes"] = response
        await link.command("DEL", prefix + route_scripts.SENT, prefix + route_scripts.PREDICTED)
        delays: list[float] = []
        heard: list[Deferred[None]] = []

        def applied(stream: str, text: str, age: float) -> None:
            heard.pop(0).callback(None)

        reader = StreamReader(url, reactor, [prefix + route_scripts.SENT], applied)
        reader.start()
        await reader.caught_up()
        for _ in range(trips):
            waiting: Deferred[None] = Deferred()
            heard.append(waiting)
            started = time.perf_counter()
            link.eval(
                route_scripts.SHARE, [], [prefix, "r1", *route_scripts.share_args([sent_entry], [])]
            )
            await waiting
            delays.append(time.perf_counter() - started)
        await reader.stop()
        await link.stop()
        delays.sort()
        found["delay_p50_ms"] = statistics.median(delays) * 1000
        found["delay_p99_ms"] = delays[int(0.99 * (len(delays) - 1))] * 1000

    def stopped(result: object) -> object:
        reactor.stop()
        return result

    ensureDeferred(run()).addBoth(stopped)
    reactor.run()
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-bytes", type=int, default=8192, help="a chat prompt's bytes")
    parser.add_argument("--tokens", type=int, default=2048, help="a predicted prompt's tokens")
    parser.add_argument("--trips", type=int, default=500, help="entries timed, one at a time")
    args = parser.parse_args(argv)
    said = cpu(args.prompt_bytes, args.tokens)
    with redis_server() as url:
        stored = redis_side(url, said.pop("entries"), args.trips)
    sent_each = stored["sent_stream_bytes"] / stored["sent_entries"]
    predicted_each = stored["predicted_stream_bytes"] / stored["predicted_entries"]
    rows = [
        ("a cache-aware choice told, its entry", f"{said['sent_bytes']:,} B"),
        ("... held in Redis, per entry", f"{sent_each:,.0f} B"),
        ("... routes:sent at its bound", f"{stored['sent_stream_bytes'] / 1e6:.1f} MB"),
        ("a kv-aware prediction told, its entry", f"{said['predicted_bytes']:,} B"),
        ("... held in Redis, per entry", f"{predicted_each:,.0f} B"),
        ("... routes:predicted at its bound", f"{stored['predicted_stream_bytes'] / 1e6:.1f} MB"),
        ("a stored response's key", f"{stored['response_bytes']} B"),
        ("CPU to tell a cache-aware choice", f"{said['tell_sent_us']:.1f} µs"),
        ("CPU to apply one heard", f"{said['hear_sent_us']:.1f} µs"),
        ("CPU to tell a prediction", f"{said['tell_predicted_us']:.1f} µs"),
        ("CPU to apply one heard", f"{said['hear_predicted_us']:.1f} µs"),
        ("told to applied by another replica, p50", f"{stored['delay_p50_ms']:.2f} ms"),
        ("... p99", f"{stored['delay_p99_ms']:.2f} ms"),
    ]
    print(f"| {args.prompt_bytes:,}-byte chat prompt, {args.tokens:,}-token prediction | |")
    print("|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
