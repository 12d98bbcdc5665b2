"""The native forward: its row-wise kernels, and batch invariance of the whole model pass."""

import numpy as np
import pytest

from qspec import _C
from qspec.draft import DraftSpec
from qspec.native import NativeBackend
from qspec.synthetic import synthetic_config, synthetic_weights

SILU_RTOL = 1e-6  # vectorized exp: ~2e-7 relative error, then a division and a product
ISA_LEVELS = _C.cpu_info()["isa_levels"]


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1536, 1537])
def test_silu_mul_paths(n):
    rng = np.random.default_rng(n)
    g = (rng.standard_normal(n) * 8).astype(np.float32)
    g[:3] = [-100.0, 100.0, 0.0][: min(3, n)]
    u = rng.standard_normal(n).astype(np.float32)
    want = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u
    paths = ["ref"] + [p for p in ("avx2", "avx512") if p in ISA_LEVELS]
    for path in paths:
        got = _C.silu_mul(g, u, path)
        np.testing.assert_allclose(got, want, rtol=SILU_RTOL, atol=1e-30, err_msg=path)
    if "avx512" in paths:  # the fused prefill MLP relies on one arithmetic for both widths
        assert np.array_equal(_C.silu_mul(g, u, "avx512"), _C.silu_mul(g, u, "avx2"))


@pytest.mark.parametrize("d", [1, 7, 31, 32, 33, 576, 1536, 1537])
def test_rms_norm_paths(d):
    rng = np.random.default_rng(d)
    x = (rng.standard_normal(d) * rng.choice([1e-3, 1.0, 300.0], d)).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64) + 1e-6) * w
    for path in ["ref"] + (["avx2"] if "avx2" in ISA_LEVELS else []):
        got = _C.rms_norm(x, w, 1e-6, path)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30, err_msg=path)
        assert np.array_equal(got, _C.rms_norm(x.copy(), w, 1e-6, path))  # deterministic
    with pytest.raises(ValueError, match="path"):
        _C.rms_norm(x, w, 1e-6, "avx512")


@pytest.mark.parametrize("n", [0, 5, 16, 17, 256, 1000])
def test_round_bf16_row_paths(n):
    """The vector rounding of K/V rows gives f32_to_bf16's bits: ties to even, NaN stays NaN."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 100).astype(np.float32)
    bits = x.view(np.uint32)
    special = np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFF800001,
                        0x00000001, 0x80000000, 0x7F7F8000], np.uint32)
    bits[: min(n, special.size)] = special[: min(n, special.size)]
    u = bits.astype(np.uint64)
    want = np.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    for path in ["ref"] + (["avx2"] if "avx2" in ISA_LEVELS else []):
        assert np.array_equal(_C.round_bf16_row(x, path), (want & 0xFFFF).astype(np.uint16)), path


@pytest.fixture(scope="module")
def small_backend():
    cfg = synthetic_config("smollm2-135m", hidden_size=128, intermediate_size=320, n_layers=3, n_heads=4,
                           n_kv_heads=2, head_dim=32, vocab_size=300, max_seq_len=256)
    be = NativeBackend(cfg, synthetic_weights(cfg, seed=5), DraftSpec("mxfp4", "mxfp4"))
    be.kv.ensure_capacity(256)
    return be


@pytest.mark.parametrize("isa", ISA_LEVELS)
@pytest.mark.parametrize("draft", [False, True])
def test_forward_rows_are_batch_invariant(small_backend, isa, draft):
    """Row j of an M-row forward == a one-row forward at the same position, bit for bit
    (the property that makes speculative greedy decoding equal plain greedy decoding)."""
    _C.set_isa_limit(isa)
    threads0 = _C.get_num_threads()
    try:
        be = small_backend
        if isa == "amx":  # the BF16 target's verify rows and single rows both run on AMX tiles
            assert {_C.gemm_choose(be.lm_head, m) for m in (1, 9)} == {"amx"}
        rng = np.random.default_rng(0)
        prefix = rng.integers(0, 300, size=40).tolist()
        rows = rng.integers(0, 300, size=9).tolist()
        be.forward(prefix, 0)
        batched = be.forward(rows, 40, all_logits=True, draft=draft).copy()
        for threads in (1, 2):
            _C.set_num_threads(threads)
            be.forward(prefix, 0)
            for j, t in enumerate(rows):
                single = be.forward([t], 40 + j, draft=draft)[0]
                assert np.array_equal(single, batched[j]), f"row {j} (threads {threads})"
    finally:
        _C.set_isa_limit(_C.isa_detected())
        _C.set_num_threads(threads0)


@pytest.mark.parametrize("isa", ISA_LEVELS)
def test_prefill_rows_equal_decode_rows(small_backend, isa):
    """A 100-row prefill (at the amx level: the fused MLP on tiles, gemm_swiglu) gives each row the
    logits of feeding the prompt one token at a time, bit for bit."""
    _C.set_isa_limit(isa)
    try:
        be = small_backend
        prompt = np.random.default_rng(3).integers(0, 300, size=100).tolist()
        batched = be.forward(prompt, 0, all_logits=True).copy()
        for j, t in enumerate(prompt):
            single = be.forward([t], j)[0]
            assert np.array_equal(single, batched[j]), f"row {j}"
    finally:
        _C.set_isa_limit(_C.isa_detected())


@pytest.mark.skipif("amx" not in ISA_LEVELS, reason="no amx level here")
def test_draft_rows_batch_invariant_on_amx_mxfp4(small_backend):
    """With MXFP4 on the amx path (_C.set_mx_tiles(True): vpdpbusd up to 2 rows, int8 tiles from
    3), the MXFP4 draft's rows are still bit-identical alone and in a 9-row pass."""
    old = _C.set_mx_tiles(True)
    try:
        test_forward_rows_are_batch_invariant(small_backend, "amx", True)
    finally:
        _C.set_mx_tiles(old)
