"""Python calls per request in the proxy's reactor thread: a figure the machine cannot move.

Requests per second on a shared two-core machine move by a third between
two runs of the same build; the number of Python calls a request costs
does not. This runs a real ``twistd nixlproxy`` under cProfile (``twistd
--profile --profiler=cprofile --savestats``) in front of the fast fake
backend, twice per load: ``--few`` requests, then ``--many``. The slope
between the two (calls more, over requests more) is the calls one request
costs, with the start and the stop cancelled out.

    python -m bench.calls                       # non-streaming and streaming
    python -m bench.calls --proxy-arg=--access-log=off
    python -m bench.calls --readers             # every reader of a request at once:
        # cache-aware on both pools, a decode-only rule, a client key whose tenant's
        # tokens per minute count (and so a stream that asks for its usage)
    python -m bench.calls --tokens 64 256 --top 10 --token-interval 0.001 [--floor]
        # streams of 64 and of 256 tokens, 1 ms apart (each token a read of its
        # own, as vLLM sends them): the calls one more token costs (the slope
        # between the two lengths), and the functions that make them; --floor:
        # the same of bench.stream_ceiling's floor server, what the stack costs
    python -m bench.calls --tokens 64 256 --top-per-stream 15 [--floor]
        # the functions called most per stream, whatever its length: each one's
        # calls at zero tokens (the intercept of the line through the two lengths)
    python -m bench.calls --tokens 64 256 --per-stream-gap 15
        # the proxy, then the floor: the functions whose calls per stream differ
        # most between them (proxy minus floor), where the proxy's extra CPU per
        # stream goes (--floor klein-upstream: against Klein and treq as the proxy
        # uses them, the design's own floor, instead of the bare stack)
"""

from __future__ import annotations

import argparse
import os
import pstats
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from bench.run import _free_port, _pinned, _process
from bench.stream_ceiling import FLOORS
from nixl_twisted.testing.process import Twistd

#: ``--floor``: not an option of the proxy, but the floor server in its place.
FLOOR = "--floor"

#: ``--readers``: the options that make every reader of a request read it.
READERS = (
    "--prefill-policy=cache-aware",
    "--decode-policy=cache-aware",
    "--decode-only-below=1",  # (evaluated, never met: both legs run)
    "--tenant-tokens-per-minute=1000000000",
    "--api-key=bench-key",
)


def calls(
    backend: str, requests: int, stream: bool, proxy_args: Sequence[str], tokens: int = 64
) -> pstats.Stats:
    """The profile of a proxy serving ``requests`` (4 connections; streams of ``tokens``)."""
    with tempfile.TemporaryDirectory(prefix="nixlproxy-calls-") as folder:
        stats = os.path.join(folder, "profile")
        _profiled(stats, backend, requests, stream, proxy_args, tokens)
        return pstats.Stats(stats)


def _profiled(
    stats: str, backend: str, requests: int, stream: bool, proxy_args: Sequence[str], tokens: int
) -> None:
    kind = _floor_kind(proxy_args)
    if kind is not None:
        # The floor of bench.stream_ceiling under cProfile: SIGTERM stops its
        # reactor, and cProfile writes the stats as the module returns.
        port = _free_port()
        floor = [sys.executable, "-m", "cProfile", "-o", stats, "-m", "bench.stream_ceiling"]
        floor += ["--serve", kind, "--port", str(port), "--backend", backend]
        with _process(_pinned("0", floor), port):
            _load(f"http://127.0.0.1:{port}", requests, stream, tokens, None)
        return
    args = ["--health-interval", "0", "--prefill", backend, "--decode", backend, *proxy_args]
    key = next((a.partition("=")[2] for a in proxy_args if a.startswith("--api-key=")), None)
    twistd_args = [f"--profile={stats}", "--profiler=cprofile", "--savestats"]
    proxy = Twistd(["--listen", "tcp:0:interface=127.0.0.1", *args], twistd_args=twistd_args)
    try:
        _load(f"http://{proxy.address()}", requests, stream, tokens, key)
    finally:
        proxy.stop(timeout=30)


def _floor_kind(proxy_args: Sequence[str]) -> str | None:
    """Which floor server ``--floor=KIND`` among the options asks for, if one does."""
    found = [a.partition("=")[2] for a in proxy_args if a.partition("=")[0] == FLOOR]
    return found[-1] if found else None


def _load(url: str, requests: int, stream: bool, tokens: int, key: str | None) -> None:
    load = [sys.executable, "-m", "bench.load", "--url", url, "--connections", "4"]
    load += ["--requests", str(requests), "--tokens", str(tokens)]
    load += ["--stream"] if stream else []
    load += ["--api-key", key] if key is not None else []
    subprocess.run(_pinned("1", load), check=True, stdout=subprocess.DEVNULL)


#: Each function's calls and own seconds, by pstats' key (file, line, name).
Costs = dict[tuple[str, int, str], tuple[float, float]]


def _costs(stats: pstats.Stats) -> Costs:
    raw = stats.stats  # type: ignore[attr-defined]
    return {key: (float(value[1]), float(value[2])) for key, value in raw.items()}


def _difference(more: Costs, less: Costs, over: float) -> Costs:
    """``(more - less) / over`` for every function: a slope."""
    nothing = (0.0, 0.0)
    return {
        key: ((calls - less.get(key, nothing)[0]) / over, (own - less.get(key, nothing)[1]) / over)
        for key, (calls, own) in more.items()
    }


def _intercept(per_stream: Costs, per_token: Costs, tokens: int) -> Costs:
    """Each function's cost of a stream of no tokens: a ``tokens``-long one's, less its tokens'."""
    nothing = (0.0, 0.0)
    return {
        key: (
            calls - tokens * per_token.get(key, nothing)[0],
            own - tokens * per_token.get(key, nothing)[1],
        )
        for key, (calls, own) in per_stream.items()
    }


def _where(key: tuple[str, int, str]) -> str:
    path, line, name = key
    return f"{os.path.basename(path)}:{line}({name})" if line else name


def top(costs: Costs, count: int, unit: str = "token") -> list[str]:
    """A table of the ``count`` Python functions called most often per ``unit``."""
    # Built-ins are left out: their calls are their Python callers' work.
    own_code = {key: costs for key, costs in costs.items() if key[1]}
    ranked = sorted(own_code.items(), key=lambda item: -item[1][0])[:count]
    lines = [f"| function | calls per {unit} | own us per {unit} |", "|---|---|---|"]
    for key, (calls, own) in ranked:
        lines.append(f"| `{_where(key)}` | {calls:.2f} | {own * 1e6:.2f} |")
    return lines


def gap(proxy: Costs, floor: Costs, count: int) -> list[str]:
    """The ``count`` Python functions whose calls per stream differ most, proxy minus floor."""
    nothing = (0.0, 0.0)
    keys = {key for key in (*proxy, *floor) if key[1]}
    rows = [(key, proxy.get(key, nothing)[0], floor.get(key, nothing)[0]) for key in keys]
    ranked = sorted(rows, key=lambda row: -abs(row[1] - row[2]))[:count]
    lines = [
        "| function | proxy calls per stream | floor calls per stream | proxy - floor |",
        "|---|---|---|---|",
    ]
    for key, mine, theirs in ranked:
        lines.append(f"| `{_where(key)}` | {mine:.1f} | {theirs:.1f} | {mine - theirs:+.1f} |")
    shown = sum(mine - theirs for _, mine, theirs in ranked)
    total = sum(c for c, _ in proxy.values()) - sum(c for c, _ in floor.values())
    lines.append(f"\nthese {len(ranked)}: {shown:+,.0f} of the gap's {total:+,.0f} calls a stream")
    return [*lines, "", *_gap_by_file(proxy, floor, count)]


def _gap_by_file(proxy: Costs, floor: Costs, count: int) -> list[str]:
    """The same gap summed by source file (built-ins as one row): which layer makes it."""
    by_file: dict[str, float] = {}
    for costs, sign in ((proxy, 1.0), (floor, -1.0)):
        for (path, line, _), (calls, _own) in costs.items():
            name = os.path.basename(path) if line else "(built-ins)"
            by_file[name] = by_file.get(name, 0.0) + sign * calls
    ranked = sorted(by_file.items(), key=lambda item: -abs(item[1]))[:count]
    lines = ["| file | proxy - floor, calls per stream |", "|---|---|"]
    return lines + [f"| `{name}` | {calls:+.1f} |" for name, calls in ranked]


def profiled_streams(
    url: str, args: argparse.Namespace, proxy_args: Sequence[str]
) -> dict[int, Costs]:
    """Print calls per request of each load (non-streaming too, but not of the floor),
    and return each stream length's calls per stream, by function."""
    floor = _floor_kind(proxy_args) is not None
    requests = args.many - args.few
    per_request: dict[int, Costs] = {}
    for tokens in ((None,) if not floor else ()) + tuple(args.tokens):
        few = _costs(calls(url, args.few, tokens is not None, proxy_args, tokens or 64))
        many = _costs(calls(url, args.many, tokens is not None, proxy_args, tokens or 64))
        slope = _difference(many, few, requests)
        name = "non-streaming" if tokens is None else f"streaming, {tokens} tokens"
        print(f"| {name} | {sum(calls for calls, _ in slope.values()):,.0f} |")
        if tokens is not None:
            per_request[tokens] = slope
    return per_request


def summary(per_request: dict[int, Costs]) -> tuple[Costs, Costs] | None:
    """With two lengths: print and return each function's calls per token (the slope
    between them) and per stream (at zero tokens, the intercept)."""
    if len(per_request) != 2:
        return None
    short, long = sorted(per_request)
    per_token = _difference(per_request[long], per_request[short], long - short)
    per_stream = _intercept(per_request[short], per_token, short)
    print(f"| per token ({short} -> {long}) | {sum(c for c, _ in per_token.values()):,.1f} |")
    print(f"| per stream (at 0 tokens) | {sum(c for c, _ in per_stream.values()):,.0f} |")
    return per_token, per_stream


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--few", type=int, default=500, help="requests of the first run")
    parser.add_argument("--many", type=int, default=2500, help="requests of the second run")
    parser.add_argument("--proxy-arg", action="append", default=[], help="one more option")
    parser.add_argument("--readers", action="store_true", help="every reader of a request on")
    parser.add_argument(
        "--floor",
        nargs="?",
        const="web-agent",
        choices=FLOORS,
        help="profile bench.stream_ceiling's floor server instead of the proxy (streams "
        "only): web-agent (the bare stack, the default) or klein-upstream (Klein and "
        "the proxy's treq client: the design's own floor); with --per-stream-gap, the "
        "floor compared with",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[64],
        help="the streams' lengths; with two, the calls per token (the slope between them)",
    )
    parser.add_argument(
        "--token-interval",
        type=float,
        default=0.0,
        help="the backend's seconds between tokens (paced, each token is a read of its own)",
    )
    parser.add_argument(
        "--top", type=int, default=0, help="with two --tokens: the N most called per token"
    )
    parser.add_argument(
        "--top-per-stream",
        type=int,
        default=0,
        metavar="N",
        help="with two --tokens: the N most called per stream (at zero tokens)",
    )
    parser.add_argument(
        "--per-stream-gap",
        type=int,
        default=0,
        metavar="N",
        help="with two --tokens: profile the proxy, then the floor, and print the N "
        "functions whose calls per stream differ most (proxy minus floor)",
    )
    args = parser.parse_args(argv)
    if args.many <= args.few:
        parser.error("--many must be more than --few")
    if len(set(args.tokens)) != len(args.tokens) or min(args.tokens) < 1:
        parser.error("--tokens must be different lengths of at least 1")
    per_length = args.top or args.top_per_stream or args.per_stream_gap
    if per_length and len(args.tokens) != 2:
        parser.error("--top, --top-per-stream and --per-stream-gap need two --tokens")
    # (with --per-stream-gap, --floor names the floor compared with: the proxy goes first)
    floors = [f"{FLOOR}={args.floor}"] if args.floor and not args.per_stream_gap else []
    proxy_args = [*args.proxy_arg, *(READERS if args.readers else ()), *floors]
    port = _free_port()
    backend = [sys.executable, "-m", "bench.backend", "--port", str(port)]
    backend += ["--token-interval", str(args.token_interval)]
    floor: tuple[Costs, Costs] | None = None
    with _process(_pinned("1", backend), port):
        url = f"http://127.0.0.1:{port}"
        print("| load | calls per request |\n|---|---|")
        slopes = summary(profiled_streams(url, args, proxy_args))
        if args.per_stream_gap:
            print("\nthe floor:\n\n| load | calls per request |\n|---|---|")
            against = f"{FLOOR}={args.floor or 'web-agent'}"
            floor = summary(profiled_streams(url, args, [*proxy_args, against]))
    if slopes is not None:
        per_token, per_stream = slopes
        if args.top:
            print("\n" + "\n".join(top(per_token, args.top)))
        if args.top_per_stream:
            print("\n" + "\n".join(top(per_stream, args.top_per_stream, "stream")))
        if floor is not None:
            print("\n" + "\n".join(gap(per_stream, floor[1], args.per_stream_gap)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
