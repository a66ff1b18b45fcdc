"""`nibble serve` black-box over real HTTP on 127.0.0.1 (issue: OpenAI-compatible server).

Every endpoint and request field, SSE framing, stream == non-stream for greedy decoding, concurrent ==
alone, stop strings, logprobs, harmony channels and tool calls for gpt-oss (driven by the test-only
`nibble_forced_output` field, honoured only with the hidden --test-forced-output flag), and the bad-input
table of docs/api.md §4. Disconnects, 429 and shutdown are in test_server_lifecycle.py.
"""
import concurrent.futures as cf
import json

import pytest
import requests

from server_util import MODELS, Server, sse_json

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello to the world."}]


@pytest.fixture(scope="module")
def qwen():
    s = Server("qwen3_nvfp4_ct", "--max-model-len", 256, "--test-forced-output", "--max-request-bytes", 65536)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oss():
    s = Server("gpt_oss_mxfp4", "--max-model-len", 512, "--test-forced-output")
    yield s
    s.stop()


def chat(server, **kw):
    body = {"model": server.name, "messages": MSG, "max_tokens": 12, "temperature": 0}
    body.update(kw)
    return server.post(CHAT, body)


def comp(server, **kw):
    body = {"model": server.name, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    body.update(kw)
    return server.post(COMP, body)


# ---- endpoints -------------------------------------------------------------------------------------

def test_models_health_metrics(qwen):
    r = qwen.get("/v1/models")
    assert r.status_code == 200
    data = r.json()["data"]
    assert data[0]["id"] == "tiny" and data[0]["object"] == "model" and data[0]["max_model_len"] == 256
    assert qwen.get("/health").status_code == 200
    m = qwen.get("/metrics")
    assert m.status_code == 200
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prefix_cache_hits_total"]:
        assert name in m.text, name


def test_chat_shape(qwen):
    r = chat(qwen)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["object"] == "chat.completion" and j["id"].startswith("chatcmpl-") and j["model"] == "tiny"
    c = j["choices"][0]
    assert c["index"] == 0 and c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
    assert c["finish_reason"] in ("stop", "length")
    u = j["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["prompt_tokens"] > 0
    assert u["completion_tokens"] <= 12


def test_completion_shape_and_defaults(qwen):
    r = qwen.post(COMP, {"prompt": "abc", "temperature": 0, "ignore_eos": True})  # no model: fine
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["object"] == "text_completion" and j["id"].startswith("cmpl-")
    assert j["usage"]["completion_tokens"] == 16  # vLLM's default max_tokens for completions
    assert j["choices"][0]["finish_reason"] == "length"


def test_max_tokens_length_and_max_completion_tokens(qwen):
    r = chat(qwen, max_completion_tokens=3, max_tokens=50, ignore_eos=True)
    assert r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("name", sorted(p.name for p in MODELS.iterdir() if (p / "config.json").exists()))
def test_every_model_chats_and_streams(name):
    s = Server(name, "--max-model-len", 512)
    try:
        a = chat(s, max_tokens=10).json()
        b = sse_json(s.post(CHAT, {"messages": MSG, "max_tokens": 10, "temperature": 0, "stream": True}, stream=True))
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in b if e["choices"])
        assert text == (a["choices"][0]["message"]["content"] or "")
    finally:
        assert s.stop() == 0


# ---- streaming -------------------------------------------------------------------------------------

def stream_chat(server, **kw):
    body = {"model": server.name, "messages": MSG, "max_tokens": 12, "temperature": 0, "stream": True}
    body.update(kw)
    r = server.post(CHAT, body, stream=True)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return sse_json(r)


def test_chat_stream_equals_non_stream(qwen):
    full = chat(qwen, max_tokens=20, ignore_eos=True).json()
    events = stream_chat(qwen, max_tokens=20, ignore_eos=True, stream_options={"include_usage": True})
    ids = {e["id"] for e in events}
    assert len(ids) == 1  # one id across chunks
    first = events[0]["choices"][0]
    assert first["delta"]["role"] == "assistant"
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:] if e["choices"])
    content_chunks = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    text = "".join(e["choices"][0]["delta"]["content"] for e in content_chunks)
    assert text == full["choices"][0]["message"]["content"]
    finals = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert "content" not in finals[0]["choices"][0]["delta"]
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"] == full["usage"]
    assert len(content_chunks) <= 20  # at most one chunk per token


def test_completion_stream_equals_non_stream(qwen):
    full = comp(qwen, max_tokens=15).json()
    r = qwen.post(COMP, {"prompt": "Once upon a time", "max_tokens": 15, "temperature": 0, "stream": True}, stream=True)
    events = sse_json(r)
    assert all(e["object"] == "text_completion" for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == full["choices"][0]["text"]
    assert events[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert not any("usage" in e for e in events)  # usage only with include_usage


def test_n_choices_and_seed(qwen):
    j = chat(qwen, n=3, temperature=1.0, seed=7, max_tokens=8).json()
    assert [c["index"] for c in j["choices"]] == [0, 1, 2]
    again = chat(qwen, n=3, temperature=1.0, seed=7, max_tokens=8).json()
    assert [c["message"]["content"] for c in j["choices"]] == [c["message"]["content"] for c in again["choices"]]
    events = stream_chat(qwen, n=2, max_tokens=6)
    assert {e["choices"][0]["index"] for e in events if e["choices"]} == {0, 1}


def test_sampling_fields_accepted(qwen):
    r = chat(qwen, temperature=0.8, top_p=0.9, top_k=5, min_p=0.05, seed=1, presence_penalty=0.5,
             frequency_penalty=0.5, repetition_penalty=1.2, user="x", unknown_field=1)
    assert r.status_code == 200, r.text


# ---- stops -----------------------------------------------------------------------------------------

def test_stop_string_spanning_tokens(qwen):
    forced = "Hello wor" + "ld STOP and more text"
    for stream in (False, True):
        body = {"messages": MSG, "max_tokens": 40, "stop": ["STOP"], "nibble_forced_output": forced, "stream": stream}
        r = qwen.post(CHAT, body, stream=stream)
        if stream:
            ev = sse_json(r)
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in ev if e["choices"])
            reason = [e["choices"][0]["finish_reason"] for e in ev if e["choices"] and e["choices"][0]["finish_reason"]]
        else:
            text = r.json()["choices"][0]["message"]["content"]
            reason = [r.json()["choices"][0]["finish_reason"]]
        assert text == "Hello world ", text
        assert reason == ["stop"]


def test_stop_string_in_completions_and_token_ids(qwen):
    forced = "abc<|im_end|>def"
    j = qwen.post(COMP, {"prompt": "x", "max_tokens": 20, "nibble_forced_output": "one two three", "stop": "two"}).json()
    assert j["choices"][0]["text"] == "one " and j["choices"][0]["finish_reason"] == "stop"
    ids = qwen.post("/tokenize", {"prompt": "one two three"}).json()["tokens"]
    j = qwen.post(COMP, {"prompt": "x", "max_tokens": 20, "nibble_forced_output": ids, "stop_token_ids": [ids[1]]}).json()
    assert j["choices"][0]["finish_reason"] == "stop"
    assert j["choices"][0]["text"] == "one"
    j = chat(qwen, max_tokens=20, nibble_forced_output=forced).json()  # <|im_end|> ends the chat turn
    assert j["choices"][0]["message"]["content"] == "abc" and j["choices"][0]["finish_reason"] == "stop"


# ---- logprobs --------------------------------------------------------------------------------------

def test_chat_logprobs(qwen):
    j = chat(qwen, logprobs=True, top_logprobs=3, max_tokens=6, ignore_eos=True).json()
    lp = j["choices"][0]["logprobs"]["content"]
    assert len(lp) == 6
    for e in lp:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 3 and isinstance(e["bytes"], list)
        assert e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6  # greedy picks the top one
    ev = stream_chat(qwen, logprobs=True, top_logprobs=2, max_tokens=6, ignore_eos=True)
    streamed = [x for e in ev if e["choices"] and e["choices"][0]["logprobs"] for x in e["choices"][0]["logprobs"]["content"]]
    assert [x["token"] for x in streamed] == [x["token"] for x in lp]


def test_completion_logprobs(qwen):
    j = comp(qwen, logprobs=2, max_tokens=5, ignore_eos=True).json()
    lp = j["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(v <= 0 for v in lp["token_logprobs"]) and all(len(t) <= 2 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0


# ---- tokenize --------------------------------------------------------------------------------------

def test_tokenize_detokenize(qwen):
    t = qwen.post("/tokenize", {"prompt": "Hello, world!"}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 256
    assert qwen.post("/detokenize", {"tokens": t["tokens"]}).json()["prompt"] == "Hello, world!"
    m = qwen.post("/tokenize", {"messages": MSG}).json()
    assert m["count"] == chat(qwen, max_tokens=1).json()["usage"]["prompt_tokens"]
    assert qwen.post("/detokenize", {"tokens": [10 ** 9]}).status_code == 400
    assert qwen.post("/detokenize", {"tokens": "x"}).status_code == 400


def test_prompt_as_token_ids_and_echo(qwen):
    ids = qwen.post("/tokenize", {"prompt": "Once upon a time"}).json()["tokens"]
    a = comp(qwen).json()["choices"][0]["text"]
    b = qwen.post(COMP, {"prompt": ids, "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"]
    assert a == b
    e = qwen.post(COMP, {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "echo": True}).json()
    assert e["choices"][0]["text"] == "Once upon a time" + a


# ---- gpt-oss harmony --------------------------------------------------------------------------------

REASON_FINAL = ("<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final"
                "<|message|>Hello there!<|return|>")
TOOL_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
             "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def test_harmony_reasoning_and_content(oss):
    j = chat(oss, nibble_forced_output=REASON_FINAL, max_tokens=100, reasoning_effort="high").json()
    m = j["choices"][0]["message"]
    assert m["reasoning_content"] == "The user greets."
    assert m["content"] == "Hello there!"
    assert j["choices"][0]["finish_reason"] == "stop"
    ev = stream_chat(oss, nibble_forced_output=REASON_FINAL, max_tokens=100)
    deltas = [e["choices"][0]["delta"] for e in ev if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user greets."
    assert "".join(d.get("content", "") for d in deltas) == "Hello there!"
    assert "<|" not in json.dumps(deltas)


def test_harmony_tool_call(oss):
    j = chat(oss, nibble_forced_output=TOOL_CALL, tools=TOOLS, max_tokens=100).json()
    c = j["choices"][0]
    assert c["finish_reason"] == "tool_calls"
    assert c["message"]["content"] is None
    call = c["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    ev = stream_chat(oss, nibble_forced_output=TOOL_CALL, tools=TOOLS, max_tokens=100)
    calls = [tc for e in ev if e["choices"] for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"city": "Paris"}
    assert [e["choices"][0]["finish_reason"] for e in ev if e["choices"] and e["choices"][0]["finish_reason"]] == ["tool_calls"]


def test_harmony_tool_choice_named_and_required(oss):
    # Named: the prompt already ends with the tool's header, so the model only writes the arguments.
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        body = dict(nibble_forced_output='{"city": "Rome"}<|call|>', tools=TOOLS, tool_choice=named, max_tokens=50)
        if stream:
            ev = stream_chat(oss, **body)
            calls = [tc for e in ev if e["choices"] for tc in e["choices"][0]["delta"].get("tool_calls", [])]
            name, args = calls[0]["function"]["name"], "".join(tc["function"]["arguments"] for tc in calls)
            finals = [e["choices"][0]["finish_reason"] for e in ev if e["choices"] and e["choices"][0]["finish_reason"]]
            assert finals == ["tool_calls"]
        else:
            c = chat(oss, **body).json()["choices"][0]
            assert c["finish_reason"] == "tool_calls"
            call = c["message"]["tool_calls"][0]
            name, args = call["function"]["name"], call["function"]["arguments"]
        assert name == "get_weather" and json.loads(args) == {"city": "Rome"}
    # Required: channel and `functions.` are fixed; the model names the function.
    c = chat(oss, nibble_forced_output='get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>',
             tools=TOOLS, tool_choice="required", max_tokens=50).json()["choices"][0]
    assert c["finish_reason"] == "tool_calls"
    assert c["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    # The prefilled header is part of the prompt.
    with_choice = chat(oss, tools=TOOLS, tool_choice=named, max_tokens=1).json()["usage"]["prompt_tokens"]
    without = chat(oss, tools=TOOLS, max_tokens=1).json()["usage"]["prompt_tokens"]
    assert with_choice > without


def test_harmony_tool_history_renders(oss):
    msgs = MSG + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 20}"}]
    r = oss.post(CHAT, {"messages": msgs, "tools": TOOLS, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text


def test_forced_output_needs_the_flag():
    s = Server("qwen3_nvfp4_ct", "--max-model-len", 128)
    try:
        j = chat(s, max_tokens=4, ignore_eos=True, nibble_forced_output="zzzzzzzz").json()
        assert j["usage"]["completion_tokens"] == 4 and "zzzz" not in j["choices"][0]["message"]["content"]
    finally:
        s.stop()


# ---- bad input (docs/api.md §4) --------------------------------------------------------------------

def assert_error(r, status, *needles, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    e = r.json()["error"]
    assert set(e) >= {"message", "type", "param", "code"} and e["code"] == status
    for n in needles:
        assert n in e["message"], e["message"]
    if param is not None:
        assert e["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_context(qwen, stream):
    long_text = "hello " * 400
    r = qwen.post(CHAT, {"messages": [{"role": "user", "content": long_text}], "stream": stream}, stream=stream)
    assert_error(r, 400, "maximum context length is 256 tokens", "input tokens")
    r = qwen.post(COMP, {"prompt": long_text, "stream": stream}, stream=stream)
    assert_error(r, 400, "maximum context length", param="prompt")


BAD = [
    ({"messages": MSG, "max_tokens": 1000}, 400, "too large: 1000"),
    ({"messages": MSG, "model": "gpt-9"}, 404, "does not exist"),
    ({"messages": MSG, "temperature": "hot"}, 400, "'temperature' must be a number"),
    ({"messages": MSG, "temperature": -1}, 400, "temperature"),
    ({"messages": MSG, "top_p": 0}, 400, "top_p"),
    ({"messages": MSG, "max_tokens": "5"}, 400, "'max_tokens' must be an integer"),
    ({"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": MSG, "n": 0}, 400, "'n'"),
    ({"messages": MSG, "n": 129}, 400, "'n'"),
    ({"messages": MSG, "stream": "yes"}, 400, "'stream' must be a boolean"),
    ({"messages": MSG, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "greater than max allowed: 20"),
    ({"messages": MSG, "presence_penalty": 3}, 400, "presence_penalty"),
    ({"messages": MSG, "stop": [1.5]}, 400, "stop"),
    ({"messages": MSG, "seed": "x"}, 400, "seed"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({}, 400, "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, 400, "unknown role"),
    ({"messages": [{"role": "user"}]}, 400, "content"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ({"messages": MSG, "tools": []}, 400, "tools"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"description": "x"}}]}, 400, "name"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, 400, "parameters"),
    ({"messages": MSG, "tool_choice": "auto"}, 400, "tool_choice"),
    ({"messages": MSG, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "nope"),
    ({"messages": MSG, "reasoning_effort": "extreme"}, 400, "reasoning_effort"),
    ({"messages": MSG, "chat_template_kwargs": 3}, 400, "chat_template_kwargs"),
    ({"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format"),
]


@pytest.mark.parametrize("body,status,needle", BAD)
def test_bad_chat_requests(qwen, body, status, needle):
    assert_error(qwen.post(CHAT, body), status, needle)
    if status == 400 and body.get("messages") and isinstance(body["messages"], list) and not (
            {"stream", "stream_options"} & set(body)):
        assert_error(qwen.post(CHAT, dict(body, stream=True), stream=True), status, needle)  # before any SSE byte


def test_bad_completion_requests(qwen):
    assert_error(qwen.post(COMP, {"prompt": [1, 2, 10 ** 7]}), 400, "outside the vocabulary")
    assert_error(qwen.post(COMP, {"prompt": ""}), 400, "empty")
    assert_error(qwen.post(COMP, {"prompt": 5}), 400, "prompt")
    assert_error(qwen.post(COMP, {"prompt": ["a", "b"]}), 400, "several prompts")
    assert_error(qwen.post(COMP, {"prompt": "a", "logprobs": 30}), 400, "max allowed")
    assert_error(qwen.post(COMP, {}), 400, "prompt")


def test_bad_bodies(qwen):
    url = qwen.url + CHAT
    assert_error(requests.post(url, data="{not json", timeout=30), 400, "not valid JSON")
    assert_error(requests.post(url, data="[1, 2]", timeout=30), 400, "JSON object")
    assert_error(requests.post(url, data=json.dumps({"messages": MSG, "pad": "x" * 70000}), timeout=30), 413)
    assert_error(qwen.get("/v1/nothing"), 404)


def test_failing_request_does_not_disturb_others(qwen):
    with cf.ThreadPoolExecutor(8) as ex:
        good = [ex.submit(lambda: chat(qwen, max_tokens=10, ignore_eos=True)) for _ in range(4)]
        bad = [ex.submit(lambda: qwen.post(CHAT, {"messages": MSG, "max_tokens": -1})) for _ in range(4)]
        assert all(f.result().status_code == 400 for f in bad)
        assert all(f.result().json()["usage"]["completion_tokens"] == 10 for f in good)


def test_concurrent_equals_alone(qwen):
    prompts = [f"Story number {i}: once upon a time" for i in range(8)]
    alone = [comp(qwen, prompt=p, max_tokens=16, ignore_eos=True).json()["choices"][0]["text"] for p in prompts]
    with cf.ThreadPoolExecutor(8) as ex:
        together = list(ex.map(lambda p: comp(qwen, prompt=p, max_tokens=16, ignore_eos=True).json()["choices"][0]["text"],
                               prompts))
    assert together == alone


def test_sync_scheduling_equals_async(qwen):
    """--no-async-scheduling (each step's ids read before the next step is queued) serves the same tokens as
    the default, which queues each step first: seeded sampling, stops and concurrent requests included."""
    sync = Server("qwen3_nvfp4_ct", "--max-model-len", 256, "--no-async-scheduling")
    try:
        assert any("async_scheduling=off" in line for line in sync.stderr_lines)
        assert any("async_scheduling=on" in line for line in qwen.stderr_lines)
        prompts = [f"Story number {i}: once upon a time" for i in range(6)]
        bodies = [dict(prompt=p, max_tokens=12 + i, ignore_eos=i % 2 == 0, seed=i, temperature=0.0 if i % 3 else 0.8)
                  for i, p in enumerate(prompts)]
        def texts(server):
            with cf.ThreadPoolExecutor(6) as ex:
                return list(ex.map(lambda b: comp(server, **b).json()["choices"][0]["text"], bodies))
        assert texts(sync) == texts(qwen)
    finally:
        sync.stop()


def test_prefix_cache_hits(qwen):
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 6
    before = qwen.metric("vllm:prefix_cache_hits_total")
    comp(qwen, prompt=long_prompt, max_tokens=2)
    j = comp(qwen, prompt=long_prompt, max_tokens=2).json()
    assert j["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert qwen.metric("vllm:prefix_cache_hits_total") - before >= 16


# ---- API key and CORS ------------------------------------------------------------------------------

def test_api_key_and_cors():
    s = Server("qwen3_nvfp4_ct", "--max-model-len", 128, "--api-key", "sekret", "--allowed-origins", "http://a.example")
    try:
        assert_error(s.post(CHAT, {"messages": MSG, "max_tokens": 2}), 401)
        assert_error(s.post(CHAT, {"messages": MSG}, headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(s.get("/v1/models"), 401)
        ok = s.post(CHAT, {"messages": MSG, "max_tokens": 2}, headers={"Authorization": "Bearer sekret",
                                                                      "Origin": "http://a.example"})
        assert ok.status_code == 200 and ok.headers["Access-Control-Allow-Origin"] == "http://a.example"
        assert s.get("/health").status_code == 200 and s.get("/metrics").status_code == 200
        pre = requests.options(s.url + CHAT, headers={"Origin": "http://a.example"}, timeout=10)
        assert pre.status_code == 204 and "POST" in pre.headers["Access-Control-Allow-Methods"]
        other = s.get("/health", headers={"Origin": "http://b.example"})
        assert "Access-Control-Allow-Origin" not in other.headers
    finally:
        s.stop()


def test_no_cors_by_default(qwen):
    r = qwen.get("/health", headers={"Origin": "http://a.example"})
    assert "Access-Control-Allow-Origin" not in r.headers
