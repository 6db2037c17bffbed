"""OpenAI response bodies and stream chunks for completions and chat, built from engine outputs."""

from __future__ import annotations

import dataclasses
import json

from dsjax.engine.outputs import CompletionOutput, RequestOutput

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(output: RequestOutput) -> dict:
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    prompt_tokens = len(output.prompt_token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclasses.dataclass
class Delta:
    """What one choice adds to its stream: new text, the tokens (and logprobs) behind it, maybe the end."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChoiceCursor:
    """How much of one choice a stream has sent.

    A stop string can truncate the text after it was generated, so until the choice finishes the last
    (longest stop - 1) characters stay back: everything sent is final.
    """

    def __init__(self, index: int, holdback: int):
        self.index = index
        self.holdback = holdback
        self.num_chars = 0
        self.num_tokens = 0
        self.finished = False

    def advance(self, completion: CompletionOutput) -> Delta | None:
        if self.finished:
            return None
        finished = completion.finish_reason is not None
        text = completion.text
        end = len(text) if finished else max(self.num_chars, len(text) - self.holdback)
        if end == self.num_chars and not finished:
            return None  # tokens without new text wait for their text, so logprobs line up with it
        num_tokens = len(completion.token_ids)  # logprobs may already be longer: the engine appends in place
        delta = Delta(self.index, text[self.num_chars:end], completion.token_ids[self.num_tokens:num_tokens],
                      None if completion.logprobs is None else completion.logprobs[self.num_tokens:num_tokens],
                      completion.finish_reason, completion.stop_reason)
        self.num_chars, self.num_tokens, self.finished = end, num_tokens, finished
        return delta


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, float]], offset: int = 0) -> dict:
    """The completions API's logprobs: per token its text, logprob, top alternatives and text offset."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(entry.get(token_id))
        top.append({_token_text(tokenizer, t): lp for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, float]], num_top: int) -> dict:
    """The chat API's logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    def item(token_id: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entry in zip(token_ids, entries):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
        content.append(item(token_id, entry.get(token_id)) | {"top_logprobs": [item(t, lp) for t, lp in ranked]})
    return {"content": content}


class CompletionFormat:
    """/v1/completions: response body and stream chunks."""

    def __init__(self, request_id: str, created: int, model: str, tokenizer, want_logprobs: bool,
                 include_usage: bool = False):
        self.base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self._offsets: dict[int, int] = {}

    def response(self, output: RequestOutput) -> dict:
        choices = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    "logprobs": completion_logprobs(self.tokenizer, c.token_ids, c.logprobs or [])
                    if self.want_logprobs else None}
                   for c in output.outputs]
        return self.base | {"choices": choices, "usage": usage(output)}

    def start(self, n: int) -> list[bytes]:
        return []

    def chunk(self, delta: Delta) -> bytes:
        logprobs = None
        if self.want_logprobs:
            offset = self._offsets.get(delta.index, 0)
            logprobs = completion_logprobs(self.tokenizer, delta.token_ids, delta.logprobs or [], offset)
            self._offsets[delta.index] = offset + sum(map(len, logprobs["tokens"]))
        choice = {"index": delta.index, "text": delta.text, "logprobs": logprobs,
                  "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
        return sse(self.base | {"choices": [choice]} | ({"usage": None} if self.include_usage else {}))

    def usage_chunk(self, output: RequestOutput) -> bytes:
        return sse(self.base | {"choices": [], "usage": usage(output)})


class ChatFormat:
    """/v1/chat/completions: response body and stream chunks."""

    def __init__(self, request_id: str, created: int, model: str, tokenizer, num_logprobs: int | None,
                 include_usage: bool = False):
        self.base = {"id": request_id, "object": "chat.completion", "created": created, "model": model}
        self.chunk_base = self.base | {"object": "chat.completion.chunk"}
        self.tokenizer = tokenizer
        self.num_logprobs = num_logprobs
        self.include_usage = include_usage

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> dict | None:
        if self.num_logprobs is None:
            return None
        return chat_logprobs(self.tokenizer, token_ids, entries or [], self.num_logprobs)

    def response(self, output: RequestOutput) -> dict:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in output.outputs]
        return self.base | {"choices": choices, "usage": usage(output)}

    def _chunk(self, choice: dict) -> bytes:
        return sse(self.chunk_base | {"choices": [choice]} | ({"usage": None} if self.include_usage else {}))

    def start(self, n: int) -> list[bytes]:
        # OpenAI opens every choice with the role, before any content.
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(n)]

    def chunk(self, delta: Delta) -> bytes:
        return self._chunk({"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                            "logprobs": self._logprobs(delta.token_ids, delta.logprobs),
                            "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason})

    def usage_chunk(self, output: RequestOutput) -> bytes:
        return sse(self.chunk_base | {"choices": [], "usage": usage(output)})
