"""``python -m nixl_twisted.testing``: fake vLLM prefill and decode instances from a shell.

All of them in this one process, sharing one ``TransferLedger``, so that a
proxy may pair any prefill with any decode, as it does real vLLM instances;
with ``--ledger DIR``, processes given the same directory share one ledger
(without, a decode would refuse another process's params as a KV-load
failure). ``--fault decode-1=fail-kv`` (``hang``, ``500``) fails one
instance's every request while the others serve. Prints each instance's URL once all
listen, then a ``twistd nixlproxy`` command line that serves them. With
``--kv-events``, each also publishes its KV cache events on ZeroMQ and
answers replays (each pair of ports said on a line of its own, after its
URL's), and the command line routes prefills ``kv-aware`` on them. With
``--max-num-seqs`` (and ``--max-num-queued-reqs``), each has vLLM's
capacity: that many requests run at once, the rest wait (or are refused).
With ``--decode-hold-after``, each decode's streams hang after that many
events (a test kills the process there: a decode that dies mid-answer).
With ``--bidirectional``, decodes answer handles on their finished
requests' blocks (``--decoder-blocks-ttl``; ``--streams-handle``: in a
stream too, as vLLM 0.33+) and prefills read them back
(``--kv-load-failure-policy`` for one they cannot read,
``--kv-recompute-threshold`` for a pull too small to make).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.endpoints import quoteStringArgument

from nixl_twisted.testing.cluster import FakeCluster, start_cluster
from nixl_twisted.testing.fake import SENTENCE_TOKENS, FakeVLLM
from nixl_twisted.testing.faults import Fault, fault_named
from nixl_twisted.testing.ledger import SharedLedger

#: The proxy's own listening endpoint in the command line printed for the user.
PROXY_LISTEN = "tcp:8000"


def _number(text: str, kind: type[int] | type[float]) -> Any:
    """``text`` as a number, or the sentence argparse shows the user."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value: int = _number(text, int)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value

    return parse


def _port(text: str) -> int:
    value: int = _number(text, int)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0 to 65535, not {value}")
    return value


def _seconds(text: str) -> float:
    value: float = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def arguments() -> argparse.ArgumentParser:
    """The command's options, each with its help and its default shown."""
    parser = argparse.ArgumentParser(
        prog="python -m nixl_twisted.testing",
        description="Serve fake vLLM prefill and decode instances (NIXL-style "
        "kv_transfer_params, no GPU) in one process sharing one KV ledger, "
        "to put twistd nixlproxy in front of.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--prefills",
        type=_at_least(1),
        default=1,
        metavar="N",
        help="how many fake prefill instances to serve",
    )
    parser.add_argument(
        "--decodes",
        type=_at_least(1),
        default=1,
        metavar="M",
        help="how many fake decode instances to serve",
    )
    parser.add_argument(
        "--prefill-port",
        type=_port,
        default=8100,
        metavar="PORT",
        help="the first prefill's port, the next ones consecutive; 0: any free port for each",
    )
    parser.add_argument(
        "--decode-port",
        type=_port,
        default=8200,
        metavar="PORT",
        help="the first decode's port, the next ones consecutive; 0: any free port for each",
    )
    parser.add_argument(
        "--interface",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="the address every instance listens on; 0.0.0.0: all of IPv4's",
    )
    parser.add_argument(
        "--model",
        default=FakeVLLM.model,
        metavar="NAME",
        help="the model every instance serves, as /v1/models lists it (a proxy in front "
        "refuses a request for another model with 404)",
    )
    parser.add_argument(
        "--tokens",
        type=_at_least(0),
        default=SENTENCE_TOKENS,
        metavar="N",
        help="tokens each answer generates, at most the request's max_tokens "
        "(the default: one whole sentence)",
    )
    parser.add_argument(
        "--token-interval",
        type=_seconds,
        default=0.05,
        metavar="SECONDS",
        help="seconds between two generated tokens",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=_at_least(0),
        default=0,
        metavar="N",
        help="generation requests each instance runs at once, as vLLM's --max-num-seqs; "
        "the rest wait in it, first come first served (0: no limit)",
    )
    parser.add_argument(
        "--max-num-queued-reqs",
        type=_at_least(0),
        default=None,
        metavar="N",
        help="requests waiting or running in an instance past which it refuses one more "
        "with 503, as vLLM's --max-num-queued-reqs (unset: no limit)",
    )
    parser.add_argument(
        "--decode-hold-after",
        type=_at_least(0),
        default=None,
        metavar="EVENTS",
        help="each decode's streams stop after this many events and wait, for good (an "
        "instance that hangs mid-answer, or one to kill mid-answer; unset: they do not)",
    )
    parser.add_argument(
        "--fault",
        type=_fault,
        action="append",
        default=[],
        metavar="NAME=FAULT",
        help="one instance fails every generation request: fail-kv (a decode whose KV "
        "loads all fail, 500), hang (taken, never answered) or 500 (an engine error); "
        "repeatable, e.g. --fault decode-1=fail-kv",
    )
    parser.add_argument(
        "--ledger",
        default=None,
        metavar="DIR",
        help="keep the KV ledger in this directory, which fake processes given the same "
        "one share: any decode of any of them redeems what any prefill issued (unset: "
        "in this process alone)",
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="publish each instance's KV cache events on ZeroMQ, as vLLM's "
        "--kv-events-config does, with a replay endpoint; their ports are printed",
    )
    parser.add_argument(
        "--bidirectional",
        action="store_true",
        help="bidirectional KV transfer, as vLLM's bidirectional_kv_xfer: a decode leg "
        "that ends answers a handle on its blocks, a prefill leg given one reads them back",
    )
    parser.add_argument(
        "--decoder-blocks-ttl",
        type=_seconds,
        default=FakeVLLM.decoder_blocks_ttl,
        metavar="SECONDS",
        help="how long a decode keeps the blocks of a handle it answered "
        "(vLLM's decoder_kv_blocks_ttl)",
    )
    parser.add_argument(
        "--streams-handle",
        action="store_true",
        help="a stream's chunk that carries finish_reason carries the handle too, as vLLM "
        "0.33+ (unset: as 0.32, only whole chat and completions answers and /v1/responses)",
    )
    parser.add_argument(
        "--kv-load-failure-policy",
        choices=("fail", "recompute"),
        default=FakeVLLM.kv_load_failure_policy,
        help="what a prefill does with a handle it cannot read (expired, or unknown): "
        "fail (500) or recompute the prompt",
    )
    parser.add_argument(
        "--kv-recompute-threshold",
        type=_at_least(0),
        default=FakeVLLM.kv_recompute_threshold,
        metavar="TOKENS",
        help="a prefill computes instead of pulling fewer tokens than this through a "
        "handle (vLLM's kv_recompute_threshold, 64 there; 0: every pull is made)",
    )
    return parser


def _fault(text: str) -> tuple[str, Fault]:
    """``NAME=FAULT`` as (the instance's name, its fault)."""
    name, equals, kind = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"not NAME=FAULT: {text!r}")
    try:
        return name, fault_named(kind)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def fake_options(args: argparse.Namespace) -> dict[str, Any]:
    """What the options make of every instance: ``FakeVLLM``'s arguments."""
    return {
        "model": args.model,
        "tokens": args.tokens,
        "token_interval": args.token_interval,
        "max_num_seqs": args.max_num_seqs,
        "max_num_queued_reqs": args.max_num_queued_reqs,
        "kv_events": args.kv_events,
        "kv_replay": args.kv_events,
        "kv_interface": args.interface,
        "bidirectional": args.bidirectional,
        "decoder_blocks_ttl": args.decoder_blocks_ttl,
        "streams_handle": args.streams_handle,
        "kv_load_failure_policy": args.kv_load_failure_policy,
        "kv_recompute_threshold": args.kv_recompute_threshold,
    }


def endpoints(first_port: int, count: int, interface: str) -> list[str]:
    """``count`` Twisted endpoints from ``first_port`` up (all ``tcp:0`` if it is 0)."""
    where = quoteStringArgument(interface)
    ports = [first_port + i if first_port else 0 for i in range(count)]
    return [f"tcp:{port}:interface={where}" for port in ports]


def declared(fake: FakeVLLM) -> str:
    """A fake's URL as the proxy is given it: with its KV event ports, when it publishes."""
    if fake.kv_events_port is None:
        return fake.url
    ports = [f"kv-events={fake.kv_events_port}"]
    if fake.kv_replay_port is not None:
        ports.append(f"kv-replay={fake.kv_replay_port}")
    return f"{fake.url}#{'&'.join(ports)}"


def kv_line(fake: FakeVLLM) -> str | None:
    """Where a fake publishes its KV events and answers replays (None: it does not)."""
    if fake.kv_publisher is None:
        return None
    events = fake.kv_publisher.where(fake.kv_events_port)
    replay = fake.kv_publisher.where(fake.kv_replay_port) or "none"
    return f"fake {fake.name} kv events on {events}, replay on {replay}"


def proxy_command(cluster: FakeCluster) -> str:
    """The ``twistd nixlproxy`` command line that serves ``cluster``'s instances."""
    command = ["twistd", "-n", "--pidfile=", "nixlproxy", "--listen", PROXY_LISTEN]
    if any(fake.kv_events_port is not None for fake in cluster.prefills):
        command += ["--prefill-policy", "kv-aware"]
    command += [arg for fake in cluster.prefills for arg in ("--prefill", declared(fake))]
    command += [arg for fake in cluster.decodes for arg in ("--decode", declared(fake))]
    return shlex.join(command)


def main(argv: Sequence[str] | None = None) -> int:
    from twisted.internet import reactor
    from twisted.internet.defer import ensureDeferred

    parser = arguments()
    args = parser.parse_args(argv)
    for option, first, count in (
        ("--prefill-port", args.prefill_port, args.prefills),
        ("--decode-port", args.decode_port, args.decodes),
    ):
        if first and first + count - 1 > 65535:
            parser.error(f"{option} {first}: {count} consecutive ports go past 65535")
    names = [f"prefill-{i}" for i in range(args.prefills)]
    names += [f"decode-{i}" for i in range(args.decodes)]
    for name, _ in args.fault:
        if name not in names:
            parser.error(f"--fault {name}: no such instance here ({', '.join(names)})")
    ledger = SharedLedger(args.ledger) if args.ledger is not None else None
    failed: list[str] = []

    async def serve() -> None:
        cluster = await start_cluster(
            endpoints(args.prefill_port, args.prefills, args.interface),
            endpoints(args.decode_port, args.decodes, args.interface),
            reactor,
            ledger,
            **fake_options(args),
        )
        reactor.addSystemEventTrigger("before", "shutdown", cluster.stop)
        if args.decode_hold_after is not None:
            for fake in cluster.decodes:
                fake.hold_streams_after(args.decode_hold_after)
        faults = dict(args.fault)
        for fake in cluster.instances:
            fake.fault = faults.get(fake.name)
            faulty = f" (fault: {fake.fault.value})" if fake.fault is not None else ""
            print(f"fake {fake.name} listening on {fake.url}{faulty}", flush=True)
            said = kv_line(fake)
            if said is not None:
                print(said, flush=True)
        print(f"serve them with nixlproxy:\n  {proxy_command(cluster)}", flush=True)

    def could_not_start(failure: Any) -> None:
        failed.append(failure.getErrorMessage())
        print(f"fake vLLM could not start: {failed[-1]}", file=sys.stderr, flush=True)
        reactor.stop()

    reactor.callWhenRunning(lambda: ensureDeferred(serve()).addErrback(could_not_start))
    reactor.run()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
