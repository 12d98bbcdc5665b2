"""Tree attention (issue 11, docs/architecture.md "Tree attention"): every node of a draft tree is
computed bit-identically to a one-row linear step over its path, at every attention path / ISA
level; KVCache.move_rows turns the accepted path into linear rows; malformed trees are refused."""

import numpy as np
import pytest

from attn_shapes import shape_for
import qspec
from qspec import _C
from qspec.draft import DraftSpec
from qspec.kv_cache import KVCache, KVPool, Preempted
from qspec.native import NativeBackend
from qspec.synthetic import synthetic_config, synthetic_weights

PATHS = _C.attn_paths()
ISA_LEVELS = _C.cpu_info()["isa_levels"]
SHAPES = {"smollm2": (9, 3, 64), "qwen1.5b": (12, 2, 128), "odd": (6, 2, 24)}


def to_bf16_bits(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def make_cache(max_seq, kv_heads, head_dim, seed):
    rng = np.random.default_rng(seed)
    return to_bf16_bits(rng.standard_normal((2, 2, max_seq, kv_heads, head_dim)) * 1.5)


def random_parents(rng, prefix, n, max_width):
    """A random tree of n nodes at slots prefix.. (slot order: a random topological order)."""
    parents, depth = [], []
    for s in range(n):
        cands = [-1] + [p for p in range(s) if sum(q == p for q in parents) < max_width]
        par = cands[rng.integers(len(cands))] if rng.random() < 0.8 or s == 0 else -1
        if s and rng.random() < 0.5:  # bias towards deep chains
            par = s - 1 if sum(q == s - 1 for q in parents) < max_width else par
        parents.append(par)
        depth.append(0 if par < 0 else depth[par] + 1)
    return [p if p < 0 else p + prefix for p in parents], depth


def path_of(parents, prefix, slot):
    path = [slot]
    while parents[path[-1] - prefix] >= 0:
        path.append(parents[path[-1] - prefix])
    return path[::-1]


def bits(x):
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def check_tree_vs_linear(path, shape, prefix, n, m, seed, max_width=3, window=0):
    """Rows = the last m of n tree nodes at slots prefix..; each == the linear step over its path
    (with a sliding window: over the same last `window` logical keys)."""
    n_heads, kv_heads, hd = shape_for(path, shape)
    rng = np.random.default_rng(seed)
    parents, _ = random_parents(rng, prefix, n, max_width)
    kv = make_cache(prefix + n + 1, kv_heads, hd, seed)
    start = prefix + n - m
    q = rng.standard_normal((m, n_heads, hd)).astype(np.float32)
    got = _C.attention(q, kv, 1, start, path=path, tree=(prefix, parents), window=window)
    for i in range(m):
        p = path_of(parents, prefix, start + i)
        lin = kv.copy()
        lin[:, :, prefix:prefix + len(p)] = kv[:, :, p]
        want = _C.attention(q[i:i + 1], lin, 1, prefix + len(p) - 1, path=path, window=window)
        assert np.array_equal(bits(got[i]), bits(want[0])), (path, prefix, i, p)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", ["smollm2", "qwen1.5b", "odd"])
@pytest.mark.parametrize("prefix", [0, 5, 8, 250, 253, 256, 600])
def test_tree_rows_equal_linear_path(path, shape, prefix):
    for seed in range(3):
        check_tree_vs_linear(path, SHAPES[shape], prefix, n=16, m=[16, 9, 1][seed], seed=seed)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", [3, 24])
@pytest.mark.parametrize("prefix", [0, 250, 600])
def test_windowed_tree_rows_equal_linear_path(path, window, prefix):
    for seed in range(3):
        check_tree_vs_linear(path, SHAPES["qwen1.5b"], prefix, n=16, m=[16, 9, 1][seed], seed=seed, window=window)


@pytest.mark.parametrize("path", PATHS)
def test_deep_chain_crosses_segments(path):
    """A chain of 40 nodes from prefix 240: paths cross the 256-key segment boundary."""
    n_heads, kv_heads, hd = SHAPES["qwen1.5b"]
    rng = np.random.default_rng(7)
    prefix, n = 240, 40
    parents = [-1] + list(range(prefix, prefix + n - 1))
    kv = make_cache(prefix + n, kv_heads, hd, 7)
    q = rng.standard_normal((n, n_heads, hd)).astype(np.float32)
    got = _C.attention(q, kv, 0, prefix, path=path, tree=(prefix, parents))
    want = _C.attention(q, kv, 0, prefix, path=path)  # a chain at its own positions is linear
    assert np.array_equal(bits(got), bits(want))


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_tree_rows_equal_linear_path_exhaustive(path):
    for seed in range(40):
        rng = np.random.default_rng(1000 + seed)
        shape = list(SHAPES.values())[seed % 3]
        prefix = int(rng.integers(0, 700))
        n = int(rng.integers(1, 40))
        check_tree_vs_linear(path, shape, prefix, n, int(rng.integers(1, n + 1)), seed,
                             max_width=int(rng.integers(1, 6)))


@pytest.mark.parametrize("bad, msg", [
    ((3, [-1, 3]), "expected"),               # wrong length (m = 2, start_pos = 4: 3 slots)
    ((5, [-1]), "prefix"),                    # prefix > start_pos
    ((-1, [-1] * 7), "prefix"),
    ((3, [-1, 4, 3]), "parent 4 of slot 4"),  # parent >= own slot
    ((3, [-1, 2, 3]), "parent 2 of slot 4"),  # parent inside the prefix
])
def test_kernel_rejects_bad_trees(bad, msg):
    q = np.zeros((2, 2, 8), np.float32)
    kv = np.zeros((1, 2, 16, 1, 8), np.uint16)
    with pytest.raises(ValueError, match=msg):
        _C.attention(q, kv, 0, 4, tree=bad)


# ------------------------------------------------------------------ model level


@pytest.fixture(scope="module")
def backend(default_model_dir):
    return qspec.load(default_model_dir).backend


@pytest.fixture(scope="module")
def small_backend():
    cfg = synthetic_config("smollm2-135m", hidden_size=128, intermediate_size=320, n_layers=3, n_heads=4,
                           n_kv_heads=2, head_dim=32, vocab_size=300, max_seq_len=512)
    return NativeBackend(cfg, synthetic_weights(cfg, seed=5), DraftSpec("mxfp4", "mxfp4"))


def _linear_logits(be, ctx, path_tokens, draft):
    be.forward(ctx, 0)
    out = None
    for j, t in enumerate(path_tokens):
        out = be.forward([t], len(ctx) + j, draft=draft)[0].copy()
    return out


def check_model_tree(be, isa, draft, n_ctx):
    """A verify pass over a tree == a one-row linear forward per node over its path, bit for bit;
    the tree written in two passes (root level, then the rest) gives the same rows."""
    _C.set_isa_limit(isa)
    try:
        rng = np.random.default_rng(3)
        ctx = rng.integers(0, be.cfg.vocab_size, n_ctx).tolist()
        P = len(ctx)
        parents = [-1, P, P, P + 1, P + 1, P + 2, P + 3, P + 6]
        toks = rng.integers(0, be.cfg.vocab_size, len(parents)).tolist()
        be.kv.ensure_capacity(P + len(parents) + 4)
        be.forward(ctx, 0)
        tree_out = be.forward(toks, P, all_logits=True, draft=draft, tree=(P, parents)).copy()
        be.forward(ctx, 0)
        be.forward(toks[:3], P, draft=draft, tree=(P, parents[:3]))
        two_pass = be.forward(toks[3:], P + 3, all_logits=True, draft=draft, tree=(P, parents)).copy()
        for i in range(len(parents)):
            path = path_of(parents, P, P + i)
            want = _linear_logits(be, ctx, [toks[s - P] for s in path], draft)
            assert np.array_equal(tree_out[i], want), (isa, draft, i, path)
            if i >= 3:
                assert np.array_equal(two_pass[i - 3], want), (isa, draft, i, path)
    finally:
        _C.set_isa_limit(_C.isa_detected())


# the default model's scalar GEMMs take minutes: that level runs under -m slow (and on the
# synthetic model below by default)
@pytest.mark.parametrize("isa", [pytest.param(i, marks=pytest.mark.slow) if i == "scalar" else i
                                 for i in ISA_LEVELS])
@pytest.mark.parametrize("draft", [0, 1])
def test_model_tree_rows_equal_linear(backend, isa, draft):
    check_model_tree(backend, isa, draft, 21)


@pytest.mark.parametrize("isa", ISA_LEVELS)
@pytest.mark.parametrize("draft", [0, 1])
@pytest.mark.parametrize("n_ctx", [21, 252])  # 252: paths cross the 256-key segment boundary
def test_small_model_tree_rows_equal_linear(small_backend, isa, draft, n_ctx):
    check_model_tree(small_backend, isa, draft, n_ctx)


def test_move_rows_then_linear_continuation(backend):
    """Verify a tree, move the accepted path to linear rows, continue linearly: == plain."""
    be = backend
    rng = np.random.default_rng(4)
    ctx = rng.integers(0, be.cfg.vocab_size, 30).tolist()
    P = len(ctx)
    parents = [-1, P, P, P + 2, P + 1, P + 3]
    toks = rng.integers(0, be.cfg.vocab_size, len(parents)).tolist()
    path = path_of(parents, P, P + 5)  # slots P, P+2, P+3, P+5
    nxt = rng.integers(0, be.cfg.vocab_size, 3).tolist()
    be.kv.ensure_capacity(P + 16)
    be.kv.forget()
    be.forward(ctx, 0)
    be.forward(toks, P, all_logits=True, tree=(P, parents))
    assert be.kv.tokens == ctx  # tree rows are not recorded
    path_toks = [toks[s - P] for s in path]
    be.kv.move_rows(path, P, tokens=path_toks, kernel_path=be.kernel_path)
    assert be.kv.length == P + len(path) and be.kv.tokens == ctx + path_toks
    moved = be.kv.data[:, :, :P + len(path)].copy()
    got = be.forward(nxt, P + len(path), all_logits=True).copy()
    be.forward(ctx + path_toks, 0)
    assert np.array_equal(be.kv.data[:, :, :P + len(path)], moved)
    want = be.forward(nxt, P + len(path), all_logits=True)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("bad, msg", [
    ("x", "pair"),
    ((1.5, [-1]), "prefix must be an int"),
    ((4, [-1, 4]), "prefix 4 must be in"),
    ((2, [-1]), "expected start_pos"),
    ((2, [-1, 2.5]), "ints"),
    ((2, [-1, 3]), "parent 3 of slot 3"),
    ((2, [-1, 0]), "parent 0 of slot 3"),
])
def test_forward_rejects_bad_trees(backend, bad, msg):
    backend.kv.ensure_capacity(8)
    with pytest.raises(ValueError, match=msg):
        backend.forward([1, 2], 2, tree=bad)


def test_move_rows_validates():
    cfg = synthetic_config("smollm2-135m", hidden_size=64, intermediate_size=64, n_layers=1,
                           n_heads=2, n_kv_heads=1, head_dim=8, vocab_size=50, max_seq_len=32)
    kv = KVCache(KVPool(cfg, page_size=16))
    kv.ensure_capacity(16)
    kv.data[:, :, kv.rows(0, 16)] = np.arange(16, dtype=np.uint16)[None, None, :, None, None]
    for src, dst, msg in [([5, 4], 2, "ascending"), ([1], 2, "ascending"), ([3], -1, "dst_start"),
                          ([16], 2, "capacity"), ([[3]], 2, "1-D"), ([3.0], 2, "1-D")]:
        with pytest.raises(ValueError, match=msg):
            kv.move_rows(src, dst)
    with pytest.raises(ValueError, match="tokens"):
        kv.move_rows([3, 5], 2, tokens=[1])
    kv.move_rows([3, 5, 9], 2)
    assert kv.length == 5 and kv.data[0, 0, kv.rows(2, 5), 0, 0].tolist() == [3, 5, 9]
    # preempted between the verify pass and the move (an older sequence took its pages): the
    # batch's Preempted, which restarts the sequence, not a capacity error
    kv.preempt()
    with pytest.raises(Preempted):
        kv.move_rows([3, 5], 2)
