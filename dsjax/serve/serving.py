"""The two generation endpoints: request body -> prompt ids + SamplingParams -> engine -> JSON or SSE."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dsjax.engine.outputs import RequestOutput
from dsjax.engine.sampling_params import SamplingParams
from dsjax.serve.async_engine import (AsyncEngine, DrainingError, EngineDeadError, EngineStepError, QueueFullError,
                                      RequestStream)
from dsjax.serve.chat_template import ChatTemplate
from dsjax.serve.errors import APIError, bad_request, from_value_error, overloaded
from dsjax.serve.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from dsjax.serve.responses import DONE, ChatFormat, ChoiceCursor, CompletionFormat, sse

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
_INLINE_ENCODE_CHARS = 4096  # shorter prompts are tokenized on the event loop; longer ones on a worker thread


class SSEResponse(StreamingResponse):
    """Closes its generator when the client goes away, so the generator's finally aborts the request now
    rather than whenever the garbage collector gets to it."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer, *, model_name: str, max_model_len: int, vocab_size: int,
                 max_n: int, chat_template: ChatTemplate | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_n = max_n
        self.chat_template = chat_template or ChatTemplate.for_tokenizer(tokenizer)

    # ----- endpoints --------------------------------------------------------------------------------
    async def completions(self, http: Request) -> Response:
        arrival = time.monotonic()
        req = parse_body(await http.body(), CompletionRequest)
        self._check_request(req)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt is empty; accepted: at least one character", "prompt", "empty_prompt")
            text, ids = prompt, await self._encode(prompt)
        else:
            text, ids = None, self._check_token_ids(prompt)
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        params = req.sampling_params(max_tokens, req.logprobs, self.vocab_size)
        self._check_length(len(ids), params.max_tokens, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        fmt = CompletionFormat(request_id, int(time.time()), self.model_name, self.tokenizer,
                               req.logprobs is not None, req.include_usage)
        return await self._generate(http, request_id, text, ids, params, fmt, req.stream, arrival)

    async def chat(self, http: Request) -> Response:
        arrival = time.monotonic()
        req = parse_body(await http.body(), ChatCompletionRequest)
        self._check_request(req)
        messages = [m.model_dump() | {"content": m.text()} for m in req.messages]
        try:
            if sum(len(m["content"]) for m in messages) <= _INLINE_ENCODE_CHARS:
                text, ids = self.chat_template.encode(self.tokenizer, messages, req.add_generation_prompt)
            else:
                text, ids = await asyncio.to_thread(self.chat_template.encode, self.tokenizer, messages,
                                                    req.add_generation_prompt)
        except ValueError as e:
            raise bad_request(str(e), "messages", "chat_template_error") from None
        max_tokens = req.requested_max_tokens
        if max_tokens is None:  # as much as the context has room for
            max_tokens = self.max_model_len - len(ids)
            if max_tokens < 1:
                self._check_length(len(ids), 1, "messages")
        params = req.sampling_params(max_tokens, req.num_logprobs, self.vocab_size)
        self._check_length(len(ids), params.max_tokens, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        fmt = ChatFormat(request_id, int(time.time()), self.model_name, self.tokenizer, req.num_logprobs,
                         req.include_usage)
        return await self._generate(http, request_id, text, ids, params, fmt, req.stream, arrival)

    # ----- checks -----------------------------------------------------------------------------------
    def _check_request(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} is not served here; accepted: {self.model_name!r}",
                           param="model", code="model_not_found")
        if not 1 <= req.n <= self.max_n:
            raise bad_request(f"n={req.n}: accepted an int in [1, {self.max_n}] (the server's --max-n)", "n")
        req.check_supported()

    def _check_token_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise bad_request("prompt is empty; accepted: at least one token id", "prompt", "empty_prompt")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"prompt: token id {bad} is out of range; accepted: ids in [0, {self.vocab_size})",
                              "prompt")
        return list(ids)

    def _check_length(self, num_prompt_tokens: int, max_tokens: int, param: str) -> None:
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise bad_request(
                f"this model's maximum context length is {self.max_model_len} tokens; the request needs "
                f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the {param}, {max_tokens} for the "
                f"completion); shorten the {param} or lower max_tokens", param, "context_length_exceeded")

    async def _encode(self, text: str) -> list[int]:
        if len(text) <= _INLINE_ENCODE_CHARS:
            return self.tokenizer.encode(text)
        return await asyncio.to_thread(self.tokenizer.encode, text)

    # ----- generation -------------------------------------------------------------------------------
    async def _generate(self, http: Request, request_id: str, text: str | None, ids: list[int],
                        params: SamplingParams, fmt, stream: bool, arrival: float) -> Response:
        try:
            handle = await self.engine.add_request(request_id, text, params, ids, arrival)
        except QueueFullError as e:
            raise overloaded(f"the server is at capacity: {e}; retry later", "queue_full") from None
        except DrainingError:
            raise overloaded("the server is shutting down; retry on another replica", "draining") from None
        except EngineDeadError as e:
            raise overloaded(str(e), "engine_dead", retry_after_s=10) from None
        except ValueError as e:  # the engine's own checks (e.g. more KV blocks than the whole pool)
            raise from_value_error(e) from None
        if stream:
            holdback = max(map(len, params.stop), default=1) - 1
            return SSEResponse(self._stream(handle, fmt, params.n, holdback), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        final = await self._wait_final(http, handle)
        return JSONResponse(fmt.response(final))

    async def _stream(self, handle: RequestStream, fmt, n: int, holdback: int) -> AsyncIterator[bytes]:
        cursors = [ChoiceCursor(i, holdback) for i in range(n)]
        try:
            for chunk in fmt.start(n):
                yield chunk
            last = None
            async for output in handle:
                last = output
                for completion in output.outputs:
                    delta = cursors[completion.index].advance(completion)
                    if delta is not None:
                        yield fmt.chunk(delta)
            if fmt.include_usage and last is not None:
                yield fmt.usage_chunk(last)
        except (EngineStepError, EngineDeadError) as e:
            # The 200 is long gone: the failure travels as an error event, which OpenAI clients raise.
            yield sse(_failure(e).body())
        finally:
            handle.abort()  # a no-op once finished; otherwise the client left: free the blocks now
        yield DONE

    async def _wait_final(self, http: Request, handle: RequestStream) -> RequestOutput:
        async def last_output() -> RequestOutput:
            output = None
            async for output in handle:
                pass
            return output

        result = asyncio.ensure_future(last_output())
        gone = asyncio.ensure_future(_client_gone(http))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not result.done():
                result.cancel()
                handle.abort()
        if not result.done():
            raise APIError(499, "the client closed the connection", code="client_closed_request")
        try:
            return result.result()
        except (EngineStepError, EngineDeadError) as e:
            raise _failure(e) from None


def _failure(error: Exception) -> APIError:
    code = "engine_step_failed" if isinstance(error, EngineStepError) else "engine_dead"
    return APIError(500, str(error), code=code)


async def _client_gone(http: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
