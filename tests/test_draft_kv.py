"""The draft copies of the KV cache, "int8" and "int4" (rotated INT4 V rows, INT4 K per channel over
each page of committed rows) (csrc/kv_q8.h, csrc/x86/attention_q8_impl.h, qspec/kv_cache.py).

- Each quantizer equals an independent numpy implementation of its rule, bit for bit (INT4: the
  fixed-order Walsh-Hadamard rotation in FP32, the UE5M3 scale, the nibble packing), and stays
  within its error bound.
- Attention over the copy, on every path this build can run (ref, avx2, avx512 under the
  ISA-emulation build), against a float64 computation over the dequantized values.
- Batch invariance (row i bit-identical for any m, thread count) and tree rows == linear rows.
- Through the model: the drafts read the copy (their logits change, within a bound), every pass
  writes it (after prefill, speculation with chains and trees, prefix reuse, move_rows it equals
  the quantized BF16 rows), and greedy speculative == plain at every context length tested.
"""

import numpy as np
import pytest

import qspec
import qspec.mx
from running import running
from qspec import _C
from qspec.memory import draft_copy_of
from qspec.synthetic import save_model_dir, synthetic_config, synthetic_weights

PATHS = _C.attn_paths()
ISA_LEVELS = _C.cpu_info()["isa_levels"]
# FP32 accumulation over up to ~1300 keys against a float64 oracle (as tests/test_attention.py)
TOL_F32_VS_F64 = dict(rtol=1e-4, atol=3e-5)
# dequantization error of one value: half a step, 2^s / 2 <= max|block| / 127
Q8_REL_STEP = 1 / 127
FORMATS = ["int8", "int4"]
GROUP = 32  # the INT4 K copy's group in the kernel tests (the pool's page size in the model)


def bf16(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def f32(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def quantize_np(bits):
    """The rule of csrc/kv_q8.h in numpy: per 32 values s = min s with max|x| <= 127 * 2^s."""
    x = f32(bits).astype(np.float64).reshape(-1, 32)
    amax = np.abs(x).max(axis=1)
    s = np.full(amax.shape, -126)
    nz = amax > 0
    s[nz] = np.ceil(np.log2(amax[nz] / 127)).astype(int)
    s[nz & (amax > 127 * np.exp2(s.astype(float)))] += 1  # log2 rounding guard
    s[nz & (amax <= 127 * np.exp2(s.astype(float) - 1))] -= 1
    s = np.clip(s, -126, 127)
    q = np.clip(np.rint(x / np.exp2(s.astype(float))[:, None]), -127, 127).astype(np.int8)
    return q.reshape(bits.shape), (s + 127).astype(np.uint8).reshape(*bits.shape[:-1], -1)


def rot_flip(p):
    """D's diagonal of csrc/kv_q8.h as booleans (True = -1): top bit of i * 0x9E3779B9 mod 2^32."""
    return ((np.arange(p, dtype=np.uint64) * 0x9E3779B9) & 0xFFFFFFFF) >> 31 == 1


def fwht(x):
    """The fixed-order Walsh-Hadamard butterflies of kv_fwht over the last axis, in x's dtype."""
    p = x.shape[-1]
    h = 1
    while h < p:
        y = x.reshape(*x.shape[:-1], p // (2 * h), 2, h)
        x = np.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], axis=-2).reshape(x.shape)
        h *= 2
    return x


def rot_size(hd):
    return hd & -hd


def q4_scale(e):
    """UE5M3 scale bytes -> values: (1 + m/8) * 2^(e >> 3 - 16); 0 -> 0, 0xFF -> NaN."""
    e = np.asarray(e).astype(np.int64)
    v = (1 + (e & 7) / 8) * np.exp2((e >> 3) - 16.0)
    return np.where(e == 0, 0.0, np.where(e == 255, np.nan, v))


def q4_scale_bytes(amax, finite):
    """The UE5M3 scale byte of csrc/kv_q8.h for float32 maxima: the smallest code in [1, 0xFE] whose
    value v has v >= fl(amax / 7) (as the C++ computes it); 0 for amax 0, 0xFF where not finite."""
    table = q4_scale(np.arange(256)).astype(np.float32)
    e = np.minimum(np.searchsorted(table[1:255], amax / np.float32(7), side="left") + 1, 254)
    return np.where(finite, np.where(amax > 0, e, 0), 255).astype(np.uint8)


def quantize_q4_np(bits):
    """The INT4 rule of csrc/kv_q8.h in numpy: rotate per block of P (FP32), per 32 values the
    smallest UE5M3 scale s with 7 s >= max|y|, q = round-half-even(y / s) in [-7, 7], packed."""
    hd = bits.shape[-1]
    p = rot_size(hd)
    y = f32(bits).reshape(-1, hd // p, p)
    y = fwht(np.where(rot_flip(p), -y, y)).reshape(-1, 32)
    finite = np.isfinite(y).all(axis=1)
    amax = np.where(finite, np.abs(np.where(np.isfinite(y), y, 0)).max(axis=1), 0).astype(np.float32)
    e = q4_scale_bytes(amax, finite)
    s = q4_scale(e).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(finite[:, None] & (e[:, None] > 0), np.clip(np.rint(y / s[:, None]), -7, 7), 0)
    nib = q.astype(np.int64).reshape(*bits.shape[:-1], hd) & 15
    packed = (nib[..., 0::2] | nib[..., 1::2] << 4).astype(np.uint8).view(np.int8)
    return packed, e.reshape(*bits.shape[:-1], hd // 32)


def quantize_copy(kv, fmt, final=None):
    """The draft copy `fmt` of BF16 rows [layers, 2, rows, kv_heads, head_dim] as qspec/kv_cache.py
    holds it: (K values, V values, K scales, V scales, flags). INT4: the K groups of GROUP rows
    below row `final` (default: all but the last whole group) are written and flagged."""
    rows = kv.shape[2]
    return draft_copy_of(kv, fmt, (rows // GROUP - 1) * GROUP if final is None else final, GROUP)


def k4_group_params(params):
    """A K group's per-head bytes [..., 3 * head_dim] (kv_k4_group) -> centers (float32), scales (float64)."""
    hd = params.shape[-1] // 3
    center = f32(params[..., 0:2 * hd:2].astype(np.uint16) | params[..., 1:2 * hd:2].astype(np.uint16) << 8)
    return center, q4_scale(params[..., 2 * hd:])


def dequant_k4(qk, ek, flags, kv_k):
    """Values of an INT4 K copy [layers, 1, rows, kvh, hd] (float64): a flagged group's center +
    q * scale, the BF16 rows kv_k elsewhere."""
    layers, _, rows, kvh, hd2 = qk.shape
    hd = 2 * hd2
    out = f32(kv_k).astype(np.float64)
    for g0 in np.flatnonzero(flags[0, 0, :, 0, 0]):
        center, scale = k4_group_params(ek[:, 0, g0:g0 + GROUP].reshape(layers, kvh, 3 * hd))
        b = qk[:, 0, g0:g0 + GROUP].view(np.uint8).astype(np.int64)
        nib = np.stack([b & 15, b >> 4], axis=-1).reshape(layers, GROUP, kvh, hd)
        out[:, 0, g0:g0 + GROUP] = center[:, None] + (nib - ((nib & 8) << 1)) * scale[:, None]
    return out


def dequant_copy(kv, qk, qv, ek, ev, flags):
    """The values the drafts attend over [layers, 2, rows, kv_heads, head_dim] (float64)."""
    k = dequant(qk, ek) if qk.shape == kv[:, :1].shape else dequant_k4(qk, ek, flags, kv[:, :1])
    return np.concatenate([k, dequant(qv, ev)], axis=1)


def dequant(q, e):
    """Values of one quantizer's output in the BF16 rows' basis: int8 values, or packed INT4 ones
    (last dimension half the values') in the rotated basis, rotated back in float64."""
    if q.shape[-1] == e.shape[-1] * 16:
        b = q.view(np.uint8).astype(np.int64)
        nib = np.stack([b & 15, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)
        y = (nib - ((nib & 8) << 1)) * np.repeat(q4_scale(e), 32, axis=-1)
        hd = y.shape[-1]
        p = rot_size(hd)
        x = fwht(y.reshape(*y.shape[:-1], hd // p, p)) / p
        return np.where(rot_flip(p), -x, x).reshape(y.shape)
    return q.astype(np.float64) * np.exp2(np.repeat(e.astype(np.float64) - 127, 32, axis=-1))


def test_quantizer_matches_its_rule():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 128)) * np.exp2(rng.integers(-20, 20, (64, 1)))
    x[3] = 0.0
    x[4, :32] = 127.0  # exactly representable at s = 0
    x[5, :32] = 127.5  # needs s = 1
    x[6, 5] = -3e38
    bits = bf16(x)
    q, e = _C.kv_q8_quantize(bits)
    q_ref, e_ref = quantize_np(bits)
    np.testing.assert_array_equal(e, e_ref)
    np.testing.assert_array_equal(q, q_ref)
    assert e[4, 0] == 127 and e[5, 0] == 128 and not q[3].any()
    err = np.abs(dequant(q, e) - f32(bits)).reshape(-1, 32)
    assert (err <= np.abs(f32(bits)).reshape(-1, 32).max(axis=1, keepdims=True) * Q8_REL_STEP).all()


@pytest.mark.parametrize("hd", [64, 96, 128, 256])
def test_q4_quantizer_matches_its_rule(hd):
    rng = np.random.default_rng(hd)
    x = rng.standard_normal((64, hd)) * np.exp2(rng.integers(-24, 20, (64, 1)))
    x[3] = 0.0
    x[4, 7] = 300.0  # one outlier channel: rotated, it spreads over the block
    x[5, 1] = np.inf
    x[6, 0] = np.nan
    x[7] *= 2.0 ** 60  # past the largest scale: clipped at 0xFE
    x[8] *= 2.0 ** -60  # below the smallest: scale byte 1
    bits = bf16(x)
    q, e = _C.kv_q4_quantize(bits)
    q_ref, e_ref = quantize_q4_np(bits)
    assert q.shape == (64, hd // 2) and e.shape == (64, hd // 32)
    np.testing.assert_array_equal(e, e_ref)
    np.testing.assert_array_equal(q, q_ref)
    assert not e[3].any() and not q[3].any()
    p = rot_size(hd)
    assert (e[5].reshape(-1, p // 32)[0] == 255).all() and (e[6].reshape(-1, p // 32)[0] == 255).all()
    assert (e[7] == 254).all() and (e[8] == 1).all() and e[3].sum() == 0
    # error: at most half a step per rotated value; the rotation is sqrt(P) times an orthogonal map
    ok = np.setdiff1d(np.flatnonzero((e < 254).all(axis=1)), [5, 6, 8])  # not clipped
    err_rot = np.repeat(q4_scale(e[ok]), 32, axis=-1) / 2
    bound = np.sqrt((err_rot.reshape(len(ok), -1, p) ** 2).sum(axis=-1) / p)
    err = np.linalg.norm((dequant(q[ok], e[ok]) - f32(bits[ok])).reshape(len(ok), -1, p), axis=-1)
    assert (err <= bound * (1 + 1e-6) + 1e-30).all()


def k4_group_np(bits, hd):
    """The INT4 K group rule of csrc/kv_q8.h in numpy: bits [g, n] -> (packed [g, n / 2], params [3 n])."""
    g, n = bits.shape
    x = f32(bits)
    finite = np.isfinite(x).all(axis=0)
    xs = np.where(np.isfinite(x), x, 0).astype(np.float32)
    lo, hi = xs.min(axis=0), xs.max(axis=0)
    center = np.where(finite, bf16(lo * np.float32(0.5) + hi * np.float32(0.5)), 0).astype(np.uint16)
    cf = f32(center)
    r = np.where(finite, np.maximum(hi - cf, cf - lo), 0).astype(np.float32)
    e = q4_scale_bytes(r, finite)
    s = q4_scale(e).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(finite & (e > 0), np.clip(np.rint((xs - cf) / s), -7, 7), 0).astype(np.int64) & 15
    packed = (q[:, 0::2] | q[:, 1::2] << 4).astype(np.uint8).view(np.int8)
    params = np.concatenate([np.stack([center & 0xFF, center >> 8], axis=-1).reshape(n // hd, 2 * hd),
                             e.reshape(n // hd, hd)], axis=1).astype(np.uint8).reshape(-1)
    return packed, params


@pytest.mark.parametrize("hd", [32, 64, 128])
def test_k4_group_matches_its_rule(hd):
    rng = np.random.default_rng(hd)
    x = rng.standard_normal((5, 32, 2 * hd)) * np.exp2(rng.integers(-20, 12, (5, 1, 2 * hd)))
    x[0, :, 3] += 300.0  # a channel far from zero: its center carries it
    x[1, :, 5] = 2.5  # a constant channel: scale byte 0, every value its center
    x[2, 7, 9] = np.nan
    x[3, 1, 2 * hd - 1] = -np.inf
    bits = bf16(x)
    packed, params = _C.kv_k4_group(bits, hd)
    assert packed.shape == (5, 32, hd) and params.shape == (5, 6 * hd)
    for b in range(5):
        want = k4_group_np(bits[b], hd)
        np.testing.assert_array_equal(packed[b], want[0])
        np.testing.assert_array_equal(params[b], want[1])
    assert params[1, 2 * hd + 5] == 0 and params[2, 2 * hd + 9] == 255 and params[3, 3 * hd + 2 * hd + hd - 1] == 255
    # within half a step of each value (finite channels)
    scale = q4_scale(params[0].reshape(2, 3 * hd)[:, 2 * hd:].reshape(-1))
    kv = bits[0][None, None, :, None, :].reshape(1, 1, 32, 2, hd)
    flags = np.zeros((1, 1, 32, 1, 1), np.uint8)
    flags[0, 0, 0] = 1  # the group's first row
    got = dequant_k4(packed[0].reshape(1, 1, 32, 2, hd // 2), params[0].reshape(1, 1, 32, 2, -1), flags, kv)
    err = np.abs(got - f32(kv)).reshape(32, 2 * hd)
    assert (err <= scale / 2 * (1 + 1e-6)).all()
    assert np.abs(got.reshape(32, 2 * hd)[:, 3] - f32(bits[0][:, 3])).max() < 0.1 * 300  # not crushed


def make_cache(max_seq, kv_heads, head_dim, seed=0, fmt="int8", final=None):
    """Random BF16 rows (max_seq rounded up to GROUP) and their copy `fmt`."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 2, -(-max_seq // GROUP) * GROUP, kv_heads, head_dim)) * 1.5
    x[:, 0, ..., 3] += 40.0  # a K channel far from zero, as real models have
    kv = bf16(x)
    return kv, quantize_copy(kv, fmt, final)


# The paths whose INT4 K scores are integer dot products over a rounded q (csrc/x86/
# attention_q8_impl.h, k4_table: the AVX-512 builds); ref and avx2 score the dequantized values.
# (avx512_bf16 runs the avx512 path's copy kernels.)
INT_K_PATHS = {"avx512", "avx512_bf16", "amx"}
# The path whose INT4 V pass runs on AMX-BF16 tiles, each weight w * scale rounded to BF16 once
# (relative 2^-9): |error| <= 2^-9 * max|v| on top of TOL_F32_VS_F64.
V4_TILE_PATHS = {"amx"}


def copy_tol(path, fmt, vals):
    """The tolerance of path's draft-copy attention against float64 over the copy's values vals."""
    if fmt == "int4" and path in V4_TILE_PATHS:
        return dict(rtol=TOL_F32_VS_F64["rtol"], atol=TOL_F32_VS_F64["atol"] + 2.0**-9 * np.nanmax(np.abs(vals[:, 1])))
    return TOL_F32_VS_F64


def k4_int_scores(qv, qk, ek, flags, layer, kh, keys):
    """The scores q.k (float64) of k4_table's arithmetic for the keys of written INT4 K groups
    among `keys` (NaN elsewhere): per group q' = q * scale (FP32), qi = rint(q' * (32767 /
    max|q'|)), delta = max|q'| / 32767 (FP32), score = delta * sum(qi * v) + q.center."""
    hd = qv.shape[-1]
    out = np.full(len(keys), np.nan)
    for g0 in np.unique(keys // GROUP * GROUP):
        if not flags[0, 0, g0, 0, 0]:
            continue
        center, scale = k4_group_params(ek[layer, 0, g0:g0 + GROUP].reshape(-1, 3 * hd)[kh])
        qp = qv.astype(np.float32) * scale.astype(np.float32)
        amax = np.abs(qp).max()
        sel = keys // GROUP * GROUP == g0
        if not np.isfinite(qp).all():
            continue  # NaN scores, as the kernel's
        qi = np.zeros(hd) if amax == 0 else np.rint(qp * (np.float32(32767) / amax)).astype(np.float64)
        b = qk[layer, 0, keys[sel], kh].view(np.uint8).astype(np.int64)
        nib = np.stack([b & 15, b >> 4], axis=-1).reshape(len(b), hd)
        vals = nib - ((nib & 8) << 1)
        out[sel] = np.float64(amax / np.float32(32767)) * (vals @ qi) + qv.astype(np.float64) @ center
    return out


def attention_f64(q, vals, layer, start_pos, window=0, sinks=0, int_k=None, recent=0, kv=None, kept=None):
    """Causal GQA attention in float64 over given K/V values [layers, 2, seq, kvh, hd]; with a
    window, a row at p attends keys p - window + 1 .. p and keys 0 .. sinks - 1. int_k = an INT4
    copy (K values, V values, K scales, V scales, flags): written groups' keys scored as
    k4_int_scores. recent: keys p - recent + 1 .. p take their values from the BF16 rows kv.
    kept [m, kvh, pages] (bool): the keys of a row's pages marked False are not attended."""
    m, h, hd = q.shape
    kvh = vals.shape[3]
    out = np.empty((m, h, hd))
    for i in range(m):
        p = start_pos + i
        keys = np.arange(p + 1)
        if window:
            keys = keys[(keys > p - window) | (keys < sinks)]
        row_vals = vals[layer, :, keys].swapaxes(0, 1)  # [2, keys, kvh, hd]
        if recent:
            row_vals = np.where((keys > p - recent)[None, :, None, None], f32(kv[layer, :, keys].swapaxes(0, 1)),
                                row_vals)
        k = np.repeat(row_vals[0], h // kvh, axis=1)
        v = np.repeat(row_vals[1], h // kvh, axis=1)
        s = np.einsum("hd,jhd->hj", q[i].astype(np.float64), k)
        if int_k is not None:
            for hh in range(h):
                si = k4_int_scores(q[i, hh], int_k[0], int_k[2], int_k[4], layer, hh // (h // kvh), keys)
                si[keys > p - recent] = np.nan  # recent keys: their BF16 rows, as the values
                s[hh] = np.where(np.isnan(si), s[hh], si)
        s /= np.sqrt(hd)
        if kept is not None:
            s[~kept[i][np.arange(h) // (h // kvh)][:, keys // GROUP]] = -np.inf
        w = np.exp(s - s.max(axis=1, keepdims=True))
        out[i] = np.einsum("hj,jhd->hd", w / w.sum(axis=1, keepdims=True), v)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(9, 3, 64), (12, 2, 128), (4, 4, 96), (8, 1, 256)])
@pytest.mark.parametrize("start_pos,m", [(0, 1), (37, 5), (255, 2), (700, 17), (1300, 1)])
def test_kernel_against_f64(path, shape, start_pos, m, fmt):
    n_heads, kv_heads, hd = shape
    kv, q8 = make_cache(start_pos + m + 3, kv_heads, hd, fmt=fmt)
    q = np.random.default_rng(1).standard_normal((m, n_heads, hd)).astype(np.float32)
    got = _C.attention(q, kv, 1, start_pos, path=path, q8=q8)
    vals = dequant_copy(kv, *q8)
    exact = attention_f64(q, vals, 1, start_pos)
    if fmt == "int4" and path in INT_K_PATHS:
        model = attention_f64(q, vals, 1, start_pos, int_k=q8)
        tol = copy_tol(path, fmt, vals)
        np.testing.assert_allclose(got, model, **tol)
        np.testing.assert_allclose(got, exact, rtol=1e-3, atol=2e-3 + tol["atol"])  # q's rounding: by little
    else:
        np.testing.assert_allclose(got, exact, **TOL_F32_VS_F64)
    bf = _C.attention(q, kv, 1, start_pos, path=path)
    assert not np.array_equal(got, bf)  # it reads the copy, not the BF16 rows


# A sliding-window layer (Gemma 3) read through the copy, and the draft window: sinks + recent keys
# (segments past the sinks and below the window are skipped, the rest merged in order).
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window,sinks", [(40, 0), (300, 0), (64, 16), (300, 64), (512, 256)])
@pytest.mark.parametrize("start_pos,m", [(0, 3), (50, 1), (700, 9), (1300, 2)])
def test_window_and_sinks_against_f64(path, window, sinks, start_pos, m, fmt):
    kv, q8 = make_cache(start_pos + m + 3, 2, 64, seed=6, fmt=fmt)
    q = np.random.default_rng(7).standard_normal((m, 6, 64)).astype(np.float32)
    got = _C.attention(q, kv, 1, start_pos, path=path, q8=q8, window=window, sinks=sinks)
    vals = dequant_copy(kv, *q8)
    want = attention_f64(q, vals, 1, start_pos, window, sinks,
                         int_k=q8 if fmt == "int4" and path in INT_K_PATHS else None)
    np.testing.assert_allclose(got, want, **copy_tol(path, fmt, vals))
    for i in (0, m - 1):  # a row alone: the same bits
        one = _C.attention(q[i:i + 1], kv, 1, start_pos + i, path=path, q8=q8, window=window, sinks=sinks)
        np.testing.assert_array_equal(one[0], got[i])


def linear_path_cache(kv, q8, prefix, parents, i):
    """The cache and copy with tree row i's path laid out linearly from `prefix` (rows; the K
    groups' flags stay), and that row's position there."""
    path_slots, s = [], prefix + i
    while s != -1:
        path_slots.insert(0, s)
        s = parents[s - prefix]
    lin_kv, lin_q8 = kv.copy(), tuple(a.copy() for a in q8)
    for j, slot in enumerate(path_slots):
        for a, b in zip((lin_kv, *lin_q8[:4]), (kv, *q8[:4])):
            a[:, :, prefix + j] = b[:, :, slot]
    return lin_kv, lin_q8, prefix + len(path_slots) - 1


# The latest keys of each row from the BF16 rows (csrc/attention.h recent_keys): alone, with a
# window and sinks, and past a segment's end (rows whose recent keys span two segments).
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("recent,window,sinks", [(1, 0, 0), (37, 0, 0), (256, 0, 0), (300, 0, 0), (64, 300, 16),
                                                 (2000, 0, 0)])
@pytest.mark.parametrize("start_pos,m", [(0, 3), (50, 1), (700, 9), (1300, 2)])
def test_recent_keys_against_f64(path, recent, window, sinks, start_pos, m, fmt):
    kv, q8 = make_cache(start_pos + m + 3, 2, 64, seed=11, fmt=fmt, final=(start_pos + m) // GROUP * GROUP)
    q = np.random.default_rng(12).standard_normal((m, 6, 64)).astype(np.float32)
    got = _C.attention(q, kv, 1, start_pos, path=path, q8=q8, window=window, sinks=sinks, recent=recent)
    vals = dequant_copy(kv, *q8)
    want = attention_f64(q, vals, 1, start_pos, window, sinks, recent=recent, kv=kv,
                         int_k=q8 if fmt == "int4" and path in INT_K_PATHS else None)
    np.testing.assert_allclose(got, want, **copy_tol(path, fmt, vals))
    for i in (0, m - 1):  # a row alone: the same bits
        one = _C.attention(q[i:i + 1], kv, 1, start_pos + i, path=path, q8=q8, window=window, sinks=sinks,
                           recent=recent)
        np.testing.assert_array_equal(one[0], got[i])
    if start_pos + m > recent:  # some keys still come from the copy
        assert not np.array_equal(got, _C.attention(q, kv, 1, start_pos, path=path, q8=q8, window=window,
                                                    sinks=sinks))
    else:  # every key is recent: the BF16 rows' attention, within FP32 (the copy's kernels compute
        # in FP32; the amx and avx512_bf16 paths' own BF16 attention rounds q and the weights: their
        # FP32 twin is avx512)
        fp32 = "avx512" if path in ("amx", "avx512_bf16") else path
        np.testing.assert_allclose(got, _C.attention(q, kv, 1, start_pos, path=fp32), **TOL_F32_VS_F64)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", PATHS)
def test_recent_keys_tree_rows_equal_linear_path(path, fmt):
    prefix, parents = 290, [-1, 290, 290, 291, 293, 292]
    m = len(parents)
    kv, q8 = make_cache(prefix + m + 8, 2, 64, seed=13, fmt=fmt, final=prefix // GROUP * GROUP)
    q = np.random.default_rng(14).standard_normal((m, 4, 64)).astype(np.float32)
    for recent in (3, 40):
        got = _C.attention(q, kv, 0, prefix, path=path, tree=(prefix, parents), q8=q8, recent=recent)
        for i in range(m):
            lin_kv, lin_q8, pos = linear_path_cache(kv, q8, prefix, parents, i)
            lin = _C.attention(q[i:i + 1], lin_kv, 0, pos, path=path, q8=lin_q8, recent=recent)
            np.testing.assert_array_equal(got[i], lin[0])


def page_bounds_f64(q, q8, layer, row, kvh, group, pages):
    """Quest's bound of each page (float64): max over the KV head's `group` query heads of
    sum q * center + 7 * |q| * scale over the page's K group params."""
    hd = q.shape[-1]
    qh = q[row, kvh * group:(kvh + 1) * group].astype(np.float64)
    out = []
    for pg in pages:
        center, scale = k4_group_params(q8[2][layer, 0, pg * GROUP:(pg + 1) * GROUP].reshape(-1, 3 * hd)[kvh])
        out.append((qh @ center + 7 * np.abs(qh) @ scale).max())
    return np.array(out)


# Sparse draft attention (csrc/draft_pages.cpp): of the written pages inside a row's window and
# below its recent keys, each row attends page 0, the last and the others of highest bound up to
# the budget, and everything else it attends.
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sparse,recent,window,sinks", [(256, 0, 0, 0), (256, 40, 0, 0), (512, 256, 0, 0),
                                                       (4096, 0, 0, 0), (256, 40, 1000, 64), (256, 0, 700, 0)])
@pytest.mark.parametrize("start_pos,m", [(300, 2), (1500, 3), (2900, 1)])
def test_sparse_pages_against_f64(path, sparse, recent, window, sinks, start_pos, m):
    kv, q8 = make_cache(start_pos + m + 3, 2, 64, seed=15, fmt="int4", final=(start_pos + m) // GROUP * GROUP)
    q = np.random.default_rng(16).standard_normal((m, 6, 64)).astype(np.float32)
    kw = dict(q8=q8, recent=recent, window=window, sinks=sinks)
    got, kept = _C.attention(q, kv, 1, start_pos, path=path, sparse=sparse, kept_pages=True, **kw)
    budget = sparse // GROUP - 2
    for i in range(m):
        p = start_pos + i
        last = max(0, p + 1 - recent) // GROUP - 1  # pages first .. last - 1 may be dropped
        first = max(1, -(-max(0, p - window + 1) // GROUP)) if window else 1
        for kvh in range(2):
            k = kept[i, kvh]
            assert k[:first].all() and k[max(first, last):].all()
            elig = np.arange(first, max(first, last))
            if len(elig) <= budget:
                assert k.all()
                continue
            assert k[elig].sum() == budget  # exactly the budget dropped the rest
            u = page_bounds_f64(q, q8, 1, i, kvh, 3, elig)
            assert u[k[elig]].min() >= u[~k[elig]].max() - 1e-3 * np.abs(u).max()  # the highest bounds
    want = attention_f64(q, dequant_copy(kv, *q8), 1, start_pos, window, sinks, recent=recent, kv=kv, kept=kept,
                         int_k=q8 if path in INT_K_PATHS else None)
    np.testing.assert_allclose(got, want, **copy_tol(path, "int4", dequant_copy(kv, *q8)))
    ref_out, ref_kept = _C.attention(q, kv, 1, start_pos, path="ref", sparse=sparse, kept_pages=True, **kw)
    np.testing.assert_array_equal(kept, ref_kept)  # the choice is the same on every path
    for i in (0, m - 1):  # a row alone: the same pages, the same bits
        one, one_kept = _C.attention(q[i:i + 1], kv, 1, start_pos + i, path=path, sparse=sparse, kept_pages=True,
                                     **kw)
        np.testing.assert_array_equal(one[0], got[i])
        np.testing.assert_array_equal(one_kept[0], kept[i, :, :one_kept.shape[2]])
    if kept.all():
        np.testing.assert_array_equal(got, _C.attention(q, kv, 1, start_pos, path=path, **kw))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv_heads,hd", [(1, 96), (2, 256)])  # key blocks across pages; half-page blocks
def test_sparse_pages_other_head_dims(path, kv_heads, hd):
    kv, q8 = make_cache(2004, kv_heads, hd, seed=21, fmt="int4", final=1984)
    q = np.random.default_rng(22).standard_normal((3, 4 * kv_heads, hd)).astype(np.float32)
    got, kept = _C.attention(q, kv, 1, 2000, path=path, q8=q8, recent=40, sparse=512, kept_pages=True)
    assert not kept.all()
    vals = dequant_copy(kv, *q8)
    want = attention_f64(q, vals, 1, 2000, recent=40, kv=kv, kept=kept, int_k=q8 if path in INT_K_PATHS else None)
    np.testing.assert_allclose(got, want, **copy_tol(path, "int4", vals))


@pytest.mark.parametrize("path", PATHS)
def test_sparse_tree_rows_equal_linear_path(path):
    prefix, parents = 1100, [-1, 1100, 1100, 1101, 1103, 1102]
    m = len(parents)
    kv, q8 = make_cache(prefix + m + 8, 2, 64, seed=17, fmt="int4", final=prefix // GROUP * GROUP)
    q = np.random.default_rng(18).standard_normal((m, 4, 64)).astype(np.float32)
    got, kept = _C.attention(q, kv, 0, prefix, path=path, tree=(prefix, parents), q8=q8, recent=3, sparse=256,
                             kept_pages=True)
    assert not kept.all()
    for i in range(m):
        lin_kv, lin_q8, pos = linear_path_cache(kv, q8, prefix, parents, i)
        lin = _C.attention(q[i:i + 1], lin_kv, 0, pos, path=path, q8=lin_q8, recent=3, sparse=256)
        np.testing.assert_array_equal(got[i], lin[0])


def test_sparse_needs_the_int4_copy():
    kv, q8 = make_cache(2000, 2, 64, fmt="int4", final=1984)
    q = np.random.default_rng(19).standard_normal((1, 4, 64)).astype(np.float32)
    for kw in (dict(sparse=256), dict(q8=q8, sparse=255), dict(q8=q8, sparse=-1)):
        with pytest.raises(ValueError, match="sparse"):
            _C.attention(q, kv, 0, 1990, **kw)
    q8_int8 = quantize_copy(kv, "int8")  # no per-page bounds: nothing dropped
    out, kept = _C.attention(q, kv, 0, 1990, q8=q8_int8, sparse=256, kept_pages=True)
    assert kept.size == 0
    np.testing.assert_array_equal(out, _C.attention(q, kv, 0, 1990, q8=q8_int8))


def test_recent_keys_need_the_copy():
    kv, q8 = make_cache(40, 2, 64)
    q = np.zeros((1, 4, 64), np.float32)
    for kw in (dict(recent=4), dict(q8=q8, recent=-1)):
        with pytest.raises(ValueError, match="recent"):
            _C.attention(q, kv, 0, 30, **kw)


def test_sinks_need_the_copy_and_fit_a_segment():
    kv, q8 = make_cache(40, 2, 64)
    q = np.zeros((1, 4, 64), np.float32)
    for kw in (dict(sinks=4, window=8), dict(q8=q8, sinks=257, window=8), dict(q8=q8, sinks=-1, window=8)):
        with pytest.raises(ValueError, match="sinks"):
            _C.attention(q, kv, 0, 30, **kw)


# head_dim 128: a row alone scores its whole 32-key blocks 16 keys at a time (k4_scores16), the
# same keys as another row's own keys in the 33-row call one at a time (k4_dot8): the same bits.
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (12, 2, 128)])
def test_kernel_batch_invariant_and_deterministic(path, fmt, heads, kv_heads, hd):
    kv, q8 = make_cache(700, kv_heads, hd, seed=2, fmt=fmt)
    q = np.random.default_rng(3).standard_normal((33, heads, hd)).astype(np.float32)
    start = 600
    whole = _C.attention(q, kv, 0, start, path=path, q8=q8)
    threads = _C.get_num_threads()
    try:
        for t in sorted({1, threads}):
            _C.set_num_threads(t)
            for i in (0, 7, 32):
                one = _C.attention(q[i:i + 1], kv, 0, start + i, path=path, q8=q8)
                np.testing.assert_array_equal(one[0], whole[i])
            q2 = q.copy()
            q2[1:] = 0  # other rows' contents do not matter
            np.testing.assert_array_equal(_C.attention(q2, kv, 0, start, path=path, q8=q8)[0], whole[0])
    finally:
        _C.set_num_threads(threads)
    np.testing.assert_array_equal(_C.attention(q, kv, 0, start, path=path, q8=q8), whole)


@pytest.mark.parametrize("path", sorted(INT_K_PATHS & set(PATHS)))
def test_int4_k_sums_the_same_with_and_without_vnni(path):
    """vpdpwssd and vpmaddwd + vpaddd give the same exact integer sums: the same bits."""
    kv, q8 = make_cache(400, 2, 96, seed=9, fmt="int4", final=352)
    q = np.random.default_rng(10).standard_normal((3, 6, 96)).astype(np.float32)
    got = {}
    for vnni in (True, False):
        old = _C.set_mx_vnni(vnni)
        try:
            got[vnni] = _C.attention(q, kv, 1, 390, path=path, q8=q8)
        finally:
            _C.set_mx_vnni(old)
    np.testing.assert_array_equal(got[True], got[False])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("prefix", [5, 263])
def test_tree_rows_equal_linear_path(path, prefix, fmt):
    rng = np.random.default_rng(4)
    parents = [-1, prefix, prefix, prefix + 1, prefix + 3, prefix + 2]
    m = len(parents)
    kv, q8 = make_cache(prefix + m + 8, 2, 64, seed=5, fmt=fmt, final=prefix // GROUP * GROUP)
    q = rng.standard_normal((m, 4, 64)).astype(np.float32)
    got = _C.attention(q, kv, 0, prefix, path=path, tree=(prefix, parents), q8=q8)
    for i in range(m):
        lin_kv, lin_q8, pos = linear_path_cache(kv, q8, prefix, parents, i)
        lin = _C.attention(q[i:i + 1], lin_kv, 0, pos, path=path, q8=lin_q8)
        np.testing.assert_array_equal(got[i], lin[0])


def test_kernel_argument_errors():
    kv, (qk, qv, ek, ev, fl) = make_cache(64, 2, 64, fmt="int4")
    q = np.zeros((1, 4, 64), np.float32)
    for bad in [(qk[:, :, :8], qv, ek, ev, fl), (qk.astype(np.uint8), qv, ek, ev, fl), (qk, qv, ek[..., :5], ev, fl),
                (qk, qv, ek, ev), (qk, qv[..., :8], ek, ev, fl), (qk, qv, ek, ev[..., :1], fl),
                (qk, qv, ek.astype(np.int8), ev, fl), (qk, qv, ek, ev, fl[..., :0]), (qk, qv, ek[:, :, :32], ev, fl)]:
        with pytest.raises(ValueError, match="q8"):
            _C.attention(q, kv, 0, 3, q8=bad)


# ---------------------------------------------------------------- through the model

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = synthetic_config("smollm2-135m", hidden_size=128, intermediate_size=256, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=32, vocab_size=64, max_seq_len=4096)
    return save_model_dir(tmp_path_factory.mktemp("q8"), cfg, synthetic_weights(cfg))


def copy_matches(kv, n):
    """The copy of positions 0..n-1 is what its rules give from the BF16 rows: every V (and INT8 K)
    row; INT4 K: the written groups, a prefix of the sequence's pages that ends at most two pages
    before n (a target pass writes the groups below its first position)."""
    assert kv.pool.page_size == GROUP
    rows = kv.rows(0, n)  # the pool rows of the sequence's positions 0..n-1
    got = [a[:, :, rows] for a in kv.q8]
    if kv.pool.draft_copy == "int8":
        want = quantize_copy(kv.data[:, :, rows], "int8")
        return all(np.array_equal(w, a) for w, a in zip(want[:4], got[:4]))
    flags = got[4][0, 0, 0:n // GROUP * GROUP:GROUP, 0, 0]
    final = int(np.argmin(np.append(flags, 0)))  # leading written groups
    want = quantize_copy(kv.data[:, :, rows], "int4", final=final * GROUP)
    k_rows = slice(0, final * GROUP)
    return (not flags[final:].any() and final >= n // GROUP - 2 and
            all(np.array_equal(want[i], got[i]) for i in (1, 3)) and
            all(np.array_equal(want[i][:, :, k_rows], got[i][:, :, k_rows]) for i in (0, 2)))


def test_memory_figure(model_dir):
    eng = qspec.load(model_dir, draft="mxfp4", draft_kv="int8")
    kv = eng.backend.kv
    bf16_bytes = 2 * 2 * 2 * 32 * 2  # layers x (K, V) x kv_heads x head_dim x 2 bytes
    # the copy: values, a scale byte per 32, a flag byte: 51.8% of the BF16 cache
    assert kv.bytes_per_position == bf16_bytes + 2 * 2 * 2 * 33 + 1
    assert "INT8 draft copy (52% of the BF16 cache)" in eng.memory(1000)
    eng = qspec.load(model_dir, draft="mxfp4", draft_kv="int4")
    # half bytes, V a scale byte per 32, K 3 bytes per channel per 32-position page: 28.3%
    assert eng.backend.kv.bytes_per_position == bf16_bytes + 2 * 2 * (16 + 16 + 3 + 1) + 1
    assert "INT4 draft copy (28% of the BF16 cache)" in eng.memory(1000)
    assert qspec.load(model_dir, draft="mxfp4", draft_kv="bf16").backend.kv.q8 is None
    assert qspec.load(model_dir, draft=None).backend.kv.q8 is None
    with pytest.raises(ValueError, match="draft_kv"):
        qspec.load(model_dir, draft_kv="mxfp4")


@pytest.mark.parametrize("fmt", FORMATS)
def test_drafts_read_the_copy_target_does_not(model_dir, fmt):
    a = qspec.load(model_dir, draft="mxfp4", draft_kv=fmt).backend
    b = qspec.load(model_dir, draft="mxfp4", draft_kv="bf16").backend
    ids = np.random.default_rng(6).integers(0, 64, 300).tolist()
    for be in (a, b):
        be.kv.ensure_capacity(400)
    np.testing.assert_array_equal(a.forward(ids, 0, all_logits=True), b.forward(ids, 0, all_logits=True))
    np.testing.assert_array_equal(a.kv.data[:, :, :300], b.kv.data[:, :, :300])
    a.forward(ids[-4:], 296)  # a target pass from 296: the K groups below 288 are committed
    assert copy_matches(a.kv, 300)
    da, db = a.forward(ids[-4:], 296, draft=True, all_logits=True), b.forward(ids[-4:], 296, draft=True, all_logits=True)
    assert not np.array_equal(da, db)
    assert np.abs(da - db).max() < (0.05 if fmt == "int8" else 0.25) * np.abs(db).max()  # a small change of the draft


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("isa", ISA_LEVELS[1:])  # the scalar level: tests/test_draft_kv.py kernels only
def test_greedy_speculative_equals_plain_at_every_context(model_dir, isa, fmt):
    _C.set_isa_limit(isa)
    try:
        eng = qspec.load(model_dir, draft="mxfp4", draft_kv=fmt)
        rng = np.random.default_rng(7)
        for n_ctx in (20, 300, 1100):
            ids = rng.integers(0, 64, n_ctx).tolist()
            want = eng.generate(ids, max_new_tokens=24, speculative=False).tokens
            for kw in (dict(draft_max=4), dict(draft_max="auto"), dict(tree="on")):
                # the draft's copy is the subject: no lookup-alone steps (the tiny model's text repeats)
                with running(eng, ids, max_new_tokens=24, lookup="off", **kw) as (got, kv, stats):
                    assert copy_matches(kv, kv.length), (n_ctx, kw)  # verify, rejection and move_rows kept it
                assert got == want, (n_ctx, kw)
                assert stats["drafted"] > 0
            # prefix reuse: the next turn's rows (and their copy) equal a full prefill's
            more = ids + want + rng.integers(0, 64, 10).tolist()
            with running(eng, more, max_new_tokens=8) as (got, kv, stats):
                assert copy_matches(kv, kv.length)
            assert stats["cached_prompt_tokens"] > 0
            assert got == eng.generate(more, max_new_tokens=8, speculative=False).tokens
    finally:
        _C.set_isa_limit(_C.isa_detected())


def test_auto_reads_the_copy_from_the_threshold(model_dir):
    from qspec.native import DRAFT_KV_AUTO_MIN

    be = qspec.load(model_dir, draft="mxfp4").backend  # draft_kv="auto"
    assert be.kv.q8 is not None
    assert not be.reads_draft_copy(True, DRAFT_KV_AUTO_MIN - 1) and be.reads_draft_copy(True, DRAFT_KV_AUTO_MIN)
    assert not be.reads_draft_copy(False, 10 * DRAFT_KV_AUTO_MIN)  # never the target


def test_draft_kv_changed_after_load(model_dir):
    # the copy is made at load: a later mode is "bf16" (the BF16 rows, not the copy) or one the pool
    # keeps; another copy format is refused (a benchmark that switched modes on one engine read the
    # load's copy in every mode)
    from qspec.native import DRAFT_KV_AUTO_FORMAT

    other = "int4" if DRAFT_KV_AUTO_FORMAT == "int8" else "int8"
    be = qspec.load(model_dir, draft="mxfp4").backend  # draft_kv="auto": the DRAFT_KV_AUTO_FORMAT copy
    be.draft_kv = "bf16"
    assert not be.reads_draft_copy(True, 10**6)
    with pytest.raises(ValueError, match=other):
        be.draft_kv = other
    assert be.draft_kv == "bf16"
    be.draft_kv = DRAFT_KV_AUTO_FORMAT
    assert be.reads_draft_copy(True, 0)
    with pytest.raises(ValueError):
        be.draft_kv = "k8v4"  # no such mode


@pytest.mark.parametrize("fmt", FORMATS)
def test_draft_window_changes_the_drafts_only(model_dir, fmt):
    from qspec.native import DRAFT_SINKS

    win = qspec.load(model_dir, draft="mxfp4", draft_kv=fmt, draft_window=128).backend
    full = qspec.load(model_dir, draft="mxfp4", draft_kv=fmt, draft_window=0).backend
    assert win.draft_window == 128 and full.draft_window == 0
    ids = np.random.default_rng(8).integers(0, 64, 600).tolist()
    for be in (win, full):
        be.kv.ensure_capacity(700)
    # the target attends every key: the same logits and cache bits
    np.testing.assert_array_equal(win.forward(ids, 0, all_logits=True), full.forward(ids, 0, all_logits=True))
    np.testing.assert_array_equal(win.kv.data[:, :, :600], full.kv.data[:, :, :600])
    # a draft pass within sinks + window of the start attends every key either way
    np.testing.assert_array_equal(win.forward(ids[:100], 0, draft=True, all_logits=True),
                                  full.forward(ids[:100], 0, draft=True, all_logits=True))
    assert 100 < DRAFT_SINKS + 128
    # past it, it does not (and each row equals that row alone)
    rows = win.forward(ids[-5:], 595, draft=True, all_logits=True)
    assert not np.array_equal(rows, full.forward(ids[-5:], 595, draft=True, all_logits=True))
    np.testing.assert_array_equal(win.forward(ids[-3:-2], 597, draft=True), rows[2:3])
    win.draft_window = 0  # off again: the full drafts
    np.testing.assert_array_equal(win.forward(ids[-5:], 595, draft=True, all_logits=True),
                                  full.forward(ids[-5:], 595, draft=True, all_logits=True))


@pytest.mark.parametrize("fmt", FORMATS)
def test_draft_window_is_lossless(model_dir, fmt):
    eng = qspec.load(model_dir, draft="mxfp4", draft_kv=fmt, draft_window=64)
    rng = np.random.default_rng(9)
    for n_ctx in (40, 700):
        ids = rng.integers(0, 64, n_ctx).tolist()
        want = eng.generate(ids, max_new_tokens=24, speculative=False).tokens
        for kw in (dict(draft_max=4), dict(draft_max="auto"), dict(tree="on")):
            r = eng.generate(ids, max_new_tokens=24, lookup="off", **kw)  # the draft window is the subject
            assert r.tokens == want, (n_ctx, kw)
            assert r.stats["drafted"] > 0


def test_bad_draft_window(model_dir):
    from qspec.native import DEFAULT_DRAFT_WINDOW

    for bad in (-1, 1.5, True, "64"):
        with pytest.raises(ValueError, match="draft_window"):
            qspec.load(model_dir, draft="mxfp4", draft_window=bad)
    for kw in (dict(draft_kv="bf16"), dict(draft=None), dict(draft="ngram")):
        with pytest.raises(ValueError, match="draft window needs a draft KV copy"):
            qspec.load(model_dir, **{"draft": "mxfp4", **kw}, draft_window=64)
    be = qspec.load(model_dir, draft="mxfp4").backend
    assert be.draft_window == DEFAULT_DRAFT_WINDOW  # the default with a copy
    with pytest.raises(ValueError, match="draft_window"):
        be.draft_window = -5
    assert be.draft_window == DEFAULT_DRAFT_WINDOW
    for kw in (dict(draft_kv="bf16"), dict(draft=None)):  # the default without a copy: none
        assert qspec.load(model_dir, **{"draft": "mxfp4", **kw}).backend.draft_window == 0


def test_draft_sparse_changes_the_drafts_only_and_is_lossless(model_dir):
    sparse = qspec.load(model_dir, draft="mxfp4", draft_kv="int4", draft_sparse=256)
    full = qspec.load(model_dir, draft="mxfp4", draft_kv="int4", draft_sparse=0)
    assert sparse.backend.draft_sparse == 256 and full.backend.draft_sparse == 0
    ids = np.random.default_rng(20).integers(0, 64, 1500).tolist()
    for be in (sparse.backend, full.backend):
        be.kv.ensure_capacity(1600)
    # the target attends every key: the same logits and cache bits (its second pass writes the INT4 K
    # copy of the pages below 1,495, which the sparse drafts choose among)
    for start, end in ((0, 1495), (1495, 1500)):
        np.testing.assert_array_equal(sparse.backend.forward(ids[start:end], start, all_logits=True),
                                      full.backend.forward(ids[start:end], start, all_logits=True))
    np.testing.assert_array_equal(sparse.backend.kv.data[:, :, :1500], full.backend.kv.data[:, :, :1500])
    # a draft pass past 256 keys of written pages below the recent ones does not, row by row
    rows = sparse.backend.forward(ids[-5:], 1495, draft=True, all_logits=True)
    assert not np.array_equal(rows, full.backend.forward(ids[-5:], 1495, draft=True, all_logits=True))
    np.testing.assert_array_equal(sparse.backend.forward(ids[-3:-2], 1497, draft=True), rows[2:3])
    want = sparse.generate(ids, max_new_tokens=24, speculative=False).tokens
    for kw in (dict(draft_max=4), dict(draft_max="auto"), dict(tree="on")):
        r = sparse.generate(ids, max_new_tokens=24, lookup="off", **kw)  # the sparse draft is the subject
        assert r.tokens == want, kw
        assert r.stats["drafted"] > 0
    sparse.backend.draft_sparse = 0  # off again: the full drafts
    np.testing.assert_array_equal(sparse.backend.forward(ids[-5:], 1495, draft=True, all_logits=True),
                                  full.backend.forward(ids[-5:], 1495, draft=True, all_logits=True))


def test_bad_draft_sparse(model_dir):
    from qspec.native import DEFAULT_DRAFT_SPARSE

    for bad in (-1, 100, 255, 1.5, True, "512"):
        with pytest.raises(ValueError, match="draft_sparse"):
            qspec.load(model_dir, draft="mxfp4", draft_sparse=bad)
    for kw in (dict(draft_kv="bf16"), dict(draft=None), dict(draft="ngram")):
        with pytest.raises(ValueError, match="sparse draft attention needs a draft KV copy"):
            qspec.load(model_dir, **{"draft": "mxfp4", **kw}, draft_sparse=512)
    be = qspec.load(model_dir, draft="mxfp4").backend
    assert be.draft_sparse == DEFAULT_DRAFT_SPARSE  # the default with a copy
    with pytest.raises(ValueError, match="draft_sparse"):
        be.draft_sparse = 10
    assert be.draft_sparse == DEFAULT_DRAFT_SPARSE
    for kw in (dict(draft_kv="bf16"), dict(draft=None)):  # the default without a copy: none
        assert qspec.load(model_dir, **{"draft": "mxfp4", **kw}).backend.draft_sparse == 0


def test_copy_format_by_head_dim():
    from qspec.kv_cache import KVPool
    from qspec.native import draft_copy_format

    wide = synthetic_config("smollm2-135m", n_layers=1, n_heads=1, n_kv_heads=1, head_dim=1024)
    assert draft_copy_format(wide, "auto", "mxfp4") == "int8"  # INT4 holds heads of at most 512
    assert draft_copy_format(wide, "int4", "mxfp4") == "int4"
    with pytest.raises(ValueError, match="INT4 draft copy needs head_dim <= 512"):
        KVPool(wide, draft_copy="int4")
    odd = synthetic_config("smollm2-135m", n_layers=1, n_heads=1, n_kv_heads=1, head_dim=80)
    assert draft_copy_format(odd, "auto", "mxfp4") is None  # the drafts read the BF16 rows
