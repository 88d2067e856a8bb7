"""Where a chunk's cache key is made: the one place that decides which chunk KVs are the same.

Under ragkv's semantics a chunk's KV depends only on (model, system tokens, chunk tokens) for
`isolated` chunks and on (model, chunk tokens) for `standalone` ones, and it is stored with
its keys rotated for the chunk's base positions (right after S, or from 0). So a chunk is
keyed by a hash of
- its namespace: the model's fingerprint, the dtype, that storage convention, the store's
  entry format, the attention scope (isolated / standalone) and the request's cache salt
  (tenants never share entries). The entry format is in it so that replicas of two versions
  during a rolling upgrade use different keys instead of deleting each other's entries as
  unreadable. The position strategy is not: the stored bytes do not depend on it;
- the system tokens its KV depends on (none for a standalone chunk; S + P for a primed chunk,
  computed after the chunk primer P: inputs/layout.py);
- its own tokens.
The tokens travel with the key (`ChunkKey`), and the chunk cache compares them on every hit,
so a hash collision can never serve wrong KV.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import SUPPORTED_HASHES
from ..host_ints import int64_bytes
from .store.format import FORMAT_VERSION

# How chunk KV is stored, part of every key: keys rotated for the chunk's base positions
# (after S for isolated chunks, from 0 for standalone ones).
KV_STORAGE = "k=rope@base"


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """One chunk's identity in the chunk cache and the store: the hash `key` of the namespace
    and the tokens, and what it hashes (compared on a hit)."""

    key: bytes
    namespace: str
    system: tuple[int, ...]  # the tokens its KV depends on (() if standalone, S + P if primed)
    tokens: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def hex(self) -> str:
        """The key as the store names its entry."""
        return self.key.hex()


class ChunkKeys:
    """The chunk keys of one engine: its model, dtype and hash."""

    def __init__(self, model_fingerprint: str, dtype: torch.dtype,
                 hash_algo: str = "sha256") -> None:
        self.base = f"{model_fingerprint}|{dtype}|{KV_STORAGE}|format={FORMAT_VERSION}"
        self._hasher = make_hasher(hash_algo)

    def namespace(self, chunk_attention: str, cache_salt: str | None) -> str:
        return f"{self.base}|attention={chunk_attention}|salt={cache_salt or ''}"

    def hash(self, namespace: str, system: Sequence[int], tokens: Sequence[int]) -> bytes:
        h = self._hasher()
        for part in (namespace.encode(), int64_bytes(system), int64_bytes(tokens)):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.digest()

    def make(self, namespace: str, system: tuple[int, ...],
             tokens: tuple[int, ...]) -> ChunkKey:
        return ChunkKey(self.hash(namespace, system, tokens), namespace, system, tokens)

    def of_prompt(self, system: Sequence[int], chunks: Sequence[Sequence[int]],
                  chunk_attention: str, cache_salt: str | None,
                  primer: Sequence[int] = ()) -> tuple[ChunkKey, ...]:
        """The keys of a prompt's chunks, in order: an isolated chunk's KV depends on the
        system tokens, a standalone one's only on its own; with `primer` (P, a primed
        layout's) every chunk after the first depends on S + P."""
        namespace = self.namespace(chunk_attention, cache_salt)
        scope = tuple(system) if chunk_attention == "isolated" else ()
        primed = scope + tuple(primer)
        return tuple(self.make(namespace, primed if i else scope, tuple(c))
                     for i, c in enumerate(chunks))


def make_hasher(algo: str):
    """The hash constructor of `chunk_hash_algo` (xxhash imported only when asked for)."""
    if algo not in SUPPORTED_HASHES:
        raise ValueError(f"chunk_hash_algo must be one of {SUPPORTED_HASHES}, got {algo!r}")
    if algo == "sha256":
        return hashlib.sha256
    try:
        import xxhash
    except ImportError as e:
        raise ValueError("chunk_hash_algo='xxh3_128' needs the xxhash package "
                         "(pip install 'ragkv[xxhash]')") from e
    return xxhash.xxh3_128
