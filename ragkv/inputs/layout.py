"""Where a prompt's tokens sit: all the position arithmetic of one request, in one frozen value.

A RAG request's tokens are laid out flat as S + C_1 + ... + C_n + Q + generated. Its layout says
where each segment lies, which RoPE positions its tokens take, and how far each chunk's cached
keys are turned to sit where the request places it (docs/rag.md states the semantics).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PromptLayout:
    """Flat token offsets of a prompt's segments and the positions of its tokens. An ordinary
    prompt has no chunks and its question segment is the whole prompt.

    A chunk's KV is always computed the same way, whatever the request does with it: at its
    *base* positions, after S (`isolated`: base s, its KV list S + itself) or alone
    (`standalone`: base 0, its KV list itself). That is what the chunk cache stores. The
    request places chunk i at its *target* positions: s for every chunk (`shared`) or where
    the chunk lies in the flat prompt (`sequential`); the question and generated tokens follow
    the longest chunk (`shared`) or the last one (`sequential`). Whoever attends to chunk i
    later sees its keys turned forward by `chunk_deltas[i]` = target - base (`turns`).

    A *primed* layout (sequential positions, isolated chunks, a chunk primer P of
    `primer_len` tokens) computes every chunk after the first after S + P instead: base
    s + p, KV list S + P + itself, so that it is computed as a document that follows another
    one. The first chunk stays where it lies. Nothing after the chunks reads P."""

    system_len: int
    chunk_bounds: tuple[tuple[int, int], ...]  # [start, end) of each chunk
    question_start: int
    max_chunk_len: int
    sees_system: bool = True  # chunk_attention == "isolated"
    chunk_deltas: tuple[int, ...] = ()
    # (start, end, delta) of every chunk whose keys are turned (model/reposition.py), in flat
    # token indices (which are also KV-list indices for the question and generated tokens).
    turns: tuple[tuple[int, int, int], ...] = ()
    question_offset: int = 0  # RoPE position minus flat index, for Q and generated tokens
    primer_len: int = 0  # p: chunks after the first are computed after S + P (0: none)

    @classmethod
    def build(cls, system_len: int, chunk_lens: list[int], position_strategy: str = "shared",
              chunk_attention: str = "isolated", primer_len: int = 0) -> PromptLayout:
        """`primer_len` applies to sequential, isolated layouts only (elsewhere no chunk
        follows another one where its KV is computed)."""
        bounds, start = [], system_len
        for n in chunk_lens:
            bounds.append((start, start + n))
            start += n
        sees_system = chunk_attention == "isolated"
        sequential = position_strategy == "sequential"
        p = primer_len if sequential and sees_system and len(bounds) > 1 else 0
        base = [(system_len + (p if i else 0)) if sees_system else 0 for i in range(len(bounds))]
        deltas = tuple((a if sequential else system_len) - b
                       for (a, _), b in zip(bounds, base, strict=True))
        longest = max(chunk_lens, default=0)
        return cls(
            system_len=system_len, chunk_bounds=tuple(bounds), question_start=start,
            max_chunk_len=longest, sees_system=sees_system, chunk_deltas=deltas,
            turns=tuple((a, b, d) for (a, b), d in zip(bounds, deltas, strict=True) if d),
            question_offset=0 if sequential or not bounds else system_len + longest - start,
            primer_len=p,
        )

    @property
    def is_rag(self) -> bool:
        return bool(self.chunk_bounds)

    @property
    def exact_end(self) -> int:
        """Flat index up to which the request's cached KV is exactly what a full prefill of
        the prompt computes: S and, when it is computed where it lies and after all that
        precedes it (sequential positions, isolated, or standalone with no S), the first
        chunk. Recomputing a token before it would give back the KV it has."""
        s = self.system_len
        if self.chunk_deltas[:1] != (0,) or not (self.sees_system or s == 0):
            return s
        return self.chunk_bounds[0][1]

    def primed(self, chunk: int) -> bool:
        """Whether chunk `chunk`'s KV is computed after S + P."""
        return chunk > 0 and self.primer_len > 0

    def chunk_base(self, chunk: int) -> int:
        """Position of chunk `chunk`'s first token where its KV is computed."""
        if not self.sees_system:
            return 0
        return self.system_len + (self.primer_len if self.primed(chunk) else 0)

    def chunk_at(self, x: int) -> int | None:
        """Index of the chunk holding flat token x, if any."""
        if not self.system_len <= x < self.question_start:
            return None
        for i, (start, end) in enumerate(self.chunk_bounds):
            if start <= x < end:
                return i
        return None

    def chunk_kv_spans(self, chunk: int, end: int) -> tuple[tuple[int, int], ...]:
        """The KV list (ranges of flat tokens) of chunk tokens computed up to flat `end`. A
        primed chunk's list has P between these two ranges (S, then the chunk)."""
        start = self.chunk_bounds[chunk][0]
        if self.sees_system and (self.system_len or self.primed(chunk)):
            return ((0, self.system_len), (start, end))
        return ((start, end),)

    def chunk_positions(self, xs: list[int]) -> tuple[list[int], list[int]]:
        """Base positions (where the cache computed their keys) and target positions (where
        the request places them) of the chunk tokens `xs`, ascending flat indices."""
        base, target = [], []
        i = 0
        for x in xs:
            while self.chunk_bounds[i][1] <= x:
                i += 1
            b = self.chunk_base(i) + x - self.chunk_bounds[i][0]
            base.append(b)
            target.append(b + self.chunk_deltas[i])
        return base, target

    def positions(self, start: int, end: int) -> list[int]:
        """RoPE positions of flat tokens [start, end), which lie in one segment; chunk tokens
        at their base positions (where their KV is computed)."""
        s = self.system_len
        if end <= s:
            return list(range(start, end))
        if start >= self.question_start:
            offset = self.question_offset
            return list(range(start + offset, end + offset))
        chunk = self.chunk_at(start)
        base = self.chunk_base(chunk) - self.chunk_bounds[chunk][0]
        return list(range(base + start, base + end))
