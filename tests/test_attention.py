"""Causal attention over the shared BF16 KV cache (csrc/attention.*, csrc/x86/attention_*).

Every path this CPU can run is checked against an independent float64 numpy computation
(masked softmax attention with GQA heads repeated), and for the two properties the lossless
speculative decoder rests on, bit-exactly: batch invariance (row i does not depend on m, on the
other query rows, or on the thread count) and the causal mask (cache rows beyond a query's
position are never read).
"""
import functools

import numpy as np
import pytest

from attn_shapes import head_dim_for, shape_for
from env_switch import assert_env_switch
from qspec import _C

PATHS = _C.attn_paths()
# The paths attention() may choose: avx512_bf16 only where set_attn_bf16 allows it (not on Intel by default).
CHOSEN = [p for p in PATHS if p != "avx512_bf16" or _C.attn_bf16()]

# Paths that round q and the softmax weights to BF16 for their products (csrc/x86/attention_amx.cpp,
# as BF16 flash attention does); each is checked against the oracle with the same roundings.
BF16_OPERAND_PATHS = {"amx", "avx512_bf16"}
# FP32 accumulation over up to ~1000 keys against a float64 oracle; outputs are O(1).
TOL_F32_VS_F64 = dict(rtol=1e-4, atol=3e-5)
# Long contexts (tens of thousands of keys) accumulate more FP32 rounding in Σ e_j · V_j.
TOL_F32_VS_F64_LONG = dict(rtol=1e-3, atol=2e-4)

# (n_heads, kv_heads, head_dim)
SMOLLM2 = (9, 3, 64)
LLAMA3_8B = (32, 8, 128)
MHA = (4, 4, 64)
SHAPES = {"smollm2": SMOLLM2, "llama3_8b": LLAMA3_8B, "mha": MHA}
MS = [1, 2, 5, 9, 17, 33]
START_POS = [0, 1, 31, 100, 1000]
LAYERS = 2
MAX_SEQ = 1040  # >= max(START_POS) + max(MS)

BF16_NAN = 0x7FC0
BF16_INF = 0x7F80


def to_bf16_bits(x):
    """float32 -> bf16 bits, round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_bits_to_f64(b):
    return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@functools.lru_cache(maxsize=None)
def make_cache(kv_heads, head_dim, max_seq=MAX_SEQ, seed=0):
    """Random cache [layers, 2, max_seq, kv_heads, head_dim]; read-only so tests can share it."""
    rng = np.random.default_rng(seed)
    kv = to_bf16_bits(rng.standard_normal((LAYERS, 2, max_seq, kv_heads, head_dim), np.float32))
    kv.flags.writeable = False
    return kv


def make_q(m, n_heads, head_dim, seed=1, amp=1.0):
    rng = np.random.default_rng(seed)
    return (amp * rng.standard_normal((m, n_heads, head_dim))).astype(np.float32)


def attention_f64(q, kv, layer, start_pos, scale=None, window=0, bf16_operands=False):
    """Independent oracle: float64 masked softmax attention, GQA by repeating kv heads; window > 0:
    sliding window (key j visible to position p when p - window < j <= p, as transformers).

    bf16_operands: the roundings that define the amx path (BF16_OPERAND_PATHS), nothing of its
    order: q rounded to BF16 before the scores, and each softmax weight exp(s - m) rounded to BF16,
    m the max of the key segment it lies in (_C.attn_seg_keys keys from key 0: the unit every
    kernel normalises by before the segments are merged), Σ over the unrounded weights."""
    m, n_heads, head_dim = q.shape
    kv_heads = kv.shape[3]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    n = start_pos + m
    k = np.repeat(bf16_bits_to_f64(kv[layer, 0, :n]), n_heads // kv_heads, axis=1)  # [n, H, D]
    v = np.repeat(bf16_bits_to_f64(kv[layer, 1, :n]), n_heads // kv_heads, axis=1)  # [n, H, D]
    q = bf16_bits_to_f64(to_bf16_bits(q)) if bf16_operands else q.astype(np.float64)
    s = scale * np.einsum("ihd,jhd->ihj", q, k)  # [m, H, n]
    pos = start_pos + np.arange(m)
    s = np.where(np.arange(n)[None, None, :] <= pos[:, None, None], s, -np.inf)
    if window:
        s = np.where(np.arange(n)[None, None, :] > pos[:, None, None] - window, s, -np.inf)
    s -= s.max(axis=-1, keepdims=True)
    if not bf16_operands:
        w = np.exp(s)
        w /= w.sum(axis=-1, keepdims=True)
        return np.einsum("ihj,jhd->ihd", w, v)
    num, den = 0.0, 0.0
    for a in range(0, n, _C.attn_seg_keys):
        seg = s[:, :, a:a + _C.attn_seg_keys]
        top = seg.max(axis=-1, keepdims=True)  # -inf: the pair attends no key of this segment
        live = np.isfinite(top)
        top = np.where(live, top, 0.0)
        w = np.exp(seg - top)
        w_bf16 = bf16_bits_to_f64(to_bf16_bits(w.astype(np.float32)))
        f = np.where(live, np.exp(top), 0.0)
        num = num + f * np.einsum("ihj,jhd->ihd", w_bf16, v[a:a + _C.attn_seg_keys])
        den = den + f * w.sum(axis=-1, keepdims=True)
    return num / den


def expected(path, q, kv, layer, start_pos, scale=None, window=0):
    """The oracle for `path`: with its operand roundings (attention_f64)."""
    return attention_f64(q, kv, layer, start_pos, scale, window, bf16_operands=path in BF16_OPERAND_PATHS)


def assert_matches(path, got, want, kv, tol=TOL_F32_VS_F64):
    """got [m, H, D] against its oracle `want` (expected). A BF16-operand path rounds FP32
    exponentials where the oracle rounds float64 ones, so a weight near a rounding boundary may
    land one BF16 step (2^-8 of itself) away; that moves its pair's outputs by at most 2^-8 ·
    max|V| and happens to few pairs: those get that bound, at least 95% of pairs must be within
    `tol` (model-167 Xeon, test_matches_float64's cases: at most 1.5% of pairs off, by 2e-3 at most)."""
    if path not in BF16_OPERAND_PATHS:
        np.testing.assert_allclose(got, want, **tol)
        return
    exact = np.isclose(got, want, **tol).all(axis=-1)  # [m, H]: pairs within the FP32 tolerance
    assert exact.mean() >= 0.95, f"{(~exact).sum()} of {exact.size} pairs off by more than FP32 rounding"
    v_max = np.abs(bf16_bits_to_f64(kv[:, 1])).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol["atol"] + 2.0**-8 * v_max)


@functools.lru_cache(maxsize=None)
def oracle(path, shape_name, m, start_pos):
    n_heads, kv_heads, head_dim = SHAPES[shape_name]
    q = make_q(m, n_heads, head_dim)
    return q, expected(path, q, make_cache(kv_heads, head_dim), 1, start_pos)


def bits(x):
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


@pytest.fixture
def threads():
    """Lets a test change the OpenMP thread count; restores it afterwards."""
    before = _C.get_num_threads()
    yield _C.set_num_threads
    _C.set_num_threads(before)


# ------------------------------------------------------------------ accuracy vs float64 oracle


def _check_vs_oracle(path, shape_name, m, start_pos):
    n_heads, kv_heads, head_dim = SHAPES[shape_name]
    q, expect = oracle(path, shape_name, m, start_pos)
    kv = make_cache(kv_heads, head_dim)
    got = _C.attention(q, kv, 1, start_pos, path=path)
    assert got.dtype == np.float32 and got.shape == (m, n_heads, head_dim)
    assert_matches(path, got, expect, kv)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape_name", ["smollm2", "mha"])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("start_pos", START_POS)
def test_matches_float64(path, shape_name, m, start_pos):
    _check_vs_oracle(path, shape_name, m, start_pos)


# Llama-3-8B-like heads: every m and position for the fast paths, a corner subset for the scalar
# reference by default (it is the slow one); the full product runs under -m slow.
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("start_pos", START_POS)
def test_matches_float64_llama(path, m, start_pos):
    if path == "ref" and (m, start_pos) not in [(1, 0), (1, 1000), (9, 31), (33, 100)]:
        pytest.skip("scalar reference on the 32/8/128 shape: corner subset only (see -m slow)")
    _check_vs_oracle(path, "llama3_8b", m, start_pos)


@pytest.mark.slow
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("start_pos", START_POS)
def test_matches_float64_llama_ref_full(m, start_pos):
    _check_vs_oracle("ref", "llama3_8b", m, start_pos)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("head_dim", [8, 24, 72, 96, 120, 160])  # every column split of the fast V pass
@pytest.mark.parametrize("heads", [(6, 2), (5, 1)])
def test_awkward_head_dims(path, head_dim, heads):
    n_heads, kv_heads = heads
    kv = make_cache(kv_heads, head_dim)
    q = make_q(7, n_heads, head_dim)
    if head_dim_for(path, head_dim) != head_dim:
        with pytest.raises(ValueError, match="not usable here"):
            _C.attention(q, kv, 0, 15, path=path)
        assert _C.attn_choose(head_dim) != path
        return
    got = _C.attention(q, kv, 0, 15, path=path)
    assert_matches(path, got, expected(path, q, kv, 0, 15), kv)


def test_ref_any_head_dim():
    kv = make_cache(2, 20)
    q = make_q(3, 4, 20)
    got = _C.attention(q, kv, 1, 9, path="ref")
    np.testing.assert_allclose(got, attention_f64(q, kv, 1, 9), **TOL_F32_VS_F64)
    assert _C.attn_choose(20) == "ref"
    assert _C.attention(q, kv, 1, 9).shape == (3, 4, 20)  # dispatcher falls back to ref


@pytest.mark.parametrize("path", PATHS)
def test_custom_scale_and_large_scores(path):
    # Scores in the hundreds: exp overflows unless the max is subtracted first.
    kv = make_cache(3, 64)
    q = make_q(4, 9, 64, amp=30.0)
    for scale in [None, 0.37]:
        got = _C.attention(q, kv, 1, 50, scale=scale, path=path)
        assert np.isfinite(got).all()
        assert_matches(path, got, expected(path, q, kv, 1, 50, scale), kv)


@pytest.mark.parametrize("path", PATHS)
def test_last_position_of_cache(path):
    kv = make_cache(3, 64, max_seq=200)
    q = make_q(9, 9, 64)
    got = _C.attention(q, kv, 1, 200 - 9, path=path)
    assert_matches(path, got, expected(path, q, kv, 1, 200 - 9), kv)


@pytest.mark.parametrize("path", [p for p in PATHS if p not in BF16_OPERAND_PATHS])  # those: their oracle
def test_fast_paths_close_to_ref(path):
    kv = make_cache(3, 64)
    q = make_q(9, 9, 64)
    ref = _C.attention(q, kv, 1, 300, path="ref")
    np.testing.assert_allclose(_C.attention(q, kv, 1, 300, path=path), ref, **TOL_F32_VS_F64)


def test_empty_query():
    out = _C.attention(np.zeros((0, 9, 64), np.float32), make_cache(3, 64), 0, 5)
    assert out.shape == (0, 9, 64)


def test_non_contiguous_q_is_accepted():
    kv = make_cache(3, 64)
    q = make_q(5, 9, 128)[:, :, ::2]
    np.testing.assert_array_equal(bits(_C.attention(q, kv, 1, 20)),
                                  bits(_C.attention(np.ascontiguousarray(q), kv, 1, 20)))


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_long_context(path):
    max_seq = 24576
    kv = make_cache(3, 64, max_seq=max_seq)
    q = make_q(3, 9, 64, amp=3.0)
    got = _C.attention(q, kv, 1, max_seq - 3, path=path)
    assert_matches(path, got, expected(path, q, kv, 1, max_seq - 3), kv, TOL_F32_VS_F64_LONG)


# ------------------------------------------------------------------ batch invariance (bit-exact)


def _garbage_rows(q, keep, seed):
    """Copy of q whose rows other than `keep` hold garbage (huge values, inf, NaN)."""
    rng = np.random.default_rng(seed)
    g = (1e4 * rng.standard_normal(q.shape)).astype(np.float32)
    g.reshape(-1)[::7] = np.inf
    g.reshape(-1)[3::11] = np.nan
    g[keep] = q[keep]
    return g


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("start_pos", [0, 31, 1000])
def test_row_independent_of_batch(path, shape_name, start_pos):
    if path == "ref" and shape_name == "llama3_8b" and start_pos == 1000:
        pytest.skip("scalar reference, 32/8/128 heads at position 1000: see the -m slow twin")
    _check_row_independent(path, shape_name, start_pos)


@pytest.mark.parametrize("path", [p for p in PATHS if p != "ref"])
def test_prefill_rows_equal_decode_rows(path):
    """A 300-row prefill (units of a row chunk over all its key segments, merged by the unit:
    csrc/attention.cpp run_chunk_units) gives every row the bits of that row decoded alone
    (units of one segment each, merged afterwards), across several key segments."""
    n_heads, kv_heads, head_dim = 12, 2, 128  # Qwen2.5-1.5B: 6 query heads per KV head
    kv = make_cache(kv_heads, head_dim)
    m, start_pos = 300, 700
    q = make_q(m, n_heads, head_dim, seed=3)
    batch = _C.attention(q, kv, 1, start_pos, path=path)
    for i in (0, 15, 16, 17, 150, 299):
        alone = _C.attention(q[i:i + 1], kv, 1, start_pos + i, path=path)
        np.testing.assert_array_equal(bits(alone[0]), bits(batch[i]), err_msg=f"row {i}")


@pytest.mark.slow
def test_row_independent_of_batch_ref_llama_far():
    _check_row_independent("ref", "llama3_8b", 1000)


def _check_row_independent(path, shape_name, start_pos):
    n_heads, kv_heads, head_dim = SHAPES[shape_name]
    kv = make_cache(kv_heads, head_dim)
    m = 9
    q = make_q(m, n_heads, head_dim)
    batch = _C.attention(q, kv, 1, start_pos, path=path)
    for i in range(m):
        alone = _C.attention(q[i:i + 1], kv, 1, start_pos + i, path=path)
        np.testing.assert_array_equal(bits(alone[0]), bits(batch[i]), err_msg=f"row {i}")
        mixed = _C.attention(_garbage_rows(q, i, seed=i), kv, 1, start_pos, path=path)
        np.testing.assert_array_equal(bits(mixed[i]), bits(batch[i]), err_msg=f"row {i}")
    # Growing m (a verify pass of K+1 rows vs a shorter one) leaves the shared rows unchanged.
    for m2 in [1, 2, 5, 17, 33]:
        q2 = make_q(m2, n_heads, head_dim, seed=5)
        q2[:min(m, m2)] = q[:min(m, m2)]
        out2 = _C.attention(q2, kv, 1, start_pos, path=path)
        k = min(m, m2)
        np.testing.assert_array_equal(bits(out2[:k]), bits(batch[:k]), err_msg=f"m={m2}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_bit_identical_across_thread_counts(path, shape_name, threads):
    n_heads, kv_heads, head_dim = SHAPES[shape_name]
    kv = make_cache(kv_heads, head_dim)
    # 300 rows: a long prompt's units over all their segments (run_chunk_units), at one thread too
    cases = [(1, 500), (9, 100), (33, 1000), (300, 400)] if path != "ref" else [(1, 500), (9, 100), (33, 40)]
    for m, start_pos in cases:
        q = make_q(m, n_heads, head_dim, seed=m)
        outs = []
        for n in [1, 2, 3]:
            threads(n)
            outs.append(bits(_C.attention(q, kv, 0, start_pos, path=path)))
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_array_equal(outs[0], outs[2])


def test_dispatcher_ignores_m():
    kv = make_cache(3, 64)
    q = make_q(33, 9, 64)
    chosen = _C.attn_choose(64)
    batch = _C.attention(q, kv, 1, 100)
    np.testing.assert_array_equal(bits(batch), bits(_C.attention(q, kv, 1, 100, path=chosen)))
    for i in [0, 7, 32]:
        np.testing.assert_array_equal(bits(_C.attention(q[i:i + 1], kv, 1, 100 + i)[0]),
                                      bits(batch[i]))


# The fast paths compute every (row, head) pair of one KV head in one task, streaming K/V blocks
# once for all of them, and group pairs into tasks by m and thread count. A row must still come
# out bit-identical to computing it alone (m = 1): grid over m, start_pos (block boundaries at
# multiples of 8 and the 64/32-key super-blocks), thread counts, GQA shapes and awkward head_dims,
# with garbage in the other rows and NaN/inf in every cache row past the batch's last position.
# Positions around 256 put single-segment and merged rows (attention.h: kAttnSegKeys) in one batch.
GRID_MS = [2, 3, 5, 8, 9, 16, 17, 33]
GRID_START_POS = [0, 1, 7, 8, 63, 64, 65, 127, 240, 255, 256, 300, 600]
GRID_SHAPES = {"smollm2": SMOLLM2, "llama3_8b": LLAMA3_8B, "gqa_24": (6, 2, 24),
               "gqa_72": (5, 1, 72)}


def _q_at(p, n_heads, head_dim):
    """The query of position p (the same for the batched and the alone call)."""
    return make_q(1, n_heads, head_dim, seed=1000 + p)[0]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape_name", list(GRID_SHAPES))
def test_batched_rows_bit_identical_to_m1(path, shape_name, threads):
    if path == "ref" and shape_name == "llama3_8b":
        pytest.skip("scalar reference on 32/8/128: covered by test_row_independent_of_batch")
    n_heads, kv_heads, head_dim = shape_for(path, GRID_SHAPES[shape_name])
    kv = make_cache(kv_heads, head_dim, max_seq=640)
    last = max(GRID_START_POS) + max(GRID_MS)
    qs = np.stack([_q_at(p, n_heads, head_dim) for p in range(last)])
    threads(1)
    alone = [_C.attention(qs[p:p + 1], kv, 1, p, path=path)[0] for p in range(last)]
    ms = GRID_MS if path != "ref" else [2, 9, 33]
    sps = GRID_START_POS if path != "ref" else [0, 7, 240]
    for t in [1, 2, 3, 4]:
        threads(t)
        for m in ms:
            for sp in sps:
                poisoned = kv.copy()
                poisoned[:, :, sp + m:] = BF16_NAN
                poisoned[:, :, sp + m::3] = BF16_INF
                poisoned[0] = BF16_NAN
                for parity in (0, 1):
                    q = qs[sp:sp + m].copy()
                    bad = np.arange(m) % 2 != parity
                    q[bad] = _garbage_rows(q, np.zeros(m, bool), seed=m + sp)[bad]
                    out = _C.attention(q, poisoned, 1, sp, path=path)
                    for i in np.flatnonzero(~bad):
                        np.testing.assert_array_equal(
                            bits(out[i]), bits(alone[sp + i]),
                            err_msg=f"threads={t} m={m} start_pos={sp} row {i}")


@pytest.mark.parametrize("path", PATHS)
def test_every_head_of_a_group_is_computed(path, threads):
    # One task covers all G heads of its rows: each head must get its own q and output slot.
    n_heads, kv_heads, head_dim = SMOLLM2
    kv = make_cache(kv_heads, head_dim)
    q = make_q(5, n_heads, head_dim, seed=3)
    for t in [1, 2, 3]:
        threads(t)
        got = _C.attention(q, kv, 1, 40, path=path)
        assert_matches(path, got, expected(path, q, kv, 1, 40), kv)
        for h in range(n_heads):  # changing one head's q changes no other head's output
            q2 = q.copy()
            q2[:, h] = make_q(5, 1, head_dim, seed=50 + h)[:, 0]
            out2 = _C.attention(q2, kv, 1, 40, path=path)
            others = [x for x in range(n_heads) if x != h]
            np.testing.assert_array_equal(bits(out2[:, others]), bits(got[:, others]))


# ------------------------------------------------------------------ causal mask


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("start_pos", [0, 5, 100])
def test_cache_beyond_position_is_never_read(path, start_pos):
    kv = make_cache(3, 64, max_seq=128).copy()
    m = 9
    q = make_q(m, 9, 64)
    before = _C.attention(q, kv, 1, start_pos, path=path)
    for i in range(m):
        p = start_pos + i
        poisoned = kv.copy()
        poisoned[:, :, p + 1:] = BF16_NAN
        poisoned[:, :, p + 1::3] = BF16_INF
        poisoned[0] = BF16_NAN  # another layer's cache is not read either
        alone = _C.attention(q[i:i + 1], poisoned, 1, p, path=path)
        np.testing.assert_array_equal(bits(alone[0]), bits(before[i]), err_msg=f"row {i}")
        # Rows 0..i of a batch see only their own prefixes too.
        part = _C.attention(q[:i + 1], poisoned, 1, start_pos, path=path)
        np.testing.assert_array_equal(bits(part), bits(before[:i + 1]), err_msg=f"rows 0..{i}")


# ------------------------------------------------------------------ paths, dispatch, bad inputs


def test_paths_and_choice():
    assert PATHS[0] == "ref"
    info = _C.cpu_info()
    if not info["features"]["avx512f"] and not info["isa_emulation"]:
        assert "avx512" not in PATHS
    assert _C.attn_choose(64) == CHOSEN[-1]
    assert _C.attn_choose(128) == CHOSEN[-1]


def test_isa_limit_restricts_paths():
    before = _C.isa_selected()
    try:
        _C.set_isa_limit("scalar")
        assert _C.attn_paths() == ["ref"]
        assert _C.attn_choose(64) == "ref"
        with pytest.raises(ValueError, match="not usable"):
            _C.attention(make_q(1, 9, 64), make_cache(3, 64), 0, 3, path="avx2")
    finally:
        _C.set_isa_limit(before)
    assert _C.attn_paths() == PATHS


def _bad_call_cases():
    kv = make_cache(3, 64, max_seq=64)
    q = make_q(2, 9, 64)
    return {
        "q float64": lambda: _C.attention(q.astype(np.float64), kv, 0, 0),
        "q float16": lambda: _C.attention(q.astype(np.float16), kv, 0, 0),
        "q 2-d": lambda: _C.attention(q[0], kv, 0, 0),
        "kv float32": lambda: _C.attention(q, kv.astype(np.float32), 0, 0),
        "kv int16": lambda: _C.attention(q, kv.astype(np.int16), 0, 0),
        "kv 4-d": lambda: _C.attention(q, kv[0], 0, 0),
        "kv not K,V": lambda: _C.attention(q, np.ascontiguousarray(kv[:, :1]), 0, 0),
        "kv non-contiguous": lambda: _C.attention(q, kv[:, :, ::2], 0, 0),
        "head_dim mismatch": lambda: _C.attention(make_q(2, 9, 32), kv, 0, 0),
        "heads not multiple": lambda: _C.attention(make_q(2, 8, 64), kv, 0, 0),
        "layer too big": lambda: _C.attention(q, kv, LAYERS, 0),
        "layer negative": lambda: _C.attention(q, kv, -1, 0),
        "start_pos negative": lambda: _C.attention(q, kv, 0, -1),
        "beyond max_seq": lambda: _C.attention(q, kv, 0, 63),
        "far beyond max_seq": lambda: _C.attention(q, kv, 0, 10_000),
        "scale nan": lambda: _C.attention(q, kv, 0, 0, scale=float("nan")),
        "unknown path": lambda: _C.attention(q, kv, 0, 0, path="avx3"),
        "avx2 on head_dim 20": lambda: _C.attention(make_q(1, 4, 20), make_cache(2, 20), 0, 0,
                                                    path="avx2"),
        "choose head_dim 0": lambda: _C.attn_choose(0),
    }


@pytest.mark.parametrize("case", list(_bad_call_cases()))
def test_bad_inputs_raise_value_error(case):
    with pytest.raises(ValueError):
        _bad_call_cases()[case]()


def test_exactly_at_max_seq_is_fine():
    kv = make_cache(3, 64, max_seq=64)
    assert _C.attention(make_q(2, 9, 64), kv, 0, 62).shape == (2, 9, 64)


# ------------------------------------------------------------------ sliding windows (Gemma 3, Phi-3, ...)

GEMMA_HEADS = (4, 1, 256)  # head_dim 256 (Gemma 3)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [SMOLLM2, GEMMA_HEADS], ids=["smollm2", "hd256"])
@pytest.mark.parametrize("window", [1, 24, 300])
@pytest.mark.parametrize("start_pos,m", [(0, 33), (100, 5), (250, 17), (600, 9), (1000, 1)])
def test_sliding_window_matches_float64_and_is_batch_invariant(path, shape, window, start_pos, m):
    """Each row attends exactly its last `window` keys, and its bits are those of the row alone."""
    n_heads, kv_heads, hd = shape
    q, kv = make_q(m, n_heads, hd), make_cache(kv_heads, hd)
    got = _C.attention(q, kv, 1, start_pos, path=path, window=window)
    assert_matches(path, got, expected(path, q, kv, 1, start_pos, window=window), kv)
    for i in {0, m // 2, m - 1}:
        alone = _C.attention(q[i:i + 1], kv, 1, start_pos + i, path=path, window=window)
        assert np.array_equal(bits(got[i]), bits(alone[0])), (path, window, start_pos, i)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [SMOLLM2, GEMMA_HEADS], ids=["smollm2", "hd256"])
def test_window_wider_than_the_context_changes_no_bit(path, shape):
    n_heads, kv_heads, hd = shape
    q, kv = make_q(17, n_heads, hd), make_cache(kv_heads, hd)
    want = _C.attention(q, kv, 1, 500, path=path)
    assert np.array_equal(bits(_C.attention(q, kv, 1, 500, path=path, window=517)), bits(want))
    assert_matches(path, want, expected(path, q, kv, 1, 500), kv)  # head_dim 256 too


# ------------------------------------------------------------------ paged cache
def paged(kv, n_pos, page_size, seed=3):
    """kv's positions 0..n_pos-1 scattered over the pages of a larger pool, in shuffled order:
    (pool, page table)."""
    n_pages = -(-n_pos // page_size)
    table = np.random.default_rng(seed).permutation(n_pages + 5)[:n_pages].astype(np.int32)
    pool = np.zeros((*kv.shape[:2], (n_pages + 5) * page_size, *kv.shape[3:]), dtype=kv.dtype)
    pos = np.arange(n_pos)
    pool[:, :, table[pos // page_size] * page_size + pos % page_size] = kv[:, :, :n_pos]
    return pool, table


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [SMOLLM2, LLAMA3_8B, (6, 2, 96), GEMMA_HEADS], ids=["smollm2", "llama", "hd96", "hd256"])
@pytest.mark.parametrize("page_size", [8, 16, 48])
@pytest.mark.parametrize("start_pos,m,window", [(0, 33, 0), (290, 5, 0), (600, 9, 100), (1000, 1, 0)])
def test_paged_cache_gives_the_bits_of_the_contiguous_one(path, shape, page_size, start_pos, m, window):
    """A sequence whose positions sit in shuffled pages of a pool attends exactly as over one
    contiguous cache: the kernels only change where a block of keys is read from."""
    n_heads, kv_heads, hd = shape
    q, kv = make_q(m, n_heads, hd), make_cache(kv_heads, hd)
    want = _C.attention(q, kv, 1, start_pos, path=path, window=window)
    pool, table = paged(kv, start_pos + m, page_size)
    got = _C.attention(q, pool, 1, start_pos, path=path, window=window, pages=table, page_size=page_size)
    assert np.array_equal(bits(got), bits(want)), (path, page_size, start_pos)


@pytest.mark.parametrize("bad,match", [
    (dict(pages=np.array([0], dtype=np.int32), page_size=16), "exceed the 1 pages"),
    (dict(pages=np.array([0, 99], dtype=np.int32), page_size=16), "outside the pool"),
    (dict(pages=np.array([0, 1], dtype=np.int32), page_size=12), "multiple of 8"),
])
def test_bad_page_table(bad, match):
    q, kv = make_q(4, SMOLLM2[0], SMOLLM2[2]), make_cache(*SMOLLM2[1:])
    with pytest.raises(ValueError, match=match):
        _C.attention(q, kv, 1, 20, **bad)


def test_amx_attention_can_be_switched_off():
    before = _C.set_attn_amx(False)
    try:
        want = [p for p in CHOSEN if p != "amx"][-1]
        assert _C.attn_choose(64) == want and _C.attn_choose(128) == want
        kv, q = make_cache(2, 64), make_q(3, 6, 64)
        assert np.array_equal(_C.attention(q, kv, 0, 20), _C.attention(q, kv, 0, 20, path=want))
    finally:
        _C.set_attn_amx(before)
    assert _C.attn_choose(64) == CHOSEN[-1]


def test_attn_dot_default_and_env():
    """BF16 operands by default where vdpbf16ps is full rate (not Intel); QSPEC_ATTN_DOT picks a
    process's choice (dpbf16 | fma) and any other value is one CLI line naming the choices."""
    assert _C.attn_bf16() == (_C.cpu_info()["vendor"] != "GenuineIntel")
    assert_env_switch("QSPEC_ATTN_DOT", "attn_bf16", "dpbf16", "fma")


@pytest.mark.skipif("avx512_bf16" not in PATHS, reason="no avx512_bf16 level here")
def test_bf16_attention_switch():
    """set_attn_bf16 picks the avx512_bf16 path (BF16 operands) or the FP32 avx512 one at that level,
    and attention() then gives that path's bits; head dims not a multiple of 32 take avx512 either way."""
    amx = _C.set_attn_amx(False)
    before = _C.set_attn_bf16(True)
    try:
        kv, q = make_cache(2, 64), make_q(3, 6, 64)
        for on, want in ((True, "avx512_bf16"), (False, "avx512")):
            _C.set_attn_bf16(on)
            assert _C.attn_bf16() == on and _C.attn_choose(64) == want and _C.attn_choose(24) == "avx512"
            assert np.array_equal(_C.attention(q, kv, 0, 20), _C.attention(q, kv, 0, 20, path=want))
        assert not np.array_equal(_C.attention(q, kv, 0, 20, path="avx512"),
                                  _C.attention(q, kv, 0, 20, path="avx512_bf16"))
    finally:
        _C.set_attn_bf16(before)
        _C.set_attn_amx(amx)
