"""What this proxy sent where: prompts as chains of hashed pieces, remembered per pool, LRU.

``cache-aware`` asks it which instance was last sent the longest leading
part of a new prompt. A piece is ``PIECE_BYTES`` bytes of the prompt as
rendered text (about 64 tokens), hashed together with every piece before
it, so one hash stands for the whole prefix up to its end: two prompts
share a hash only when they share everything before it too. This is the
proxy's own memory of what it sent, not of what vLLM still holds (for
that, ``kv-aware`` and vLLM's KV events): it never asks vLLM, and an entry
may outlive the blocks it stands for. Bounded by ``--cache-aware-entries``
(one entry per piece), the least recently used going first. With
``--replicas-redis`` each prompt sent is told to the other replicas
(``on_sent``), and what they sent is remembered here as if sent from here
(``remember``): the hashes are blake2b's, the same in every process.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

#: Bytes of rendered prompt per piece: a piece is the finest prefix the memory knows.
PIECE_BYTES = 256
#: The most instances remembered per prefix.
HOLDERS = 4
#: The most of a prompt that is hashed (about 16k tokens; past that, a prefix is known to
#: be long enough, and hashing stays under half a millisecond).
MAX_PROMPT_BYTES = 64 * 1024


def pieces(prompt: bytes, namespace: bytes = b"") -> tuple[int, ...]:
    """The hash of each whole piece of ``prompt`` with all before it (a short tail: none).

    ``namespace`` (a ``cache_salt``'s) is hashed in front of the first piece, so the same
    prompt in two namespaces shares no piece."""
    running = hashlib.blake2b(namespace, digest_size=8)
    view = memoryview(prompt)
    hashes = []
    end = min(len(prompt), MAX_PROMPT_BYTES)
    for start in range(0, end - PIECE_BYTES + 1, PIECE_BYTES):
        running.update(view[start : start + PIECE_BYTES])
        hashes.append(int.from_bytes(running.copy().digest(), "big"))
    return tuple(hashes)


class SentPrefixes:
    """For one pool: the instances each prefix (a piece's chained hash) was last sent to.

    Up to ``HOLDERS`` instances per prefix, the latest first: when the
    balance guard moved a hot prefix to a second instance, both hold it.
    """

    def __init__(self, entries: int) -> None:
        #: The most entries kept (0: remember nothing).
        self.entries = entries
        self._sent: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        self._told: list[Callable[[Sequence[int], str], object]] = []

    def __len__(self) -> int:
        return len(self._sent)

    def longest(self, chain: Sequence[int], urls: Collection[str]) -> dict[str, int]:
        """Each of ``urls`` sent a prefix of ``chain``, and its longest one in pieces.

        The walk stops at the first piece never sent anywhere: a longer
        prefix has that one's hash in its chain, so it was not sent either.
        """
        depths: dict[str, int] = {}
        for at, piece in enumerate(chain, 1):
            holders = self._sent.get(piece)
            if holders is None:
                break
            for url in holders:
                if url in urls:
                    depths[url] = at
        return depths

    def on_sent(self, told: Callable[[Sequence[int], str], object]) -> None:
        """``told(chain, url)`` of each prompt this process sends (the other replicas)."""
        self._told.append(told)

    def sent(self, chain: Sequence[int], url: str) -> None:
        """``url`` was sent this prompt: it is now the first holder of each of its prefixes."""
        if self.remember(chain, url):
            for told in self._told:
                told(chain, url)

    def remember(self, chain: Sequence[int], url: str) -> bool:
        """``url`` was sent this prompt (by this process, or another replica: not told on);
        whether there was anything to remember."""
        if not self.entries or not chain:
            return False
        remembered = self._sent
        for piece in chain:
            holders = remembered.get(piece, ())
            if holders[:1] != (url,):
                remembered[piece] = (url, *(h for h in holders if h != url))[:HOLDERS]
            remembered.move_to_end(piece)
        while len(remembered) > self.entries:
            remembered.popitem(last=False)
        return True

    def resize(self, entries: int) -> None:
        """A reload's new bound: the oldest entries beyond it go now."""
        self.entries = entries
        while len(self._sent) > entries:
            self._sent.popitem(last=False)
