"""`qspec serve`: a real server process on loopback, driven by the official `openai` client and by
raw HTTP (malformed requests, queue-full answers, disconnects, shutdown). Short generations
keep the CI part quick; `-m slow` adds a soak of 1,000 requests."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import signal
import socket
import threading
import time

import openai
import pytest

import qspec
from qspec.bench import serve as bench_serve
from qspec.bench.serve import ServerProcess

MODEL = "smollm2-135m"
CTX = 512
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess("--max-queue", "4", "-c", str(CTX), "-t", "2",
                        log_path=tmp_path_factory.mktemp("serve") / "serve.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine():
    return qspec.load()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


class PieceTokenizer:
    """decode() of ids that index a list of text pieces."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


@pytest.mark.parametrize("pieces,stops,want,stopped", [
    (["Hel", "lo", " wor", "ld"], [], ["Hel", "lo", " wor", "ld"], False),
    (["a", "b", "ST", "OP", "c"], ["STOP"], ["a", "b", "", ""], True),        # held back, then cut
    (["a", "S", "x", "b"], ["ST"], ["a", "", "Sx", "b"], False),           # held back, then released
    (["xx", "AB", "CD"], ["BC", "ABX"], ["xx", "", "A"], True),              # the earliest match wins
    (["one ", "\ufffd", "two"], [], ["one ", "", "\ufffdtwo"], False),
])
def test_text_stream_cuts_at_stop_strings(pieces, stops, want, stopped):
    from qspec.tokenizer import TextStream

    ts = TextStream(PieceTokenizer(pieces), stops)
    got = []
    for i in range(len(pieces)):
        got.append(ts.push(i))
        if ts.stopped:
            break
    assert got == want and ts.stopped == stopped
    full = "".join(pieces)
    cut = min([full.index(s) for s in stops if s in full], default=len(full))
    assert "".join(got) + ts.finish() == full[:cut]


def test_openai_client_matches_engine_generate(client, engine, server):
    """Greedy output through the server (both endpoints, JSON and streamed) is Engine.generate's."""
    want = engine.generate(CHAT, max_new_tokens=12)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=12)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(engine.encode_messages(CHAT))
    assert r.usage.completion_tokens == len(want.tokens)
    assert r.choices[0].finish_reason == ("stop" if want.tokens[-1] in engine.eos_ids else "length")
    ext = r.model_extra["qspec"]
    assert ext["drafted"] >= ext["accepted"] >= 0 and 0 <= ext["acceptance_rate"] <= 1 and ext["decode_s"] > 0

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[-1].usage.completion_tokens == len(want.tokens)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")

    prompt = "The three primary colors are"
    want = engine.generate(prompt, max_new_tokens=10, chat=False)
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=10)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(engine.encode_prompt(prompt, chat=False))
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=10, stream=True))
    assert streamed == want.text
    assert client.models.list().data[0].id == MODEL
    # OpenAI's batch form holding one prompt (LangChain's), and no model named: the served one
    r = client.completions.create(model=MODEL, prompt=[prompt], temperature=0, max_tokens=10)
    assert r.choices[0].text == want.text
    ids = engine.encode_prompt(prompt, chat=False)
    r = client.completions.create(model=MODEL, prompt=[ids], temperature=0, max_tokens=10)
    assert r.choices[0].text == want.text
    status, _, r = server.request("POST", "/v1/completions", {"prompt": prompt, "temperature": 0, "max_tokens": 10})
    assert status == 200 and r["model"] == MODEL and r["choices"][0]["text"] == want.text


def test_stop_strings_and_sampling(client, engine):
    want = engine.generate(prompt := "Count: 1, 2, 3,", max_new_tokens=16, chat=False).text
    assert len(want) > 8
    stop = want[5:8]
    cut = want[:want.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16, stop=[stop],
                                      stream=stream)
        chunks = list(r) if stream else [r]
        assert "".join(c.choices[0].text for c in chunks) == cut
        assert chunks[-1].choices[0].finish_reason == "stop"
    kw = dict(model=MODEL, prompt=prompt, temperature=0.9, top_p=0.9, seed=7, max_tokens=8)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_multi_turn_chat_reuses_the_previous_turn(client):
    r1 = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24)
    turn2 = CHAT + [{"role": "assistant", "content": r1.choices[0].message.content},
                    {"role": "user", "content": "And of Spain?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=turn2, temperature=0, max_tokens=8)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    assert r2.model_extra["qspec"]["cached_prompt_tokens"] == r2.usage.prompt_tokens_details.cached_tokens


def test_queue_counts_only_jobs_no_worker_is_free_for():
    """`--max-queue` bounds the jobs waiting beyond the workers: a burst of parallel + max_queue
    requests that arrives before any worker wakes is taken whole, the next one refused."""
    from qspec.server.metrics import Metrics
    from qspec.server.scheduler import Job, QueueFull, Scheduler

    sched = Scheduler(engine=None, draft_kwargs={}, max_queue=2, metrics=Metrics(), parallel=3)  # workers not started
    loop = asyncio.new_event_loop()
    try:
        jobs = [Job(id=str(i), ids=[1], max_new=1, sampling={}, stops=[], loop=loop) for i in range(6)]
        for job in jobs[:5]:
            sched.submit(job)
        with pytest.raises(QueueFull):
            sched.submit(jobs[5])
    finally:
        loop.close()


def test_concurrent_clients_all_answered_queue_full_well_formed(server, engine):
    """32 clients at once, queue of 4: every client ends with its own answer; the 503s on the way
    carry an OpenAI error and Retry-After."""
    prompts = [f"Item {i % 8}: the word for number {i % 8} is" for i in range(32)]  # 8 answers to know
    answers = [engine.generate(p, max_new_tokens=2, chat=False).text for p in prompts[:8]]
    want = {i: answers[i % 8] for i in range(32)}
    results: dict[int, str] = {}
    refusals: list[tuple[dict, dict]] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for _ in range(100):  # bounded: a lost request fails the test instead of hanging it
            status, headers, body = server.request("POST", "/v1/completions", {
                "model": MODEL, "prompt": prompts[i], "temperature": 0, "max_tokens": 2})
            if status == 200:
                with lock:
                    results[i] = body["choices"][0]["text"]
                return
            with lock:
                refusals.append((headers, body))
            time.sleep(random.uniform(0.3, 1.0) * min(1, int(headers.get("Retry-After", 1))))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results == want
    assert refusals, "a queue of 4 should have refused some of 32 simultaneous requests"
    for headers, body in refusals:
        assert body["error"]["code"] == "queue_full" and body["error"]["message"]
        assert int(headers["Retry-After"]) >= 1


def test_disconnect_mid_stream_frees_the_engine(server):
    """A client that goes away mid-stream: the next request is served, and the abandoned generation
    stops soon after (its log line says "cancelled", far short of max_tokens)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": MODEL, "prompt": "Write a very long story.", "max_tokens": CTX - 16, "stream": True,
         "temperature": 0.8, "seed": 1}), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    first = json.loads(r.readline()[6:])
    assert r.status == 200
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    status, _, body = server.request("POST", "/v1/completions",
                                     {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] <= 2
    # the batch runs "Hi" beside the abandoned stream, so "Hi" can finish before the server notices
    # the disconnect (at its next write): wait for the abandoned request's log line
    deadline = time.monotonic() + 60
    while not (lines := [x for x in server.log_text().splitlines() if first["id"] in x]):
        assert time.monotonic() < deadline, "the abandoned request never finished"
        time.sleep(0.1)
    line = lines[0]
    new_tokens = int(line.split(" new tok")[0].rsplit(" ", 1)[1])
    assert line.endswith("cancelled") and new_tokens < CTX // 2, line


def test_malformed_requests_get_openai_errors(server):
    chat = {"model": MODEL, "messages": CHAT}
    cases = [
        ("POST", "/v1/chat/completions", "{not json", 400, None),
        ("POST", "/v1/chat/completions", "[1, 2]", 400, None),
        ("POST", "/v1/chat/completions", {**chat, "max_tokens": "many"}, 400, "max_tokens"),
        ("POST", "/v1/chat/completions", {**chat, "temperature": -1}, 400, "temperature"),
        ("POST", "/v1/chat/completions", {**chat, "n": 2}, 400, "n"),
        ("POST", "/v1/chat/completions", {**chat, "messages": []}, 400, "messages"),
        ("POST", "/v1/chat/completions", {**chat, "messages": [{"role": "tool", "content": "x"}]}, 400, None),
        ("POST", "/v1/chat/completions", {**chat, "logprobs": True, "stream": True}, 400, None),
        ("POST", "/v1/chat/completions", {**chat, "top_logprobs": 2}, 400, None),
        ("POST", "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "logprobs": 6}, 400, "logprobs"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 0}, 400, None),
        ("POST", "/v1/chat/completions", {**chat, "frobnicate": 1}, 400, None),
        ("POST", "/v1/chat/completions", {**chat, "model": "gpt-4o"}, 404, "model"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "word " * CTX}, 400, "prompt"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": CTX}, 400, "prompt"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": 7}, 400, "prompt"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "x" * (2 << 20)}, 413, None),
        ("GET", "/v1/completions", None, 405, None),
        ("GET", "/v1/nothing", None, 404, None),
    ]
    for method, path, body, status, param in cases:
        got, _, data = server.request(method, path, body)
        assert got == status, (body if not isinstance(body, str) else body[:40], got, data)
        err = data["error"]
        assert err["message"] and "Traceback" not in err["message"] and err["type"]
        if param:
            assert err["param"] == param, err
    _, _, data = server.request("POST", "/v1/completions", {"model": MODEL, "prompt": "word " * CTX})
    assert str(CTX) in data["error"]["message"]  # names the limit
    assert server.request("POST", "/v1/chat/completions", {**chat, "max_tokens": 2, "user": "u1",
                                                           "presence_penalty": 0, "logprobs": False})[0] == 200


def test_api_key(tmp_path):
    srv = ServerProcess("--api-key", "s3cret", "-c", "256", log_path=tmp_path / "serve.log")
    try:
        assert srv.request("GET", "/health")[0] == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, _, data = srv.request("GET", "/v1/models", headers=headers)
            assert status == 401 and data["error"]["code"] == "invalid_api_key"
            assert srv.request("GET", "/metrics", headers=headers)[0] == 401
        assert srv.request("GET", "/v1/models", headers={"Authorization": "Bearer s3cret"})[0] == 200
        ok = openai.OpenAI(base_url=srv.base + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens <= 2
        bad = openai.OpenAI(base_url=srv.base + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert "Traceback" not in srv.log_text()
    finally:
        assert srv.stop() == 0


def test_graceful_shutdown_finishes_the_stream_in_flight(tmp_path):
    srv = ServerProcess("-c", "256", log_path=tmp_path / "serve.log")
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "stream": True, "temperature": 0}),
            headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.readline().startswith(b"data: ")
        srv.proc.send_signal(signal.SIGTERM)
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
        assert srv.stop(timeout=30) == 0
        with pytest.raises(OSError):
            srv.request("GET", "/health", timeout=5)
        assert "Traceback" not in srv.log_text()
    finally:
        conn.close()
        srv.stop()


def test_bench_serve_quick(tmp_path, capsys):
    out = tmp_path / "serve.jsonl"
    bench_serve.main(["--quick", "--prompts", "1", "--max-new", "8", "--reps", "1", "--turns", "2",
                      "--json", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["case"] for r in rows] == ["stream", "load", "load", "admission", "multi_turn"]
    assert rows[0]["served_tokens_per_s"] > 0 and rows[0]["engine_tokens_per_s"] > 0 and rows[0]["new_tokens"] == 8
    assert [r["clients"] for r in rows[1:3]] == [1, 2] and all(r["aggregate_tok_s"] > 0 for r in rows[1:3])
    assert rows[3]["long_prompt_tokens"] <= 200 and rows[3]["gap_p50_ms"] > 0
    assert rows[4]["cached_tokens"] > 0 and rows[4]["prefill_reuse_s"] > 0
    printed = capsys.readouterr().out
    assert "target >= 97%" in printed and "2 clients =" in printed


def test_concurrent_streams_equal_each_request_alone(server, engine):
    """Eight requests at once, of different lengths, speculative: each greedy answer is the one
    the engine gives that prompt alone, token for token (continuous batching, qspec/batch.py)."""
    prompts = ["def fibonacci(n):", "The three primary colours are", "import numpy as np\n", "Once upon a time",
               "SELECT name FROM", "The capital of Japan is", "for i in range(10):", "Water boils at"]
    lengths = [24, 6, 17, 24, 3, 12, 24, 9]
    want = [engine.generate(p, max_new_tokens=n, chat=False).text for p, n in zip(prompts, lengths)]
    got: dict[int, str] = {}

    def client(i: int) -> None:
        status, _, body = server.request("POST", "/v1/completions", {
            "model": MODEL, "prompt": prompts[i], "temperature": 0, "max_tokens": lengths[i]})
        got[i] = body["choices"][0]["text"] if status == 200 else f"HTTP {status}: {body}"

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [got.get(i) for i in range(len(prompts))] == want


@pytest.mark.slow
def test_soak_thousand_requests_rss_stable(server):
    import psutil

    proc = psutil.Process(server.proc.pid)

    def burst(n: int) -> None:
        for i in range(n):
            body = {"model": MODEL, "max_tokens": 2, "temperature": 0.5, "seed": i, "stream": i % 2 == 0}
            if i % 3:
                status = server.request("POST", "/v1/completions", {**body, "prompt": f"Note {i}:"})[0]
            else:
                status = server.request("POST", "/v1/chat/completions",
                                        {**body, "messages": [{"role": "user", "content": f"Say {i}"}]})[0]
            assert status == 200

    burst(200)
    rss = proc.memory_info().rss
    burst(800)
    assert proc.memory_info().rss - rss < 32 << 20


def test_stream_decoder_adds_up_to_decode_on_the_default_tokenizer(engine):
    """The incremental detokenizer on a byte-level BPE (SmolLM2's): pieces + finish() equal
    decode() over real text with multi-byte characters and over random ids."""
    from test_convert_arch import STRINGS, assert_streams_as_decode

    tok = engine.tokenizer._tok
    text = "\n".join(STRINGS) * 3
    assert_streams_as_decode(tok, [tok.encode(t).ids for t in (*STRINGS, text)], random_lists=50)


def test_logprobs_are_the_plain_decode_rows(client, engine):
    """logprobs (chat: logprobs + top_logprobs; completions: logprobs = k) are Engine.score's of the
    answer's tokens: the log-softmax of the rows plain decoding computes, bit for bit whatever the
    draft, the chunking of the scoring pass or the rows beside it."""
    prompt = "The three primary colors are"
    r = engine.generate(prompt, max_new_tokens=12, chat=False, logprobs=3)
    assert len(r.logprobs) == len(r.tokens) and [lp.token for lp in r.logprobs] == r.tokens
    assert all(lp.token == lp.top[0][0] and lp.logprob <= 0 for lp in r.logprobs)  # greedy: the top token
    assert all(a[1] >= b[1] for lp in r.logprobs for a, b in zip(lp.top, lp.top[1:]))
    ids = engine.encode_prompt(prompt, chat=False)
    one_by_one = [engine.score(ids + r.tokens[:i], [t], 3)[0] for i, t in enumerate(r.tokens)]
    assert one_by_one == r.logprobs  # M = 1 rows == the rows of one pass over all the tokens
    plain = engine.generate(prompt, max_new_tokens=12, chat=False, logprobs=3, speculative=False)
    assert plain.logprobs == r.logprobs and engine.score(prompt, [], 2, chat=False) == []

    c = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, logprobs=3)
    lp = c.choices[0].logprobs
    assert lp.token_logprobs == [x.logprob for x in r.logprobs] and "".join(lp.tokens) == c.choices[0].text
    lp_gen = lp.token_logprobs
    assert lp.text_offset[0] == 0 and all(len(t) == 3 for t in lp.top_logprobs)
    ch = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=8, logprobs=True,
                                        top_logprobs=2)
    want = engine.generate(CHAT, max_new_tokens=8, logprobs=2)
    got = ch.choices[0].logprobs.content
    assert [x.logprob for x in got] == [x.logprob for x in want.logprobs if x.token not in engine.eos_ids]
    assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob == x.logprob for x in got)
    assert bytes(b for x in got for b in x.bytes).decode() == ch.choices[0].message.content
    with pytest.raises(ValueError, match="logprobs"):
        engine.generate(prompt, max_new_tokens=2, logprobs=21)

    # echo (an eval harness's loglikelihood): the prompt's text and token logprobs before the answer's
    e = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=0, echo=True, logprobs=1)
    lp, want = e.choices[0].logprobs, engine.score(ids[:1], ids[1:], 1)
    assert e.choices[0].text == prompt and lp.token_logprobs == [None] + [x.logprob for x in want]
    assert lp.top_logprobs[0] is None and "".join(lp.tokens) == prompt
    assert [prompt[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    e = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, echo=True, logprobs=0)
    assert e.choices[0].text == prompt + c.choices[0].text
    assert e.choices[0].logprobs.token_logprobs == [None] + [x.logprob for x in want] + lp_gen


def test_engine_stop_strings_cut_text_and_generation(engine):
    """Engine.generate / stream(stop=...): the text ends before the earliest stop string, the
    tokens are the plain generation's up to the one that completed it, finish_reason says why."""
    prompt = "Count from 1 to 20, separated by commas."
    full = engine.generate(prompt, max_new_tokens=48)
    assert full.finish_reason in ("length", "stop")
    stop = full.text[len(full.text) // 2:][:3]
    cut = engine.generate(prompt, max_new_tokens=48, stop=["never there", stop])
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    assert cut.tokens == full.tokens[:len(cut.tokens)] and len(cut.tokens) < len(full.tokens)
    assert stop in engine.tokenizer.decode(cut.tokens) and stop not in engine.tokenizer.decode(cut.tokens[:-1])
    assert "".join(engine.stream(prompt, max_new_tokens=48, stop=stop)) == cut.text
    assert engine.generate(prompt, max_new_tokens=3).finish_reason == "length"
    for bad in ("", [""], 5, ["a"] * 17, [b"x"]):
        with pytest.raises(ValueError, match="stop"):
            engine.generate(prompt, max_new_tokens=2, stop=bad)
