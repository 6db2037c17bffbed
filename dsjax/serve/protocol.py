"""OpenAI request bodies (completions, chat) as strict pydantic models, and their SamplingParams.

Strict: "10" is not a number and true is not 1; unknown fields are refused by name, so a typo never
silently falls back to a default. Extensions in vLLM's spelling: top_k, min_tokens, ignore_eos,
stop_token_ids, and priority ('realtime' | 'default' | 'bulk', the scheduler's lanes).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsjax.engine.sampling_params import PRIORITIES, SamplingParams
from dsjax.serve.errors import APIError, bad_request, from_value_error

Priority = Literal[PRIORITIES]  # type: ignore[valid-type]  # the scheduler's lanes, from one tuple


MAX_STOP_STRINGS = 16  # each is searched for after every token: a bounded list keeps a step's cost bounded
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1 (vLLM's spelling) is off
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Priority = "default"
    user: str | None = None  # accepted and ignored, as OpenAI's abuse-tracking field
    # Accepted only at their neutral values: refusing is better than silently ignoring them.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def check_supported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise bad_request(f"{name}={getattr(self, name)!r} is not supported; accepted: 0 or null", name)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported; accepted: null or {}", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only accepted with stream=true", "stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise bad_request(f"stop: accepted at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                              "characters", "stop")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad_request(f"stop_token_ids: accepted at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")

    def sampling_params(self, max_tokens: int, logprobs: int | None, vocab_size: int) -> SamplingParams:
        # top_k at or above the vocabulary keeps every token: the same as off, and it fits the engine's int32.
        top_k = 0 if self.top_k in (None, -1) or (self.top_k or 0) >= vocab_size else self.top_k
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=top_k,
                min_tokens=self.min_tokens, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos, logprobs=logprobs, priority=self.priority)
        except ValueError as e:
            raise from_value_error(e) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    # One prompt per request: text or token ids (a one-element batch is unwrapped).
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # top-n per token
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo=true is not supported; accepted: false", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported; accepted: null", "suffix")
        if self.best_of not in (None, self.n):
            raise bad_request(f"best_of={self.best_of} is not supported; accepted: null or equal to n={self.n}",
                              "best_of")

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise bad_request(f"prompt: a batch of {len(prompt)} prompts is not supported; "
                                  "accepted: one string or one list of token ids per request", "prompt")
            prompt = prompt[0]
        return prompt


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (name, tool_call_id, ...) pass through to the chat template.
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Accepted only when unset.
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("tools", "tool_choice", "response_format", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                raise bad_request(f"{name} is not supported by this server; accepted: null", name)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens differ; send one of them", "max_tokens")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def parse_body(body: bytes, model: type[BaseModel]) -> Any:
    """JSON bytes -> the request model, or a 400 naming the first problem."""
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
    except ValueError as e:  # NaN / Infinity, which Python's json would otherwise accept
        raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


# Union members show up in pydantic's error locations ('prompt', 'list[int]', 0); they are no field names.
def _param(loc: tuple) -> str:
    return ".".join(str(part) for part in loc if isinstance(part, int) or ("[" not in part and part not in
                                                                           ("str", "int", "float", "bool")))


def _validation_error(error: ValidationError) -> APIError:
    first = error.errors()[0]
    param = _param(first["loc"]) or None
    if first["type"] == "extra_forbidden":
        return bad_request(f"unknown field {param!r}", param, code="unknown_field")
    if first["type"] == "missing":
        return bad_request(f"{param} is required", param, code="missing_field")
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    # A value matching no member of a union: one error per member, each naming it in its location.
    members = [e["loc"][len(first["loc"]) - 1] for e in error.errors()
               if e["loc"][:1] == first["loc"][:1] and len(e["loc"]) >= len(first["loc"])]
    if len(members) > 1 and all(isinstance(m, str) and m not in param.split(".") for m in members):
        accepted = ", ".join(dict.fromkeys(members))
        return bad_request(f"{param}: got {shown}; accepted one of: {accepted}", param, code="invalid_value")
    return bad_request(f"{param}: {first['msg'].lower()} (got {shown})", param, code="invalid_value")
