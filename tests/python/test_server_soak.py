"""Bounded soak of `nibble serve` on loopback: 200 mixed requests (chat and completions, streaming
and not, n > 1, stop strings, logprobs) at concurrency 16, a quarter of the streams closed early.
It must end with zero leaked KV blocks, no failed request, and metrics that add up.
"""
import concurrent.futures as cf
import random

import requests

from server_util import Server, sse_json


def one(s, i):
    rng = random.Random(i)
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    n = 2 if rng.random() < 0.1 else 1
    body = {"max_tokens": rng.randint(1, 48), "temperature": rng.choice([0, 0.7, 1.0]), "seed": i, "n": n,
            "stream": stream}
    if rng.random() < 0.2:
        body["stop"] = ["e", "th"]
    if rng.random() < 0.2:
        body["logprobs"] = True if chat else 2
    if chat:
        body["messages"] = [{"role": "user", "content": "word " * rng.randint(1, 60)}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = "shared prefix for caching " * 4 + str(i) * rng.randint(1, 30)
        path = "/v1/completions"
    cancel = stream and rng.random() < 0.25
    r = requests.post(s.url + path, json=body, stream=stream, timeout=120)
    assert r.status_code == 200, r.text
    if cancel:
        it = r.iter_lines()
        next(it)
        r.close()
        return "cancelled", 0
    if stream:
        ev = sse_json(r)
        finals = [c["finish_reason"] for e in ev for c in e["choices"] if c["finish_reason"]]
    else:
        finals = [c["finish_reason"] for c in r.json()["choices"]]
    assert len(finals) == n and all(f in ("stop", "length") for f in finals), finals
    return "ok", n


def test_soak():
    s = Server("qwen3_nvfp4_ct", "--max-model-len", 512, "--max-num-seqs", 8, "--max-queue", 64,
               "--num-gpu-blocks-override", 48, "--max-num-batched-tokens", 128)
    try:
        with cf.ThreadPoolExecutor(16) as ex:
            results = list(ex.map(lambda i: one(s, i), range(200)))
        deadline = __import__("time").time() + 10
        while __import__("time").time() < deadline and s.metric("nibble:kv_cache_blocks_used") != 0:
            __import__("time").sleep(0.1)
        assert s.metric("nibble:kv_cache_blocks_used") == 0
        assert s.metric("vllm:num_requests_running") == 0 and s.metric("vllm:num_requests_waiting") == 0
        finished = s.metric("vllm:request_success_total")
        n_seqs_ok = sum(n for r, n in results if r == "ok")
        n_cancelled = sum(1 for r, _ in results if r == "cancelled")
        assert s.metric("vllm:request_success_total", finished_reason="error") == 0
        assert finished >= n_seqs_ok + n_cancelled  # every sequence ended exactly once (n > 1: several)
        assert s.metric("vllm:e2e_request_latency_seconds_count") == finished
        assert s.metric("vllm:time_to_first_token_seconds_count") <= finished
        assert s.metric("vllm:generation_tokens_total") > 0
        assert s.metric("vllm:num_preemptions_total") >= 0
    finally:
        assert s.stop() == 0
