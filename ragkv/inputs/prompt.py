"""Prompt inputs -> a `ChunkedPrompt` of token lists (docs/rag.md: prompt parsing).

Accepted inputs:
- a string: an ordinary prompt, unless a chunk separator is set (the engine's
  `chunk_separator`, or the prompt dict's) and occurs in it: then it reads
  `system ## chunk_1 ## ... ## question`. The text is split first and each part tokenized on
  its own (the system part with the tokenizer's special tokens, chunks and question without),
  because splitting on separator *tokens* breaks when the tokenizer merges the separator with
  its neighbours. The whitespace around each separator is trimmed (`split_at_separator`), one
  canonical form: `S##d##Q` and `S ## d ## Q` give the same chunk tokens;
- a `RAGPrompt(system, chunks, question)` of strings or token-id lists (lists used as given);
- a dict: `{"prompt_token_ids": [...]}` (used as given) or `{"prompt": "..."}` (with an
  optional `"chunk_separator"`, replacing the engine's for this prompt; None: no split),
  either with an optional `"cache_salt"` and RAG options (`RAG_OPTIONS`).
Separators never reach the model. Empty chunks are dropped; no chunks is an ordinary prompt.
The parts that recur across requests (system parts and chunks given as text, a chat's rendered
head and documents) are tokenized through the engine's `TokenCache` when it has one.
A prompt's RAG options (None: the engine's default) choose its layout, `position_strategy` and
`chunk_attention`, and its selective recompute, `recompute`, `recompute_ratio`,
`recompute_sink_tokens` and an adaptive budget, `recompute_score_mass` and
`recompute_min_ratio`, and `recompute_damping`, and whether later chunks are computed after
the engine's chunk primer, `chunk_primer` (docs/rag.md; see `config.py`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from itertools import chain

from ..config import check_adaptive, check_damping, check_layout, check_recompute, check_separator
from ..host_ints import int64_tensor
from .token_cache import TokenCache

# Per-prompt settings of a RAG prompt, each None for the engine's default.
RAG_OPTIONS = ("position_strategy", "chunk_attention", "recompute", "recompute_ratio",
               "recompute_sink_tokens", "recompute_score_mass", "recompute_min_ratio",
               "recompute_damping", "chunk_primer")


@dataclass(frozen=True, slots=True)
class RAGPrompt:
    system: str | list[int]
    chunks: list[str | list[int]] = field(default_factory=list)
    question: str | list[int] = ""
    cache_salt: str | None = None
    position_strategy: str | None = None  # "shared" | "sequential"; None: engine default
    chunk_attention: str | None = None  # "isolated" | "standalone"; None: engine default
    recompute: str | None = None  # config.RECOMPUTE_METHODS; None: engine default
    recompute_ratio: float | None = None  # the most recomputed when the budget is adaptive
    recompute_sink_tokens: int | None = None
    recompute_score_mass: float | None = None  # an adaptive budget (config.py)
    recompute_min_ratio: float | None = None
    recompute_damping: float | None = None  # logit offset of stale chunk tokens (config.py)
    chunk_primer: bool | None = None  # later chunks after the engine's primer; None: its default
    # Rendered with the model's chat template as a chat request is (LLM.chat, the server's
    # chat endpoint; chat.split_rag_chat): `system` the system message, `chunks` the
    # documents, `question` the user message. Text parts only.
    chat: bool = False


@dataclass(frozen=True, slots=True)
class ChunkedPrompt:
    """Token lists of one prompt. With no chunks it is an ordinary prompt (system + question
    are simply consecutive tokens)."""

    system: list[int]
    chunks: list[list[int]]
    question: list[int]
    text: str | None = None
    cache_salt: str | None = None
    position_strategy: str | None = None
    chunk_attention: str | None = None
    recompute: str | None = None
    recompute_ratio: float | None = None
    recompute_sink_tokens: int | None = None
    recompute_score_mass: float | None = None
    recompute_min_ratio: float | None = None
    recompute_damping: float | None = None
    chunk_primer: bool | None = None

    @property
    def is_rag(self) -> bool:
        return bool(self.chunks)

    @property
    def token_ids(self) -> list[int]:
        out = list(self.system)
        for chunk in self.chunks:
            out.extend(chunk)
        out.extend(self.question)
        return out


@dataclass(frozen=True, slots=True)
class PromptRules:
    """How prompts are split and checked; from the engine config."""

    vocab_size: int
    separator: str | None = None
    max_chunk_tokens: int = 4096
    oversize_chunk: str = "error"  # or "split"
    # Text longer than this cannot fit max_model_len: refused before tokenizing.
    max_prompt_chars: int | None = None


def max_token_chars(tokenizer) -> int:
    """Characters of the longest vocabulary entry: no text tokenizes to fewer than
    len(text) / max_token_chars tokens (byte-level entries spell one byte per character, and a
    character is at least one byte)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def check_text(name: str, text: str, max_chars: int | None = None) -> None:
    """A clear ValueError for text the tokenizer cannot take or that can never fit."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode: it holds a lone surrogate "
                         f"(U+{ord(text[e.start]):04X}) at index {e.start}") from None
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(f"{name} has {len(text)} characters; no text over {max_chars} "
                         "characters fits max_model_len")


def reused_tokenizer(tokenizer, cache: TokenCache | None, salt: object):
    """How the parts that recur (system parts, documents) are tokenized: (text, whether to
    add special tokens) -> ids, through `cache` under the request's salt when there is one.
    A salt that is not a string bypasses the cache; `_finish` refuses it, after the checks
    that come before it."""
    if cache is not None and (salt is None or isinstance(salt, str)):
        return lambda text, special: cache.encode(text, special, salt)
    return lambda text, special: tokenizer.encode(text, add_special_tokens=special)


def parse_prompt(prompt: object, tokenizer, rules: PromptRules,
                 cache: TokenCache | None = None) -> ChunkedPrompt:
    """`cache`: token ids of system parts and chunks given as text, by their text."""
    salt = None
    layout: dict = {}
    separator = rules.separator
    if isinstance(prompt, dict):
        salt = prompt.get("cache_salt")
        if "chunk_separator" in prompt:  # checked whatever the prompt's form
            check_separator(prompt["chunk_separator"])
        layout = {k: prompt[k] for k in RAG_OPTIONS if k in prompt}
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            _check_ids("prompt_token_ids", ids)
            parsed = ChunkedPrompt([], [], list(ids), prompt.get("prompt"), salt, **layout)
            return _finish(parsed, rules)
        if "prompt" not in prompt:
            raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        separator = prompt.get("chunk_separator", separator)
        prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise ValueError("'prompt' must be a string")
    _check_salt(salt)
    if isinstance(prompt, str):
        check_text("prompt", prompt, rules.max_prompt_chars)
        parsed = _split_text(prompt, tokenizer, separator, salt, cache)
        return _finish(replace(parsed, **layout), rules)
    if isinstance(prompt, RAGPrompt):
        if prompt.chat:
            raise ValueError("RAGPrompt(chat=True) is rendered by chat.split_rag_chat first")
        return _finish(_from_rag_prompt(prompt, tokenizer, rules.max_prompt_chars, cache),
                       rules)
    if isinstance(prompt, ChunkedPrompt):  # already tokenized (e.g. a split chat prompt)
        return _finish(prompt, rules)
    raise ValueError(
        f"unsupported prompt type {type(prompt).__name__}: give a str, a RAGPrompt or a dict "
        "with 'prompt_token_ids' or 'prompt'"
    )


def _split_text(text: str, tokenizer, separator: str | None, salt: str | None,
                cache: TokenCache | None = None) -> ChunkedPrompt:
    if not text:
        raise ValueError("prompt is empty")
    if not separator or separator not in text:
        return ChunkedPrompt([], [], tokenizer.encode(text, add_special_tokens=True), text, salt)
    system, chunks, question = split_at_separator(text, separator)
    if not question:
        raise ValueError("the question (the text after the last chunk separator) is empty")
    reused = reused_tokenizer(tokenizer, cache, salt)
    return ChunkedPrompt(
        system=reused(system, True),
        chunks=[reused(c, False) for c in chunks if c],
        question=tokenizer.encode(question, add_special_tokens=False),
        text=text, cache_salt=salt,
    )


def split_at_separator(text: str, separator: str) -> tuple[str, list[str], str]:
    """`system sep chunk_1 sep ... sep question` as (system, chunks, question), each part
    trimmed of the whitespace next to a separator (the system part's end, the question's
    start, both ends of a chunk), so the spacing around separators never changes the tokens."""
    parts = text.split(separator)
    return parts[0].rstrip(), [p.strip() for p in parts[1:-1]], parts[-1].lstrip()


def _from_rag_prompt(p: RAGPrompt, tokenizer, max_chars: int | None,
                     cache: TokenCache | None = None) -> ChunkedPrompt:
    chunks = p.chunks if isinstance(p.chunks, (list, tuple)) else ()
    named = [("RAGPrompt.system", p.system), ("RAGPrompt.question", p.question),
             *(("RAGPrompt.chunks", c) for c in chunks)]
    texts = [(name, x) for name, x in named if isinstance(x, str)]
    for name, text in texts:
        check_text(name, text)
    total = sum(len(x) for _, x in texts)
    if max_chars is not None and total > max_chars:
        raise ValueError(f"RAGPrompt has {total} characters; no text over {max_chars} "
                         "characters fits max_model_len")

    reused = reused_tokenizer(tokenizer, cache, p.cache_salt)

    def tokens(part, name: str, special: bool, encode=reused) -> list[int]:
        if isinstance(part, str):
            # Like the separator form: a blank chunk is dropped, the system part gets BOS.
            return encode(part, special) if special or part.strip() else []
        _check_ids(name, part)
        return list(part)

    if isinstance(p.question, str) and not p.question.strip() or not p.question:
        raise ValueError("RAGPrompt.question is empty")
    if not isinstance(p.chunks, (list, tuple)):
        raise ValueError("RAGPrompt.chunks must be a list")
    chunks = [tokens(c, "RAGPrompt.chunks", False) for c in p.chunks]
    return ChunkedPrompt(
        system=tokens(p.system, "RAGPrompt.system", True),
        chunks=[c for c in chunks if c],
        question=tokens(p.question, "RAGPrompt.question", False,
                        encode=reused_tokenizer(tokenizer, None, None)),  # new every time: not kept
        text=None, cache_salt=p.cache_salt,
        **{name: getattr(p, name) for name in RAG_OPTIONS},
    )


def _check_salt(salt: object) -> None:
    if salt is not None and not isinstance(salt, str):
        raise ValueError("cache_salt must be a string")


def _finish(p: ChunkedPrompt, rules: PromptRules) -> ChunkedPrompt:
    if p.cache_salt is not None:
        _check_salt(p.cache_salt)
        check_text("cache_salt", p.cache_salt)
    check_layout(p.position_strategy, p.chunk_attention, allow_default=True)
    check_recompute(p.recompute, p.recompute_ratio, p.recompute_sink_tokens, allow_default=True)
    check_adaptive(p.recompute_score_mass, p.recompute_min_ratio, allow_default=True)
    check_damping(p.recompute_damping, allow_default=True)
    if p.chunk_primer is not None and not isinstance(p.chunk_primer, bool):
        raise ValueError(f"chunk_primer must be true, false or null, got {p.chunk_primer!r}")
    if not p.system and not p.chunks and not p.question:
        raise ValueError("prompt is empty (0 tokens)")
    if p.chunks and not p.question:
        raise ValueError("the question is empty")
    ids = list(chain(p.system, *p.chunks, p.question))
    if not _in_vocab(ids, rules.vocab_size):
        bad = next(t for t in ids if not 0 <= t < rules.vocab_size)
        raise ValueError(
            f"prompt_token_ids contains {bad}, outside the vocabulary [0, {rules.vocab_size})"
        )
    chunks = p.chunks
    if any(len(c) > rules.max_chunk_tokens for c in chunks):
        if rules.oversize_chunk != "split":
            longest = max(len(c) for c in chunks)
            raise ValueError(
                f"a chunk has {longest} tokens, more than max_chunk_tokens="
                f"{rules.max_chunk_tokens} (oversize_chunk='split', or --oversize-chunk split, "
                "splits it instead)"
            )
        step = rules.max_chunk_tokens
        chunks = [c[i:i + step] for c in chunks for i in range(0, len(c), step)]
    if not chunks:
        # No chunks: an ordinary prompt whose tokens are system + question.
        return replace(p, system=[], chunks=[], question=p.system + p.question)
    return replace(p, chunks=chunks)


def _in_vocab(ids: list[int], vocab_size: int) -> bool:
    """Every id in [0, vocab_size), at C speed: min() and max() over a long list of ints each
    cost more than packing it once."""
    if not ids:
        return True
    try:
        low, high = int64_tensor(ids).aminmax()
    except (struct.error, OverflowError):
        # Not all int64 (an id beyond it, or a caller's ChunkedPrompt holding other numbers,
        # NaN included): compared one by one.
        return all(0 <= t < vocab_size for t in ids)
    return int(low) >= 0 and int(high) < vocab_size


def _check_ids(name: str, ids: object) -> None:
    # Exact type checks in C (set of types): bools and other int subclasses are refused, and
    # a long prompt costs microseconds, not a Python loop over its tokens.
    if not isinstance(ids, (list, tuple)) or not set(map(type, ids)) <= {int}:
        raise ValueError(f"{name} must be a list of integers")
