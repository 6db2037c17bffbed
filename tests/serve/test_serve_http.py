"""The real server (uvicorn subprocess, tiny preset, configs/serve/tiny-cpu.yaml: 8 running sequences) driven
with the official openai client: completions, chat, streaming, n, stop, 32 concurrent streams, a disconnect
storm that must leak no KV block, realtime overtaking bulk, a failing engine step, auth, bad input."""

from __future__ import annotations

import asyncio
import json
import time

import httpx2 as httpx
import openai
import pytest
from server_process import running_server

KEY = "sk-test"
MAX_NUM_SEQS = 8  # configs/serve/tiny-cpu.yaml
NEVER_STOP = {"ignore_eos": True}  # the tiny model's random weights may draw EOS early


@pytest.fixture(scope="module")
def server():
    with running_server("--api-key", KEY, "--max-queue-len", "64", env={"DSJAX_FAULT_INJECT": "BOOM"}) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert server.get_json("/health") == {"status": "ok"}


def test_completion(client):
    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=7, temperature=0,
                                           extra_body=NEVER_STOP)
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and isinstance(choice.text, str)
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (6, 7)  # BOS + 5 bytes


def test_extreme_but_valid_values_are_served(client):
    completion = client.completions.create(model="tiny", prompt="x", max_tokens=3, seed=2**63, temperature=1e30,
                                           top_p=1e-9, extra_body={"top_k": 10**12, "min_tokens": 3})
    assert completion.usage.completion_tokens == 3


def test_chat(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          extra_body=NEVER_STOP)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 5


def test_streaming_matches_non_streaming_for_a_seed(client):
    request = dict(model="tiny", prompt="Once upon", max_tokens=12, temperature=0.8, seed=7, extra_body=NEVER_STOP)
    whole = client.completions.create(**request).choices[0].text
    chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 12
    chat_chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=True, extra_body=NEVER_STOP))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-1].choices[0].finish_reason == "length"


def test_n_and_stop(client):
    completion = client.completions.create(model="tiny", prompt="abc", max_tokens=8, n=3, seed=1,
                                           extra_body=NEVER_STOP)
    assert sorted(c.index for c in completion.choices) == [0, 1, 2]
    assert completion.usage.completion_tokens == 24
    greedy = dict(model="tiny", prompt="The", max_tokens=24, temperature=0, extra_body=NEVER_STOP)
    text = client.completions.create(**greedy).choices[0].text
    stop = text[5:7]
    assert stop, text
    stopped = client.completions.create(**greedy, stop=[stop]).choices[0]
    assert (stopped.text, stopped.finish_reason) == (text[:text.index(stop)], "stop")


def test_32_concurrent_streams(server):
    async def one(client, i):
        text, usage = "", None
        stream = await client.completions.create(model="tiny", prompt=f"stream {i}", max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=NEVER_STOP)
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def main():
        async with async_client(server) as client:
            return await asyncio.gather(*[one(client, i) for i in range(32)])

    assert asyncio.run(main()) == [16] * 32
    assert server.wait_idle(KEY)["num_blocks_used"] == 0


def test_disconnect_storm_leaks_no_kv_blocks(server):
    """Streams cut before any token, after one, after a few: every one is aborted and its blocks freed."""
    async def cut(http, i):
        body = {"model": "tiny", "prompt": f"storm {i} " * 4, "max_tokens": 300, "stream": True, **NEVER_STOP}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            num_events = 0
            async for line in response.aiter_lines():
                num_events += line.startswith("data: ")
                if num_events >= i % 3 * 2:
                    break  # leaving the block closes the connection mid-stream

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=30) as http:
            await asyncio.gather(*[cut(http, i) for i in range(30)])

    aborted_before = num_aborted(server)
    asyncio.run(main())
    stats = server.wait_idle(KEY, timeout=5)  # far less than the 300 tokens each would take to finish
    assert stats["num_blocks_used"] == 0, stats
    assert num_aborted(server) - aborted_before == 30


def test_non_streaming_client_that_leaves_is_aborted(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=30) as http:
            request = asyncio.ensure_future(http.post("/v1/completions", json={
                "prompt": "impatient", "max_tokens": 300, **NEVER_STOP}))
            while (await http.get("/debug/stats")).json()["num_running"] == 0:
                await asyncio.sleep(0.02)
            request.cancel()  # closes the connection mid-request
            with pytest.raises(asyncio.CancelledError):
                await request

    aborted_before = num_aborted(server)
    asyncio.run(main())
    assert server.wait_idle(KEY, timeout=5)["num_blocks_used"] == 0
    assert num_aborted(server) - aborted_before == 1


def num_aborted(server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith('dsjax_requests_finished_total{finish_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


def test_realtime_overtakes_queued_bulk(server):
    """18 bulk streams fill the 8 running slots and queue 10; a realtime request sent then is admitted at the
    next free slot, ahead of all 10, and finishes before every one of them. Without lanes it would queue
    behind 8 of them (FCFS) and finish after those. 160 tokens a bulk stream: long enough that none of
    the first 8 finishes while the other 10 are still being sent on a loaded 2-core machine."""
    async def bulk(client, i, first_token, finished):
        stream = await client.completions.create(model="tiny", prompt=f"bulk {i}", max_tokens=160, stream=True,
                                                 extra_body={"priority": "bulk", **NEVER_STOP})
        async for chunk in stream:
            if chunk.choices and i not in first_token:
                first_token[i] = time.monotonic()
        finished[i] = time.monotonic()

    async def main():
        first_token, finished = {}, {}
        async with async_client(server) as client:
            tasks = [asyncio.ensure_future(bulk(client, i, first_token, finished)) for i in range(18)]
            deadline = time.monotonic() + 30
            while len(first_token) < MAX_NUM_SEQS or server.get_json("/debug/stats", KEY)["num_waiting"] < 10:
                assert time.monotonic() < deadline, (len(first_token), server.get_json("/debug/stats", KEY))
                await asyncio.sleep(0.02)
            queued = set(range(18)) - set(first_token)
            assert len(queued) == 10
            await client.completions.create(model="tiny", prompt="urgent", max_tokens=4,
                                            extra_body={"priority": "realtime", **NEVER_STOP})
            realtime_done = time.monotonic()
            await asyncio.gather(*tasks)
        return realtime_done, {i: finished[i] for i in queued}

    realtime_done, queued_finish = asyncio.run(main())
    assert realtime_done < min(queued_finish.values())


def test_engine_fault_is_500_and_the_server_keeps_serving(server, client):
    with pytest.raises(openai.InternalServerError) as failure:
        client.completions.create(model="tiny", prompt="please BOOM", max_tokens=4)
    assert failure.value.body["code"] == "engine_step_failed"
    with pytest.raises(openai.APIError, match="engine step"):
        for _ in client.completions.create(model="tiny", prompt="BOOM again", max_tokens=4, stream=True):
            pass
    assert client.completions.create(model="tiny", prompt="fine", max_tokens=3,
                                     extra_body=NEVER_STOP).usage.completion_tokens == 3
    stats = server.wait_idle(KEY)
    assert stats["num_blocks_used"] == 0 and stats["num_step_failures"] >= 2 and stats["healthy"]


def test_auth(server):
    for key in (None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


BAD_INPUT = [  # (id, raw body, status, error param)
    ("malformed-json", b'{"prompt": "x", ', 400, None),
    ("not-an-object", b'["x"]', 400, None),
    ("missing-prompt", {"max_tokens": 3}, 400, "prompt"),
    ("prompt-wrong-type", {"prompt": 42}, 400, "prompt"),
    ("max-tokens-string", {"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    ("max-tokens-bool", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("max-tokens-zero", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("temperature-negative", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top-p-too-big", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top-k-negative", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("empty-prompt", {"prompt": ""}, 400, "prompt"),
    ("empty-token-prompt", {"prompt": []}, 400, "prompt"),
    ("too-long", {"prompt": "x" * 500, "max_tokens": 100}, 400, "prompt"),
    ("n-too-large", {"prompt": "x", "n": 17}, 400, "n"),
    ("logprobs-too-many", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("empty-stop", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("unknown-field", {"prompt": "x", "max_tokenz": 3}, 400, "max_tokenz"),
    ("bad-priority", {"prompt": "x", "priority": "urgent"}, 400, "priority"),
    ("nan", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("number-overflow", b'{"prompt": "x", "temperature": 1e400}', 400, "temperature"),
    ("too-many-stops", {"prompt": "x", "stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("oversized-body", {"prompt": "x" * (5 << 20)}, 413, None),
    ("chat-no-messages", {"messages": []}, 400, "messages"),
    ("chat-bad-role", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
]


@pytest.mark.parametrize("body, status, param", [case[1:] for case in BAD_INPUT], ids=[case[0] for case in BAD_INPUT])
def test_bad_input(server, body, status, param):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


def test_still_healthy_after_everything(server, client):
    assert server.get_json("/health") == {"status": "ok"}
    assert client.completions.create(model="tiny", prompt="bye", max_tokens=2).usage.completion_tokens <= 2
    assert server.wait_idle(KEY)["num_blocks_used"] == 0


def test_loadtest_briefly(server, tmp_path):
    from dsjax.loadtest.__main__ import main

    out = tmp_path / "loadtest.json"
    summary = main(["--url", server.url, "--api-key", KEY, "--workload", "mixed", "--scale", "0.05",
                    "--max-tokens", "4-8", "--qps", "6", "--duration", "2", "--max-requests", "12", "--out", str(out)])
    assert json.loads(out.read_text())["requests"] == summary["requests"]
    assert 0 < summary["requests"]["sent"] <= 12 and summary["requests"]["ok"] == summary["requests"]["sent"]
    assert summary["ttft_s"]["p50"] > 0 and summary["tpot_s"]["count"] > 0
    assert 0 < summary["batch_efficiency"]["efficiency"] <= 1
