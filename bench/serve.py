"""`qspec serve` under load: `qspec bench serve [--model NAME|DIR] [--prompt-file F] [--threads N] [--quick]
[--json PATH] [--prompts N] [--max-new N] [--reps N] [--clients 1,2,4,8,16] [--per-client N] [--max-tokens N]
[--long-prompt N] [--peer-server BIN --peer-gguf FILE] [--turns T]` (or `python -m bench.serve ...`).

A server process on a loopback port (`python -m qspec.cli serve --parallel max(clients)`, the
default draft) and an Engine of the same model in this process. Greedy, speculative.
- stream: per prompt, Engine.tokens and a streamed /v1/completions request of the same prompt
  (token ids as the prompt: no template), interleaved `--reps` times. Decode tok/s = (tokens - 1)
  / (last token - first token), both timed by their consumer (this process); the server's
  tok/s is taken at the client, over HTTP and SSE. Reported: latency to the first token (client:
  request sent -> first chunk), both tok/s and their ratio (target: >= 97%).
- load: for each client count C (`--clients`), C clients each send `--per-client` streamed
  requests of `--max-tokens` new tokens back to back (bench/load.py): aggregate tok/s, per-request
  tok/s, TTFT p50, step gap p50/p99; the same against llama.cpp's llama-server (`--peer-server`,
  `-np C` slots, continuous batching) on `--peer-gguf` (the same weights in BF16), when given.
- admission: 4 streams run while a `--long-prompt`-token prompt is sent; the p99 of their step
  gaps while it is prefilled against their p50 (target: <= 3x).
- multi-turn: a `--turns`-turn chat (each turn: the chat so far, its answer, a new question)
  in the Engine, with prefix reuse and again with every prompt prefilled in full (kv.forget());
  total prefill seconds of each and their ratio (target: <= 30%).
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import statistics
import subprocess
import sys
import time

from .common import (JsonWriter, dev_prompts, fmt_table, free_port, model_parser, parent_parser,
                     positive_int, print_header, setup)
from .load import LlamaServer, admission, run_clients
from .long_prompts import long_prompts
from .models import load_engine, model_label

QUESTIONS = ["What is a CPU cache?", "Why does it matter for matrix multiplication?",
             "Give an example with numbers.", "How does a GPU differ here?", "Summarize in one sentence.",
             "What should I read next?", "Thanks! One more: what is SIMD?", "And AVX-512?"]


class ServerProcess:
    """`python -m qspec.cli serve ARGS` on a free loopback port, once /health answers (the tests
    drive the server through this too)."""

    def __init__(self, *args: str, log_path=None, start_timeout: float = 300):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "qspec.cli", "serve", "--port", str(self.port), *args],
                                     stdout=self._log, stderr=self._log)
        deadline = time.time() + start_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"qspec serve exited with status {self.proc.returncode}: {self.log_text()}")
            try:
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"qspec serve did not answer /health within {start_timeout:.0f} s")

    def log_text(self) -> str:
        return open(self.log_path).read() if self.log_path else ""

    def request(self, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 120):
        """(status, headers (case-insensitive), the JSON body parsed, or its text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=json.dumps(body) if isinstance(body, (dict, list)) else body,
                         headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            raw = r.read().decode()
            try:
                return r.status, r.headers, json.loads(raw)
            except json.JSONDecodeError:
                return r.status, r.headers, raw
        finally:
            conn.close()

    def stream(self, path: str, body: dict, timeout: float = 300):
        """Yields (seconds since the request was sent, event) for each server-sent event."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            t0 = time.perf_counter()
            conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                raise RuntimeError(f"{path}: HTTP {r.status}: {r.read().decode()}")
            for line in r:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    yield time.perf_counter() - t0, json.loads(line[6:])
        finally:
            conn.close()

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.proc.returncode


def direct_run(eng, ids: list[int], max_new: int) -> dict:
    t0 = time.perf_counter()
    times = [time.perf_counter() - t0 for _ in eng.tokens(ids, max_new_tokens=max_new)]
    return {"first_s": times[0], "tokens": len(times), "tokens_per_s": _rate(times)}


def served_run(srv: ServerProcess, model: str, ids: list[int], max_new: int) -> dict:
    times, n = [], 0
    for t, ev in srv.stream("/v1/completions", {"model": model, "prompt": ids, "max_tokens": max_new,
                                                "temperature": 0, "stream_options": {"include_usage": True}}):
        if ev.get("usage"):
            n = ev["usage"]["completion_tokens"]
        elif ev["choices"][0]["text"]:
            times.append(t)
    return {"first_s": times[0], "tokens": n,
            "tokens_per_s": (n - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0}


def _rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


def multi_turn(eng, turns: int, max_new: int) -> dict:
    """Total prefill seconds of a `turns`-turn chat with prefix reuse and with full prefills."""
    chats, messages = [], []
    for q in (QUESTIONS * turns)[:turns]:
        messages = messages + [{"role": "user", "content": q}]
        chats.append(messages)
        answer = eng.generate(messages, max_new_tokens=max_new).text
        messages = messages + [{"role": "assistant", "content": answer}]
    reuse = full = 0.0
    cached = 0
    eng.backend.kv.forget()  # the first turn has nothing before it
    for chat in chats:  # interleaved: each turn with reuse, then in full
        r = eng.generate(chat, max_new_tokens=max_new)
        reuse += r.stats["prefill_s"]
        cached += r.stats["cached_prompt_tokens"]
        eng.backend.kv.forget()
        # ... which leaves in the cache this turn's prompt and answer, as the next turn expects
        full += eng.generate(chat, max_new_tokens=max_new).stats["prefill_s"]
    return {"case": "multi_turn", "turns": turns, "prompt_tokens_last": len(eng.encode_messages(chats[-1])),
            "cached_tokens": cached, "prefill_reuse_s": reuse, "prefill_full_s": full,
            "reuse_pct": 100 * reuse / full}


def load_rows(port: int, model: str, prompts: list[list[int]], args, server: str, label: str) -> list[dict]:
    rows = []
    for c in args.clients:
        row = {"model": label, "case": "load", "server": server,
               **run_clients(port, model, prompts, c, args.per_client, args.max_tokens)}
        rows.append(row)
        print(f"# {server}, {c} clients: {row['aggregate_tok_s']:.1f} tok/s in all, {row['request_tok_s']:.1f} "
              f"per request, TTFT {row['ttft_p50_ms']:.0f} ms, step gap p50 {row['gap_p50_ms']:.0f} / p99 "
              f"{row['gap_p99_ms']:.0f} ms", flush=True)
    return rows


def run(args) -> list[dict]:
    setup(args)
    ctx = print_header(args, "bench.serve: qspec serve vs Engine, clients 1..N (vs llama-server), admission, "
                             "multi-turn prefix reuse")
    out = JsonWriter(args.json, ctx)
    eng = load_engine(args, "auto")
    label = model_label(eng)
    prompts = dev_prompts(args.prompt_file, min(args.prompts, 2) if args.quick else args.prompts)
    max_new = min(args.max_new, 32) if args.quick else args.max_new
    slots = max(args.clients)
    srv_args = ["-t", str(args.threads), "--parallel", str(slots), "--max-queue", str(max(16, 2 * slots))]
    srv = ServerProcess(*srv_args, *(["-m", args.model] if args.model else []))
    rows = []
    load_prompts = [eng.encode_prompt(p) for p in dev_prompts(args.prompt_file)]
    try:
        _, _, models = srv.request("GET", "/v1/models")
        model = models["data"][0]["id"]
        for j, p in enumerate(prompts):
            ids = eng.encode_prompt(p)
            direct_run(eng, ids, 4)  # warm-up of both
            served_run(srv, model, ids, 4)
            pairs = [(direct_run(eng, ids, max_new), served_run(srv, model, ids, max_new)) for _ in range(args.reps)]
            d = statistics.median(a["tokens_per_s"] for a, _ in pairs)
            s = statistics.median(b["tokens_per_s"] for _, b in pairs)
            row = {"model": label, "case": "stream", "prompt": j, "prompt_tokens": len(ids), "reps": args.reps,
                   "new_tokens": statistics.median(b["tokens"] for _, b in pairs),
                   "first_token_ms": 1e3 * statistics.median(b["first_s"] for _, b in pairs),
                   "engine_first_token_ms": 1e3 * statistics.median(a["first_s"] for a, _ in pairs),
                   "engine_tokens_per_s": d, "served_tokens_per_s": s, "served_pct": 100 * s / d if d else 0.0}
            rows.append(row)
            out.write(row)
            print(f"# prompt {j}: served {s:.1f} tok/s = {row['served_pct']:.1f}% of Engine ({d:.1f}), "
                  f"first token {row['first_token_ms']:.0f} ms", flush=True)
        for row in load_rows(srv.port, model, load_prompts, args, "qspec", label):
            rows.append(row)
            out.write(row)
        if args.long_prompt:
            (long,) = long_prompts(eng, args.long_prompt, 1)
            row = {"model": label, "case": "admission",
                   **admission(srv.port, model, load_prompts, long, 4, 4 * args.max_tokens)}
            rows.append(row)
            out.write(row)
            print(f"# admission of a {row['long_prompt_tokens']}-token prompt beside 4 streams: step gap p99 "
                  f"{row['gap_p99_during_ms']:.0f} ms during its prefill ({row['long_ttft_s']:.1f} s) vs p50 "
                  f"{row['gap_p50_ms']:.0f} ms = {row['p99_over_p50']:.1f}x (target <= 3x)", flush=True)
    finally:
        srv.stop()
    if args.peer_server:
        peer = LlamaServer(args.peer_server, args.peer_gguf, slots, max(len(p) for p in load_prompts) + 2 * args.max_tokens,
                           args.threads, free_port())
        try:
            for row in load_rows(peer.port, "peer", load_prompts, args, "llama-server", label):
                rows.append(row)
                out.write(row)
        finally:
            peer.stop()
    row = {"model": label, **multi_turn(eng, args.turns, 16 if args.quick else 48)}
    rows.append(row)
    out.write(row)
    out.close()
    stream = [r for r in rows if r["case"] == "stream"]
    print(fmt_table(stream, ["prompt", "prompt_tokens", "new_tokens", "first_token_ms", "engine_first_token_ms",
                             "engine_tokens_per_s", "served_tokens_per_s", "served_pct"]))
    print(f"# served/Engine tok/s (median over prompts): "
          f"{statistics.median(r['served_pct'] for r in stream):.1f}% (target >= 97%)")
    load = [r for r in rows if r["case"] == "load"]
    print(fmt_table(load, ["server", "clients", "requests", "tokens", "aggregate_tok_s", "request_tok_s",
                           "ttft_p50_ms", "gap_p50_ms", "gap_p99_ms"]))
    one = {r["server"]: r["aggregate_tok_s"] for r in load if r["clients"] == min(args.clients)}
    for r in load:
        if r["clients"] == slots and r["server"] in one:
            print(f"# {r['server']}: {slots} clients = {r['aggregate_tok_s'] / one[r['server']]:.2f}x the aggregate of "
                  f"{min(args.clients)}")
    m = rows[-1]
    print(f"# multi-turn ({m['turns']} turns): prefill {m['prefill_reuse_s'] * 1e3:.0f} ms with prefix reuse vs "
          f"{m['prefill_full_s'] * 1e3:.0f} ms in full = {m['reuse_pct']:.0f}% (target <= 30%)")
    return rows


def _client_counts(s: str) -> list[int]:
    try:
        counts = [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected client counts like 1,2,4,8, got {s!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("client counts must be >= 1")
    return counts


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="qspec bench serve", parents=[parent_parser(), model_parser()],
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=positive_int, default=4, help="prompts for the streaming comparison (default 4)")
    p.add_argument("--max-new", type=positive_int, default=128, help="new tokens per streamed generation (default 128)")
    p.add_argument("--reps", type=positive_int, default=3, help="interleaved Engine/server runs per prompt (default 3)")
    p.add_argument("--clients", type=_client_counts, default=[1, 2, 4, 8, 16],
                   help="client counts of the load sweep (default 1,2,4,8,16)")
    p.add_argument("--per-client", type=positive_int, default=2, help="requests each client sends (default 2)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="new tokens per load request (default 64)")
    p.add_argument("--long-prompt", type=positive_int, default=2000,
                   help="tokens of the prompt admitted beside running streams (default 2000; 0: skip)")
    p.add_argument("--peer-server", help="llama.cpp's llama-server binary: the same load against it")
    p.add_argument("--peer-gguf", help="the GGUF llama-server loads (the model's weights in BF16)")
    p.add_argument("--turns", type=positive_int, default=5, help="turns of the multi-turn chat (default 5)")
    args = p.parse_args(argv)
    for name in ("prompts", "max_new", "reps", "per_client", "max_tokens", "turns"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.long_prompt < 0:
        p.error("--long-prompt must be >= 0")
    if bool(args.peer_server) != bool(args.peer_gguf):
        p.error("--peer-server and --peer-gguf go together")
    if args.quick:
        args.clients, args.per_client, args.max_tokens = [1, 2], 1, min(args.max_tokens, 16)
        args.long_prompt = min(args.long_prompt, 200)
    run(args)


if __name__ == "__main__":
    main()
