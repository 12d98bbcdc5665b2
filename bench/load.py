"""Many clients against an OpenAI-compatible server: qspec serve, or llama.cpp's llama-server.

`sweep` sends, for each client count C, C clients' worth of streamed /v1/completions requests
(greedy, token ids as the prompt, `max_tokens` new tokens each, every client sending its next
request as soon as the last one ended) and reports, from the client side:
  aggregate tok/s   completion tokens of all requests / wall time from the first send to the last end
  request tok/s     median over requests of (tokens - 1) / (last chunk - first chunk)
  TTFT p50          request sent -> first chunk
  step gap p50/p99  time between a stream's consecutive chunk bursts (chunks < 1 ms apart are
                    one burst: a speculative step emits several tokens at once)
`admission` measures what a long prompt does to running streams: `clients` streams run, then a
prompt of `long_tokens` tokens is sent; the step gaps of the running streams while it is
prefilled (send -> its first token), p99, against their p50 over the whole run.
"""

from __future__ import annotations

import http.client
import json
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field

BURST_S = 1e-3


@dataclass
class Stream:
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival times (absolute perf_counter)
    tokens: int = 0
    ended: float = 0.0

    def gaps(self, lo: float = 0.0, hi: float = float("inf")) -> list[float]:
        """Gaps between consecutive bursts that overlap [lo, hi) (a stream frozen through the
        whole window counts with the one gap that spans it)."""
        bursts = [t for i, t in enumerate(self.chunks) if i == 0 or t - self.chunks[i - 1] >= BURST_S]
        return [b - a for a, b in zip(bursts, bursts[1:]) if b > lo and a < hi]


def stream_request(port: int, body: dict, timeout: float = 900, s: Stream | None = None) -> Stream:
    """One streamed /v1/completions request; its chunk arrival times and completion tokens
    (recorded into `s` as they arrive, when given)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    s = s or Stream(0.0)
    s.sent = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True,
                                                                  "stream_options": {"include_usage": True}}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read().decode()[:300]}")
        texts = 0
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                s.tokens = int(ev["usage"]["completion_tokens"])
            if ev.get("choices") and ev["choices"][0].get("text"):
                s.chunks.append(time.perf_counter())
                texts += 1
        s.tokens = s.tokens or texts
    finally:
        conn.close()
    s.ended = time.perf_counter()
    return s


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_clients(port: int, model: str, prompts: list[list[int]], clients: int, per_client: int,
                max_tokens: int) -> dict:
    """`clients` threads, each sending `per_client` requests one after another."""
    results: list[Stream] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(per_client):
            ids = prompts[(c * per_client + r) % len(prompts)]
            try:
                s = stream_request(port, {"model": model, "prompt": ids, "max_tokens": max_tokens,
                                          "temperature": 0})
            except (OSError, RuntimeError) as e:
                with lock:
                    errors.append(str(e))
                return
            with lock:
                results.append(s)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    wall = max(s.ended for s in results) - t0
    gaps = [g for s in results for g in s.gaps()]
    rates = [(s.tokens - 1) / (s.chunks[-1] - s.chunks[0]) for s in results
             if len(s.chunks) > 1 and s.chunks[-1] > s.chunks[0]]
    return {"clients": clients, "requests": len(results), "tokens": sum(s.tokens for s in results),
            "aggregate_tok_s": sum(s.tokens for s in results) / wall,
            "request_tok_s": statistics.median(rates) if rates else 0.0,
            "ttft_p50_ms": 1e3 * _pct([s.chunks[0] - s.sent for s in results if s.chunks], 0.5),
            "gap_p50_ms": 1e3 * _pct(gaps, 0.5), "gap_p99_ms": 1e3 * _pct(gaps, 0.99)}


def admission(port: int, model: str, prompts: list[list[int]], long_prompt: list[int], clients: int,
              max_tokens: int) -> dict:
    """Running streams' step gaps while a long prompt is prefilled, against their p50. The long
    prompt is sent once every stream has its first tokens."""
    streams = [Stream(0.0) for _ in range(clients)]

    def client(c: int) -> None:
        stream_request(port, {"model": model, "prompt": prompts[c % len(prompts)], "max_tokens": max_tokens,
                              "temperature": 0}, s=streams[c])

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    while any(len(s.chunks) < 3 and not s.ended for s in streams):
        time.sleep(0.01)
    long = stream_request(port, {"model": model, "prompt": long_prompt, "max_tokens": 2, "temperature": 0})
    for t in threads:
        t.join()
    lo, hi = long.sent, long.chunks[0] if long.chunks else long.ended
    during = [g for s in streams for g in s.gaps(lo, hi)]
    allg = [g for s in streams for g in s.gaps()]
    p50, p99 = _pct(allg, 0.5), _pct(during, 0.99)
    return {"clients": clients, "long_prompt_tokens": len(long_prompt), "long_ttft_s": hi - lo,
            "gaps_during": len(during), "gap_p50_ms": 1e3 * p50, "gap_p99_during_ms": 1e3 * p99,
            "p99_over_p50": p99 / p50 if p50 else 0.0}


class LlamaServer:
    """llama.cpp's llama-server on a loopback port: `binary -m GGUF -np N -c N*ctx -t threads`
    (continuous batching over N slots, its default), once /health answers."""

    def __init__(self, binary: str, gguf: str, slots: int, ctx: int, threads: int, port: int,
                 log_path=None, start_timeout: float = 600):
        self.port = port
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([binary, "-m", gguf, "-np", str(slots), "-c", str(slots * ctx), "-t", str(threads),
                                      "--host", "127.0.0.1", "--port", str(port)], stdout=self._log, stderr=self._log)
        deadline = time.time() + start_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with status {self.proc.returncode}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("llama-server did not answer /health in time")

    def prefill_s(self, ids: list[int]) -> float:
        """Seconds llama-server spends on the prompt `ids` (its own timings.prompt_ms; no cached prefix)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        conn.request("POST", "/completion", json.dumps({"prompt": ids, "n_predict": 1, "cache_prompt": False}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        body = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"llama-server answered {r.status}: {body}")
        if body["timings"]["prompt_n"] != len(ids):
            raise RuntimeError(f"llama-server prefilled {body['timings']['prompt_n']} of {len(ids)} tokens")
        return body["timings"]["prompt_ms"] / 1e3

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
