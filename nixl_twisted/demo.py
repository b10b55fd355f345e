"""The demo of the main job: a streaming chat completion through the proxy.

Starts a fake prefill/decode pair (``python -m nixl_twisted.testing``) and a
real ``twistd nixlproxy`` on loopback ports the OS picks, sends one streaming
chat completion with the official ``openai`` client, prints its tokens as
they arrive, and stops what it started. No GPU and no vLLM needed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Sequence

from nixl_twisted.testing.fake import SENTENCE_TOKENS
from nixl_twisted.testing.process import Twistd, TwistdFailed

#: What ``python -m nixl_twisted.testing`` prints for each instance once all listen.
_URL = re.compile(r"fake (?P<role>prefill|decode)-\d+ listening on (?P<url>\S+)")


class DemoFailed(RuntimeError):
    """A demo process did not start, or the request failed."""


def _fakes(tokens: int, token_interval: float) -> tuple[subprocess.Popen[str], str, str]:
    """``python -m nixl_twisted.testing`` on ports the OS picks, and its two URLs."""
    fakes = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nixl_twisted.testing",
            "--prefill-port",
            "0",
            "--decode-port",
            "0",
            "--interface",
            "127.0.0.1",
            "--tokens",
            str(tokens),
            "--token-interval",
            str(token_interval),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    urls: dict[str, str] = {}
    said = []
    assert fakes.stdout is not None
    for line in fakes.stdout:
        said.append(line)
        match = _URL.search(line)
        if match:
            urls[match.group("role")] = match.group("url")
        if len(urls) == 2:
            return fakes, urls["prefill"], urls["decode"]
    raise DemoFailed("the fake vLLM instances exited before they listened:\n" + "".join(said))


def arguments() -> argparse.ArgumentParser:
    """The demo's options: by default the fake's whole sentence, ending on its full stop."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens",
        type=int,
        default=SENTENCE_TOKENS,
        help="tokens to generate (default: the fake's one sentence, whole)",
    )
    parser.add_argument("--token-interval", type=float, default=0.05, help="seconds between tokens")
    parser.add_argument(
        "--prompt", default="Explain disaggregated prefill and decode in one sentence."
    )
    return parser


#: What the demo's client needs, not the proxy: ``nixl-twisted[demo]``.
CLIENT = "openai"


def main(argv: Sequence[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    if importlib.util.find_spec(CLIENT) is None:
        print(
            f"nixlproxy-demo needs the {CLIENT} client, which is not installed: "
            "pip install 'nixl-twisted[demo]'",
            file=sys.stderr,
        )
        return 2

    fakes: subprocess.Popen[str] | None = None
    proxy: Twistd | None = None
    try:
        fakes, prefill, decode = _fakes(args.tokens, args.token_interval)
        print(f"fake prefill instance: {prefill}")
        print(f"fake decode instance:  {decode}")
        proxy = Twistd(
            ["--listen", "tcp:0:interface=127.0.0.1", "--prefill", prefill, "--decode", decode]
        )
        address = proxy.address()
        print(f"twistd nixlproxy:      http://{address}")
        print(f"\nuser> {args.prompt}\nassistant> ", end="", flush=True)
        _chat(f"http://{address}/v1", args.prompt)
        print()
        return 0
    except (DemoFailed, TwistdFailed) as error:
        print(f"\ndemo failed: {error}", file=sys.stderr)
        return 1
    finally:
        if proxy is not None:
            proxy.stop()
        if fakes is not None:
            fakes.terminate()
            fakes.wait(timeout=10)


def _chat(base_url: str, prompt: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="demo-key", max_retries=0, timeout=30)
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": prompt}],
        stream=True,
    )
    received = 0
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                received += 1
                print(choice.delta.content, end="", flush=True)
    if not received:
        raise DemoFailed("the stream carried no tokens")


if __name__ == "__main__":
    raise SystemExit(main())
