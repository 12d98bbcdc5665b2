"""Speculative decoding: bit-exact losslessness (greedy), exact distribution (sampling), shared KV."""

import math
import os

import numpy as np
import pytest
import torch

import qspec
from qspec.kv_cache import KVCache
from running import running
from qspec import _C
from qspec.bench.common import dev_prompts as load_prompts
from qspec.draft import DRAFT_FORMATS
from qspec.sampling import SamplingParams, sample, warp
from qspec.speculative import _accept_sampled

ISA_LEVELS = _C.cpu_info()["isa_levels"]


def dev_prompts() -> list[str]:
    """The dev prompt set shipped with the benchmarks (bench/prompts), or $QSPEC_PROMPTS."""
    return load_prompts(os.environ.get("QSPEC_PROMPTS"))


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    _C.set_isa_limit(_C.isa_detected())


_engines: dict = {}


def engine_for(model_dir, fmt: str):
    if fmt not in _engines:
        _engines.clear()  # one draft format in memory at a time
        _engines[fmt] = qspec.load(model_dir, draft=fmt)
    return _engines[fmt]


_plain_cache: dict = {}


def plain_greedy(engine, prompt, n, isa):
    key = (prompt, n, isa)
    if key not in _plain_cache:
        _plain_cache[key] = engine.generate(prompt, max_new_tokens=n, speculative=False).tokens
    return _plain_cache[key]


def check_lossless(engine, prompts, n, ks, isa):
    _C.set_isa_limit(isa)
    drafted = 0
    for prompt in prompts:
        want = plain_greedy(engine, prompt, n, isa)
        for k in ks:
            got = engine.generate(prompt, max_new_tokens=n, draft_max=k)
            assert got.tokens == want, f"isa={isa} draft={engine.draft.fmt} K={k}: {prompt!r} differs"
            drafted += got.stats["drafted"]  # a step may be the prompt lookup's alone (qspec/lookup.py)
    assert drafted > 0


# CI subset: every draft format at the CPU's level, a few prompts and K values (the two default
# drafts five prompts, the others two; the full matrix: -m slow).
@pytest.mark.parametrize("fmt", DRAFT_FORMATS)
def test_greedy_lossless_subset(default_model_dir, fmt):
    eng = engine_for(default_model_dir, fmt)
    prompts = dev_prompts()
    some = prompts[:3] + prompts[-2:] if fmt in ("mxfp4", "mxfp6_e2m3") else [prompts[0], prompts[-1]]
    check_lossless(eng, some, 48, [1, 3, 8, "auto"], ISA_LEVELS[-1])


# Every ISA level (the emulated build runs this one at the levels the CPU lacks): the default
# draft, two short cases each (the scalar level is slow).
def test_greedy_lossless_each_level(default_model_dir):
    eng = engine_for(default_model_dir, "mxfp4")
    prompts = dev_prompts()
    for isa in ISA_LEVELS:
        if isa == "scalar":
            check_lossless(eng, prompts[:1], 8, [3], isa)
        else:
            check_lossless(eng, [prompts[0], prompts[-1]], 12, [3, "auto"], isa)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ISA_LEVELS)
@pytest.mark.parametrize("fmt", DRAFT_FORMATS)
def test_greedy_lossless_all_prompts(default_model_dir, fmt, isa):
    """The full matrix: 24 prompts x 128 tokens x K in {1, 2, 4, 8, auto} x format x ISA level."""
    check_lossless(engine_for(default_model_dir, fmt), dev_prompts(), 128, [1, 2, 4, 8, "auto"], isa)


def test_lossless_with_p_min_and_lm_head_draft(default_model_dir):
    eng = qspec.load(default_model_dir, draft="mxfp4", draft_lm_head="mxfp4")
    prompt = dev_prompts()[8]
    want = eng.generate(prompt, max_new_tokens=48, speculative=False).tokens
    for kw in (dict(draft_max=6, draft_p_min=0.6), dict(draft_max=8, draft_min=3, draft_p_min=0.9)):
        r = eng.generate(prompt, max_new_tokens=48, **kw)
        assert r.tokens == want, kw


def test_one_shared_kv_cache(default_model_dir):
    eng = engine_for(default_model_dir, "mxfp4")
    be = eng.backend
    ids = eng.encode_prompt("Why is the sky blue?")
    with running(eng, ids, max_new_tokens=40, draft_max=4) as (tokens, kv, s):
        # target and draft wrote one cache: committed = prompt + every emitted token but the last
        assert kv.length == len(ids) + len(tokens) - 1 and kv.pool is be.pool
    assert 0 < s["accepted"] <= s["drafted"] and s["tokens_per_step"] >= 1
    assert math.isclose(s["acceptance_rate"], s["accepted"] / s["drafted"])
    # the draft adds only its packed MX weights (LM head shared): ~4.25/16 of the GEMM bytes
    assert be.draft_bytes < 0.5 * be.target_bytes


@pytest.mark.parametrize("k", [None, 3])
def test_speculative_sampling_is_seeded(default_model_dir, k):
    """Same seed, same fixed K -> same tokens (the default K for sampling is a fixed one)."""
    eng = engine_for(default_model_dir, "mxfp4")
    kw = dict(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=7, draft_max=k)
    a, b = eng.generate("Tell me a story.", **kw), eng.generate("Tell me a story.", **kw)
    assert a.tokens == b.tokens and a.stats["drafted"] > 0


def test_cost_model_sees_bursty_acceptance():
    """Acceptance comes in stretches (easy text: nearly every draft right; hard: most wrong).
    The chosen K must reach within 5% of the best fixed K's true rate, where one pooled
    per-token rate picks K = 1 here (8% below the best)."""
    import random

    from qspec.speculative import CostModel

    t_draft, verify = 0.3, (lambda m: 1.0 + 0.02 * (m - 1))

    def run_length(rng, easy: bool, k: int) -> int:
        a = 0.97 if easy else 0.3
        n = 0
        while n < k and rng.random() < a:
            n += 1
        return n

    def true_rate(k: int, easy_share: float = 0.5) -> float:
        tau = sum(share * (1 + sum(a ** j for j in range(1, k + 1)))
                  for share, a in ((easy_share, 0.97), (1 - easy_share, 0.3)))
        return tau / (k * t_draft + verify(k + 1))

    rng = random.Random(0)
    cm = CostModel(byte_ratio=0.3, k_max=16, k_min=1)
    easy, chosen = True, []
    for step in range(400):
        if rng.random() < 0.05:  # stretches of ~20 steps
            easy = not easy
        k = cm.choose()
        chosen.append(k)
        cm.observe(k, run_length(rng, easy, k), k * t_draft, verify(k + 1))
    best = max(true_rate(k) for k in range(1, 17))
    late = sorted(chosen[100:])
    assert true_rate(late[len(late) // 2]) >= 0.95 * best, (late[len(late) // 2], best)


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    from scipy.stats import chisquare

    n = int(counts.sum())
    keep = probs * n >= 5  # pool rare cells (chi-square validity)
    obs = np.append(counts[keep], counts[~keep].sum()).astype(np.float64)
    exp = np.append(probs[keep], probs[~keep].sum()).astype(np.float64) * n
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def test_rejection_sampling_preserves_target_distribution():
    """The accept/resample rule alone, with a draft q far from the target p (fixed seed)."""
    V = 12
    g = np.random.default_rng(0)
    p_logits = (g.standard_normal((2, V)) * 2).astype(np.float32)
    q = warp(g.standard_normal(V).astype(np.float32) * 2, SamplingParams(temperature=1.0))
    params = SamplingParams(temperature=1.0, seed=1)
    p = warp(p_logits[0], params)
    gen = params.generator()
    counts = np.zeros(V)
    n = 20000
    for _ in range(n):
        x = sample(q, gen)
        a, nxt = _accept_sampled([x], [q], p_logits, params, gen)
        counts[x if a == 1 else nxt] += 1
    assert _chi2_pvalue(counts, p) > 1e-3


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from qspec.synthetic import save_model_dir, synthetic_config, synthetic_weights

    cfg = synthetic_config("smollm2-135m", hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=16, vocab_size=16, max_seq_len=64)
    return save_model_dir(tmp_path_factory.mktemp("tiny"), cfg, synthetic_weights(cfg, seed=3, scale=3.0))


def test_speculative_sampling_matches_target_distribution(tiny_model):
    """End to end on a tiny model: the 2nd new token's marginal equals the exact target marginal."""
    params = dict(temperature=1.0, top_k=10)
    eng = qspec.load(tiny_model, draft="mxfp4", draft_lm_head="mxfp4")
    prompt = [1, 5, 7]
    sp = SamplingParams(**params)
    # exact: P(t2) = sum_t1 p(t1 | prompt) p(t2 | prompt, t1), from target forwards
    be = be_kv = eng.backend
    be_kv.kv.reset()
    be.kv.ensure_capacity(8)
    p1 = warp(be.forward(prompt, 0)[-1], sp)
    exact = np.zeros(16)
    for t1 in range(16):
        if p1[t1] > 0:
            p2 = warp(be.forward(prompt + [t1], 0)[-1], sp)
            exact += p1[t1] * p2
    counts = np.zeros(16)
    drafted = accepted = 0
    for s in range(3000):
        r = eng.generate(prompt, max_new_tokens=3, seed=s, draft_max=2, **params)
        counts[r.tokens[1]] += 1
        drafted += r.stats["drafted"]
        accepted += r.stats["accepted"]
    assert 0.05 < accepted / drafted < 0.95, "the draft should differ from the target here"
    assert _chi2_pvalue(counts, exact) > 1e-3


def test_cost_model_picks_k_from_measurements():
    from qspec.speculative import CostModel

    def trained(alpha, t_draft, verify):  # verify(m) -> seconds
        cm = CostModel(byte_ratio=0.3, k_max=8, k_min=1)
        while cm._explore:
            k = cm.choose()
            acc = round(alpha * k)
            cm.observe(k, acc, k * t_draft, verify(k + 1))
        for _ in range(200):  # per-token acceptance alpha: 100 accepted of 100/alpha trials
            cm.observe(1, 1, t_draft, verify(2)) if torch.rand(()) < alpha else cm.observe(1, 0, t_draft, verify(2))
        return cm

    torch.manual_seed(0)
    cheap = trained(0.95, 0.1, lambda m: 1.0)          # flat verify, cheap accurate draft -> long drafts
    assert cheap.choose() >= 6
    costly = trained(0.5, 0.6, lambda m: 1.0 + 0.5 * (m - 1))  # poor draft, steep verify -> K = 1
    assert costly.choose() == 1


def test_cost_model_follows_the_verify_curve():
    """Verify flat up to 5 rows, then steep (AVX2-like): the best K is 4, which a line through
    the measured points misjudges; a flat curve (AMX-like) makes long drafts pay."""
    import random

    from qspec.speculative import CostModel

    def best_after_training(verify, alpha=0.9, t_draft=0.1):
        rng = random.Random(1)
        cm = CostModel(byte_ratio=0.3, k_max=12, k_min=1)
        for _ in range(300):
            k = cm.choose()
            a = 0
            while a < k and rng.random() < alpha:
                a += 1
            cm.observe(k, a, k * t_draft, verify(k + 1))
        return cm.choose(), cm

    def rate(k, verify, alpha=0.9, t_draft=0.1):
        return sum(alpha ** j for j in range(k + 1)) / (k * t_draft + verify(k + 1))

    knee = lambda m: 1.0 if m <= 5 else 1.0 + 0.6 * (m - 5)  # noqa: E731
    k, cm = best_after_training(knee)
    assert k == max(range(1, 13), key=lambda k: rate(k, knee)) == 4
    assert cm.verify_seconds(5) == 1.0 and cm.verify_seconds(6) > 1.5  # measured, not a fitted line
    flat = lambda m: 1.0 + 0.01 * (m - 1)  # noqa: E731
    k, _ = best_after_training(flat)
    assert k >= 8


def test_cost_model_one_choice_a_batch_round():
    """Beside other sequences (a round given), the first call of a round decides and every
    sequence of that round drafts the same K; exploration advances once a round. Alone (no round)
    each call decides."""
    from qspec.speculative import CostModel
    from qspec.tree import TreeCost, TreeParams

    cm = CostModel(byte_ratio=0.3, k_max=8, k_min=1, skippable=True, shared_by=4)
    first = [cm.choose(7) for _ in range(4)]
    assert first == [1] * 4  # exploration starts at K = 1
    assert [cm.choose(8) for _ in range(3)] == [2] * 3 and cm.choose(9) == 4
    alone = CostModel(byte_ratio=0.3, k_max=8, k_min=1)
    assert [alone.choose() for _ in range(3)] == [1, 2, 4]
    tc = TreeCost(TreeParams("auto", 3), chain_ok=True)
    arms = [tc.arm(3) for _ in range(4)]
    assert len(set(arms)) == 1 and tc.steps == 1
    tc.arm(4)
    assert tc.steps == 2


def test_auto_k_remembers_costs_across_generations(default_model_dir):
    eng = engine_for(default_model_dir, "mxfp4")
    p = dev_prompts()[3]
    eng.generate(p, max_new_tokens=24)  # draft_max="auto" by default for greedy
    (cm,) = [c for key, c in eng._cost_models.items() if key[2]]
    seen = dict(cm.t_verify)
    assert seen and cm.t_draft is not None
    eng.generate(dev_prompts()[4], max_new_tokens=24)
    assert eng._cost_models[next(k for k in eng._cost_models if k[2])] is cm and set(seen) <= set(cm.t_verify)


def test_default_draft_follows_model_size(default_model_dir):
    """draft="auto": MXFP6-E2M3 below SMALL_MODEL_PARAMS GEMM weights, MXFP4 (own LM head) above
    (measured: README, "Choosing the draft")."""
    from qspec.engine import DEFAULT_DRAFT, SMALL_MODEL_DRAFT, SMALL_MODEL_PARAMS
    from qspec.loading import default_draft
    from qspec.synthetic import synthetic_config

    small = qspec.config.ModelConfig.from_file(default_model_dir / "config.json")
    assert small.gemm_params < SMALL_MODEL_PARAMS and default_draft(small) == SMALL_MODEL_DRAFT
    big = synthetic_config("llama-3.2-1b")
    assert big.gemm_params > SMALL_MODEL_PARAMS and default_draft(big) == DEFAULT_DRAFT
    assert DEFAULT_DRAFT == qspec.engine.DraftSpec("mxfp4", "mxfp4")
    eng = engine_for(default_model_dir, "auto")
    assert eng.draft == SMALL_MODEL_DRAFT
    # an explicit format casts its LM head in the same format unless told otherwise
    assert qspec.loading.resolve_draft_spec("mxfp8_e4m3", None, small) == qspec.draft.DraftSpec("mxfp8_e4m3", "mxfp8_e4m3")


def full_prefill(eng, prompt, **kw):
    """generate() after forgetting the cache's rows: the reference, prefilled in full."""
    eng.backend.kv.forget()
    r = eng.generate(prompt, **kw)
    assert r.stats["cached_prompt_tokens"] == 0
    return r


@pytest.mark.parametrize("speculative", [False, True])
def test_prefix_reuse_is_bit_identical(default_model_dir, speculative):
    """A prompt starting with ids the cache holds as target rows prefills only the rest (at least
    its last token, for the logits); greedy output is the same with and without reuse: the same
    prompt again, a chat's next turn (turn 1's prompt + answer + a new message) and a prompt that
    is a strict prefix of what the cache holds."""
    eng = engine_for(default_model_dir, "mxfp4")
    kw = dict(max_new_tokens=24, speculative=speculative, draft_max=4)
    p = dev_prompts()[2]
    first = full_prefill(eng, p, **kw)
    again = eng.generate(p, **kw)
    assert again.stats["cached_prompt_tokens"] == again.stats["prompt_tokens"] - 1
    assert again.tokens == first.tokens

    turn1 = [{"role": "user", "content": "What is the capital of France?"}]
    r1 = eng.generate(turn1, **kw)
    turn2 = turn1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And of Spain?"}]
    ids1, ids2 = eng.encode_messages(turn1), eng.encode_messages(turn2)
    assert ids2[:len(ids1) + len(r1.tokens)] == ids1 + r1.tokens  # the template allows full reuse
    with running(eng, turn2, **kw) as (r2_tokens, kv, r2_stats):
        kv_reused = kv.data[:, :, kv.rows(0, len(ids2))].copy()
    assert r2_stats["cached_prompt_tokens"] >= len(ids1) + len(r1.tokens) - 1
    eng.backend.kv.forget()
    with running(eng, turn2, **kw) as (ref_tokens, kv, ref_stats):
        assert np.array_equal(kv_reused, kv.data[:, :, kv.rows(0, len(ids2))])
    assert ref_stats["cached_prompt_tokens"] == 0 and r2_tokens == ref_tokens

    ids = eng.encode_prompt(p) + first.tokens[:5]  # held: the prompt and the answer's first rows
    eng.generate(p, **kw)
    strict = eng.generate(ids, **kw)
    assert strict.stats["cached_prompt_tokens"] == len(ids) - 1
    assert strict.tokens == full_prefill(eng, ids, **kw).tokens


def test_prefix_reuse_needs_target_rows_of_the_same_kernels(default_model_dir):
    """Draft passes and another ISA level invalidate what they would change; the torch reference
    (not batch-invariant) records nothing."""
    eng = engine_for(default_model_dir, "mxfp4")
    p = dev_prompts()[5]
    want = eng.generate(p, max_new_tokens=4)
    ids = eng.encode_prompt(p)
    assert eng.generate(p, max_new_tokens=4).stats["cached_prompt_tokens"] == len(ids) - 1
    # a sequence that adopts the prompt's pages and writes draft rows from position 3 on gets
    # copies of them: the indexed pages keep their target rows
    kv = KVCache(eng.backend.pool)
    assert kv.adopt(ids, eng.backend.kernel_path) == len(ids) - 1
    eng.backend.prepare(kv, [1, 2], 3, draft=True)
    again = eng.generate(p, max_new_tokens=4)
    assert again.stats["cached_prompt_tokens"] == len(ids) - 1 and again.tokens == want.tokens
    kv.release()
    eng.backend.kv.forget()
    assert eng.generate(p, max_new_tokens=4).stats["cached_prompt_tokens"] == 0
    if len(ISA_LEVELS) > 1:
        _C.set_isa_limit(ISA_LEVELS[-2])
        assert eng.generate(p, max_new_tokens=4).stats["cached_prompt_tokens"] == 0
    ref = qspec.load(default_model_dir, backend="torch", draft=None)
    for _ in range(2):
        assert ref.generate(p, max_new_tokens=2).stats["cached_prompt_tokens"] == 0


def test_closing_a_generation_early_leaves_the_engine_ready(default_model_dir):
    """A caller that stops iterating Engine.tokens (a server whose client went away) leaves a
    consistent cache: the next generation is what it would have been."""
    eng = engine_for(default_model_dir, "mxfp4")
    p, q = dev_prompts()[1], dev_prompts()[3]
    want = full_prefill(eng, q, max_new_tokens=16).tokens
    it = eng.tokens(p, max_new_tokens=64)
    for _ in range(10):
        next(it)
    it.close()
    assert eng.generate(q, max_new_tokens=16).tokens == want
