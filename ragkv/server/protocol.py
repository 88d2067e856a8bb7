"""OpenAI-compatible request models, with vLLM's extra sampling fields and ragkv's
`documents`, `position_strategy` and `chunk_attention`. Unknown fields are ignored, as
OpenAI-compatible servers do."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..config import MAX_DAMPING
from ..inputs.chat import content_text
from ..inputs.prompt import RAG_OPTIONS
from ..inputs.tools import check_tools, tool_fields
from ..sampling.params import SamplingParams
from ..structured.params import StructuredOutputsParams
from .tool_calls import ToolChoice, tool_choice


class ErrorResponse(Exception):
    """An OpenAI-style error with its HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": _printable(self.message), "type": self.type,
                          "param": None if self.param is None else _printable(self.param),
                          "code": self.status}}


def _printable(text: str) -> str:
    """`text` with anything UTF-8 cannot encode (a lone surrogate echoed from the request)
    escaped, so that writing the error can never fail."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# Strict: JSON `true` is not the integer 1 and "1" is not a number; a token id must be an
# integer (as in the OpenAI API). Unknown fields are still ignored, and null means the default
# wherever the OpenAI API allows it.
_STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = _STRICT

    model: str
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    # vLLM's: each prompt token's log-probability and the k most likely there (SamplingParams).
    prompt_logprobs: int | None = None
    # OpenAI's form: token ids as JSON object keys (strings).
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    # Splits a text prompt (or the last user message) at this text into system, documents and
    # question, for this request (None: the server's --chunk-separator, which may be none).
    chunk_separator: str | None = None
    # ragkv's RAG layout of this request (None: the server's default; see config.py).
    position_strategy: Literal["shared", "sequential"] | None = None
    chunk_attention: Literal["isolated", "standalone"] | None = None
    # Selective recompute of this request (None: the server's default; see config.py).
    recompute: Literal["none", "blend", "sink", "query", "sink+blend", "sink+query",
                       "query+blend"] | None = None
    recompute_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    recompute_sink_tokens: int | None = Field(default=None, ge=0)
    recompute_score_mass: float | None = Field(default=None, gt=0.0, le=1.0)
    recompute_min_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    recompute_damping: float | None = Field(default=None, ge=0.0, le=MAX_DAMPING)
    # Later documents computed after the server's chunk primer (None: the server's default).
    chunk_primer: bool | None = None
    user: str | None = None
    # Structured outputs: OpenAI's response_format (json_object, json_schema) and vLLM's
    # guided_json, guided_choice and structured_outputs (json, json_object, choice). Regex and
    # grammar constraints are refused (400), as is best_of other than n: ignoring a field
    # would return something other than what the client asked for.
    response_format: dict | None = None
    best_of: int | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    def _tool_schema(self) -> dict | None:
        """The schema a tool choice holds the output to (chat requests)."""
        return None

    def layout(self) -> dict:
        """The prompt keys of the RAG options (prompt.RAG_OPTIONS) that were given."""
        return {k: getattr(self, k) for k in RAG_OPTIONS if getattr(self, k) is not None}

    def _refuse_unsupported(self) -> None:
        for name in ("guided_regex", "guided_grammar"):
            if getattr(self, name) is not None:
                raise ErrorResponse(400, f"{name} is not supported: ragkv's structured outputs "
                                         "are JSON (json_object, a JSON schema) and choice",
                                    param=name)
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ErrorResponse(400, "best_of is not supported (use n)", param="best_of")

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The output constraint asked for, from whichever field gave one (at most one)."""
        asked: list[tuple[str, dict]] = []
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                asked.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                if not isinstance(spec, dict) or "schema" not in spec:
                    raise ErrorResponse(400, "response_format json_schema needs "
                                             "{'json_schema': {'name': ..., 'schema': {...}}}",
                                        param="response_format")
                asked.append(("response_format", {"json": spec["schema"]}))
            elif kind != "text":
                raise ErrorResponse(400, f"response_format type {kind!r} is not supported "
                                         "(text, json_object, json_schema)",
                                    param="response_format")
        if self.guided_json is not None:
            asked.append(("guided_json", {"json": self.guided_json}))
        if self.guided_choice is not None:
            asked.append(("guided_choice", {"choice": self.guided_choice}))
        if self.structured_outputs is not None:
            spec = self.structured_outputs
            if not isinstance(spec, dict):
                raise ErrorResponse(400, "structured_outputs must be an object",
                                    param="structured_outputs")
            other = [k for k, v in spec.items()
                     if v not in (None, False) and k not in ("json", "json_object", "choice")]
            if other:
                raise ErrorResponse(400, f"structured_outputs {other[0]!r} is not supported "
                                         "(json, json_object, choice)",
                                    param="structured_outputs")
            asked.append(("structured_outputs", {k: spec[k] for k in ("json", "json_object",
                                                                       "choice") if k in spec}))
        schema = self._tool_schema()
        if schema is not None:
            asked.append(("tools", {"json": schema}))
        if not asked:
            return None
        if len(asked) > 1:
            raise ErrorResponse(400, f"{asked[0][0]} and {asked[1][0]} both constrain the "
                                     "output: give one", param=asked[1][0])
        field, kwargs = asked[0]
        try:
            return StructuredOutputsParams(**kwargs)
        except (ValueError, TypeError) as e:
            raise ErrorResponse(400, f"{field}: {e}", param=field) from None

    def _sampling(self, max_tokens: int | None, logprobs: int | None,
                  prompt_logprobs: int | None = None) -> SamplingParams:
        self._refuse_unsupported()
        return SamplingParams(
            n=1 if self.n is None else self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            max_tokens=max_tokens, ignore_eos=bool(self.ignore_eos), logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens is not False,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(1.0 if self.repetition_penalty is None
                                else self.repetition_penalty),
            logit_bias=self._logit_bias(),
            min_tokens=self.min_tokens or 0,
            structured_outputs=self._structured_outputs(),
        )

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            # Digits only (no sign, space or other scripts' digits); 18 of them fit int64.
            if not key.isascii() or not key.isdigit() or len(key) > 18:
                raise ErrorResponse(400, f"logit_bias keys must be token ids, got {key[:40]!r}",
                                    param="logit_bias")
            token = int(key)
            if token in bias:
                raise ErrorResponse(400, f"logit_bias names token {token} twice",
                                    param="logit_bias")
            bias[token] = value
        return bias


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # Documents (reused chunks) placed before each text prompt, which is then the question.
    documents: list[str] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    def sampling_params(self) -> SamplingParams:
        # echo with logprobs scores the prompt too (lm-evaluation-harness's log-likelihood
        # requests: echo, logprobs, max_tokens 0).
        prompt = (self.logprobs if self.echo and self.logprobs is not None
                  and self.prompt_logprobs is None else None)
        return self._sampling(self.max_tokens, self.logprobs, prompt)


class FunctionCall(BaseModel):
    model_config = _STRICT

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = _STRICT

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result's call
    name: str | None = None

    def text(self) -> str:
        try:
            return content_text(self.content)
        except ValueError as e:
            raise ErrorResponse(400, str(e), param="messages") from None

    def template_message(self, i: int) -> dict:
        """The message as the chat template takes it (content text, calls' arguments parsed)."""
        try:
            extra = tool_fields(self.model_dump(exclude_none=True), f"messages[{i}]")
        except ValueError as e:
            raise ErrorResponse(400, str(e), param="messages") from None
        return {"role": self.role, "content": self.text(), **extra}


def _tool_list(tools: list[ToolDefinition] | None) -> list[dict] | None:
    """A request's tools as the chat template takes them, checked."""
    if tools is None:
        return None
    dicts = [t.model_dump(exclude_none=True) for t in tools]
    try:
        check_tools(dicts)
    except ValueError as e:
        raise ErrorResponse(400, str(e), param="tools") from None
    return dicts


class FunctionDefinition(BaseModel):
    model_config = _STRICT

    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    documents: list[str] | None = None
    # vLLM's chat options: a Jinja template in place of the model's, and whether the rendered
    # text ends with the assistant's header.
    chat_template: str | None = None
    add_generation_prompt: bool = True
    # Tool calling (server/tool_calls.py).
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None  # OpenAI's legacy function calling
    function_call: str | dict | None = None

    def tool_list(self) -> list[dict] | None:
        return _tool_list(self.tools)

    def tool_choice_of(self) -> ToolChoice:
        try:
            return tool_choice(self.tool_list(), self.tool_choice, self.parallel_tool_calls)
        except ValueError as e:
            raise ErrorResponse(400, str(e), param="tool_choice") from None

    def _tool_schema(self) -> dict | None:
        return self.tool_choice_of().schema()

    def sampling_params(self) -> SamplingParams:
        if self.functions or self.function_call not in (None, "none"):
            raise ErrorResponse(400, "functions (legacy function calling) are not supported: "
                                     "use tools",
                                param="functions" if self.functions else "function_call")
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        if self.top_logprobs is not None and not self.logprobs:
            raise ErrorResponse(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        top = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, top)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion `prompt` or chat `messages` (one of the two), tokenized
    as the engine tokenizes that request (documents and separators included)."""

    model_config = _STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    documents: list[str] | None = None
    chunk_separator: str | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False

    def tool_list(self) -> list[dict] | None:
        return _tool_list(self.tools)


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids back to text."""

    model_config = _STRICT

    model: str | None = None
    tokens: list[int]
