"""Continuous batching (qspec/batch.py) over the paged KV cache (qspec/kv_cache.py).

The property it rests on: a sequence's rows in a batched forward are bit-identical to the same
rows run alone, so a greedy response is the same whatever else the engine is running — checked
pass by pass (every weight set, tree passes, prefill chunks) and end to end (concurrent
generations, mixed lengths, speculation on and off, preemption, cancellation).
"""

import threading
import types

import numpy as np
import pytest

import qspec
from qspec.batch import Batcher, Pass, Seq
from qspec.bench.common import dev_prompts as load_prompts
from qspec.kv_cache import KVCache, KVPool

N_NEW = 24


@pytest.fixture(scope="module")
def eng(default_model_dir):
    return qspec.load(default_model_dir, draft="mxfp6_e2m3", draft_levels=["mxfp4"])


def prompts(eng, n=6):
    texts = load_prompts(None)[:n]
    return [eng.encode_prompt(t) for t in texts]


def test_batched_pass_equals_each_sequence_alone(eng):
    """One native forward over several sequences' rows (prefill, decode, verify, a tree, every
    weight set) gives each sequence the logits and K/V rows it gets alone."""
    be = eng.backend
    rng = np.random.default_rng(0)
    lens = [37, 5, 70, 16]
    for weight_set in (0, 1, 2):
        caches, passes, alone = [], [], []
        for i, n in enumerate(lens):
            ids = rng.integers(0, 2000, n).tolist()
            kv_a, kv_b = KVCache(be.pool), KVCache(be.pool)
            for kv in (kv_a, kv_b):  # the same context, then the pass under test
                be.run([be.prepare(kv, ids[:-3], 0)], 0)
            tree = (n - 3, [-1, n - 3, n - 3]) if i == 3 else None  # a root and its two children
            p_a = be.prepare(kv_a, ids[-3:], n - 3, all_logits=True, draft=weight_set, tree=tree)
            p_b = be.prepare(kv_b, ids[-3:], n - 3, all_logits=True, draft=weight_set, tree=tree)
            alone.append(be.run([p_a], weight_set)[0])
            caches.append((kv_a, kv_b))
            passes.append(p_b)
        together = be.run(passes, weight_set)
        for (kv_a, kv_b), a, b, n in zip(caches, alone, together, lens):
            assert np.array_equal(a, b), weight_set
            rows_a, rows_b = kv_a.rows(0, n), kv_b.rows(0, n)
            assert np.array_equal(be.pool.data[:, :, rows_a], be.pool.data[:, :, rows_b])
            kv_a.release(), kv_b.release()


@pytest.mark.parametrize("kw", [dict(speculative=False), dict(), dict(draft_max=3), dict(tree="on")],
                         ids=["plain", "auto", "k3", "tree"])
def test_concurrent_generations_equal_each_alone(eng, kw):
    ps = prompts(eng)
    lengths = [N_NEW, 8, N_NEW, 3, 16, N_NEW]
    steps = eng.batcher.steps
    want = [eng.generate(p, max_new_tokens=n, **kw).tokens for p, n in zip(ps, lengths)]
    alone_steps, steps = eng.batcher.steps - steps, eng.batcher.steps
    got: list = [None] * len(ps)

    def run(i):
        got[i] = eng.generate(ps[i], max_new_tokens=lengths[i], **kw).tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    assert eng.batcher.steps - steps < 0.7 * alone_steps  # the passes were shared


@pytest.mark.parametrize("kw", [dict(draft_max=3, tree="off"), dict(tree="on")], ids=["k3", "tree"])
def test_sequences_draft_in_step_and_verify_together(eng, monkeypatch, kw):
    """While a sequence drafts, the target's passes wait (Batcher._step): no step runs a target
    forward beside a draft one, and the sequences verify in one forward a round — about as many
    target forwards as the longest generation has steps, not one per sequence and step."""
    be = eng.backend
    ps = prompts(eng, 4)
    want = [eng.generate(p, N_NEW, levels=1, **kw).tokens for p in ps]
    log = []
    run = be.run

    def spy(group, weight_set):
        log.append((eng.batcher.steps, weight_set, all(p.prefill for p in group)))
        return run(group, weight_set)

    monkeypatch.setattr(be, "run", spy)
    res = eng.generate_batch(ps, N_NEW, levels=1, **kw)
    assert [r.tokens for r in res] == want
    sets = {}
    for step, weight_set, prefill in log:
        sets.setdefault(step, set()).add(weight_set if not prefill else "prefill")
    assert not [s for s in sets.values() if 0 in s and len(s - {"prefill"}) > 1]
    verifies = sum(1 for s in sets.values() if 0 in s)
    steps = [r.stats["steps"] for r in res]
    assert verifies <= max(steps) + len(ps) < sum(steps)


def test_a_sequence_whose_pass_ran_counts_as_running():
    """After a step, the sequences it served are running (their threads have yet to take the
    logits): the next step waits for them instead of running without them (Batcher._ready)."""
    pool = types.SimpleNamespace(lock=threading.Lock())
    backend = types.SimpleNamespace(pool=pool, run=lambda group, ws: [np.zeros(1) for _ in group])
    b = Batcher(backend)
    a, c = (Seq(kv=None, order=i) for i in range(2))
    b.live = [a, c]
    for s in (a, c):
        s.passes = [Pass(kv=None, tokens=np.zeros(1, np.int32), start_pos=0, all_logits=False, tree=None,
                         weight_set=1)]
        s.state = "waiting"
    with b.cv:  # steps run under the pool lock
        b._step()
    assert a.state == c.state == "running" and not b._ready()
    a.passes = [Pass(kv=None, tokens=np.zeros(1, np.int32), start_pos=1, all_logits=False, tree=None, weight_set=1)]
    a.state = "waiting"
    assert not b._ready()  # c has not taken its logits yet
    c.state = "waiting"
    assert b._ready()


def test_generate_batch(eng):
    ps = prompts(eng, 4)
    want = [eng.generate(p, max_new_tokens=12).tokens for p in ps]
    got = eng.generate_batch(ps, max_new_tokens=12)
    assert [r.tokens for r in got] == want and [r.text for r in got] == [eng.tokenizer.decode(w) for w in want]
    assert eng.generate_batch([]) == []
    with pytest.raises(ValueError, match="list of prompts"):
        eng.generate_batch("one prompt")
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate_batch(ps, max_new_tokens=0)


def test_chunked_prefill_and_preemption_keep_the_output(default_model_dir):
    """A pool too small for every sequence at once (12 pages; the prompts share their first
    pages): the newest are preempted and start again from their prompt and what they produced,
    prompts go in chunks while others run; the outputs are unchanged."""
    eng = qspec.load(default_model_dir, draft="mxfp4")
    ps = prompts(eng, 6)
    want = [eng.generate(p, max_new_tokens=N_NEW).tokens for p in ps]
    pool = KVPool(eng.backend.pool.cfg, draft_copy=eng.backend.pool.draft_copy, max_pages=6)  # 192 positions
    eng.backend.pool = pool
    eng.batcher = Batcher(eng.backend, max_seqs=6, min_free_pages=0)
    got = eng.generate_batch(ps, max_new_tokens=N_NEW)
    assert [r.tokens for r in got] == want
    assert sum(r.stats.get("preemptions", 0) for r in got) > 0
    assert not eng.batcher.live and all(pool.refs == 0)  # every page back


def test_a_prompt_alone_goes_in_passes_of_at_most_prefill_rows(eng, monkeypatch):
    """A prompt longer than PREFILL_ROWS is prefilled in several passes even alone (bounded
    activations), with the output of a one-pass prefill (rows are batch-invariant; bit
    equality of chunked prefills: tests/test_long_context.py)."""
    p = prompts(eng, 1)[0]
    eng.backend.kv.forget()
    whole = eng.generate(p, max_new_tokens=8)
    passes = []
    forward = qspec.batch.SeqBackend.forward

    def spy(self, tokens, start_pos, **kw):
        if kw.get("prefill"):
            passes.append(len(tokens))
        return forward(self, tokens, start_pos, **kw)

    monkeypatch.setattr(qspec.batch.SeqBackend, "forward", spy)
    monkeypatch.setattr(qspec.batch, "PREFILL_ROWS", 7)
    eng.backend.kv.forget()
    chunked = eng.generate(p, max_new_tokens=8)
    n = chunked.stats["prompt_tokens"]
    assert chunked.tokens == whole.tokens and n > 7
    assert passes == [7] * (n // 7) + ([n % 7] if n % 7 else [])


def test_shared_prefix_pages_are_adopted_by_reference(eng):
    system = "You are a careful assistant. " * 12
    ps = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
          for q in ("Name a prime number.", "Name a colour.", "Name a fruit.")]
    eng.backend.kv.forget()
    first = eng.generate(ps[0], max_new_tokens=4)
    assert first.stats["cached_prompt_tokens"] == 0
    rest = eng.generate_batch(ps[1:], max_new_tokens=4)
    head = len(eng.encode_prompt(system, chat=False))
    assert all(r.stats["cached_prompt_tokens"] >= head - eng.backend.pool.page_size for r in rest)
    eng.backend.kv.forget()
    assert [r.tokens for r in rest] == [eng.generate(p, max_new_tokens=4).tokens for p in ps[1:]]


def test_a_closed_generation_frees_its_pages_at_once(eng):
    pool = eng.backend.pool
    gen = eng.tokens(prompts(eng, 1)[0], max_new_tokens=64)
    next(gen)
    (seq,) = eng.batcher.live
    held = list(seq.kv.pages)
    assert held and all(pool.refs[p] >= 1 for p in held)
    gen.close()
    assert not eng.batcher.live and all(pool.refs[p] == 0 for p in held)


def test_pool_arrays_start_on_a_page(eng):
    # the attention kernels read 64-byte pieces of cache rows: none may span two lines
    pool = KVPool(eng.backend.pool.cfg, draft_copy="int4")
    pool.grow_to(3)
    for a in (pool.data, *pool.q8):
        assert a.ctypes.data % 4096 == 0 and a.flags.c_contiguous and a.shape[2] == 3 * pool.page_size


def test_pool_budget_too_small_for_one_sequence(default_model_dir):
    eng = qspec.load(default_model_dir, draft=None)
    pool = eng.backend.pool
    pool.max_pages = 1
    with pytest.raises(qspec.ContextMemoryError, match=f"KV cache's budget of {pool.page_size} tokens"):
        eng.generate(list(range(1, pool.page_size + 8)), max_new_tokens=4)
    assert not eng.batcher.live


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_real_model_under_load(name):
    """A real model, 1 to 16 generations at once with mixed prompt lengths (up to ~600 tokens,
    prefilled in chunks beside the others), speculation on, some cancelled part-way: every greedy
    response equals the same request run alone, token for token."""
    from qspec.bench.long_prompts import long_prompts

    try:
        eng = qspec.load(name, threads=2)
    except qspec.ModelLoadError as e:  # the tests run offline (conftest): fetch it first
        pytest.skip(f"{e} (QSPEC_CACHE: a cache holding it)")
    ps = [eng.encode_prompt(t) for t in load_prompts(None)] + long_prompts(eng, 600, 2)
    lengths = [24, 5, 16, 24, 9, 24, 3, 20]
    want = [eng.generate(p, max_new_tokens=lengths[i % len(lengths)]).tokens for i, p in enumerate(ps)]
    for clients in (2, 16):
        got: dict[int, list[int]] = {}

        def run(i, stop_after):
            toks = []
            gen = eng.tokens(ps[i], max_new_tokens=lengths[i % len(lengths)])
            for t in gen:
                toks.append(t)
                if len(toks) == stop_after:
                    gen.close()  # a client that went away
                    break
            got[i] = toks

        threads = [threading.Thread(target=run, args=(i % len(ps), 4 if i % 5 == 4 else -1))
                   for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, toks in got.items():
            assert toks == want[i][:len(toks)] and (len(toks) == len(want[i]) or len(toks) == 4), (name, clients, i)
    assert not eng.batcher.live and all(eng.backend.pool.refs == 0)
