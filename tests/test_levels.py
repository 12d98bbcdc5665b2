"""Multi-level drafting (qspec/levels.py): chains stay lossless, n-gram drafting, bad input."""

import subprocess
import sys

import numpy as np
import pytest

import qspec
from running import running
from qspec import _C
from qspec.bench.common import dev_prompts
from qspec.levels import MAX_LEVELS, NgramLevel, check_formats, parse_chain
from qspec.sampling import SamplingParams, warp
from qspec.speculative import CostModel, _accept_sampled
from test_speculative import _chi2_pvalue

ISA_LEVELS = _C.cpu_info()["isa_levels"]
CHAIN = ["mxfp4", "ngram"]  # above the default model's mxfp6_e2m3 draft


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    _C.set_isa_limit(_C.isa_detected())


@pytest.fixture(scope="module")
def chain_engine(default_model_dir):
    """MXFP6-E2M3 (level 1) <- MXFP4 (level 2) <- n-gram (level 3): `levels=` selects a prefix."""
    return qspec.load(default_model_dir, draft="mxfp6_e2m3", draft_levels=CHAIN)


def repetitive_prompts() -> list[str]:
    return dev_prompts("repetition")


# ---------------------------------------------------------------- the n-gram drafter
def test_ngram_proposes_what_followed_the_latest_occurrence():
    ng = NgramLevel(n_max=3, n_min=1)
    #          0  1  2  3  4  5  6  7  8  9
    context = [5, 6, 7, 8, 1, 5, 6, 7, 9, 5, 6, 7]
    # the last 3 tokens (5 6 7) occur at 0 and 5: the latest one (5) is followed by 9 5 6 7
    assert ng.propose(context, 3) == [9, 5, 6]
    assert ng.propose(context, 10) == [9, 5, 6, 7]  # up to the end of the context
    assert ng.propose([1, 2, 3], 4) == []           # nothing recurs
    assert ng.propose([4], 4) == []


def test_ngram_tries_the_longest_n_first():
    ng = NgramLevel(n_max=3, n_min=1)
    # "2 3" occurs once (then 4); "3" alone occurs later (then 8): the longer match wins
    assert ng.propose([2, 3, 4, 9, 3, 8, 2, 3], 2) == [4, 9]
    assert NgramLevel(n_max=1).propose([2, 3, 4, 9, 3, 8, 2, 3], 2) == [8, 2]
    assert NgramLevel(n_max=3, n_min=2).propose([1, 3, 5, 3], 2) == []  # only a 1-gram matches
    with pytest.raises(ValueError):
        NgramLevel(n_max=1, n_min=2)


def test_deterministic_draft_acceptance_keeps_the_target_distribution():
    """An n-gram proposal x (q = one-hot): kept with probability p(x), else drawn from p without x."""
    V = 10
    g = np.random.default_rng(0)
    logits = (g.standard_normal((2, V)) * 1.5).astype(np.float32)
    params = SamplingParams(temperature=1.0, seed=2)
    p = warp(logits[0], params)
    gen = params.generator()
    for x in (int(np.argmax(p)), int(np.argmin(p))):  # a likely and an unlikely proposal
        counts = np.zeros(V)
        kept = 0
        n = 20000
        for _ in range(n):
            rows: list = []
            a, nxt = _accept_sampled([x], [None], logits, params, gen, warped=rows)
            counts[x if a == 1 else nxt] += 1
            kept += a
            assert len(rows) == a + 1 and np.allclose(rows[0], p)
        assert _chi2_pvalue(counts, p) > 1e-3
        assert abs(kept / n - p[x]) < 4 * np.sqrt(p[x] * (1 - p[x]) / n) + 1e-3


# ---------------------------------------------------------------- chains are lossless
def check_chain_lossless(engine, prompts, n, settings, isa):
    _C.set_isa_limit(isa)
    for prompt in prompts:
        want = engine.generate(prompt, max_new_tokens=n, speculative=False).tokens
        for levels, draft_max in settings:
            r = engine.generate(prompt, max_new_tokens=n, levels=levels, draft_max=draft_max)
            assert r.tokens == want, f"isa={isa} chain={engine.chain[:levels]} K={draft_max}: {prompt!r}"
            assert r.stats["levels"] == levels and r.stats["steps"] > 0


def test_mx_chains_are_lossless(chain_engine):
    """MXFP6-E2M3 <- MXFP4 and MXFP6-E2M3 <- MXFP4 <- n-gram, fixed and automatic lengths."""
    prompts = dev_prompts()
    settings = [(2, [4, 3]), (3, [6, 3, 8]), (3, None)]
    check_chain_lossless(chain_engine, prompts[-1:], 32, settings, ISA_LEVELS[-1])
    for isa in ISA_LEVELS[:-1]:  # lower levels (the scalar one is slow): one short case each
        check_chain_lossless(chain_engine, prompts[:1], 6, [(3, [3, 2, 4])], isa)


def test_an_end_of_sequence_token_mid_run_ends_the_cache_there(chain_engine):
    """A round whose accepted run holds an end-of-sequence token commits nothing past it: with
    each of several tokens of the plain output taken as the EOS, the output stops at its first
    occurrence and the cache holds the prompt and every emitted token but the last."""
    eng = chain_engine
    prompt = repetitive_prompts()[0]
    ids = eng.encode_prompt(prompt)
    plain = eng.generate(prompt, max_new_tokens=24, speculative=False).tokens
    saved = eng.eos_ids
    try:
        for j in range(3, 22, 2):
            first = plain.index(plain[j])
            eng.eos_ids = {plain[j]}
            with running(eng, ids, max_new_tokens=24, draft_max=[6, 3, 8]) as (tokens, kv, s):
                assert tokens == plain[:first + 1]
                assert kv.length == len(ids) + len(tokens) - 1, f"EOS at {first}"
    finally:
        eng.eos_ids = saved


def test_chain_levels_draft_and_share_the_cache(chain_engine):
    eng = chain_engine
    ids = eng.encode_prompt(repetitive_prompts()[0])
    with running(eng, ids, max_new_tokens=48, draft_max=[6, 3, 8]) as (tokens, kv, s):
        # one cache: committed = prompt + every emitted token but the last
        assert kv.length == len(ids) + len(tokens) - 1
    assert s["level2_drafted"] > 0 and 0 < s["level2_accepted"] <= s["level2_drafted"]
    assert s["drafted"] == s["level1_drafted"] and s["accepted"] == s["level1_accepted"]
    assert eng.chain == ["mxfp6_e2m3", "mxfp4", "ngram"]
    be = eng.backend
    assert be.upper_drafts[0].fmt == "mxfp4" and be.set_bytes[2] < be.set_bytes[1] < be.set_bytes[0]


def test_mx_with_ngram_and_ngram_alone_are_lossless(default_model_dir):
    prompts = repetitive_prompts()[:1] + dev_prompts()[8:9]
    mx_ngram = qspec.load(default_model_dir, draft="mxfp6_e2m3", draft_levels=["ngram"])
    check_chain_lossless(mx_ngram, prompts, 32, [(2, [4, 6])], ISA_LEVELS[-1])
    del mx_ngram
    ngram = qspec.load(default_model_dir, draft="ngram")
    assert ngram.chain == ["ngram"] and ngram.draft is None
    check_chain_lossless(ngram, prompts, 32, [(1, 8), (1, None)], ISA_LEVELS[-1])
    r = ngram.generate(prompts[0], max_new_tokens=32, draft_max=8)
    assert r.stats["accepted"] > 0  # the code is in the prompt: n-grams do match


class RandomDrafter(NgramLevel):
    """A deliberately bad top level: random tokens (never sensible text)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.rng, self.vocab = np.random.default_rng(0), vocab

    def propose(self, context, k):
        return self.rng.integers(0, self.vocab, size=k).tolist()


def test_bad_drafts_cost_speed_never_correctness(chain_engine):
    eng = chain_engine
    vocab = eng.cfg.vocab_size
    prompt = dev_prompts()[3]
    want = eng.generate(prompt, max_new_tokens=32, speculative=False).tokens
    saved = eng.levels
    try:
        for levels in ([RandomDrafter(vocab)], saved[:1] + [RandomDrafter(vocab)]):
            eng.levels = levels
            r = eng.generate(prompt, max_new_tokens=32, draft_max=[4] * len(levels))
            assert r.tokens == want
            top = len(levels)
            assert r.stats[f"level{top}_drafted"] > 0
            assert r.stats[f"level{top}_accepted"] <= 0.1 * r.stats[f"level{top}_drafted"]
    finally:
        eng.levels = saved


# ---------------------------------------------------------------- sampling through a chain
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from qspec.synthetic import save_model_dir, synthetic_config, synthetic_weights

    cfg = synthetic_config("smollm2-135m", hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=16, vocab_size=16, max_seq_len=64)
    return save_model_dir(tmp_path_factory.mktemp("tiny"), cfg, synthetic_weights(cfg, seed=3, scale=3.0))


def exact_second_token(eng, prompt, sp) -> np.ndarray:
    """P(t2) = sum_t1 p(t1 | prompt) p(t2 | prompt, t1), from target forwards."""
    be = eng.backend
    be.kv.reset()
    be.kv.ensure_capacity(len(prompt) + 2)
    p1 = warp(be.forward(prompt, 0)[-1], sp)
    exact = np.zeros(len(p1))
    for t1 in np.flatnonzero(p1):
        exact += p1[t1] * warp(be.forward(prompt + [int(t1)], 0)[-1], sp)
    return exact


@pytest.mark.parametrize("draft,levels,draft_max", [
    ("ngram", [], 3),                       # the deterministic-draft rule at the target
    ("mxfp8_e4m3", ["mxfp4"], [3, 2]),      # an MX level checking another one's samples
    ("mxfp4", ["ngram"], [3, 3]),           # an MX level checking n-gram proposals
    ("mxfp8_e4m3", ["HELPER:mxfp4"], [3, 2]),  # a helper model (here: the model itself) with its own cache
])
def test_chain_sampling_matches_target_distribution(tiny_model, draft, levels, draft_max):
    params = dict(temperature=1.0, top_k=10)
    levels = [name.replace("HELPER", str(tiny_model)) for name in levels]
    eng = qspec.load(tiny_model, draft=draft, draft_levels=levels)
    # the prompt holds the greedy continuation of its own end: the n-gram drafter proposes it
    greedy = eng.generate([1, 5, 7], max_new_tokens=6, speculative=False).tokens
    prompt = [1, 5, 7] + greedy + [1, 5, 7]
    exact = exact_second_token(eng, prompt, SamplingParams(**params))
    counts = np.zeros(16)
    top = len(eng.levels)
    drafted = accepted = 0
    for s in range(1500):
        r = eng.generate(prompt, max_new_tokens=5, seed=s, draft_max=draft_max, **params)
        counts[r.tokens[1]] += 1
        drafted += r.stats[f"level{top}_drafted"]
        accepted += r.stats[f"level{top}_accepted"]
    assert drafted > 0 and accepted < drafted, "the top level should draft, and not always be right"
    assert _chi2_pvalue(counts, exact) > 1e-3


# ---------------------------------------------------------------- helper models
@pytest.fixture(scope="module")
def random_helper(default_model_dir, tmp_path_factory):
    """A tiny random model with the default model's tokenizer: a helper whose drafts are bad."""
    import shutil

    from qspec.synthetic import save_model_dir, synthetic_config, synthetic_weights

    cfg = synthetic_config("smollm2-135m", hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=16, max_seq_len=2048)
    out = save_model_dir(tmp_path_factory.mktemp("helper"), cfg, synthetic_weights(cfg, seed=5))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / f, out / f)
    return out


def test_helper_levels_are_lossless(default_model_dir, random_helper):
    """The default model's own MXFP4 cast as a helper (its own KV cache, catching up on what level 1
    accepted) agrees with level 1 about as often as the shared-cache MXFP4 level; a random helper
    is nearly never right, and costs nothing but speed."""
    prompts = repetitive_prompts()[:1]
    good = qspec.load(default_model_dir, draft="mxfp6_e2m3", draft_levels=[f"{default_model_dir}:mxfp4", "ngram"])
    helper = good.levels[1]
    assert helper.backend is not good.backend and helper.backend.kv is not good.backend.kv
    check_chain_lossless(good, prompts, 32, [(2, [4, 3]), (3, [6, 3, 8])], ISA_LEVELS[-1])
    r = good.generate(prompts[0], max_new_tokens=32, levels=2, draft_max=[4, 3])
    assert r.stats["level2_accepted"] >= 0.3 * r.stats["level2_drafted"] > 0
    del good, helper, r
    bad = qspec.load(default_model_dir, draft="mxfp6_e2m3", draft_levels=[str(random_helper)])
    check_chain_lossless(bad, prompts[:1], 32, [(2, [4, 3])], ISA_LEVELS[-1])
    r = bad.generate(prompts[0], max_new_tokens=32, draft_max=[4, 3])
    assert r.stats["level2_accepted"] <= 0.1 * r.stats["level2_drafted"]


def test_helper_with_another_vocabulary_is_refused(default_model_dir, tiny_model, tmp_path):
    with pytest.raises(qspec.ModelLoadError, match="vocabulary of 16 tokens"):
        qspec.load(default_model_dir, draft_levels=[str(tiny_model)])
    from qspec.synthetic import save_model_dir, synthetic_config, synthetic_weights

    cfg = synthetic_config("smollm2-135m", hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=16)
    other = save_model_dir(tmp_path / "other", cfg, synthetic_weights(cfg))  # a word-level tokenizer, same size
    with pytest.raises(qspec.ModelLoadError, match="tokenizer differs"):
        qspec.load(default_model_dir, draft_levels=[str(other)])
    with pytest.raises(qspec.ModelLoadError, match="no such file"):
        qspec.load(default_model_dir, draft_levels=[str(tmp_path / "missing")])


# ---------------------------------------------------------------- the cost model skips a level
def test_cost_model_skips_a_level_that_does_not_pay():
    """Drafts that are never accepted, a verify that grows with rows: K = 0 most steps, with a
    probe every PROBE_EVERY steps; a good cheap level is never skipped."""
    def run(alpha, t_draft, verify, steps=200):
        rng = np.random.default_rng(0)
        cm = CostModel(byte_ratio=0.3, k_max=8, k_min=1, skippable=True)
        chosen = []
        for _ in range(steps):
            k = cm.choose()
            a = 0
            while a < k and rng.random() < alpha:
                a += 1
            cm.observe(k, a, k * t_draft, verify(k + 1))
            chosen.append(k)
        return chosen[50:]

    bad = run(0.0, 0.3, lambda m: 1.0 + 0.2 * (m - 1))
    assert bad.count(0) >= 0.8 * len(bad) and bad.count(0) < len(bad)  # skipped, but probed
    good = run(0.9, 0.05, lambda m: 1.0 + 0.02 * (m - 1))
    assert 0 not in good


# ---------------------------------------------------------------- bad input
def test_bad_chains_fail_before_loading():
    with pytest.raises(ValueError, match="unknown draft level 'mxfp3'"):
        parse_chain("auto", ["mxfp3"])
    with pytest.raises(ValueError, match="at most"):
        parse_chain("auto", ["mxfp4"] * MAX_LEVELS)
    with pytest.raises(ValueError, match="top draft level"):
        parse_chain("auto", ["ngram", "mxfp4"])
    with pytest.raises(ValueError, match="top draft level"):
        parse_chain("ngram", ["mxfp4"])
    with pytest.raises(ValueError, match="need a draft"):
        parse_chain(None, ["mxfp4"])
    with pytest.raises(ValueError, match="repeats level 1"):
        check_formats(["mxfp4", "mxfp4"])
    with pytest.raises(ValueError, match="at most 3 MX"):
        check_formats(["mxfp8_e4m3", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4"])
    # the chain is checked before the model is looked for
    for kw in (dict(draft_levels=["mxfp4", "mxfp4", "mxfp4", "ngram"]), dict(draft=None, draft_levels=["ngram"]),
               dict(draft="ngram", draft_file="x.safetensors"), dict(backend="torch", draft_levels=["ngram"])):
        with pytest.raises(ValueError):
            qspec.load("/nonexistent/model", **kw)


def test_bad_generate_arguments(chain_engine):
    eng = chain_engine
    for kw, words in ((dict(levels=4), "levels"), (dict(levels=0), "levels"),
                      (dict(draft_max=[2, 2, 2, 2]), "draft_max"), (dict(draft_max=[2, 33]), "level 2"),
                      (dict(draft_max=[2, 0]), "level 2")):
        with pytest.raises(ValueError, match=words):
            eng.generate("hi", max_new_tokens=4, **kw)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "qspec.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("args,words", [
    (["--draft2", "mxfp3"], ["unknown draft level"]),
    (["--draft2", "/nonexistent/helper"], ["/nonexistent"]),
    (["--draft3", "mxfp4"], ["--draft3 needs --draft2"]),
    (["--draft2-max", "4"], ["--draft2-max needs --draft2"]),
    (["--draft2", "mxfp4", "--draft2-max", "40"], ["--draft2-max"]),
    (["--draft2", "ngram", "--draft3", "mxfp4"], ["top draft level"]),
    (["--draft", "none", "--draft2", "mxfp4"], ["need a draft"]),
])
def test_cli_bad_chains_are_one_line(args, words):
    r = run_cli("generate", "-m", "/nonexistent/model", *args, "hi")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_cli_chain_generates(default_model_dir):
    import json

    r = run_cli("generate", "--json", "-n", "8", "--draft", "mxfp6_e2m3", "--draft2", "mxfp4",
                "--draft3", "ngram", "--draft2-max", "3", "Why is the sky blue?")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["stats"]
    assert s["levels"] == 3 and "level3_drafted" in s


# ---------------------------------------------------------------- the full matrix (slow)
@pytest.mark.slow
@pytest.mark.parametrize("isa", ISA_LEVELS)
def test_chains_lossless_all_prompts(chain_engine, isa):
    prompts = dev_prompts() + repetitive_prompts()
    settings = [(2, [k, k2]) for k in (2, 4, 8) for k2 in (1, 3, "auto")] + [(3, None), (3, [8, 4, 8])]
    check_chain_lossless(chain_engine, prompts, 96, settings, isa)
