"""A scripted OpenAI-compatible SSE server with known timings, for tests of `nibble bench` (stdlib only).

Streaming chat completions follow one script: headers at once; after --ttfr seconds a role chunk
(choices[0].delta = {role, content: ""}); after --first-token more seconds the first content chunk, then
one content chunk every --itl seconds (--tokens chunks, or max_tokens if smaller); then a usage chunk
(prompt_tokens = the prompt's whitespace-free character count // 4 + --prompt-overhead, or --prompt-tokens
when set) and `data: [DONE]`. Non-streaming requests (the warm-up) answer at once with usage.

--fail-every K --fail-mode M makes every K-th streamed request fail: http500, malformed (a broken JSON
line mid-stream), error_chunk (data: {"error": ...}), hang (stalls for --hang seconds before tokens).

Usage: python fake_sse_server.py --port 0 [...]; prints "listening on PORT" on stdout when ready.
"""
import argparse
import http.server
import json
import socket
import socketserver
import threading
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ttfr", type=float, default=0.2)
    p.add_argument("--first-token", type=float, default=0.05)
    p.add_argument("--itl", type=float, default=0.02)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--prompt-tokens", type=int, default=0)
    p.add_argument("--warmup-prompt-tokens", type=int, default=0, help="usage.prompt_tokens of non-streamed requests")
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--fail-mode", default="http500", choices=["http500", "malformed", "error_chunk", "hang"])
    p.add_argument("--hang", type=float, default=5.0)
    return p.parse_args(argv)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    cfg = None
    counter = 0
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def setup(self):
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send_json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.rstrip("/") == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        else:
            self.send_json(404, {"error": {"message": "not found"}})

    def chunk(self, text):
        data = text.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def event(self, obj):
        self.chunk("data: " + json.dumps(obj) + "\n\n")

    def do_POST(self):
        cfg = self.cfg
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        if self.path.rstrip("/") != "/v1/chat/completions":
            return self.send_json(404, {"error": {"message": "not found"}})
        text = "".join(m.get("content") or "" for m in req["messages"])
        prompt_tokens = cfg.prompt_tokens or len("".join(text.split())) // 4 + 1
        if not req.get("stream"):
            usage = {"prompt_tokens": cfg.warmup_prompt_tokens or prompt_tokens, "completion_tokens": 1}
            return self.send_json(200, {"object": "chat.completion", "usage": usage,
                                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                                     "finish_reason": "length"}]})
        fail = None
        if cfg.fail_every and req.get("stream_options"):
            with Handler.lock:
                Handler.counter += 1
                if Handler.counter % cfg.fail_every == 0:
                    fail = cfg.fail_mode
        if fail == "http500":
            return self.send_json(500, {"error": {"message": "scripted failure"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        base = {"id": "c", "object": "chat.completion.chunk", "model": req["model"]}
        t0 = time.perf_counter()

        def wait_until(t):
            d = t0 + t - time.perf_counter()
            if d > 0:
                time.sleep(d)

        if fail == "hang":
            time.sleep(cfg.hang)
        wait_until(cfg.ttfr)
        self.event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        n = min(cfg.tokens, req.get("max_tokens") or cfg.tokens)
        for i in range(n):
            wait_until(cfg.ttfr + cfg.first_token + i * cfg.itl)
            if fail == "malformed" and i == n // 2:
                self.chunk('data: {"choices": [{"delta": {"content": "x"\n\n')
                continue
            if fail == "error_chunk" and i == n // 2:
                self.event({"error": {"message": "scripted error", "type": "server_error"}})
                break
            self.event({**base, "choices": [{"index": 0, "delta": {"content": f"t{i} "}}]})
        if req.get("stream_options", {}).get("include_usage"):
            self.event({**base, "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                         "total_tokens": prompt_tokens + n}})
        self.chunk("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def main():
    cfg = parse_args()
    Handler.cfg = cfg
    srv = Server(("127.0.0.1", cfg.port), Handler)
    print(f"listening on {srv.server_address[1]}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
