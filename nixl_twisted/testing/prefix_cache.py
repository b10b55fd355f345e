"""vLLM's automatic prefix caching, as a fake models it: blocks of tokens, hashed in a chain, LRU.

A "token" is approximated as four bytes of the rendered prompt (vLLM's
tokenizers average three to five bytes per token on English text). Like
vLLM, a block is cached only when full, a prompt hits the leading blocks
it shares with what the instance computed before, and the counters are in
tokens: ``queries`` (prompt tokens looked up) and ``hits`` (of those, cached).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

BYTES_PER_TOKEN = 4


def prompt_text(body: dict[str, Any]) -> str:
    """What the engine would tokenize: the chat messages rendered, or the prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        rendered = []
        for message in messages:
            if isinstance(message, dict):
                content = message.get("content")
                if isinstance(content, list):
                    content = "".join(
                        str(p.get("text", "")) for p in content if isinstance(p, dict)
                    )
                rendered.append(f"{message.get('role')}\n{content}\n")
        return "".join(rendered)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return str(prompt or "")


def token_count(text: str) -> int:
    """A prompt's tokens as this module counts them: four bytes of UTF-8 each, at least one."""
    return max(1, len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)


class PrefixCache:
    """One instance's prefix cache: ``capacity`` blocks of ``block_tokens`` tokens, LRU."""

    def __init__(self, block_tokens: int = 128, capacity: int = 4096) -> None:
        self.block_tokens = block_tokens
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        #: Prompt tokens looked up, and of those the ones found cached (vLLM's counters).
        self.queries = 0
        self.hits = 0

    @property
    def usage(self) -> float:
        """The share of the cache in use, as ``vllm:kv_cache_usage_perc`` (0 to 1)."""
        return len(self._blocks) / self.capacity

    def compute(self, text: str) -> tuple[int, int]:
        """Look a prompt up and cache its blocks; returns (cached tokens, prompt tokens)."""
        raw = text.encode("utf-8", "surrogatepass")
        tokens = token_count(text)
        size = self.block_tokens * BYTES_PER_TOKEN
        chain = b""
        cached_blocks = 0
        missing = False
        for start in range(0, len(raw) - size + 1, size):
            chain = hashlib.blake2b(chain + raw[start : start + size], digest_size=16).digest()
            if not missing and chain in self._blocks:
                cached_blocks += 1
                self._blocks.move_to_end(chain)
                continue
            missing = True
            self._blocks[chain] = None
            self._blocks.move_to_end(chain)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        cached = min(tokens, cached_blocks * self.block_tokens)
        self.queries += tokens
        self.hits += cached
        return cached, tokens
