"""`nibble serve` lifecycle over real HTTP: a client that disconnects (streaming or not) frees its
KV blocks at once, a full waiting queue answers 429, and SIGTERM drains in-flight requests for
--shutdown-timeout seconds (0: abort them now) while refusing new ones.
"""
import json
import signal
import socket
import threading
import time

import requests

from server_util import Server, sse_json

CHAT = "/v1/chat/completions"
LONG = {"messages": [{"role": "user", "content": "Go on forever."}], "max_tokens": 30000, "temperature": 0,
        "ignore_eos": True}


def wait_for(pred, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def idle(s):
    return (s.metric("nibble:kv_cache_blocks_used") == 0 and s.metric("vllm:num_requests_running") == 0
            and s.metric("vllm:num_requests_waiting") == 0)


def test_stream_disconnect_frees_blocks():
    s = Server("qwen3_nvfp4_ct", "--max-model-len", 32768)
    try:
        r = s.post(CHAT, dict(LONG, stream=True), stream=True)
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert s.metric("nibble:kv_cache_blocks_used") > 0
        r.close()
        assert wait_for(lambda: idle(s), 5), s.metrics()
        assert s.metric("vllm:request_success_total", finished_reason="abort") == 1
        assert s.metric("vllm:generation_tokens_total") < 30000
    finally:
        assert s.stop() == 0


def test_non_stream_disconnect_frees_blocks():
    s = Server("qwen3_nvfp4_ct", "--max-model-len", 32768)
    try:
        body = json.dumps(LONG).encode()
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert wait_for(lambda: s.metric("vllm:num_requests_running") == 1, 5)
        sock.close()
        assert wait_for(lambda: idle(s), 6), s.metrics()  # noticed by the keepalive probe within ~2 s
        assert s.metric("vllm:request_success_total", finished_reason="abort") == 1
    finally:
        s.stop()


def test_queue_full_is_429():
    s = Server("qwen3_nvfp4_ct", "--max-model-len", 32768, "--max-num-seqs", 1, "--max-queue", 1)
    try:
        first = s.post(CHAT, dict(LONG, stream=True), stream=True)
        assert wait_for(lambda: s.metric("vllm:num_requests_running") == 1)
        second = s.post(CHAT, dict(LONG, stream=True), stream=True)
        assert wait_for(lambda: s.metric("vllm:num_requests_waiting") == 1)
        r = s.post(CHAT, dict(LONG, max_tokens=2))
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "RateLimitError" and r.json()["error"]["code"] == 429
        first.close()
        second.close()
        assert wait_for(lambda: idle(s), 8)
        assert s.post(CHAT, dict(LONG, max_tokens=2)).status_code == 200  # room again
    finally:
        s.stop()


def test_graceful_shutdown_drains():
    # 2000 tokens: long enough to be seen running even on the GPU, where the tiny model decodes a
    # token in well under a millisecond.
    s = Server("qwen3_nvfp4_ct", "--max-model-len", 4096, "--shutdown-timeout", 30)
    result = {}

    def run():
        r = s.post(CHAT, dict(LONG, max_tokens=2000, stream=True), stream=True)
        result["events"] = sse_json(r)

    t = threading.Thread(target=run)
    t.start()
    assert wait_for(lambda: s.metric("vllm:num_requests_running") == 1)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    try:
        r = s.post(CHAT, dict(LONG, max_tokens=2), timeout=5)
        assert r.status_code == 503, r.text  # refused while draining
    except requests.ConnectionError:
        pass
    t.join(60)
    finals = [e["choices"][0]["finish_reason"] for e in result["events"] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finals == ["length"]  # the in-flight request completed
    assert s.proc.wait(30) == 0


def test_shutdown_timeout_zero_aborts():
    s = Server("qwen3_nvfp4_ct", "--max-model-len", 32768, "--shutdown-timeout", 0)
    r = s.post(CHAT, dict(LONG, stream=True), stream=True)
    lines = r.iter_lines()
    next(lines)
    t0 = time.time()
    s.proc.send_signal(signal.SIGTERM)
    events = [json.loads(l[6:]) for l in lines if l and l.startswith(b"data: {")]
    finals = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finals == ["abort"]
    assert s.proc.wait(10) == 0
    assert time.time() - t0 < 4
