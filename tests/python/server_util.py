"""Starts `nibble serve` on 127.0.0.1 with a free port for the server tests and stops it (SIGTERM).

The binary comes from NIBBLE_BIN (scripts/test.sh sets it). Tiny committed checkpoints make every
request fast on the CPU backend; their weights are random, so tests assert shapes, invariants and
equalities (stream == non-stream, concurrent == alone), never particular text.
"""
import json
import os
import pathlib
import signal
import socket
import subprocess
import time

import requests

ROOT = pathlib.Path(__file__).resolve().parents[2]
NIBBLE = os.environ.get("NIBBLE_BIN", str(ROOT / "build" / "src" / "nibble"))
MODELS = ROOT / "tests" / "data" / "models"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model="qwen3_nvfp4_ct", *flags, name="tiny"):
        self.port = free_port()
        self.name = name
        self.args = [NIBBLE, "serve", "-m", str(MODELS / model), "--port", str(self.port), "--threads", "1",
                     "--served-model-name", name, *map(str, flags)]
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr_lines = []
        deadline = time.time() + 60
        while True:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"nibble serve exited ({self.proc.wait()}): {''.join(self.stderr_lines)}")
            self.stderr_lines.append(line)
            if "ready on" in line:
                break
            if time.time() > deadline:
                raise RuntimeError("nibble serve did not become ready")
        self.url = f"http://127.0.0.1:{self.port}"

    def post(self, path, body, **kw):
        return requests.post(self.url + path, json=body, timeout=kw.pop("timeout", 120), **kw)

    def get(self, path, **kw):
        return requests.get(self.url + path, timeout=kw.pop("timeout", 60), **kw)

    def metrics(self):
        """Prometheus text -> {series (name and labels): value}."""
        out = {}
        for line in self.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def metric(self, name, **labels):
        """Sum over the series of `name` whose labels include `labels`."""
        total = 0.0
        for key, v in self.metrics().items():
            base = key.split("{")[0]
            if base == name and all(f'{k}="{val}"' in key for k, val in labels.items()):
                total += v
        return total

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rest = self.proc.communicate(timeout=timeout)[1]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rest = self.proc.communicate()[1]
        self.stderr_lines.append(rest or "")
        return self.proc.returncode


def sse_events(resp):
    """Parses an SSE response into a list of payload strings (JSON text or [DONE]); skips comments."""
    events = []
    for raw in resp.iter_lines():
        line = raw.decode("utf-8")
        if not line or line.startswith(":"):
            continue
        assert line.startswith("data: "), line
        events.append(line[len("data: "):])
    return events


def sse_json(resp):
    ev = sse_events(resp)
    assert ev and ev[-1] == "[DONE]", ev[-3:]
    return [json.loads(e) for e in ev[:-1]]
