"""Draft trees (qspec/tree.py): greedy == plain greedy, exact sampling distribution, cost model, bad input."""

import inspect
import os
import subprocess
import sys

import numpy as np
import pytest

import qspec
from qspec.sampling import SamplingParams, argmax, warp
from qspec.tree import (AcceptCal, TreeCost, TreeParams, accept_greedy, accept_sampled, draft_tree, select,
                        verify_layout)

from test_speculative import _chi2_pvalue, dev_prompts


# ---------------------------------------------------------------- a Markov "model" in numpy
class Markov:
    """Target and draft logits depend on the last token only (tables T and Q): the exact
    distributions of the next tokens are known in closed form."""

    def __init__(self, V: int, seed: int, draft_noise: float):
        g = np.random.default_rng(seed)
        self.T = (g.standard_normal((V, V)) * 2).astype(np.float32)
        self.Q = (self.T * 0.3 + g.standard_normal((V, V)) * draft_noise).astype(np.float32)

    def generate(self, first: int, n: int, width: int, depth: int, nodes: int, gen=None, params=None) -> list[int]:
        """n tokens after `first` by tree steps (the slot layout is exercised, positions are not)."""
        out, tok, P = [], first, 0
        while len(out) < n:
            t = draft_tree(lambda toks, start, parents: self.Q[toks], tok, P, width, depth,
                           nodes if gen is not None else 10 ** 9, gen, params)
            kept = select(t, nodes, gen is not None)
            toks, parents = verify_layout(t, kept, P)
            assert all(parents[k] < P + k for k in range(len(parents)))
            rows = self.T[toks]
            path, new = accept_greedy(t, kept, rows) if gen is None else accept_sampled(t, kept, rows, params, gen)
            assert len(new) == len(path) and len(path) <= depth + 1
            out += new
            tok, P = new[-1], P + len(new)
        return out[:n]


@pytest.mark.parametrize("width,depth,nodes", [(1, 1, 2), (1, 4, 5), (2, 3, 6), (3, 4, 12), (4, 2, 20)])
def test_greedy_tree_on_markov_equals_argmax_chain(width, depth, nodes):
    for noise in (0.5, 5.0):  # a close draft and a deliberately bad one
        m = Markov(12, seed=width * 10 + depth, draft_noise=noise)
        want, t = [], 3
        for _ in range(40):
            t = argmax(m.T[t])
            want.append(t)
        assert m.generate(3, 40, width, depth, nodes) == want


def test_rerank_keeps_ancestors_and_prefers_value():
    m = Markov(10, seed=1, draft_noise=1.0)
    t = draft_tree(lambda toks, s, p: m.Q[toks], 0, 5, 3, 4, 10 ** 9)
    kept = select(t, 7, sampled=False)
    assert len(kept) == 7 and kept[0] == 0
    assert all(t.parent[i] in kept[:k] for k, i in enumerate(kept) if k)
    dropped = [i for i in range(1, len(t.tokens)) if i not in kept]
    assert min(t.value[i] for i in kept) >= max(t.value[i] for i in dropped)


@pytest.mark.parametrize("width,depth,nodes", [(3, 2, 13), (2, 3, 11), (3, 2, 6)])  # 6: a group cut
def test_tree_sampling_preserves_target_distribution(width, depth, nodes):
    """SpecInfer's rule with several i.i.d. children per node: the joint of the first two tokens
    equals the target's p(t1 | r) p(t2 | t1); the draft is far from the target."""
    V = 5
    m = Markov(V, seed=7, draft_noise=2.0)
    sp = SamplingParams(temperature=1.0, top_k=4)
    p = warp(m.T, sp)
    exact = (p[2][:, None] * p).ravel()
    gen = np.random.default_rng(11)
    counts = np.zeros(V * V)
    n = 6000
    for _ in range(n):
        a, b = m.generate(2, 2, width, depth, nodes, gen, sp)
        counts[a * V + b] += 1
    assert _chi2_pvalue(counts, exact) > 1e-3


def test_tree_sampling_chi_square_detects_a_wrong_rule(monkeypatch):
    """The test above can fail: keeping the draft's children without the residual rule
    (accept the first child whatever p says) is caught."""
    V = 5
    m = Markov(V, seed=7, draft_noise=2.0)
    sp = SamplingParams(temperature=1.0)
    p = warp(m.T, sp)
    exact = (p[2][:, None] * p).ravel()
    gen = np.random.default_rng(11)
    counts = np.zeros(V * V)
    for _ in range(3000):
        t = draft_tree(lambda toks, s, par: m.Q[toks], 2, 0, 2, 2, 7, gen, sp)
        kept = select(t, 7, True)
        a = t.tokens[kept[1]]
        b = t.tokens[next(i for i in kept if t.parent[i] == kept[1])]
        counts[a * V + b] += 1
    assert _chi2_pvalue(counts, exact) < 1e-6


# ---------------------------------------------------------------- cost model
def _trained(verify, draft_pass=0.1, steps=120, alpha=0.8):
    tp = TreeParams("auto", 3, 4)
    cost = TreeCost(tp, chain_ok=True)
    for _ in range(steps):
        arm = cost.arm()
        if arm == "chain":  # chain: K = 4, tau from a per-token acceptance alpha
            tau = sum(alpha ** j for j in range(5))
            cost.observe_arm(arm, tau, 4 * draft_pass + verify(5))
        else:  # a tree of width w: more accepted tokens, w-row draft passes, N = 1 + w * 4 rows
            tau = sum(alpha ** j for j in range(5)) + 0.5 * (arm - 1)
            cost.observe_arm(arm, tau, 4 * draft_pass * (1 + 0.1 * arm) + verify(1 + 4 * arm))
    return cost


def test_cost_model_degenerates_to_chain_when_verify_is_steep():
    steep = lambda m: 1.0 + 0.5 * (m - 1)  # noqa: E731  (AVX2-like: every row costs)
    flat = lambda m: 1.0 + 0.005 * (m - 1)  # noqa: E731  (AMX-like)
    assert [_trained(steep).arm() for _ in range(5)].count("chain") >= 4
    assert _trained(flat).arm() != "chain"


def test_a_stale_arm_rate_gives_way_to_new_trials():
    """The chain's first trials ran while its own K was still being explored (slow); later it is the
    fastest arm: its probes must win it back within a few probes, not after its old rate has been
    averaged away trial by trial."""
    cost = TreeCost(TreeParams("auto", 2, 4), chain_ok=True)
    rates = {"chain": 5.0, 2: 12.0}
    chosen = []
    for step in range(200):
        if step == 20:
            rates["chain"] = 15.0
        arm = cost.arm()
        chosen.append(arm)
        cost.observe_arm(arm, rates[arm] * 0.4, 0.4)
    assert chosen[:20].count(2) >= 14                  # the tree wins while the chain is slow
    assert chosen[64:124].count("chain") >= 55          # and the chain within a few probes of its change
    assert cost.rate("chain") == pytest.approx(15.0, rel=0.05)


def test_cost_model_chooses_n_from_the_verify_curve():
    m = Markov(10, seed=2, draft_noise=0.3)
    t = draft_tree(lambda toks, s, p: m.Q[toks], 0, 0, 3, 4, 10 ** 9)
    cost = TreeCost(TreeParams("auto"), chain_ok=True)
    for rows in (1, 2, 8, 16):
        cost.observe_verify(rows, 1.0 + 0.5 * (rows - 1), 0.0, 0)
    steep = cost.nodes(t, 16, 0.1)
    cost = TreeCost(TreeParams("auto"), chain_ok=True)
    for rows in (1, 2, 8, 16):
        cost.observe_verify(rows, 1.0 + 0.001 * (rows - 1), 0.0, 0)
    flat = cost.nodes(t, 16, 0.1)
    assert steep <= 3 and flat == 16


def test_depth_stops_when_a_pass_does_not_pay():
    cost = TreeCost(TreeParams("auto"), chain_ok=True)
    cost.observe_arm(2, 10.0, 1.0)  # 10 tokens/s
    cost.observe_pass(2, 0.05)      # a 2-row draft pass: 0.05 s -> worth 0.5 tokens
    assert cost.keep_going(2, [0.6, 0.3])
    assert not cost.keep_going(2, [0.2, 0.1])


def test_acceptance_calibration_learns_rank_and_probability():
    """A top child the target takes 9 times in 10 at draft probability 0.45 and a second child it
    never takes: their estimates move from the probabilities (the prior) to what was observed, and
    only the children a verify pass tested (kept children of accepted nodes) count."""
    cal = AcceptCal()
    assert cal.estimate(0, 0.45) == pytest.approx(0.45) and cal.estimate(1, 0.3) == pytest.approx(0.3)
    # root 0 -> children 1 (rank 0, p 0.45), 2 (rank 1, p 0.3); 1 -> 3 (rank 0, p 0.45), 4 (rank 1)
    t = draft_tree(lambda toks, s, p: np.zeros((len(toks), 4), np.float32), 0, 0, 2, 2, 10 ** 9)
    t.rank[1:], t.prob[1:] = [0, 1, 0, 1], [0.45, 0.3, 0.45, 0.3]
    kept = [0, 1, 2, 3, 4]
    for step in range(200):
        path = [0, 1, 3] if step % 10 else [0]  # 9 in 10: both top children accepted
        cal.observe(t, kept, path)
    assert cal.estimate(0, 0.45) == pytest.approx(0.9, abs=0.05)
    assert cal.estimate(1, 0.3) < 0.05
    assert cal.estimate(0, 0.95) == pytest.approx(0.95)  # an untouched cell keeps its prior
    seen, hits = cal.seen.copy(), cal.hits.copy()
    cal.observe(t, [0, 2], [0, 1])  # node 2 accepted; its children were not kept: one test
    changed = np.argwhere(cal.seen != seen)
    assert changed.tolist() == [[1, 3]]  # rank 1, probability bin 0.3
    assert cal.seen[1, 3] == pytest.approx(seen[1, 3] * AcceptCal.DECAY + 1)
    assert cal.hits[1, 3] == pytest.approx(hits[1, 3] * AcceptCal.DECAY + 1)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw,words", [
    (dict(mode="yes"), "tree must be"), (dict(width=0), "tree_width"), (dict(width=9), "tree_width"),
    (dict(depth=0), "tree_depth"), (dict(nodes=1), "tree_nodes"), (dict(nodes=100), "tree_nodes"),
    (dict(depth=6, nodes=4), "at least tree_depth + 1"), (dict(width=True), "tree_width")])
def test_tree_params_bad_input(kw, words):
    with pytest.raises(ValueError, match=words.replace("+", r"\+")):
        TreeParams(**kw)


@pytest.mark.parametrize("args,words", [
    (["--tree-width", "0"], "--tree-width"), (["--tree-depth", "5", "--tree-nodes", "3"], "--tree-nodes"),
    (["--tree", "maybe"], "--tree")])
def test_cli_bad_tree_caps_are_one_line(args, words):
    r = subprocess.run([sys.executable, "-m", "qspec.cli", "generate", *args, "hi"], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ))
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0 and len(lines) == 1 and words in lines[0], r.stderr


# ---------------------------------------------------------------- backends
def test_torch_tree_rows_match_linear_steps(default_model_dir):
    """The torch reference's tree pass: each node's row equals the linear step over its path
    (FP32 torch GEMMs are not batch-invariant: close, not bit-equal)."""
    eng = qspec.load(default_model_dir, backend="torch")
    be = eng.backend
    ids = eng.encode_prompt("The capital of France is", chat=False)
    P = len(ids)
    be.kv.ensure_capacity(P + 16)
    be.forward(ids, 0)
    toks = [5, 17, 900, 42, 7, 11]
    parents = [-1, P, P, P + 1, P + 2, P + 3]  # root, two children, then two chains
    rows = be.forward(toks, P, all_logits=True, tree=(P, parents))
    for j in range(len(toks)):
        path, s = [], P + j
        while s != -1:
            path.insert(0, toks[s - P])
            s = parents[s - P]
        be.forward(ids, 0)
        lin = be.forward(path, P, all_logits=True)[-1]
        np.testing.assert_allclose(rows[j], lin, atol=2e-3, rtol=1e-3)
        be.forward(toks, P, all_logits=True, tree=(P, parents))  # the rows the check overwrote


_engine = {}


def native_engine(model_dir):
    if "e" not in _engine:
        _engine["e"] = qspec.load(model_dir)
        if "tree" not in inspect.signature(_engine["e"].backend.forward).parameters:
            pytest.fail("the native backend has no tree forward (branch tree-native not merged)")
    return _engine["e"]


@pytest.mark.parametrize("caps", [dict(tree_width=1, tree_depth=4, tree_nodes=5), dict(tree_width=2, tree_depth=3),
                                  dict(tree_width=3, tree_depth=5, tree_nodes=12), dict()])
def test_native_greedy_tree_equals_plain(default_model_dir, caps):
    eng = native_engine(default_model_dir)
    prompts = dev_prompts()
    steps = rows = 0
    for prompt in prompts[:2] + prompts[-1:]:
        want = eng.generate(prompt, max_new_tokens=40, speculative=False).tokens
        got = eng.generate(prompt, max_new_tokens=40, tree="on", **caps)
        assert got.tokens == want, (caps, prompt)
        steps += got.stats["tree_steps"]  # a step may be the prompt lookup's alone (qspec/lookup.py)
        rows += got.stats["tree_verify_rows"]
    assert steps > 0 and rows >= 2 * steps


def test_native_tree_auto_and_sampling_seeded(default_model_dir):
    eng = native_engine(default_model_dir)
    prompt = dev_prompts()[3]
    want = eng.generate(prompt, max_new_tokens=48, speculative=False).tokens
    assert eng.generate(prompt, max_new_tokens=48, tree="auto").tokens == want
    kw = dict(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=3, tree="on", tree_width=2, tree_depth=2)
    a, b = eng.generate(prompt, **kw), eng.generate(prompt, **kw)
    assert a.tokens == b.tokens and a.stats["tree_steps"] > 0


def test_default_tree_by_isa_level_and_model_size():
    from qspec.engine import SMALL_MODEL_PARAMS, default_tree

    assert default_tree("amx", SMALL_MODEL_PARAMS) == "auto"
    for path in ("avx512_bf16", "avx512", "avx2", "scalar", None):
        assert default_tree(path, SMALL_MODEL_PARAMS) == "off"
    assert default_tree("amx", SMALL_MODEL_PARAMS - 1) == "off"


def test_generate_takes_the_default_tree_of_its_kernel_path(default_model_dir, monkeypatch):
    import qspec.engine as engine

    eng = native_engine(default_model_dir)
    prompt = dev_prompts()[2]
    want = eng.generate(prompt, max_new_tokens=32, speculative=False).tokens
    off = eng.generate(prompt, max_new_tokens=32)
    assert off.tokens == want and not off.stats.get("tree_steps")  # SmolLM2-135M: below SMALL_MODEL_PARAMS
    monkeypatch.setattr(engine, "SMALL_MODEL_PARAMS", 0)
    monkeypatch.setitem(engine.DEFAULT_TREE_BY_ISA, eng.backend.kernel_path, "on")
    on = eng.generate(prompt, max_new_tokens=32, lookup="off")  # the default tree is the subject
    assert on.tokens == want and on.stats["tree_steps"] > 0
    assert not eng.generate(prompt, max_new_tokens=32, tree="off").stats.get("tree_steps")


def test_native_tree_with_a_chain_of_levels(default_model_dir):
    eng = qspec.load(default_model_dir, draft="mxfp6_e2m3", draft_levels=["mxfp4"])
    prompt = dev_prompts()[5]
    want = eng.generate(prompt, max_new_tokens=40, speculative=False).tokens
    for tree in ("on", "auto"):
        assert eng.generate(prompt, max_new_tokens=40, tree=tree, tree_width=2).tokens == want


def test_tree_on_needs_an_mx_draft(default_model_dir):
    eng = qspec.load(default_model_dir, draft="ngram")
    with pytest.raises(ValueError, match="MX draft"):
        eng.generate("hi", max_new_tokens=4, tree="on")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_real_model_greedy_tree_equals_plain(model):
    from qspec.fetch import resolve_model

    try:
        model_dir = resolve_model(model)
    except qspec.QspecError as e:  # not fetched (the suite sets QSPEC_OFFLINE=1 unless told otherwise)
        pytest.skip(f"{model} is not fetched ({e}); qspec fetch {model}")
    eng = qspec.load(model_dir)
    for prompt in dev_prompts():
        want = eng.generate(prompt, max_new_tokens=64, speculative=False).tokens
        for caps in (dict(tree="on", tree_width=3), dict(tree="auto")):
            assert eng.generate(prompt, max_new_tokens=64, **caps).tokens == want, (model, prompt, caps)


def test_native_tree_sampling_matches_target_distribution(tmp_path):
    """End to end on a tiny synthetic model (vocabulary 16, an MXFP4 draft far from it): the 2nd new
    token's marginal equals the exact target marginal, with trees of three children per node."""
    from qspec.synthetic import save_model_dir, synthetic_config, synthetic_weights

    cfg = synthetic_config("smollm2-135m", hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=16, vocab_size=16, max_seq_len=64)
    eng = qspec.load(save_model_dir(tmp_path, cfg, synthetic_weights(cfg, seed=3, scale=3.0)),
                     draft="mxfp4", draft_lm_head="mxfp4")
    params = dict(temperature=1.0, top_k=10)
    sp = SamplingParams(**params)
    prompt = [1, 5, 7]
    be = eng.backend
    be.kv.reset()
    be.kv.ensure_capacity(8)
    p1 = warp(be.forward(prompt, 0)[-1], sp)
    exact = np.zeros(16)
    for t1 in range(16):
        if p1[t1] > 0:
            exact += p1[t1] * warp(be.forward(prompt + [t1], 0)[-1], sp)
    counts = np.zeros(16)
    steps = 0
    for s in range(3000):
        r = eng.generate(prompt, max_new_tokens=3, seed=s, tree="on", tree_width=3, tree_depth=2,
                         tree_nodes=13, **params)
        counts[r.tokens[1]] += 1
        steps += r.stats["tree_steps"]
    assert steps >= 3000
    assert _chi2_pvalue(counts, exact) > 1e-3
