"""vLLM's automatic prefix caching as a fake models it: blocks of token ids, hashed in a chain, LRU.

A prompt's tokens (``prompt_tokens``) are its own when it is token ids;
otherwise each four bytes of the rendered prompt are one token (vLLM's
tokenizers average three to five bytes per token on English text). Like
vLLM, a block is cached only when full, a prompt hits the leading blocks
it shares with what the instance computed before, the counters are in
tokens (``queries``: prompt tokens looked up; ``hits``: of those, cached),
each block's hash is seeded per instance (two instances never agree on
one), a request's ``cache_salt`` enters its first block's hash (so salts
never share blocks) and, when told (``on_events``), the cache reports what it stored and
evicted as vLLM's KV cache events do. With ``lookahead`` L (vLLM 0.34's
lookahead hashing, under EAGLE-style speculative decoding) each block's
hash also covers the L tokens after it, a block is cached only once they
exist, and ``BlockStored`` carries them (``lookahead_token_ids``).

A fake renders a conversation as it generated it: an assistant message
followed by another whose content is exactly the text the fake generates
from its start (``answers.words``) renders to the ids it generated
(``answers.generated_ids``), and the text before and after it is
tokenized apart. So the next turn of a chat (its messages, the answer,
a new user message) starts with exactly the ids its decode held (the
prompt's ids, then the answer's), as a real chat template's does; an
earlier message changed, or an answer edited, does not.
"""

from __future__ import annotations

import hashlib
import os
import struct
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Any

from nixl_twisted.testing.answers import generated_ids, words

BYTES_PER_TOKEN = 4

#: One KV cache event, a map tagged by ``"type"`` as vLLM encodes it.
KvEvent = dict[str, Any]


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


def text_tokens(text: str) -> list[int]:
    """Four bytes of UTF-8 a token (little-endian), a shorter tail dropped, at least one."""
    raw = text.encode("utf-8", "surrogatepass")
    whole = len(raw) // BYTES_PER_TOKEN
    if whole == 0:  # a prompt shorter than a token is still one
        return [int.from_bytes(raw, "little")]
    return list(struct.unpack(f"<{whole}I", raw[: whole * BYTES_PER_TOKEN]))


def prompt_tokens(body: dict[str, Any], generates: str | None = None) -> list[int]:
    """The token ids the engine computes for a request: a token-id prompt's own, else the
    rendered prompt's (``text_tokens``; a chat's answers by a fake that ``generates`` this
    text: their generated ids). ``/tokenize`` and the render endpoints answer these."""
    prompt = body.get("prompt")
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        and isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)
    if generates is not None and isinstance(messages, list):
        return _conversation(messages, generates)
    return text_tokens(prompt_text(body))


def _conversation(messages: list[Any], generates: str) -> list[int]:
    """A chat's ids, each of its answers (``generates``'s text) as the ids generated."""
    ids: list[int] = []
    since = 0  # the first message not yet rendered
    for at, message in enumerate(messages[:-1]):
        answered = _answered(message, generates)
        if answered is None:
            continue
        before = prompt_text({"messages": messages[since:at]})
        ids += text_tokens(before) if before else []
        ids += answered
        since = at + 1
    return ids + text_tokens(prompt_text({"messages": messages[since:]}))


def _answered(message: object, generates: str) -> list[int] | None:
    """The ids a fake generated for this message, if it is its answer (else None)."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return None
    content = message.get("content")
    count = len(content.split()) if isinstance(content, str) else 0
    if count == 0 or content != "".join(words(generates, count)):
        return None
    return generated_ids(0, count)


def token_count(text: str) -> int:
    """A text prompt's tokens as this module counts them: four bytes of UTF-8 each, at least one."""
    return max(1, len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)


def _packed(tokens: Sequence[int]) -> bytes:
    try:
        return array("q", tokens).tobytes()
    except OverflowError:  # ids past 64 bits: any stable spelling will do
        return repr(list(tokens)).encode()


def block_stored(
    hashes: Sequence[int],
    parent: int | None,
    tokens: Sequence[int],
    block_size: int,
    salt: str | None = None,
    lookahead: Sequence[Sequence[int]] | None = None,
) -> KvEvent:
    """vLLM's ``BlockStored``: full blocks newly cached, after ``parent`` (None: the first);
    a first block's ``cache_salt`` is its extra key, as vLLM publishes it; ``lookahead``: the
    tokens after each block hashed into it (vLLM 0.34's last field, left out when None)."""
    extra: list[list[str] | None] = [None] * len(hashes)
    if salt is not None and parent is None and hashes:
        extra[0] = [salt]
    event: KvEvent = {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": extra,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    if lookahead is not None:
        event["lookahead_token_ids"] = [list(tokens) for tokens in lookahead]
    return event


def block_removed(block_hash: int) -> KvEvent:
    """vLLM's ``BlockRemoved``: one evicted block (vLLM sends one event per eviction)."""
    return {"type": "BlockRemoved", "block_hashes": [block_hash], "medium": "GPU", "group_idx": 0}


def all_blocks_cleared() -> KvEvent:
    """vLLM's ``AllBlocksCleared``: the whole cache reset."""
    return {"type": "AllBlocksCleared"}


class PrefixCache:
    """One instance's prefix cache: ``capacity`` blocks of ``block_tokens`` tokens, LRU.

    ``seed`` keys the block hashes (random unless given, as vLLM seeds them
    per process); ``on_events`` is called with each change's KV cache events;
    ``lookahead``: the tokens after each block its hash covers (0: none).
    """

    def __init__(
        self,
        block_tokens: int = 128,
        capacity: int = 4096,
        seed: bytes | None = None,
        on_events: Callable[[list[KvEvent]], object] | None = None,
        lookahead: int = 0,
    ) -> None:
        self.block_tokens = block_tokens
        self.lookahead = lookahead
        self.capacity = capacity
        self.seed = os.urandom(16) if seed is None else seed
        self.on_events = on_events
        #: Block hashes, the next to evict first.
        self._blocks: OrderedDict[int, None] = OrderedDict()
        #: Prompt tokens looked up, and of those the ones found cached (vLLM's counters).
        self.queries = 0
        self.hits = 0

    @property
    def usage(self) -> float:
        """The share of the cache in use, as ``vllm:kv_cache_usage_perc`` (0 to 1)."""
        return len(self._blocks) / self.capacity

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def block_hashes(self, tokens: Sequence[int], salt: str | None = None) -> list[int]:
        """The hash of each full block of ``tokens`` followed by its ``lookahead`` tokens, each
        covering its parent's hash (the first covering ``salt``) and those tokens: 64 bits."""
        size, ahead = self.block_tokens, self.lookahead
        parent = b"" if salt is None else b"salt\0" + salt.encode("utf-8", "surrogatepass")
        hashes = []
        for start in range(0, len(tokens) - size - ahead + 1, size):
            after = (
                b"ahead\0" + _packed(tokens[start + size : start + size + ahead]) if ahead else b""
            )
            parent = hashlib.blake2b(
                parent + _packed(tokens[start : start + size]) + after,
                digest_size=8,
                key=self.seed,
            ).digest()
            hashes.append(int.from_bytes(parent, "big"))
        return hashes

    def compute(self, tokens: Sequence[int], salt: str | None = None) -> tuple[int, int]:
        """Look a prompt up (under its ``cache_salt``) and cache its blocks; returns (cached
        tokens, prompt tokens).

        Its blocks after the leading cached ones are computed and stored
        (one ``BlockStored``); room is made first by evicting the least
        recently used blocks of other prompts (a ``BlockRemoved`` each).
        """
        hashes = self.block_hashes(tokens, salt)
        found = 0
        while found < len(hashes) and hashes[found] in self._blocks:
            found += 1
        computed = hashes[found:]
        events = [block_removed(h) for h in self._make_room(computed, set(hashes))]
        # A prompt's last block is marked used first, its first block last: the
        # tail goes before the head, as vLLM frees a request's blocks in reverse.
        for block_hash in reversed(hashes):
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        if computed:
            size, ahead = self.block_tokens, self.lookahead
            after = [
                tokens[end : end + ahead]
                for end in range((found + 1) * size, (len(hashes) + 1) * size, size)
            ]
            events.append(
                block_stored(
                    computed,
                    hashes[found - 1] if found else None,
                    tokens[found * size : len(hashes) * size],
                    size,
                    salt,
                    after if ahead else None,
                )
            )
        while len(self._blocks) > self.capacity:  # a prompt longer than the whole cache
            events.append(block_removed(self._blocks.popitem(last=False)[0]))
        cached = min(len(tokens), found * self.block_tokens)
        self.queries += len(tokens)
        self.hits += cached
        self._report(events)
        return cached, len(tokens)

    def _make_room(self, computed: list[int], own: set[int]) -> list[int]:
        """Evict the least recently used blocks not of this prompt, for ``computed``."""
        adding = sum(1 for h in computed if h not in self._blocks)
        excess = len(self._blocks) + adding - self.capacity
        if excess <= 0:
            return []
        victims = list(islice((h for h in self._blocks if h not in own), excess))
        for block_hash in victims:
            del self._blocks[block_hash]
        return victims

    def clear(self, report: bool = True) -> None:
        """Empty the cache (vLLM's prefix-cache reset): ``AllBlocksCleared``, unless not
        ``report`` (an engine that restarted says nothing of its old cache)."""
        self._blocks.clear()
        if report:
            self._report([all_blocks_cleared()])

    def _report(self, events: list[KvEvent]) -> None:
        if events and self.on_events is not None:
            self.on_events(events)
