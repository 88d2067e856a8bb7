"""Token ids of the prompt parts that recur, kept by their text.

RAG traffic sends the same documents and system prompts again and again, as text. Tokenizing
them is host work on every request's critical path: a 512-token document takes about a
millisecond with SmolLM2's tokenizer on one core, eight of them longer than a warm request's
whole step on a GPU. `TokenCache` maps (text, whether special tokens are added) to the ids
the tokenizer gave, so a document is tokenized once. Tokenizing is a function of those two,
so a hit returns exactly what the tokenizer would. A request's `cache_salt` is part of the
key, as it is of the chunk cache's: one tenant cannot learn from a faster answer that another
sent a document.

Only the reusable parts go through it (a RAG prompt's system part and chunks, a chat's
rendered head and documents); questions are new every time and would only evict documents.
It is bounded in bytes (each entry's text, salt and ids, plus what the map spends on it),
least recently used first out, and shared by the server's tokenizer threads, hence the lock
(the tokenizer runs outside it).
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

# What the map spends on an entry besides its text, salt and ids' buffer: the key and value
# tuples, the array object, the size, the ordered dict's slot and link (CPython 3.11, measured
# with tracemalloc over 20,000 entries: ~275 bytes).
ENTRY_OVERHEAD = 288


@dataclass(frozen=True, slots=True)
class TokenCacheStats:
    queries: int
    hits: int
    entries: int
    bytes: int
    capacity_bytes: int


class TokenCache:
    def __init__(self, tokenizer, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.tokenizer = tokenizer
        self.capacity_bytes = capacity_bytes
        # (text, special, salt) -> (ids as int32: 4 bytes a token instead of a list's ~36,
        # the bytes counted for the entry when it came in).
        self._entries: OrderedDict[tuple[str, bool, str | None], tuple[array, int]] = (
            OrderedDict())
        self._bytes = 0
        self._queries = 0
        self._hits = 0
        self._lock = threading.Lock()

    def encode(self, text: str, special: bool, salt: str | None = None) -> list[int]:
        """`tokenizer.encode(text, add_special_tokens=special)`, from the cache when this text
        was tokenized before under the same `salt` (a request's cache_salt). The list returned
        is the caller's own."""
        key = (text, special, salt)
        with self._lock:
            self._queries += 1
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self._hits += 1
                return entry[0].tolist()
        tokens = self.tokenizer.encode(text, add_special_tokens=special)
        self._store(key, tokens)
        return tokens

    def _store(self, key: tuple[str, bool, str | None], tokens: list[int]) -> None:
        try:
            ids = array("i", tokens)
        except (OverflowError, TypeError):  # ids beyond int32: not kept, still returned
            return
        # Sized once: a str's size can grow later (CPython caches its UTF-8 form on demand).
        text, _, salt = key
        size = (sys.getsizeof(text) + (sys.getsizeof(salt) if salt is not None else 0)
                + ids.itemsize * len(ids) + ENTRY_OVERHEAD)
        if size > self.capacity_bytes:
            return
        with self._lock:
            if key in self._entries:  # another thread tokenized it meanwhile
                return
            self._entries[key] = (ids, size)
            self._bytes += size
            while self._bytes > self.capacity_bytes:
                _, (_, old_size) = self._entries.popitem(last=False)
                self._bytes -= old_size

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> TokenCacheStats:
        with self._lock:
            return TokenCacheStats(self._queries, self._hits, len(self._entries), self._bytes,
                                   self.capacity_bytes)

    def check_integrity(self) -> None:
        """The byte count equals the entries' sizes and stays within the capacity."""
        with self._lock:
            total = sum(size for _, size in self._entries.values())
            if total != self._bytes or total > self.capacity_bytes:
                raise AssertionError(f"token cache holds {total} bytes, counts {self._bytes}, "
                                     f"capacity {self.capacity_bytes}")

