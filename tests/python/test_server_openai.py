"""Conformance of `nibble serve` with the official `openai` Python SDK: chat, completions, streaming
with usage, tool calls (gpt-oss harmony, scripted through the test-only nibble_forced_output field),
error mapping to the SDK's exception types, and closing a stream mid-way (the server frees it).
"""
import json
import time

import openai
import pytest

from server_util import Server

MSG = [{"role": "user", "content": "Say hello."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_CALL = ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}"
             "<|call|>")


@pytest.fixture(scope="module")
def server():
    s = Server("gpt_oss_mxfp4", "--max-model-len", 4096, "--test-forced-output", "--api-key", "k")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completions(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens <= 5


def test_stream_with_usage_equals_non_stream(client):
    full = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (full.choices[0].message.content or "")


def test_tool_calls(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, max_tokens=64,
                                       extra_body={"nibble_forced_output": TOOL_CALL})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    stream = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, max_tokens=64, stream=True,
                                            extra_body={"nibble_forced_output": TOOL_CALL})
    args, name, reason = "", None, None
    for ch in stream:
        if not ch.choices:
            continue
        for tc in ch.choices[0].delta.tool_calls or []:
            name = name or tc.function.name
            args += tc.function.arguments or ""
        reason = ch.choices[0].finish_reason or reason
    assert name == "get_weather" and json.loads(args) == {"city": "Oslo"} and reason == "tool_calls"


def test_error_mapping(server, client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x " * 5000}])
    assert "maximum context length" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=10 ** 6)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MSG, n=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MSG, tools=[{"type": "function", "function": {}}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()


def test_abort_mid_stream(server, client):
    stream = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3000, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    deadline = time.time() + 5
    while time.time() < deadline and server.metric("nibble:kv_cache_blocks_used") != 0:
        time.sleep(0.05)
    assert server.metric("nibble:kv_cache_blocks_used") == 0
    assert server.metric("vllm:request_success_total", finished_reason="abort") >= 1
