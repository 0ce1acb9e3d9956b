"""A stand-in for ``vllm serve`` on CPU tests: the OpenAI routes vLLM's multi-turn client uses
(streamed chat completions, /v1/models, /version), a completion for warm-ups, and a Prometheus
/metrics page in vLLM 0.23's format whose counters grow with the tokens served."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeVLLM:
    """``with FakeVLLM(name) as url``: a server on a free port; ``requests`` lists what it got."""

    def __init__(self, name: str = "m", token_s: float = 0.0, words_per_chunk: int = 1):
        self.name, self.token_s, self.words_per_chunk = name, token_s, words_per_chunk
        self.requests: list[dict] = []
        self.counters = {"prompt": 0, "hits": 0, "load_bytes": 0, "store_bytes": 0}
        self._lock = threading.Lock()

    def metrics(self) -> str:
        c = self.counters
        eng = 'engine="0",model_name="%s"' % self.name
        return "\n".join([
            "# HELP vllm:prefix_cache_queries_total x", "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{eng}}} {c['prompt']}.0",
            f"vllm:prefix_cache_hits_total{{{eng}}} {c['hits'] // 2}.0",
            f"vllm:external_prefix_cache_queries_total{{{eng}}} {c['prompt']}.0",
            f"vllm:external_prefix_cache_hits_total{{{eng}}} {c['hits']}.0",
            f'vllm:kv_offload_total_bytes_total{{{eng},transfer_type="CPU_to_GPU"}} {c["load_bytes"]}.0',
            f'vllm:kv_offload_total_bytes_total{{{eng},transfer_type="GPU_to_CPU"}} {c["store_bytes"]}.0',
            f'vllm:kv_offload_total_time_total{{{eng},transfer_type="CPU_to_GPU"}} {c["load_bytes"] / 5e10}',
            f'vllm:kv_offload_total_time_total{{{eng},transfer_type="GPU_to_CPU"}} {c["store_bytes"] / 5e10}',
            f"vllm:num_preemptions_total{{{eng}}} 0.0", ""])

    def __enter__(self) -> str:
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _json(self, obj, code=200):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._json({"data": [{"id": fake.name, "max_model_len": 8192}]})
                if self.path == "/version":
                    return self._json({"version": "fake"})
                if self.path == "/metrics":
                    body = fake.metrics().encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    return self.wfile.write(body)
                if self.path == "/health":
                    return self._json({})
                self._json({"error": "no route"}, 404)

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake._lock:
                    fake.requests.append(req)
                n = int(req.get("max_tokens") or 8)
                words = [f"w{(7 * i) % 500}" for i in range(n)]
                if self.path == "/v1/completions":
                    return self._json({"choices": [{"text": " ".join(words)}]})
                text = " ".join(m["content"] for m in req["messages"])
                prompt = len(text.split())
                with fake._lock:  # a history of earlier turns counts as an offload hit
                    c = fake.counters
                    hit = prompt - len(req["messages"][-1]["content"].split()) if len(req["messages"]) > 1 else 0
                    c["prompt"] += prompt
                    c["hits"] += hit
                    c["load_bytes"] += hit * 1024
                    c["store_bytes"] += prompt * 1024
                if not req.get("stream"):
                    return self._json({"choices": [{"message": {"role": "assistant", "content": " ".join(words)}}]})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                k = fake.words_per_chunk
                for i in range(0, n, k):
                    piece = (" " if i else "") + " ".join(words[i:i + k])
                    chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    if fake.token_s:
                        time.sleep(fake.token_s)
                self.wfile.write(b"data: [DONE]\n\n")

        self._srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self._srv.daemon_threads = True
        self._thread = threading.Thread(target=self._srv.serve_forever, daemon=True)
        self._thread.start()
        return f"http://127.0.0.1:{self._srv.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self._srv.shutdown()
        self._srv.server_close()
