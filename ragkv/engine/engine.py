"""The engine: builds the parts and runs a step one way, schedule -> execute -> update ->
outputs.

- inputs (input_processor.py): prompt and sampling parameters -> validated `Request`s;
- schedule (scheduler.py): which tokens of which requests run this step, as works of the
  attention contract, plus the recompute probes (recompute/planner.py);
- execute (model/runner.py): the model over the works, then the probes;
- update (scheduler.py): computed counts, finished chunks, the recompute choice;
- outputs (output_processor.py): sampling, stop rules, detokenization, `RequestOutput`s.
A stage's results reach the next one as arguments: no stage hands work or decisions back to an
earlier one. (Resources do go back the other way through small callbacks: a finished request's
slots to the caches, its slot-table row to the runner.)
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ..cache.chunk_cache import ChunkCache, ChunkCacheStats
from ..cache.chunk_key import ChunkKeys
from ..cache.kv_manager import KVCacheManager
from ..cache.kv_pool import KVPool, SlotAllocator, model_len_limit, size_pool
from ..cache.store.format import ChunkMeta
from ..cache.store.tiered import build_chunk_store
from ..config import EngineConfig, resolve_device, resolve_dtype
from ..inputs.prompt import ChunkedPrompt
from ..inputs.token_cache import TokenCache, TokenCacheStats
from ..model.executor import EngineDeadError, RankSpec, make_runner
from ..model.llama import CausalLM
from ..model.loader import inspect_checkpoint, load_tokenizer, load_weights, use_packed
from ..model.parallel import TPGroup
from ..outputs import RequestOutput
from ..recompute.policy import check_layers_for
from ..recompute.profile import describe_default, resolve_recompute
from ..sampling.params import SamplingParams
from ..structured.token_grammar import StructuredOutputs
from .input_processor import InputProcessor
from .output_processor import OutputProcessor
from .scheduler import InvariantViolation, Scheduler
from .speculative import SpecDecodeStats, speculator_for

logger = logging.getLogger("ragkv")

# Longest an idle step waits for a chunk-store read (a request added meanwhile waits as long).
_LOAD_WAIT_SECONDS = 0.05


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
        self.checkpoint = checkpoint = inspect_checkpoint(config.model)
        self.model_config = mc = checkpoint.model_config
        # The default layout and every recompute setting made concrete: the quality mode
        # (sequential + the model's calibrated recompute) where the user left them unset.
        given_layers, given_primer = config.recompute_check_layers, config.chunk_primer
        config, self.recompute_profile, self.recompute_source = resolve_recompute(
            config, checkpoint.fingerprint, mc.rope.get("rope_type") == "dynamic")
        self.device = resolve_device(config)
        packed = use_packed(config, checkpoint, self.device)
        self.dtype = resolve_dtype(config, self.device, checkpoint.torch_dtype)
        self.tokenizer = load_tokenizer(config.tokenizer or checkpoint.path)
        max_len = model_len_limit(config, mc.max_context_len)
        tp = TPGroup(0, config.tensor_parallel_size)  # rank 0's shard (all without TP)
        self.model = CausalLM(mc, max_len, self.dtype, self.device, tp).eval()
        self.weights = load_weights(self.model, checkpoint, packed)
        # Packed weights compute other values than dequantized ones: other chunk KV.
        weights_id = checkpoint.fingerprint + self.weights.id_suffix
        per_token = KVPool.bytes_per_token(mc.num_layers, self.model.num_kv_heads, mc.head_dim,
                                           self.dtype)
        size = size_pool(config, per_token, self.device, max_len)
        self.max_model_len = size.max_model_len
        # System parts and documents sent as text are tokenized once (inputs/token_cache.py).
        self.token_cache = (TokenCache(self.tokenizer, config.tokenizer_cache_mb << 20)
                            if config.tokenizer_cache_mb else None)
        # Grammars of structured outputs; the vocabulary's trie is built on first use.
        self.structured = StructuredOutputs(self.tokenizer, mc.vocab_size)
        self.eos_token_ids = frozenset(set(checkpoint.eos_token_ids)
                                       | {self.tokenizer.eos_token_id} - {None})
        keys = (ChunkKeys(weights_id, self.dtype, config.chunk_hash_algo)
                if config.enable_chunk_cache else None)
        # Built before the pool and the runner: it refuses settings the model cannot serve.
        self.inputs = InputProcessor(config, mc, self.tokenizer, self.max_model_len,
                                     self.eos_token_ids, self.model.rotary.dynamic, keys,
                                     self.token_cache, self.structured,
                                     layers_for_all=given_layers is not None,
                                     primer_given=given_primer is not None)
        self.config = config = self.inputs.config  # without a default's primer that can't fit
        logger.info("RAG default: %s", self.describe_rag_default())
        self.pool = KVPool(mc.num_layers, size.num_slots, self.model.num_kv_heads, mc.head_dim,
                           self.dtype, self.device)
        self.runner = make_runner(self.model, self.pool, RankSpec(
            config, checkpoint, self.dtype, max_len, self.max_model_len, size.num_slots, packed))
        self.kv = KVCacheManager(SlotAllocator(1, size.general_end),
                                 config.enable_prefix_caching, on_release=self.runner.release)
        self.chunk_store = build_chunk_store(config.chunk_store,
                                             pin_memory=self.device.type == "cuda")
        self.chunk_cache = None
        if config.enable_chunk_cache:
            self.chunk_cache = ChunkCache(SlotAllocator(size.general_end, size.num_slots),
                                          self.chunk_store, self.runner.chunk_pool, weights_id)
        # Chunks offloaded by sleep(), restored into the pool by wake_up().
        self._asleep: list | None = None
        debug = config.debug_checks or os.environ.get("RAGKV_DEBUG_CHECKS", "") == "1"
        self.scheduler = Scheduler(self.kv, self.chunk_cache, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_prefix_caching,
                                   debug_checks=debug, num_layers=mc.num_layers,
                                   speculator=speculator_for(config, self.max_model_len))
        self.outputs = OutputProcessor(self.scheduler, self.tokenizer, self.max_model_len,
                                       self.device)

    def process_prompt(self, prompt: object,
                       params: SamplingParams | None = None) -> ChunkedPrompt:
        """Parse, tokenize and validate a prompt with its sampling parameters; raises
        ValueError naming the field and the limit. Reads only the tokenizer and the config,
        so a server runs it off the engine thread and hands the result to `add_request`."""
        return self.inputs.process_prompt(prompt, params)

    def process_chat(self, messages: list[dict], documents: list[str] | None = None,
                     cache_salt: str | None = None, params: SamplingParams | None = None,
                     **rag_options: object) -> ChunkedPrompt:
        """A chat request as a validated prompt (InputProcessor.process_chat)."""
        return self.inputs.process_chat(messages, documents, cache_salt, params,
                                        **rag_options)

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
        requests = self.inputs.make_requests(prompt, params, request_id, arrival_time,
                                             score_tokens, self.outputs.has)
        self.outputs.add(requests)
        for req in requests:
            self.scheduler.add(req)
        return requests[0].parent_id

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_request(self, request_id: str) -> bool:
        """Whether a request (by its parent id) is queued or running."""
        return self.outputs.has(request_id)

    def recompute_settings(self) -> dict:
        """The default layout and selective recompute, where the recompute came from
        ("profile", "model-agnostic" or "config") and the calibrated profile (None: none
        used), as plain values."""
        c, profile = self.config, self.recompute_profile
        layers = c.recompute_check_layers
        if c.recompute == "sink":  # probes nothing
            layers = None
        elif c.recompute != "none" and layers is None:
            layers = check_layers_for(c.recompute, None, self.model_config.num_layers)
        return {"position_strategy": c.position_strategy,
                "chunk_attention": c.chunk_attention, "recompute": c.recompute,
                "recompute_ratio": c.recompute_ratio,
                "recompute_min_ratio": c.recompute_min_ratio,
                "recompute_score_mass": c.recompute_score_mass,
                "recompute_damping": c.recompute_damping, "chunk_primer": c.chunk_primer,
                "recompute_check_layers": None if layers is None else list(layers),
                "source": self.recompute_source,
                "profile": None if profile is None else profile.path}

    def describe_rag_default(self) -> str:
        """One line: the default layout of a RAG prompt, its recompute and their source."""
        return describe_default(self.recompute_settings())

    def abort_request(self, request_id: str) -> None:
        self.outputs.abort(request_id)

    def abort_all(self) -> None:
        self.outputs.abort_all()

    def step(self, include_unfinished: bool = False) -> list[RequestOutput]:
        """Run one scheduling step. Returns an output for every request that finished, and
        with `include_unfinished` also for every request that got a new token (streaming);
        without it no per-step detokenization is done unless stop strings need it.

        A failure while serving one request (planning it, choosing its recomputed tokens,
        or turning its token into text) finishes that request alone with finish_reason
        "error" and `RequestOutput.error`; if the model itself cannot run the step, the
        requests in the step fail and every other request and cache stays as it was. An
        `EngineDeadError` (a tensor-parallel rank died; an `InvariantViolation`: debug checks
        found the bookkeeping inconsistent) propagates: the engine must not go on."""
        sched = self.scheduler.schedule()
        # Requests that failed while being planned are already out of the step. Their
        # siblings fail after it: one of them may compute a chunk another request of this
        # step reads.
        if sched.empty:
            if self.chunk_cache is not None:  # nothing can run before a store read lands
                self.chunk_cache.wait_for_loads(_LOAD_WAIT_SECONDS)
            return self.outputs.fail_parents(sched.failed)
        try:
            result = self.runner.execute(sched.works, sched.probes)
        except EngineDeadError:
            raise
        except Exception as e:  # the step cannot go on: fail its requests, keep the rest
            logger.exception("model step failed")
            message = f"model step failed: {type(e).__name__}: {e}"
            in_step = self.scheduler.fail_step(sched, message)
            return self.outputs.fail_parents(sched.failed + in_step)
        planned = len(sched.failed)
        self.scheduler.update(sched, result.probe_scores)
        for req in sched.failed[planned:]:  # their samples sample nothing more
            self.outputs.fail(req, req.error)
        if len(sched.failed) > planned:
            self._check_after_failure()
        if result.logits is None:
            return self.outputs.fail_parents(sched.failed)
        outputs = self.outputs.process(sched, result.logits, include_unfinished)
        if sched.failed:
            # A failed parent's final output replaces a partial one from this step.
            by_id = {o.request_id: o for o in outputs}
            by_id.update((o.request_id, o) for o in self.outputs.fail_parents(sched.failed))
            outputs = list(by_id.values())
        return outputs

    def chunk_keys(self, prompt: object) -> list[str]:
        """Hex chunk-cache keys (the chunk store's keys) of a prompt's chunks, in order."""
        return [key.hex for key in self.inputs.chunk_keys_of(prompt)]

    def chunk_metas(self, prompt: object) -> list[ChunkMeta]:
        """What the chunk store's entries of a prompt's chunks must describe, in order."""
        return [self.chunk_cache.meta(key) for key in self.inputs.chunk_keys_of(prompt)]

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
        self.runner.release_memory()
        logger.info("asleep: KV pool freed, %d cached chunks offloaded to host memory",
                    len(self._asleep))

    def wake_up(self) -> None:
        """Allocate the KV pool again and put the chunks `sleep()` offloaded back into it."""
        if self._asleep is None:
            return
        self.runner.restore_memory()
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
        """Finish the chunk store's pending writes and close its connections; stop the
        tensor-parallel workers."""
        if self.chunk_store is not None:
            self.chunk_store.close()
        self.runner.close()

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
        return (ChunkCache(None) if self.chunk_cache is None else self.chunk_cache).stats()

    def token_cache_stats(self) -> TokenCacheStats:
        return (TokenCache(None, 0) if self.token_cache is None else self.token_cache).stats()

    def spec_decode_stats(self) -> SpecDecodeStats:
        spec = self.scheduler.speculator
        return SpecDecodeStats() if spec is None else spec.stats

    def clear_chunk_cache(self) -> int:
        if self._asleep:  # what sleep() offloaded is cached too: it does not come back
            dropped, self._asleep = len(self._asleep), []
            return dropped + (self.chunk_cache.clear() if self.chunk_cache else 0)
        return self.chunk_cache.clear() if self.chunk_cache is not None else 0

    def _check_after_failure(self) -> None:
        """A commit failed midway: its request is gone, but whether the caches are whole
        cannot be taken on trust. A full integrity check (rare: only after such a failure);
        if it fails, no request is at fault and the engine must stop."""
        try:
            self.check_integrity()
        except Exception as e:
            raise InvariantViolation(f"after a failed commit: {type(e).__name__}: {e}") from e

    def check_integrity(self) -> None:
        """Every slot is free, cached or held by a live request, exactly once; chunk pins
        are exactly the live requests' references."""
        live = self.scheduler.live()
        self.kv.check_integrity([r.kv for r in live])
        self.runner.slot_table.check_integrity(r.kv for r in live)
        if self.chunk_cache is not None:
            pins: dict[int, int] = {}
            for req in live:
                for binding in req.bindings:
                    if binding is not None and binding.entry is not None:
                        pins[id(binding.entry)] = pins.get(id(binding.entry), 0) + 1
            self.chunk_cache.check_integrity(pins)
        if self.token_cache is not None:
            self.token_cache.check_integrity()
