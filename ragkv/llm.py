"""`LLM`: the offline API, named and shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from .cache.chunk_cache import ChunkCacheStats
from .config import EngineConfig
from .engine.engine import Engine
from .inputs.chat import content_text
from .inputs.tools import check_tools, tool_fields
from .outputs import RequestOutput
from .sampling.params import SamplingParams


class LLM:
    """Load a model and generate for batches of prompts.

    `model` is a local HF directory or a built-in model name (`builtin:tiny`, `builtin:small`).
    Other keyword arguments are `EngineConfig` fields.
    """

    def __init__(self, model: str, **kwargs) -> None:
        unknown = set(kwargs) - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(f"LLM() got unexpected arguments: {', '.join(sorted(unknown))}")
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = Engine(self.config)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list; outputs come back in the prompts' order.

        A prompt is a str (an ordinary prompt; split into system, chunks and question only
        at the engine's `chunk_separator` when one is set), a `RAGPrompt`, or a
        `{"prompt_token_ids": [...]}` / `{"prompt": ...}` dict, each with an optional
        `cache_salt` (the text form also with its own `chunk_separator`). All prompts are
        validated before any is queued, so a bad one raises ValueError and nothing runs.
        """
        # Anything but a list or tuple is one prompt (and a wrong type is a ValueError there).
        prompts = list(prompts) if isinstance(prompts, (list, tuple)) else [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for "
                                 f"{len(prompts)} prompts")
        engine = self.engine
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list, strict=False):
                ids.append(engine.add_request(prompt, params))
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in results:
                    engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams]
             | None = None, use_tqdm: bool = True, *, documents: list[str] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             chunk_separator: str | None = None, cache_salt: str | None = None,
             tools: list[dict] | None = None, **rag_options: object) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a
        list of them, rendered with the model's chat template (or `chat_template`) exactly as
        the server's /v1/chat/completions renders them: `documents` (or, with a
        `chunk_separator`, separators in the last user message) become reused chunks after
        the system message. A message's content is a string or a list of text parts; an
        assistant's `tool_calls` and a tool result's `tool_call_id` render through the
        template, as do `tools` (OpenAI's function definitions; the reply is text: the server
        parses tool calls). The RAG options (`position_strategy`, `recompute`, ...) apply to
        every conversation."""
        if tools is not None:
            check_tools(tools)
        conversations = (messages if messages and isinstance(messages, (list, tuple))
                         and isinstance(messages[0], (list, tuple)) else [messages])
        prompts = []
        for conversation in conversations:
            prompts.append(self.engine.process_chat(
                [_chat_message(m, i) for i, m in enumerate(conversation)], documents,
                cache_salt, chunk_separator=chunk_separator,
                add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                tools=tools, **rag_options))
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_chunk_cache_stats(self) -> ChunkCacheStats:
        """lookups, hits, misses, hit_rate, hit_tokens, cached_chunks, used_tokens,
        capacity_tokens, evictions, avg_lookup_ms (counted over the engine's life)."""
        return self.engine.chunk_cache_stats()

    def clear_chunk_cache(self) -> int:
        """Drop every cached chunk no running request uses; returns how many."""
        return self.engine.clear_chunk_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool's memory (vLLM's name; level 1: the weights stay loaded). Cached
        chunks are offloaded to host memory and restored by `wake_up()`, so hits after waking
        equal hits before; the prefix cache is dropped. Refused while requests run."""
        if level != 1:
            raise ValueError(f"sleep level {level!r} is not supported: level 1 frees the KV "
                             "pool (ragkv keeps the weights loaded)")
        self.engine.sleep()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Allocate the KV pool again and restore the chunks `sleep()` offloaded. `tags`
        (vLLM's) choose what wakes: "kv_cache" does; "weights" never left."""
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags must be 'weights' or 'kv_cache', got {tags!r}")
        if tags is None or "kv_cache" in tags:
            self.engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()


def _chat_message(message: object, i: int) -> dict:
    """One chat message as the template takes it, its content text as the server's is."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"messages[{i}] must be a dict with a string 'role'")
    try:
        content = content_text(message.get("content"))
    except ValueError as e:
        raise ValueError(f"messages[{i}].content: {e}") from None
    return {"role": message["role"], "content": content,
            **tool_fields(message, f"messages[{i}]")}
