"""The engine: one `step()` is schedule -> run the model -> sample -> update requests."""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass, replace

import torch

from ..cache.chunk_cache import ChunkCache, ChunkCacheStats
from ..cache.chunk_key import ChunkKeys
from ..cache.kv_manager import KVCacheManager, SeqKV
from ..cache.kv_pool import KVPool, SlotAllocator
from ..cache.slot_table import SlotTable
from ..cache.store.format import ChunkMeta
from ..cache.store.tiered import build_chunk_store
from ..config import (
    DEFAULT_CPU_KV_BYTES,
    DEFAULT_GPU_KV_FRACTION,
    EngineConfig,
    check_recompute,
    parse_torch_dtype,
    resolve_device,
    resolve_dtype,
)
from ..host_ints import int64_tensor, to_device
from ..inputs.chat import split_chat_prompt
from ..inputs.prompt import (
    RAG_OPTIONS,
    ChunkedPrompt,
    PromptRules,
    max_token_chars,
    parse_prompt,
)
from ..inputs.token_cache import TokenCache, TokenCacheStats
from ..model.attention import get_attention_backend
from ..model.llama import CausalLM
from ..model.loader import inspect_checkpoint, load_tokenizer, load_weights
from ..model.probe import probe_scores
from ..model.runner import ModelRunner
from ..outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ..sampling.detokenizer import IncrementalDetokenizer
from ..sampling.params import SamplingParams
from ..sampling.penalties import TokenHistory
from ..sampling.sampler import sample
from ..structured.token_grammar import StructuredOutputs
from .recompute import RecomputeSpec, check_layers_for
from .request import PromptLayout, Request, RequestStatus
from .scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger("ragkv")

# Default pool size cap: the free list is a Python list, and a pool far larger than the
# workload only costs start-up time.
_DEFAULT_MAX_KV_TOKENS = 262_144
# Largest decode batch captured in a CUDA graph (vLLM captures up to 512); larger ones run eagerly.
_MAX_GRAPH_BATCH = 256
_SEED_MASK = (1 << 64) - 1


def _int64(bits: int) -> int:
    """A 64-bit pattern as the signed integer an int64 tensor holds."""
    return bits - (1 << 64) if bits >= 1 << 63 else bits


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """Derived sizes of the KV pool: slot 0 (padding), the general region, the chunk region."""

    general_tokens: int
    chunk_tokens: int
    max_model_len: int

    @property
    def num_slots(self) -> int:
        return 1 + self.general_tokens + self.chunk_tokens


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_capacity_tokens: int
    kv_free_tokens: int
    kv_available_tokens: int  # free plus held only by unlocked prefix-cache entries
    prefix_queried_tokens: int
    prefix_hit_tokens: int

    @property
    def kv_usage(self) -> float:
        """Fraction of the general region held by requests (reclaimable cache excluded)."""
        return 1.0 - self.kv_available_tokens / self.kv_capacity_tokens


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        checkpoint = inspect_checkpoint(config.model)
        self.checkpoint = checkpoint
        self.model_config = mc = checkpoint.model_config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device, parse_torch_dtype(checkpoint.torch_dtype))
        self.tokenizer = load_tokenizer(config.tokenizer or checkpoint.path)
        max_len = _max_model_len(config, mc)
        self.model = CausalLM(mc, max_len, self.dtype, self.device)
        load_weights(self.model, checkpoint)
        self.model.eval()
        self.layout = _cache_layout(config, mc, self.dtype, self.device, max_len)
        self.max_model_len = self.layout.max_model_len
        self.pool = KVPool(mc.num_layers, self.layout.num_slots, mc.num_kv_heads, mc.head_dim,
                           self.dtype, self.device)
        general_end = 1 + self.layout.general_tokens
        self.kv = KVCacheManager(SlotAllocator(1, general_end), config.enable_prefix_caching)
        self.chunk_cache = None
        self.chunk_store = build_chunk_store(config.chunk_store,
                                             pin_memory=self.device.type == "cuda")
        if config.enable_chunk_cache:
            region = SlotAllocator(general_end, self.layout.num_slots)
            self.chunk_cache = ChunkCache(region, self.chunk_store, self.pool,
                                          checkpoint.fingerprint)
            self.chunk_keys_of = ChunkKeys(checkpoint.fingerprint, self.dtype,
                                           config.chunk_hash_algo)
        # Chunks offloaded by sleep(), restored into the pool by wake_up().
        self._asleep: list | None = None
        debug = config.debug_checks or os.environ.get("RAGKV_DEBUG_CHECKS", "") == "1"
        self.scheduler = Scheduler(self.kv, self.chunk_cache, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_prefix_caching,
                                   debug_checks=debug, num_layers=mc.num_layers)
        # No text longer than this can tokenize to max_model_len tokens (x2: normalizers may
        # merge characters), so longer prompts are refused before the tokenizer runs.
        max_chars = 2 * self.max_model_len * max_token_chars(self.tokenizer)
        self.prompt_rules = PromptRules(mc.vocab_size, config.chunk_separator,
                                        config.max_chunk_tokens, config.oversize_chunk,
                                        max_chars)
        # System parts and documents sent as text are tokenized once (token_cache.py).
        # Grammars of structured outputs; the vocabulary's trie is built on first use.
        self.structured = StructuredOutputs(self.tokenizer, mc.vocab_size)
        self.token_cache = (TokenCache(self.tokenizer, config.tokenizer_cache_mb << 20)
                            if config.tokenizer_cache_mb else None)
        self._check_rope(config.position_strategy, config.chunk_attention)
        if config.recompute != "none":
            self._resolve_check_layers(config.recompute)
        # One row per running sequence (max_num_seqs) plus the padding row.
        self.slot_table = SlotTable(config.max_num_seqs, self.max_model_len, self.device)
        self.kv.slot_table = self.slot_table
        backend = get_attention_backend(config.attention_backend, self.device)
        if self.device.type == "cuda" and backend.name == "triton":
            self.model.use_fused_kernels()
        self.runner = ModelRunner(self.model, self.pool, backend, self.slot_table, self.device)
        if self.device.type == "cuda" and backend.name == "triton" and not config.enforce_eager:
            from ..model.cuda_graph import DecodeGraphs, ExtendGraphs

            graphs = DecodeGraphs(self.model, self.pool, backend, self.slot_table,
                                  min(config.max_num_seqs, _MAX_GRAPH_BATCH), self.max_model_len)
            graphs.capture()
            self.runner.graphs = graphs
            extend = ExtendGraphs(self.model, self.pool, backend, self.slot_table,
                                  config.max_num_batched_tokens, self.max_model_len)
            extend.capture()
            self.runner.extend_graphs = extend
        self.runner.warmup(min(config.max_num_batched_tokens, self.max_model_len))
        self.eos_token_ids = frozenset(self._eos_ids())
        self._rng = random.Random(config.seed)
        self._parents: dict[str, list[Request]] = {}
        self._counter = 0

    def _eos_ids(self) -> set[int]:
        ids = set(self.checkpoint.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def process_prompt(self, prompt: object,
                       params: SamplingParams | None = None) -> ChunkedPrompt:
        """Parse, tokenize and validate a prompt with its sampling parameters; raises
        ValueError naming the field and the limit. Reads only the tokenizer and the config,
        so a server runs it off the engine thread and hands the result to `add_request`."""
        params = self._check_params(params)
        parsed = parse_prompt(prompt, self.tokenizer, self.prompt_rules, self.token_cache)
        self._validate(len(parsed.token_ids), params)
        if parsed.chunks:
            self._check_rope(*self._layout_of(parsed))
            self._recompute_of(parsed)
        return parsed

    def _layout_of(self, prompt: ChunkedPrompt) -> tuple[str, str]:
        """(position_strategy, chunk_attention) of a prompt: its own, else the engine's; a
        prompt that asks for selective recompute without a position strategy gets the
        sequential one it needs."""
        strategy = prompt.position_strategy
        if strategy is None:
            own = prompt.recompute not in (None, "none")
            strategy = "sequential" if own else self.config.position_strategy
        return strategy, prompt.chunk_attention or self.config.chunk_attention

    def _recompute_of(self, prompt: ChunkedPrompt) -> RecomputeSpec | None:
        """The prompt's selective recompute (its own settings, else the engine's), or None;
        raises ValueError for one its layout cannot do."""
        c = self.config
        method = c.recompute if prompt.recompute is None else prompt.recompute
        ratio = c.recompute_ratio if prompt.recompute_ratio is None else prompt.recompute_ratio
        sink = (c.recompute_sink_tokens if prompt.recompute_sink_tokens is None
                else prompt.recompute_sink_tokens)
        check_recompute(method, ratio, sink)
        if method == "none":
            return None
        strategy, _ = self._layout_of(prompt)
        if strategy != "sequential":
            raise ValueError(f"recompute={method!r} recomputes chunk tokens in the sequential "
                             f"layout, not with position_strategy={strategy!r}")
        return RecomputeSpec(method, float(ratio), sink, self._resolve_check_layers(method))

    def _resolve_check_layers(self, method: str) -> tuple[int, ...]:
        """The check layers `method` probes on this model; a configured layer the model
        does not have is a ValueError."""
        configured, n = self.config.recompute_check_layers, self.model_config.num_layers
        layers = check_layers_for(method, configured, n)
        bad = [x for x in layers if x >= n]
        if bad and (configured is not None or method != "sink"):  # sink alone probes nothing
            which = "" if configured is not None else f" ({method}'s default)"
            raise ValueError(f"recompute_check_layers={layers}{which} names layer {bad[0]}; "
                             f"the model has layers 0 .. {n - 1}")
        return layers

    def process_chat(self, messages: list[dict], documents: list[str] | None = None,
                     cache_salt: str | None = None,
                     params: SamplingParams | None = None,
                     **rag_options: object) -> ChunkedPrompt:
        """A chat request as a prompt (`split_chat_prompt` with the model's template and the
        engine's separator), validated like `process_prompt`; `rag_options` (prompt.RAG_OPTIONS:
        layout and selective recompute, None for the engine's default) apply to this request."""
        unknown = sorted(set(rag_options) - set(RAG_OPTIONS))
        if unknown:
            raise ValueError(f"unknown RAG option {unknown[0]!r}; known: {', '.join(RAG_OPTIONS)}")
        prompt, _ = split_chat_prompt(self.tokenizer, messages, documents,
                                      self.config.chunk_separator, cache_salt,
                                      self.prompt_rules.max_prompt_chars, self.token_cache)
        return self.process_prompt(replace(prompt, **rag_options), params)

    def _check_rope(self, position_strategy: str, chunk_attention: str) -> None:
        """Re-positioning rotates cached keys, which dynamic-NTK RoPE cannot do exactly."""
        if ((position_strategy, chunk_attention) != ("shared", "isolated")
                and self.model.rotary.dynamic):
            raise ValueError(
                f"position_strategy={position_strategy!r} with chunk_attention="
                f"{chunk_attention!r} rotates cached keys to new positions, which is not exact "
                "for this model's dynamic-NTK RoPE (its frequencies depend on the sequence "
                "length): use position_strategy='shared' with chunk_attention='isolated'")

    def add_request(self, prompt: object, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    score_tokens: int = 0) -> str:
        """Validate and queue a request; raises ValueError (queuing nothing) on bad input.
        `prompt` may be the result of `process_prompt` (validated again, cheaply).

        `score_tokens=m` keeps the next-token log-probabilities after each of the last m
        prompt tokens (`RequestOutput.score_logprobs`); they must lie in the question of a
        RAG prompt, and are computed by the request itself, never read from a cache."""
        if self._asleep is not None:
            raise RuntimeError("the engine is asleep: call wake_up() before adding requests")
        params = self._check_params(params)
        parsed = self.process_prompt(prompt, params)
        token_ids = parsed.token_ids
        scorable = len(parsed.question) if parsed.chunks else len(token_ids)
        if (not isinstance(score_tokens, int) or isinstance(score_tokens, bool)
                or not 0 <= score_tokens <= scorable):
            raise ValueError(f"score_tokens must be an integer in [0, {scorable}] (the "
                             f"question's length), got {score_tokens!r}")
        if request_id is None:
            request_id = str(self._counter)
            self._counter += 1
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        max_tokens = self.max_model_len - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens={params.min_tokens} exceeds the {max_tokens} tokens "
                             f"this prompt leaves (max_tokens and max_model_len="
                             f"{self.max_model_len})")
        strategy, attention = self._layout_of(parsed)
        layout = PromptLayout.build(len(parsed.system), [len(c) for c in parsed.chunks],
                                    strategy, attention)
        chunk_keys = self._chunk_keys(parsed, attention)
        repositioned = sum(b - a for a, b, _ in layout.rotations)
        recompute = self._recompute_of(parsed) if parsed.chunks else None
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        children = []
        for i in range(params.n):
            # The sampler's counter-based streams take a 64-bit pattern as an int64.
            seed = (_int64((params.seed + i) & _SEED_MASK) if params.seed is not None
                    else self._rng.getrandbits(63))
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(Request(
                request_id=child_id, parent_id=request_id, index=i, prompt=parsed.text,
                prompt_token_ids=token_ids, params=params, seed=seed,
                max_tokens=max_tokens, stop_ids=frozenset(stop_ids),
                metrics=RequestMetrics(arrival_time=arrival,
                                       num_repositioned_tokens=repositioned),
                layout=layout,
                chunk_keys=chunk_keys,
                kv=SeqKV(namespace=parsed.cache_salt or ""),
                detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                                   start=len(token_ids)),
                num_scored_tokens=score_tokens, recompute=recompute,
                matcher=(None if params.structured_outputs is None
                         else self.structured.matcher(params.structured_outputs)),
            ))
        self._parents[request_id] = children
        for child in children:
            self.scheduler.add(child)
        return request_id

    def _chunk_keys(self, parsed: ChunkedPrompt, attention: str) -> tuple:
        """The chunk-cache keys of a prompt's chunks (none without a chunk cache)."""
        if self.chunk_cache is None or not parsed.chunks:
            return ()
        return self.chunk_keys_of.of_prompt(parsed.system, parsed.chunks, attention,
                                            parsed.cache_salt)

    def chunk_keys(self, prompt: object) -> list[str]:
        """Hex chunk-cache keys (the chunk store's keys) of a prompt's chunks, in order."""
        return [meta.key for meta in self.chunk_metas(prompt)]

    def chunk_metas(self, prompt: object) -> list[ChunkMeta]:
        """What the chunk store's entries of a prompt's chunks must describe, in order."""
        parsed = self.process_prompt(prompt)
        _, attention = self._layout_of(parsed)
        return [self.chunk_cache.meta(k) for k in self._chunk_keys(parsed, attention)]

    def sleep(self) -> None:
        """Free the KV pool's memory (vLLM's `sleep`, level 1 for the KV cache; the weights
        stay): cached chunks are offloaded to host memory first and come back with
        `wake_up()`, the prefix cache is dropped. Refused while requests are unfinished."""
        if self._asleep is not None:
            return
        if self.scheduler.has_unfinished():
            raise RuntimeError("sleep() with unfinished requests: let them finish or abort "
                               "them first")
        self._asleep = self.chunk_cache.offload() if self.chunk_cache is not None else []
        self.reset_prefix_cache()
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the offload copies have landed before the pool goes
        self.pool.release_memory()
        logger.info("asleep: KV pool freed, %d cached chunks offloaded to host memory",
                    len(self._asleep))

    def wake_up(self) -> None:
        """Allocate the KV pool again and put the chunks `sleep()` offloaded back into it."""
        if self._asleep is None:
            return
        self.pool.restore_memory()
        for graphs in (self.runner.graphs, self.runner.extend_graphs):
            if graphs is not None:  # captured graphs address the old pool memory
                graphs.capture()
        offloaded, self._asleep = self._asleep, None
        for entry, record in offloaded:
            self.chunk_cache.insert(entry.id, record.kv)

    def is_sleeping(self) -> bool:
        return self._asleep is not None

    def flush_chunk_store(self) -> None:
        """Wait until every chunk written through to the store's shared tiers has landed."""
        if self.chunk_store is not None:
            self.chunk_store.flush()

    def close(self) -> None:
        """Finish the chunk store's pending writes and close its connections."""
        if self.chunk_store is not None:
            self.chunk_store.close()

    def _select(self, req: Request) -> None:
        """Choose the chunk tokens `req` recomputes by its method's probe (its chunks' KV is
        ready; choices without a probe are the scheduler's), then `RecomputeSpec.select`."""
        spec: RecomputeSpec = req.recompute
        layout = req.layout
        s, qs = layout.system_len, layout.question_start
        if spec.scorer == "blend":
            probed = list(range(s, qs))
            key_positions, positions = layout.chunk_positions(probed)
        else:
            # Scored prompt tokens are an answer being scored (ragkv eval): choosing by them
            # would let the answer pick its own evidence.
            end = req.num_prompt_tokens - max(0, req.num_scored_tokens - 1)
            probed = list(range(qs, max(end, qs + 1)))
            positions = key_positions = layout.positions(qs, probed[-1] + 1)
        scores = probe_scores(self.model, self.pool, spec.scorer,
                              [req.token_ids[x] for x in probed], positions, key_positions,
                              req.kv.slots[:qs], layout.rotations, (s, qs), spec.check_layers)
        self.scheduler.choose(req, spec.select(layout, scores))

    @staticmethod
    def _check_params(params: SamplingParams | None) -> SamplingParams:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        return params

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
        if params.logprobs is not None:
            limit = min(self.config.max_logprobs, self.model_config.vocab_size)
            if params.logprobs > limit:
                raise ValueError(f"logprobs={params.logprobs} exceeds the limit of {limit} "
                                 f"(max_logprobs={self.config.max_logprobs}, vocabulary size "
                                 f"{self.model_config.vocab_size})")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self, include_unfinished: bool = False) -> list[RequestOutput]:
        """Run one scheduling step. Returns an output for every request that finished, and
        with `include_unfinished` also for every request that got a new token (streaming);
        without it no per-step detokenization is done unless stop strings need it.

        A failure while serving one request (planning it, or turning its token into text)
        finishes that request alone with finish_reason "error" and `RequestOutput.error`; if
        the model itself cannot run the step, the requests in the step fail and every other
        request and cache stays as it was."""
        sched = self.scheduler.schedule()
        # Requests that failed while being planned are already out of the step. Their
        # siblings fail after it: one of them may compute a chunk another request of this
        # step reads.
        failed = {r.parent_id: None for r in sched.failed}
        if sched.empty:
            return self._fail_parents(sched.failed, failed)
        try:
            logits = self.runner.execute(sched.works) if sched.works else None
        except Exception as e:  # the step cannot go on: fail its requests, keep the rest
            logger.exception("model step failed")
            message = f"model step failed: {type(e).__name__}: {e}"
            in_step = self.scheduler.fail_step(sched, message)
            failed.update((r.parent_id, None) for r in in_step)
            return self._fail_parents(sched.failed + in_step, failed)
        self.scheduler.update(sched)
        for req in sched.selecting:
            if req.status.finished:
                continue
            try:
                self._select(req)
            except Exception as e:  # noqa: BLE001 (this request fails, not the step)
                logger.exception("choosing recomputed tokens for %s failed", req.request_id)
                self._fail(req, f"recompute selection failed: {type(e).__name__}: {e}")
                sched.failed.append(req)
                failed[req.parent_id] = None
        if logits is None:
            return self._fail_parents(sched.failed, failed)
        outputs = self._postprocess(sched, logits, include_unfinished)
        if sched.failed:
            # A failed parent's final output replaces a partial one from this step.
            by_id = {o.request_id: o for o in outputs}
            by_id.update((o.request_id, o) for o in self._fail_parents(sched.failed, failed))
            outputs = list(by_id.values())
        return outputs

    def _fail_parents(self, failed: list[Request], parent_ids: dict[str, None]
                      ) -> list[RequestOutput]:
        """Fail the siblings of `failed` requests too; the outputs of their parents."""
        for req in failed:
            self._fail(req, req.error)
        return [self._output(pid) for pid in parent_ids if pid in self._parents]

    def _postprocess(self, sched: SchedulerOutput, logits: torch.Tensor,
                     include_unfinished: bool) -> list[RequestOutput]:
        logits = self._keep_scores(sched, logits)
        sampled = [w.request for w in sched.works if w.sample]
        touched: dict[str, None] = {}
        if sampled:
            try:
                history = None
                if any(r.params.has_penalties for r in sampled):
                    history = [self._history(r) if r.params.has_penalties else None
                               for r in sampled]
                result = sample(logits, [r.params for r in sampled],
                                [r.seed for r in sampled],
                                [r.num_output_tokens for r in sampled], history)
            except Exception as e:  # noqa: BLE001 (the sampled requests fail, not the engine)
                logger.exception("sampling failed")
                for req in sampled:
                    self._fail(req, f"sampling failed: {type(e).__name__}: {e}")
                    touched[req.parent_id] = None
                sampled = []
            now = time.monotonic()
            for j, req in enumerate(sampled):
                if req.status.finished:
                    continue  # a sibling failed
                try:
                    self._append_token(req, result.token_ids[j], result.token_logprobs[j],
                                       result.top_logprobs[j], now)
                except Exception as e:  # noqa: BLE001 (this request fails, not the step)
                    logger.exception("request %s failed", req.request_id)
                    self._fail(req, f"{type(e).__name__}: {e}")
                touched[req.parent_id] = None
        outputs = []
        for pid in touched:
            children = self._parents.get(pid)
            if children is not None and (include_unfinished
                                         or all(c.status.finished for c in children)):
                outputs.append(self._output(pid))
        return outputs

    def _history(self, req: Request) -> TokenHistory:
        """What a request's penalties read; its prompt's distinct ids go to the device once
        for all of a parent's samples (non-blocking: the step's forward is still running)."""
        prompt = None
        if req.params.repetition_penalty != 1.0:
            if req.prompt_ids_on_device is None:
                siblings = self._parents.get(req.parent_id, ())
                shared = next((s.prompt_ids_on_device for s in siblings
                               if s.prompt_ids_on_device is not None), None)
                if shared is None:
                    shared = to_device(int64_tensor(list(set(req.prompt_token_ids))),
                                       self.device)
                req.prompt_ids_on_device = shared
            prompt = req.prompt_ids_on_device
        early = req.num_output_tokens < req.params.min_tokens
        allowed, also, ban = None, (), early
        if req.matcher is not None:
            # Stop tokens only where the output may end (and min_tokens allows): added where
            # it may, banned elsewhere (a stop token with text may fit the grammar's mask).
            allowed = req.matcher.mask()
            ending = req.matcher.accepting and not early
            also = tuple(req.stop_ids) if ending else ()
            ban = not ending
        return TokenHistory(req.output_counts or {}, prompt,
                            tuple(req.stop_ids) if ban else (), allowed, also)

    @staticmethod
    def _keep_scores(sched: SchedulerOutput, logits: torch.Tensor) -> torch.Tensor:
        """Store the log-probabilities of scored prompt tokens; the rows to sample from."""
        if not any(w.request.num_scored_tokens for w in sched.works):
            return logits  # one row per sampling work
        sample_rows: list[int] = []
        row = 0
        for w in sched.works:
            n = w.end - w.logits_from
            req = w.request
            first = req.num_prompt_tokens - req.num_scored_tokens
            lo, hi = max(w.logits_from, first), min(w.end, req.num_prompt_tokens)
            if req.num_scored_tokens and lo < hi:
                part = logits[row + lo - w.logits_from:row + hi - w.logits_from]
                rows = torch.log_softmax(part.float(), dim=-1).cpu()
                for t in range(lo, hi):  # by token: a recomputed token overwrites its row
                    req.scores[t] = rows[t - lo]
            if w.sample:
                sample_rows.append(row + n - 1)
            row += n
        return logits[sample_rows]

    def _append_token(self, req: Request, token: int, logprob: float | None,
                      top: tuple[list[int], list[float], int] | None, now: float) -> None:
        req.token_ids.append(token)
        if req.output_counts is not None:
            req.output_counts[token] += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if req.logprobs is not None:
            entry = {tid: Logprob(lp, rank=r + 1) for r, (tid, lp) in
                     enumerate(zip(top[0], top[1], strict=False))}
            entry.setdefault(token, Logprob(logprob, rank=top[2]))
            for tid, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([tid])
            req.logprobs.append(entry)
            req.cumulative_logprob += logprob
        status = None
        # vLLM's min_tokens: a stop token ends a sample from the min_tokens-th token on (none
        # is sampled before), a stop string only in text after the first min_tokens tokens.
        # Before that the text stays current, so a later search sees only what later tokens
        # add.
        count = req.num_output_tokens
        if token in req.stop_ids and count >= req.params.min_tokens:
            status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = token if token in req.params.stop_token_ids else None
        elif req.params.stop and count <= req.params.min_tokens:
            req.detokenizer.update(req.token_ids)
        elif req.params.stop and self._hit_stop_string(req):
            status = RequestStatus.FINISHED_STOPPED
        if req.matcher is not None and token not in req.stop_ids:
            req.matcher.advance(token)
            if status is None and req.matcher.terminal:
                status = RequestStatus.FINISHED_STOPPED  # complete: nothing may follow
        if status is None and (req.num_output_tokens >= req.max_tokens
                               or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self._finish(req, status)

    def _hit_stop_string(self, req: Request) -> bool:
        """Look for a stop string in the text the last token added (and the few characters
        before it that a stop string could start in); cut the text there if found."""
        detok = req.detokenizer
        added = detok.update(req.token_ids)
        if not added:
            return False
        text = detok.text
        longest = max(len(s) for s in req.params.stop)
        start = max(0, len(text) - added - longest + 1)
        earliest = None
        for stop in req.params.stop:
            idx = text.find(stop, start)
            if idx >= 0 and (earliest is None or idx < earliest[0]):
                earliest = (idx, stop)
        if earliest is None:
            return False
        detok.truncate(earliest[0])
        req.text = detok.text
        req.stop_reason = earliest[1]
        return True

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if not isinstance(req.stop_reason, str):  # a stop string already cut the text
            ids, end = req.token_ids, req.num_tokens
            if (status is RequestStatus.FINISHED_STOPPED and req.num_output_tokens
                    and ids[-1] in req.stop_ids):
                end -= 1  # the stop token's text is not part of the output (vLLM)
            req.text = req.detokenizer.finish(ids, end)
        req.metrics.finished_time = time.monotonic()
        self.scheduler.finish(req, status)

    def _fail(self, req: Request, message: str | None) -> None:
        """Finish `req` and its siblings (the other samples of its prompt) with an error."""
        now = time.monotonic()
        for child in self._parents.get(req.parent_id, [req]):
            if child is req or not child.status.finished:
                child.error = message or "request failed"
                if child.metrics.finished_time is None:
                    child.metrics.finished_time = now
                if not child.status.finished:
                    self.scheduler.finish(child, RequestStatus.FINISHED_ERROR)

    def has_request(self, request_id: str) -> bool:
        """Whether a request (by its parent id) is queued or running."""
        return request_id in self._parents

    def abort_request(self, request_id: str) -> None:
        for req in self._parents.pop(request_id, []):
            if not req.status.finished:
                req.metrics.finished_time = time.monotonic()
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def abort_all(self) -> None:
        """Abort every queued and running request."""
        for request_id in list(self._parents):
            self.abort_request(request_id)
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)  # not reachable by id

    def _output(self, parent_id: str) -> RequestOutput:
        children = self._parents[parent_id]
        finished = all(c.status.finished for c in children)
        if finished:
            del self._parents[parent_id]
        first = children[0]
        completions = [
            CompletionOutput(
                index=c.index,
                text=c.text if c.status.finished else self._partial_text(c),
                token_ids=list(c.output_token_ids),
                cumulative_logprob=c.cumulative_logprob,
                # A copy: the engine keeps appending while a server thread reads it.
                logprobs=None if c.logprobs is None else list(c.logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in children
        ]
        error = next((c.error for c in children if c.error is not None), None)
        metrics = first.metrics
        if finished and len(children) > 1:  # the request ends with its last sample
            metrics = replace(metrics, finished_time=max(c.metrics.finished_time or 0.0
                                                         for c in children),
                              last_token_time=max(c.metrics.last_token_time or 0.0
                                                  for c in children),
                              num_preemptions=sum(c.metrics.num_preemptions for c in children))
        return RequestOutput(
            request_id=parent_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=completions, finished=finished, num_cached_tokens=first.num_cached_tokens,
            metrics=metrics, error=error, score_logprobs=self._scores(first),
        )

    @staticmethod
    def _scores(req: Request) -> torch.Tensor | None:
        first = req.num_prompt_tokens - req.num_scored_tokens
        if not req.num_scored_tokens or len(req.scores) < req.num_scored_tokens:
            return None
        return torch.stack([req.scores[t] for t in range(first, req.num_prompt_tokens)])

    @staticmethod
    def _partial_text(req: Request) -> str:
        """The stable text of an unfinished request (an incomplete last character is held
        back), brought up to date incrementally."""
        req.detokenizer.update(req.token_ids)
        return req.detokenizer.text

    def stats(self) -> EngineStats:
        radix = self.kv.radix
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_capacity_tokens=self.kv.capacity,
            kv_free_tokens=self.kv.allocator.num_free,
            kv_available_tokens=self.kv.num_available(),
            prefix_queried_tokens=radix.queried_tokens if radix else 0,
            prefix_hit_tokens=radix.hit_tokens if radix else 0,
        )

    def reset_prefix_cache(self) -> None:
        if self.kv.radix is not None:
            self.kv.radix.reset()

    def chunk_cache_stats(self) -> ChunkCacheStats:
        if self.chunk_cache is None:
            return ChunkCache(None).stats()
        return self.chunk_cache.stats()

    def token_cache_stats(self) -> TokenCacheStats:
        if self.token_cache is None:
            return TokenCache(None, 0).stats()
        return self.token_cache.stats()

    def clear_chunk_cache(self) -> int:
        if self._asleep:  # what sleep() offloaded is cached too: it does not come back
            dropped, self._asleep = len(self._asleep), []
            return dropped + (self.chunk_cache.clear() if self.chunk_cache else 0)
        return self.chunk_cache.clear() if self.chunk_cache is not None else 0

    def check_integrity(self) -> None:
        """Every slot is free, cached or held by a live request, exactly once; chunk pins
        are exactly the live requests' references."""
        live = self.scheduler.live()
        self.kv.check_integrity([r.kv for r in live])
        self.slot_table.check_integrity(r.kv for r in live)
        if self.chunk_cache is not None:
            pins: dict[int, int] = {}
            for req in live:
                for binding in req.bindings:
                    if binding is not None and binding.entry is not None:
                        pins[id(binding.entry)] = pins.get(id(binding.entry), 0) + 1
            self.chunk_cache.check_integrity(pins)
        if self.token_cache is not None:
            self.token_cache.check_integrity()


def _max_model_len(config: EngineConfig, mc) -> int:
    limit = mc.max_context_len
    if mc.sliding_window is not None and mc.sliding_window < limit:
        # Full attention equals sliding-window attention only within the window.
        logger.warning("model uses a sliding window of %d tokens: max_model_len is capped there",
                       mc.sliding_window)
        limit = mc.sliding_window
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} tokens"
        )
    return config.max_model_len


def _cache_layout(config: EngineConfig, mc, dtype: torch.dtype, device: torch.device,
                  max_len: int) -> CacheLayout:
    """Pool size from kv_cache_tokens, a memory budget or the device; the chunk region takes
    chunk_cache_tokens or chunk_cache_fraction of it, the general region the rest."""
    per_token = KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
    if config.kv_cache_tokens is not None:
        tokens = config.kv_cache_tokens
    elif config.kv_cache_memory_bytes is not None:
        tokens = config.kv_cache_memory_bytes // per_token
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        tokens = int(free * DEFAULT_GPU_KV_FRACTION) // per_token
    else:
        tokens = min(DEFAULT_CPU_KV_BYTES // per_token, _DEFAULT_MAX_KV_TOKENS)
    chunk = 0
    if config.enable_chunk_cache:
        chunk = (config.chunk_cache_tokens if config.chunk_cache_tokens is not None
                 else int(tokens * config.chunk_cache_fraction))
        if chunk >= tokens:
            raise ValueError(f"chunk_cache_tokens={chunk} leaves no room in a KV pool of "
                             f"{tokens} tokens")
    general = tokens - chunk
    if general < 1:
        raise ValueError("the KV cache budget holds no token at all")
    if general < max_len:
        if config.max_model_len is not None:
            raise ValueError(
                f"the general KV region holds {general} tokens ({tokens} in the pool, {chunk} "
                f"for the chunk cache), fewer than max_model_len={max_len}: raise "
                "kv_cache_tokens or lower max_model_len or chunk_cache_tokens"
            )
        logger.warning("max_model_len lowered to %d: the general KV region holds no more",
                       general)
        max_len = general
    return CacheLayout(general_tokens=general, chunk_tokens=chunk, max_model_len=max_len)
