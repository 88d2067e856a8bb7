"""Input processing (vLLM v1's): a prompt and its sampling parameters become the `Request`s the
scheduler runs, or a ValueError naming the field and the limit, queuing nothing.

One pipeline, each stage once, in order:
1. parse: text, `RAGPrompt`, token ids or a chat -> a `ChunkedPrompt` of token lists
   (inputs/prompt.py, inputs/chat.py; recurring parts through inputs/token_cache.py);
2. validate: lengths against max_model_len, the vocabulary, n, logprobs, stop ids;
3. layout: the prompt's position strategy and chunk attention (its own, else the engine's),
   checked against the model's RoPE, and its `PromptLayout` (inputs/layout.py); the chunks'
   cache keys (cache/chunk_key.py) and its selective recompute (recompute/policy.py);
4. request: one `Request` per sample (n), each with its own seed.
`process_prompt` runs stages 1-3 and reads only the tokenizer and the config, so a server runs
it off the engine thread and hands the result to `make_requests`, which runs them again
cheaply on the tokenized prompt.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..cache.chunk_key import ChunkKey, ChunkKeys
from ..cache.kv_manager import SeqKV
from ..config import EngineConfig, check_separator
from ..inputs.chat import split_chat_prompt, split_rag_chat
from ..inputs.layout import PromptLayout
from ..inputs.primer import primer_tokens
from ..inputs.prompt import (
    RAG_OPTIONS,
    ChunkedPrompt,
    PromptRules,
    RAGPrompt,
    max_token_chars,
    parse_prompt,
)
from ..inputs.token_cache import TokenCache
from ..model.model_config import ModelConfig
from ..outputs import RequestMetrics
from ..recompute.policy import recompute_spec
from ..recompute.selection import RecomputeSpec
from ..sampling.detokenizer import IncrementalDetokenizer
from ..sampling.params import SamplingParams
from ..structured.token_grammar import StructuredOutputs
from .request import Request

logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A validated prompt and what stage 3 made of it."""

    prompt: ChunkedPrompt
    layout: PromptLayout
    chunk_keys: tuple[ChunkKey, ...]
    recompute: RecomputeSpec | None
    primer: tuple[int, ...] = ()  # P's tokens when the layout is primed
    primer_key: ChunkKey | None = None  # and its chunk-cache key (with a chunk cache)


class InputProcessor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer,
                 max_model_len: int, eos_token_ids: frozenset[int], dynamic_rope: bool,
                 chunk_keys: ChunkKeys | None, token_cache: TokenCache | None,
                 structured: StructuredOutputs, layers_for_all: bool = True,
                 primer_given: bool = True) -> None:
        """`chunk_keys`: the engine's chunk keys (None without a chunk cache);
        `layers_for_all`: the configured check layers apply to every method (the user's),
        else only to methods with the engine's scorers (a calibrated profile's);
        `primer_given`: the user set `chunk_primer` (else it is a default's, which is left
        out where it cannot be computed: `config` then says "none")."""
        self.layers_for_all = layers_for_all
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.dynamic_rope = dynamic_rope
        self.chunk_keys = chunk_keys
        self.token_cache = token_cache
        self.structured = structured
        # No text longer than this can tokenize to max_model_len tokens (x2: normalizers may
        # merge characters), so longer prompts are refused before the tokenizer runs.
        max_chars = 2 * max_model_len * max_token_chars(tokenizer)
        self.rules = PromptRules(model_config.vocab_size, config.chunk_separator,
                                 config.max_chunk_tokens, config.oversize_chunk, max_chars)
        self.primer = primer_tokens(tokenizer, config.chunk_primer)
        if len(self.primer) > config.max_num_batched_tokens:  # P is computed in one step
            if primer_given:
                raise ValueError(f"chunk_primer has {len(self.primer)} tokens, more than "
                                 f"max_num_batched_tokens={config.max_num_batched_tokens} (it "
                                 "is computed in one step): raise max_num_batched_tokens, give "
                                 "a shorter chunk_primer, or set chunk_primer='none'")
            # A profile's or the model-agnostic default's primer: the user asked for none.
            logger.warning("the chunk primer (%d tokens) does not fit max_num_batched_tokens="
                           "%d (it is computed in one step): documents are computed without it",
                           len(self.primer), config.max_num_batched_tokens)
            self.config = config = replace(config, chunk_primer="none")
            self.primer = ()
        self._rng = random.Random(config.seed)
        self._counter = 0
        # The engine's own defaults must be possible on this model.
        self._check_rope(config.position_strategy, config.chunk_attention)
        recompute_spec(config, None, None, None, "sequential", model_config.num_layers)

    def process_prompt(self, prompt: object,
                       params: SamplingParams | None = None) -> ChunkedPrompt:
        """Stages 1-3 of `prompt` with its sampling parameters; the tokenized prompt."""
        return self.process(prompt, _check_params(params)).prompt

    def process_chat(self, messages: list[dict], documents: list[str] | None = None,
                     cache_salt: str | None = None, params: SamplingParams | None = None,
                     chunk_separator: str | None = None, add_generation_prompt: bool = True,
                     chat_template: str | None = None, tools: list[dict] | None = None,
                     **rag_options: object) -> ChunkedPrompt:
        """A chat request as a prompt (`split_chat_prompt` with `chat_template`, else the
        model's, `tools`, and `chunk_separator`, else the engine's), validated like
        `process_prompt`;
        `rag_options` (RAG_OPTIONS: layout and selective recompute, None for the engine's
        default) apply to it."""
        unknown = sorted(set(rag_options) - set(RAG_OPTIONS))
        if unknown:
            raise ValueError(f"unknown RAG option {unknown[0]!r}; known: {', '.join(RAG_OPTIONS)}")
        prompt = self.split_chat(messages, documents, cache_salt, chunk_separator,
                                 add_generation_prompt, chat_template, tools=tools)
        return self.process_prompt(replace(prompt, **rag_options), params)

    def split_chat(self, messages: list[dict], documents: list[str] | None = None,
                   cache_salt: str | None = None, chunk_separator: str | None = None,
                   add_generation_prompt: bool = True, chat_template: str | None = None,
                   use_token_cache: bool = True, tools: list[dict] | None = None
                   ) -> ChunkedPrompt:
        """A chat rendered and split (`split_chat_prompt`) with `chunk_separator`, else the
        engine's, unvalidated; `use_token_cache` False leaves the tokenizer cache (and its
        counts) to the requests that run (/tokenize)."""
        check_separator(chunk_separator)
        if documents is not None and chunk_separator is not None:
            raise ValueError("give documents or chunk_separator, not both")
        prompt, _ = split_chat_prompt(self.tokenizer, messages, documents,
                                      chunk_separator or self.config.chunk_separator, cache_salt,
                                      self.rules.max_prompt_chars,
                                      self.token_cache if use_token_cache else None,
                                      add_generation_prompt, chat_template, tools)
        return prompt

    def chunk_keys_of(self, prompt: object) -> tuple[ChunkKey, ...]:
        """The chunk-cache keys of a prompt's chunks, in order (none without a cache)."""
        return self.process(prompt).chunk_keys

    def make_requests(self, prompt: object, params: SamplingParams | None,
                      request_id: str | None, arrival_time: float | None, score_tokens: int,
                      in_use: Callable[[str], bool]) -> list[Request]:
        """The requests of one prompt: one per sample (`params.n`), all with the parent id
        `request_id` (a fresh one when None; `in_use(id)` says whether one is taken).
        `score_tokens=m` keeps the next-token log-probabilities after each of the last m
        prompt tokens, which must lie in the question of a RAG prompt."""
        params = _check_params(params)
        done = self.process(prompt, params)
        parsed, layout = done.prompt, done.layout
        token_ids = parsed.token_ids
        scorable = len(parsed.question) if parsed.chunks else len(token_ids)
        if (not isinstance(score_tokens, int) or isinstance(score_tokens, bool)
                or not 0 <= score_tokens <= scorable):
            raise ValueError(f"score_tokens must be an integer in [0, {scorable}] (the "
                             f"question's length), got {score_tokens!r}")
        if request_id is None:
            request_id = str(self._counter)
            self._counter += 1
        if in_use(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_tokens = self.max_model_len - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens={params.min_tokens} exceeds the {max_tokens} tokens "
                             f"this prompt leaves (max_tokens and max_model_len="
                             f"{self.max_model_len})")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        repositioned = sum(b - a for a, b, _ in layout.turns)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        requests = []
        for i in range(params.n):
            # The sampler's counter-based streams take a 64-bit pattern as an int64.
            seed = (_int64((params.seed + i) & _SEED_MASK) if params.seed is not None
                    else self._rng.getrandbits(63))
            requests.append(Request(
                request_id=request_id if params.n == 1 else f"{i}_{request_id}",
                parent_id=request_id, index=i, prompt=parsed.text, prompt_token_ids=token_ids,
                params=params, seed=seed, max_tokens=max_tokens, stop_ids=frozenset(stop_ids),
                metrics=RequestMetrics(arrival_time=arrival,
                                       num_repositioned_tokens=repositioned),
                layout=layout, chunk_keys=done.chunk_keys, primer=done.primer,
                primer_key=done.primer_key,
                kv=SeqKV(namespace=parsed.cache_salt or ""),
                detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                                   start=len(token_ids)),
                num_scored_tokens=score_tokens, recompute=done.recompute,
                # Every scorable token's next-token distribution: the prompt logprobs of the
                # tokens after it, kept by the first sample (the output reads it there).
                num_prompt_logprob_tokens=(scorable if params.prompt_logprobs is not None
                                           and i == 0 else 0),
                matcher=(None if params.structured_outputs is None
                         else self.structured.matcher(params.structured_outputs)),
            ))
        return requests

    def process(self, prompt: object, params: SamplingParams | None = None) -> ProcessedPrompt:
        """Stages 1-3 of `prompt`: the tokenized prompt, its layout, chunk keys and recompute."""
        params = _check_params(params)
        if isinstance(prompt, RAGPrompt) and prompt.chat:
            prompt = split_rag_chat(prompt, self.tokenizer, self.rules.max_prompt_chars,
                                    self.token_cache)
        parsed = parse_prompt(prompt, self.tokenizer, self.rules, self.token_cache)
        self._validate(len(parsed.token_ids), params)
        strategy, attention = self._layout_of(parsed)
        recompute = None
        if parsed.chunks:
            self._check_rope(strategy, attention)
            recompute = recompute_spec(self.config, parsed.recompute, parsed.recompute_ratio,
                                       parsed.recompute_sink_tokens, strategy,
                                       self.model_config.num_layers,
                                       parsed.recompute_score_mass, parsed.recompute_min_ratio,
                                       self.layers_for_all, parsed.recompute_damping)
        primed = self.primer if parsed.chunk_primer is not False else ()
        if parsed.chunk_primer and not primed:
            raise ValueError("chunk_primer=true needs an engine with a chunk primer "
                             "(chunk_primer / --chunk-primer)")
        if parsed.chunk_primer and (strategy, attention) != ("sequential", "isolated"):
            raise ValueError(f"chunk_primer=true applies to sequential positions with isolated "
                             f"chunks, not position_strategy={strategy!r} with "
                             f"chunk_attention={attention!r}")
        sizes = [len(c) for c in parsed.chunks]
        layout = PromptLayout.build(len(parsed.system), sizes, strategy, attention, len(primed))
        if layout.primer_len:
            # A later chunk's KV sits after S + P: its positions must exist for the model.
            top = max(layout.chunk_base(i) + len(c) for i, c in enumerate(parsed.chunks))
            if top > self.max_model_len:
                if parsed.chunk_primer:
                    raise ValueError(
                        f"with the chunk primer ({layout.primer_len} tokens) a document's KV "
                        f"is computed at positions up to {top - 1}, past max_model_len="
                        f"{self.max_model_len}: send this prompt with chunk_primer=false")
                # The engine's primer, not the request's: this prompt goes unprimed.
                layout = PromptLayout.build(len(parsed.system), sizes, strategy, attention, 0)
        keys, primer_key = (), None
        primer = primed if layout.primer_len else ()
        if self.chunk_keys is not None and parsed.chunks:
            keys = self.chunk_keys.of_prompt(parsed.system, parsed.chunks, attention,
                                             parsed.cache_salt, primer)
            if primer:
                primer_key = self.chunk_keys.of_prompt(parsed.system, [primer], attention,
                                                       parsed.cache_salt)[0]
        return ProcessedPrompt(parsed, layout, keys, recompute, primer, primer_key)

    def _layout_of(self, prompt: ChunkedPrompt) -> tuple[str, str]:
        """(position_strategy, chunk_attention) of a prompt: its own, else the engine's; a
        prompt that asks for selective recompute without a position strategy gets the
        sequential one it needs."""
        strategy = prompt.position_strategy
        if strategy is None:
            own = prompt.recompute not in (None, "none")
            strategy = "sequential" if own else self.config.position_strategy
        return strategy, prompt.chunk_attention or self.config.chunk_attention

    def _check_rope(self, position_strategy: str, chunk_attention: str) -> None:
        """Re-positioning turns cached keys, which dynamic-NTK RoPE cannot do exactly."""
        if (position_strategy, chunk_attention) != ("shared", "isolated") and self.dynamic_rope:
            raise ValueError(
                f"position_strategy={position_strategy!r} with chunk_attention="
                f"{chunk_attention!r} rotates cached keys to new positions, which is not exact "
                "for this model's dynamic-NTK RoPE (its frequencies depend on the sequence "
                "length): use position_strategy='shared' with chunk_attention='isolated'")

    def _validate(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        # max_model_len bounds a sequence's tokens, prompt plus output (for a RAG prompt the
        # flat count S + all chunks + Q, which is also the length of the question's KV
        # list), so a prompt must leave room for at least one generated token.
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens, too long for max_model_len="
                f"{self.max_model_len} (prompt plus output): at most "
                f"{self.max_model_len - 1} prompt tokens fit"
            )
        if params.n > self.config.max_n:
            raise ValueError(f"n={params.n} exceeds max_n={self.config.max_n}")
        vocab = self.model_config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("stop_token_ids", params.stop_token_ids)):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise ValueError(f"{name} names token {outside[0]}, outside the vocabulary "
                                 f"(ids 0 .. {vocab - 1})")
        limit = min(self.config.max_logprobs, vocab)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(f"{name}={value} exceeds the limit of {limit} "
                                 f"(max_logprobs={self.config.max_logprobs}, vocabulary size "
                                 f"{vocab})")


def _check_params(params: SamplingParams | None) -> SamplingParams:
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError("sampling_params must be a SamplingParams")
    return params


def _int64(bits: int) -> int:
    """A 64-bit pattern as the signed integer an int64 tensor holds."""
    return bits - (1 << 64) if bits >= 1 << 63 else bits
