"""The app in-process (FastAPI TestClient) on the model-free FakeEngine, whose completions read "abcd...":
response shapes, streaming, stop strings, logprobs, n, errors, auth, body limit, a failing step."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from dsjax.serve import fault_inject
from dsjax.serve.config import ServeConfig
from dsjax.serve.server import create_app

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine():
    engine = FakeEngine()
    fault_inject.install(engine, "BOOM")
    return engine


@pytest.fixture(scope="module")
def client(engine):
    app = create_app(ServeConfig(model="tiny", api_key=KEY, max_n=4, max_body_bytes=4096), engine)
    with TestClient(app, headers=AUTH) as client:
        yield client


def events(response) -> list:
    """The SSE payloads of a stream, [DONE] as the string."""
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


def test_completion(client):
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 5}).json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"] == [{"index": 0, "text": "abcde", "finish_reason": "length", "stop_reason": None,
                                "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}  # BOS + 2 bytes


def test_token_id_prompt_and_n(client):
    body = client.post("/v1/completions", json={"prompt": [0, 50, 60], "max_tokens": 3, "n": 3}).json()
    assert [c["text"] for c in body["choices"]] == ["abc"] * 3
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 9


def test_stop_string_is_cut_and_never_streamed(client):
    request = {"prompt": "hi", "max_tokens": 20, "stop": ["efg", "zz"]}
    body = client.post("/v1/completions", json=request).json()
    assert body["choices"][0]["text"] == "abcd"
    assert (body["choices"][0]["finish_reason"], body["choices"][0]["stop_reason"]) == ("stop", "efg")
    chunks = events(client.post("/v1/completions", json=request | {"stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "abcd"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1] == "[DONE]"


def test_streaming_completion_with_usage(client):
    chunks = events(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 6, "n": 2, "stream": True,
                                                          "stream_options": {"include_usage": True}}))
    assert chunks[-1] == "[DONE]"
    usage = chunks[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    for index in (0, 1):
        pieces = [c["choices"][0] for c in chunks[:-2] if c["choices"][0]["index"] == index]
        assert "".join(p["text"] for p in pieces) == "abcdef"
        assert [p["finish_reason"] for p in pieces][-1] == "length"
    assert all(c["usage"] is None for c in chunks[:-2])


def test_completion_logprobs(client):
    body = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 2}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "c"]
    assert logprobs["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert logprobs["top_logprobs"][0] == {"a": -0.5, "b": -1.0}
    assert logprobs["text_offset"] == [0, 1, 2]


def test_chat(client):
    body = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 4}).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "abcd"}
    # the default template: "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n" + BOS
    assert body["usage"]["prompt_tokens"] == 1 + len("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n")


def test_chat_without_max_tokens_fills_the_context(client, engine):
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert body["usage"]["total_tokens"] == engine.config.max_model_len
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_streaming_with_logprobs(client):
    chunks = events(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 3,
        "stream": True, "logprobs": True, "top_logprobs": 2}))
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
    assert content == "abc"
    items = [item for c in chunks[1:-1] for item in (c["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert [i["token"] for i in items] == ["a", "b", "c"]
    assert [t["token"] for t in items[0]["top_logprobs"]] == ["a", "b"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_models_health_metrics(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert client.get("/health").json() == {"status": "ok"}
    text = client.get("/metrics").text
    for name in ("dsjax_http_requests_total", "dsjax_time_to_first_token_seconds_bucket",
                 "dsjax_time_per_output_token_seconds_bucket", "dsjax_e2e_request_latency_seconds_bucket",
                 "dsjax_generation_tokens_total", "dsjax_num_requests_running", "dsjax_num_requests_waiting",
                 "dsjax_kv_cache_usage_ratio", "dsjax_prefix_cache_hit_rate", "dsjax_num_preemptions_total",
                 "dsjax_step_padded_tokens_total",
                 # the memory-pressure ladder's rungs (the fourth: dsjax_requests_rejected{reason="queue_full"})
                 "dsjax_kv_prefix_evictions_total", "dsjax_kv_pressure_compressions_total",
                 "dsjax_kv_blocks_compressed_total"):
        assert name in text, name


def test_auth(client):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + KEY}):
        response = client.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/health", headers={"Authorization": ""}).status_code == 200


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "n": 5}, 400, "n"),  # this app's --max-n is 4
    ("/v1/completions", {"prompt": [0, 512]}, 400, "prompt"),  # token id outside the vocabulary
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),  # batches are not supported
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 30, "max_tokens": 10}, 400, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": []}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content"),
])
def test_refusals_name_the_parameter(client, path, body, status, param):
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_body_limit_413_with_and_without_content_length(client):
    big = json.dumps({"prompt": "x" * 5000}).encode()
    assert client.post("/v1/completions", content=big, headers={"content-type": "application/json"}).status_code == 413

    def chunks():
        yield big[:3000]
        yield big[3000:]

    response = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method_are_openai_errors(client):
    assert client.get("/v1/nope").json()["error"]["code"] == "not_found"
    assert client.get("/v1/completions").status_code == 405


def test_failing_step_is_500_then_serving_continues(client, engine):
    response = client.post("/v1/completions", json={"prompt": "BOOM", "max_tokens": 3})
    assert response.status_code == 500 and response.json()["error"]["code"] == "engine_step_failed"
    chunks = events(client.post("/v1/completions", json={"prompt": "BOOM", "max_tokens": 3, "stream": True}))
    assert chunks[-2]["error"]["code"] == "engine_step_failed" and chunks[-1] == "[DONE]"
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).json()["choices"][0]["text"] == "ab"
    stats = client.get("/debug/stats").json()
    assert stats["num_blocks_used"] == 0 and stats["num_step_failures"] == 2 and stats["healthy"]
    engine.scheduler.check_invariants()
    assert 'dsjax_requests_finished_total{finish_reason="error"} 2.0' in client.get("/metrics").text
