"""OpenAI response bodies and streaming chunks from engine outputs: choices, usage (with
ragkv's `num_recomputed_tokens`), logprobs in the completions and chat shapes, completions'
`echo`, vLLM's `prompt_logprobs`."""

from __future__ import annotations

import time

from ..outputs import RequestOutput
from .tool_calls import ToolCallStream, ToolChoice, reply


class ResponseFormatter:
    """Builds OpenAI response bodies and streaming chunks from engine outputs."""

    def __init__(self, request_id: str, model: str, chat: bool, params, tokenizer,
                 echo: bool = False, prompt_logprobs: bool = False,
                 tools: ToolChoice | None = None) -> None:
        """`echo`: completions' (the prompt before each choice's text); `prompt_logprobs`:
        whether the request asked for them (each choice then carries them); `tools`: a chat
        request's tool choice (replies parsed for calls unless it is "none")."""
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.params = params
        self.tokenizer = tokenizer
        self.n = params.n
        self.created = int(time.time())
        # choice index -> (characters sent, tokens sent, text_offset of the next token)
        self._sent: dict[int, tuple[int, int, int]] = {}
        self._done: set[int] = set()  # choices whose finish_reason was sent
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self.echo = echo
        self.show_prompt_logprobs = prompt_logprobs
        self.tools = tools if tools is not None and tools.parses else None
        self._tool_streams: dict[int, ToolCallStream] = {}  # choice index -> its parser

    def _echo(self, choice: dict, out: RequestOutput, c) -> None:
        """The prompt in front of the completion, and with logprobs its tokens' in front of
        the completion's (the first, and a RAG prompt's up to its question's first, null)."""
        prompt = (out.prompt if out.prompt is not None
                  else self.tokenizer.decode(out.prompt_token_ids))
        choice["text"] = prompt + c.text
        if choice["logprobs"] is not None:
            entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            choice["logprobs"], _ = self._logprobs(out.prompt_token_ids + c.token_ids,
                                                   entries + c.logprobs, 0)

    def _choice_index(self, prompt_index: int, completion_index: int) -> int:
        return prompt_index * self.n + completion_index

    def full(self, outputs: list[RequestOutput]) -> dict:
        choices = []
        for p, out in enumerate(outputs):
            for c in out.outputs:
                index = self._choice_index(p, c.index)
                logprobs, _ = self._logprobs(c.token_ids, c.logprobs, 0)
                choice = {"index": index, "finish_reason": c.finish_reason,
                          "logprobs": logprobs}
                if self.chat and self.tools is not None:
                    choice["message"], choice["finish_reason"] = reply(self.tools, c.text,
                                                                       c.finish_reason)
                elif self.chat:
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    choice["text"] = c.text
                    choice["stop_reason"] = c.stop_reason
                    if self.echo:
                        self._echo(choice, out, c)
                if self.show_prompt_logprobs and not self.chat:  # vLLM: per choice
                    choice["prompt_logprobs"] = _prompt_logprobs_json(out.prompt_logprobs)
                choices.append(choice)
        body = {"id": self.request_id,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self._usage(outputs)}
        if self.show_prompt_logprobs and self.chat:  # vLLM: the response's, one prompt
            body["prompt_logprobs"] = _prompt_logprobs_json(outputs[0].prompt_logprobs)
        return body

    def delta(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        chunks = []
        for c in out.outputs:
            index = self._choice_index(prompt_index, c.index)
            if index in self._done:
                continue  # finished earlier; its siblings are still running
            first = index not in self._sent
            chars, tokens, offset = self._sent.get(index, (0, 0, 0))
            text = c.text
            if c.finish_reason is None:
                # Hold back an incomplete UTF-8 character, then what may become a stop string
                # (counted on the complete characters only).
                end = len(text)
                while end > chars and text[end - 1] == "\ufffd":
                    end -= 1
                text = text[:max(end - self._hold, chars)]
            new_text = text[chars:]
            new_ids = c.token_ids[tokens:]
            finish = c.finish_reason
            if self.chat:
                delta, finish = self._chat_delta(index, new_text, finish)
                if not delta and not first and finish is None:
                    self._sent[index] = (chars + len(new_text), tokens, offset)  # held
                    continue
                if not delta and self.tools is None:
                    delta = {"content": ""}
                choice = {"index": index, "delta": ({"role": "assistant", **delta} if first
                                                    else delta)}
            elif not new_text and not first and finish is None:
                continue
            else:
                choice = {"index": index, "text": new_text}
            logprobs, next_offset = self._logprobs(
                new_ids, c.logprobs[tokens:] if c.logprobs is not None else None, offset)
            self._sent[index] = (chars + len(new_text), len(c.token_ids), next_offset)
            if finish is not None:
                self._done.add(index)
            choice["logprobs"] = logprobs
            choice["finish_reason"] = finish
            if not self.chat:
                choice["stop_reason"] = c.stop_reason
            chunks.append({"id": self.request_id,
                           "object": "chat.completion.chunk" if self.chat else "text_completion",
                           "created": self.created, "model": self.model, "choices": [choice]})
        return chunks

    def _chat_delta(self, index: int, new_text: str, finish: str | None
                    ) -> tuple[dict, str | None]:
        """A chat choice's delta fields for its new text, and its finish_reason: the text as
        content, or what its tool-call parser makes of it."""
        if self.tools is None:
            return {"content": new_text} if new_text else {}, finish
        stream = self._tool_streams.setdefault(index, ToolCallStream(self.tools))
        return stream.feed(new_text, finish is not None, finish)

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        return {"id": self.request_id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [],
                "usage": self._usage(outputs)}

    def _usage(self, outputs: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outputs)
        # Chunk tokens recomputed by selective recompute (ragkv's extension of usage).
        recomputed = sum(o.metrics.num_recomputed_tokens for o in outputs if o.metrics)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
                "num_recomputed_tokens": recomputed}

    def _logprobs(self, token_ids: list[int], logprobs,
                  offset: int) -> tuple[dict | None, int]:
        """The logprobs object of these tokens, and the text offset after them (completions'
        `text_offset` counts from the start of the choice's text, across chunks)."""
        if logprobs is None:
            return None, offset
        decode = self.tokenizer.decode
        if self.chat:
            content = []
            for tid, entry in zip(token_ids, logprobs, strict=False):
                token = decode([tid])
                top = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
                content.append({
                    "token": token, "logprob": entry[tid].logprob,
                    "bytes": list(token.encode()),
                    "top_logprobs": [
                        {"token": decode([t]), "logprob": lp.logprob,
                         "bytes": list(decode([t]).encode())}
                        for t, lp in top if lp.rank and lp.rank <= self.params.logprobs
                    ],
                })
            return {"content": content}, offset
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, logprobs, strict=False):
            token = decode([tid])
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
            # An echoed prompt's first token (and a RAG prompt's up to its question) has none.
            token_logprobs.append(None if entry is None else entry[tid].logprob)
            tops.append(None if entry is None else {decode([t]): lp.logprob
                                                    for t, lp in entry.items()})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}, offset


def _prompt_logprobs_json(entries: list | None) -> list | None:
    """vLLM's `prompt_logprobs` of a choice: per prompt token, null or {token id: {logprob,
    rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                             "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in entries]
