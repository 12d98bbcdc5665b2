"""GEMM kernels: every path vs the scalar reference, the reference vs an independent float64
computation, batch invariance (bit-exact), packing round trips and bad inputs.

The MX element decoding here is written from the format table (MX.md), independent of
qspec/mx.py and csrc/mx.*.
"""

import numpy as np
import pytest

from env_switch import assert_env_switch
from qspec import _C

MX_FORMATS = ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxint8"]
ALL_FORMATS = ["bf16"] + MX_FORMATS
Q8_FORMATS = ["mxfp4", "mxfp6_e2m3"]  # activations quantized to int8 per 32-block, integer dots
# (bits, exponent bits, mantissa bits, bias) per element format (OCP MX v1.0)
FMT = {
    "mxfp4": (4, 2, 1, 1),
    "mxfp6_e2m3": (6, 2, 3, 1),
    "mxfp6_e3m2": (6, 3, 2, 3),
    "mxfp8_e4m3": (8, 4, 3, 7),
    "mxfp8_e5m2": (8, 5, 2, 15),
    "mxint8": (8, 0, 7, 0),
}

# Named tolerances. Reference vs float64 is bounded by |err| <= TOL * sum_k |x_k w_k| (+ the
# Q8 activation rounding for MXFP4, bounded exactly below). Fast paths vs ref: the paths that
# keep fp32 activations (avx2, avx512) perform the same arithmetic as ref (gemm.h): exact.
REF_VS_F64_TOL = 3e-6           # fp32 FMA chains over K <= 4128
EXACT = 0.0
BF16_ACTIVATIONS = 2 ** -7      # x rounded to bf16 (RNE): relative 2^-9 per product, + dot order
PATH_VS_REF_TOL = {             # [path][format]
    "avx2": {fmt: EXACT for fmt in ALL_FORMATS},
    "avx512": {fmt: EXACT for fmt in ALL_FORMATS},
    "avx512_bf16": {"bf16": BF16_ACTIVATIONS},
    "amx": {"bf16": BF16_ACTIVATIONS},  # MXFP4: its own oracle (assert_mxfp4_amx)
}
# amx MXFP4: integer weights relative to each output's largest block scale, x in two int8 parts
# per row, exact int32 sums: the oracle (amx_mxfp4_oracle) repeats that arithmetic in numpy, so
# only the fp32 epilogue (int32 -> fp32, one FMA, two products) separates the kernel from it.
AMX_MXFP4_TOL = 1e-6


def bf16_bits(a):
    """float -> bf16 bits, round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_values(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def decode_table(fmt):
    """float64 value of every code of an MX element format (before the shared scale)."""
    bits, eb, mb, bias = FMT[fmt]
    out = np.zeros(1 << bits)
    for c in range(1 << bits):
        if fmt == "mxint8":
            out[c] = (c - 256 if c >= 128 else c) / 64.0
            continue
        sign = -1.0 if c >> (bits - 1) else 1.0
        e = (c >> mb) & ((1 << eb) - 1)
        m = c & ((1 << mb) - 1)
        if fmt == "mxfp8_e4m3" and e == 15 and m == 7:
            v = np.nan
        elif fmt == "mxfp8_e5m2" and e == 31:
            v = np.inf if m == 0 else np.nan
        elif e == 0:
            v = m / (1 << mb) * 2.0 ** (1 - bias)
        else:
            v = (1 + m / (1 << mb)) * 2.0 ** (e - bias)
        out[c] = sign * v
    return out


def random_mx(rng, fmt, n, k, scale_lo=118, scale_hi=131, special=False):
    """Random codes [n, kpad] (padding zero) + E8M0 scales; no NaN/Inf codes unless special."""
    bits = FMT[fmt][0]
    kp = (k + 31) // 32 * 32
    codes = rng.integers(0, 1 << bits, size=(n, kp), dtype=np.uint8)
    if not special:
        vals = decode_table(fmt)[codes]
        codes[~np.isfinite(vals)] = 0
    codes[:, k:] = 0
    scales = rng.integers(scale_lo, scale_hi, size=(n, kp // 32), dtype=np.uint8)
    return codes, scales


def dequant(fmt, codes, scales, k):
    vals = decode_table(fmt)[codes]
    s = np.where(scales == 255, np.nan, np.ldexp(1.0, scales.astype(np.int64) - 127))
    return (vals * np.repeat(s, 32, axis=1))[:, :k]


class Dense(np.ndarray):
    """A dense float64 W that remembers the MX codes and scales it came from (`mx`)."""
    mx = None

    def __array_finalize__(self, obj):
        self.mx = getattr(obj, "mx", None)


def make_weight(rng, fmt, n, k):
    """(packed weight, float64 dense W [n, k]; for MX formats W.mx = (codes, scales))."""
    if fmt == "bf16":
        bits = bf16_bits(rng.standard_normal((n, k)) * 0.1)
        return _C.pack_bf16(bits), bf16_values(bits).astype(np.float64)
    codes, scales = random_mx(rng, fmt, n, k)
    w = dequant(fmt, codes, scales, k).view(Dense)
    w.mx = (codes, scales)
    return _C.pack_mx(fmt, codes, scales, k), w


def q8_error_bound(x, w):
    """Max |x·w - xq·w| from rounding x to int8 per 32-block (|dx| <= amax/254 per element)."""
    m, k = x.shape
    kp = (k + 31) // 32 * 32
    xp = np.zeros((m, kp))
    xp[:, :k] = np.abs(x)
    amax = np.repeat(xp.reshape(m, -1, 32).max(axis=2), 32, axis=1)[:, :k]
    return (amax / 254.0) @ np.abs(w).T * 1.001


def paths_for(pw, m):
    return _C.gemm_paths(pw, m)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def threads():
    old = _C.get_num_threads()
    yield
    _C.set_num_threads(old)


# ------------------------------------------------------------------------------------------ API


def test_paths_and_dispatch():
    pw = _C.pack_bf16(np.zeros((16, 32), np.uint16))
    info = _C.cpu_info()
    paths = _C.gemm_paths(pw, 1)
    assert paths[0] == "ref"
    if info["isa_selected"] != "scalar":
        assert "avx2" in paths
    if not info["features"]["avx512f"] and not info["isa_emulation"]:
        assert not {"avx512", "avx512_bf16", "amx"} & set(paths)
    # decode / verify range: one path whatever M (docs/architecture.md invariant 2)
    for fmt in ["bf16", "mxfp4", "mxfp8_e4m3"]:
        w = pw if fmt == "bf16" else _C.pack_mx(fmt, np.zeros((16, 32), np.uint8), np.zeros((16, 1), np.uint8), 32)
        chosen = {_C.gemm_choose(w, m) for m in range(1, 65)}
        assert chosen <= set(_C.gemm_paths(w, 1))
        assert len(chosen) == 1, chosen
        if info["isa_selected"] == "amx":  # tiles for BF16; MXFP4 on the amx path when asked
            assert chosen == {"amx" if fmt == "bf16" else "avx512"}
            if fmt == "mxfp4":
                old = _C.set_mx_tiles(True)
                try:
                    assert {_C.gemm_choose(w, m) for m in range(1, 65)} == {"amx"}
                finally:
                    _C.set_mx_tiles(old)
    assert isinstance(_C.PACK_LAYOUT_VERSION, int)


def test_mxfp4_vnni_and_maddubs_paths_equal_ref(rng):
    """The avx512 path's two integer-dot instructions (vpdpbusd where the CPU has AVX512-VNNI,
    else vpmaddubsw) give ref's bits at every tile shape; the amx path (vpdpbusd up to 2 rows,
    then int8 tiles in chunks of 16 rows) meets its oracle at M up to 40, with the same bits
    for a row whatever M."""
    pw, w = make_weight(rng, "mxfp4", 72, 1000)
    if "avx512" not in _C.gemm_paths(pw, 1):
        pytest.skip("no avx512 path on this CPU")
    info = _C.cpu_info()
    assert _C.mx_vnni() == (info["features"]["avx512_vnni"] or info["isa_emulation"])  # on by default
    for m in list(range(1, 18)) + [33, 40]:
        x = rng.standard_normal((m, 1000)).astype(np.float32)
        yref = _C.gemm(pw, x, path="ref")
        for vnni in (False, True):
            old = _C.set_mx_vnni(vnni)
            try:
                np.testing.assert_array_equal(_C.gemm(pw, x, path="avx512"), yref, err_msg=f"m={m} vnni={vnni}")
            finally:
                _C.set_mx_vnni(old)
        if "amx" in _C.gemm_paths(pw, m):
            y = _C.gemm(pw, x, path="amx")
            assert_mxfp4_amx(y, x, w)
            np.testing.assert_array_equal(y[:1], _C.gemm(pw, x[:1], path="amx"), err_msg=f"m={m}")


@pytest.fixture(params=[False, True], ids=["dpbf16", "fma"])
def bf16_dot(request):
    """The avx512_bf16 path with vdpbf16ps at every M, or with FMAs from kBf16FmaRows rows."""
    old = _C.set_bf16_fma(request.param)
    yield request.param
    _C.set_bf16_fma(old)


def test_bf16_dot_default_and_env():
    """FMAs by default on Intel only; QSPEC_BF16_DOT picks a process's choice (fma | dpbf16) and
    any other value is one CLI line naming the choices, before anything is loaded."""
    assert _C.bf16_fma() == (_C.cpu_info()["vendor"] == "GenuineIntel")
    assert_env_switch("QSPEC_BF16_DOT", "bf16_fma", "fma", "dpbf16")


def test_avx512_bf16_both_dots_match_ref_and_keep_rows(bf16_dot, rng):
    """Either way the avx512_bf16 path meets the BF16-activation tolerance at every tile shape of
    the FMA kernel (7-16 rows one group, 17-24 two, prefill chunks with K chunks, ragged N, padded
    K) and a row has the same bits at every M, across the switch at kBf16FmaRows rows."""
    pw, w = make_weight(rng, "bf16", 72, 1000)
    if "avx512_bf16" not in _C.gemm_paths(pw, 1):
        pytest.skip("no avx512_bf16 path on this CPU")
    for m in list(range(1, 18)) + [24, 33, 49, 100]:
        x = rng.standard_normal((m, 1000)).astype(np.float32)
        assert_close_to_ref("avx512_bf16", pw.fmt, _C.gemm(pw, x, path="avx512_bf16"), _C.gemm(pw, x, path="ref"), x, w)
    pw, _ = make_weight(rng, "bf16", 48, 4128)
    check_invariance(pw, 4128, rng, ms=(2, 6, 7, 9, 16, 17, 24, 30, 49, 100))


@pytest.mark.skipif(not _C.cpu_info()["features"]["avx512_bf16"] or _C.cpu_info()["isa_emulation"],
                    reason="compares with the CPU's own vdpbf16ps")
def test_bf16_fma_kernel_has_vdpbf16ps_bits(rng):
    """The FMA kernel gives the vdpbf16ps kernel's bits at every M where it can run, with x and
    weights small enough that products and sums fall to denormals (FTZ / DAZ) and spread over
    the exponent range. On AMD this is what would have to hold before bf16_fma() could be on."""
    n, k = 40, 700
    if "avx512_bf16" not in _C.gemm_paths(_C.pack_bf16(bf16_bits(rng.standard_normal((n, k)))), 7):
        pytest.skip("the avx512_bf16 path is below the selected ISA level (QSPEC_ISA)")
    for scale in (1.0, 1e-19, 1e-21):
        bits = bf16_bits(rng.standard_normal((n, k)) * rng.choice([1e-3, 1.0, 1e3], size=(n, k)) * scale)
        pw = _C.pack_bf16(bits)
        for m in (7, 9, 16, 17, 24, 49):
            x = (rng.standard_normal((m, k)) * rng.choice([1e-3, 1.0, 1e3], size=(m, k)) * scale).astype(np.float32)
            ys = []
            for fma in (False, True):
                old = _C.set_bf16_fma(fma)
                try:
                    ys.append(_C.gemm(pw, x, path="avx512_bf16"))
                finally:
                    _C.set_bf16_fma(old)
            np.testing.assert_array_equal(ys[1], ys[0], err_msg=f"scale={scale} m={m}")


def test_mxfp4_vnni_row_blocks_keep_the_bits(rng):
    """The VNNI kernel's row blocks a tile (1, 2 or 4 streams, chosen per CPU) never change a bit:
    ref's bits at every M and count, with the count a tile of more row blocks than the weight has
    (72 outputs: 4 blocks and a half) included."""
    pw, _ = make_weight(rng, "mxfp4", 72, 1000)
    if "avx512" not in _C.gemm_paths(pw, 1) or not _C.mx_vnni():
        pytest.skip("no VNNI avx512 path on this CPU")
    for m in (1, 2, 3, 5, 8, 9, 17):
        x = rng.standard_normal((m, 1000)).astype(np.float32)
        yref = _C.gemm(pw, x, path="ref")
        for n in (1, 2, 4, 0):
            old = _C.set_mx_row_blocks(n)
            try:
                assert _C.mx_row_blocks(m) in (1, 2, 4) and (n == 0 or _C.mx_row_blocks(m) == n)
                np.testing.assert_array_equal(_C.gemm(pw, x, path="avx512"), yref, err_msg=f"m={m} blocks={n}")
            finally:
                _C.set_mx_row_blocks(old)


def test_mxfp4_avx2_tiles_keep_the_bits(rng):
    """The AVX2 MXFP4 kernel with vpmaddubsw and, where the CPU has AVX-VNNI (or under emulation),
    with vpdpbusd on ymm: ref's bits at every row tile shape, and at one row with one or two row
    blocks' streams (mx_row_blocks, per CPU), odd block counts (72 outputs: 4 blocks and a half;
    40: 2 and a half) leaving a single block at the end."""
    info = _C.cpu_info()
    assert _C.mx_avx_vnni() == (info["features"]["avx_vnni"] or info["isa_emulation"])  # on by default
    for n_out in (72, 40, 16):
        pw, _ = make_weight(rng, "mxfp4", n_out, 1000)
        if "avx2" not in _C.gemm_paths(pw, 1):
            pytest.skip("no avx2 path at this ISA level")
        for m in (1, 2, 3, 4, 5, 8, 9, 17) if n_out == 72 else (1,):
            x = rng.standard_normal((m, 1000)).astype(np.float32)
            yref = _C.gemm(pw, x, path="ref")
            for vnni in (False, True):
                for n in (1, 2, 4, 0) if m == 1 else (0,):
                    old, old_vnni = _C.set_mx_row_blocks(n), _C.set_mx_vnni(vnni)
                    try:
                        np.testing.assert_array_equal(_C.gemm(pw, x, path="avx2"), yref,
                                                      err_msg=f"n={n_out} m={m} vnni={vnni} blocks={n}")
                    finally:
                        _C.set_mx_row_blocks(old)
                        _C.set_mx_vnni(old_vnni)


@pytest.mark.parametrize("n", [-1, 3, 8])
def test_mxfp4_vnni_row_blocks_bad_value(n):
    with pytest.raises(ValueError, match="set_mx_row_blocks: n is 0"):
        _C.set_mx_row_blocks(n)


def test_mxfp4_amx_scale_range(rng):
    """amx MXFP4 folds each block's scale into int8 weights relative to the output's largest
    scale S: blocks up to 3 binades below S are exact, 4-6 rounded to the nearest integer (ties to
    even), 7 or more drop out (never wrap into garbage), also 200 binades down; a NaN scale (0xFF)
    makes its column NaN, a NaN or infinite x its row."""
    n, k = 48, 256
    codes, scales = random_mx(rng, "mxfp4", n, k, scale_lo=60, scale_hi=200)
    scales[0, :] = [200, 75, 0, 199, 197, 196, 193, 194]  # d = 0, 125, 200, 1, 3, 4, 7, 6
    codes[1, :32] = 0                                     # the largest scale's block is all zeros:
    scales[1, :] = [200, 198, 198, 197, 199, 198, 197, 198]  # the rest, 1-3 below it, is exact
    scales[2, 3] = 255
    pw = _C.pack_mx("mxfp4", codes, scales, k)
    if "amx" not in _C.gemm_paths(pw, 1):
        pytest.skip("no amx level here")
    w = dequant("mxfp4", codes, scales, k).view(Dense)
    w.mx = (codes, scales)
    for m in (1, 2, 5, 17):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = _C.gemm(pw, x, path="amx")
        assert np.isnan(y[:, 2]).all() and np.isfinite(np.delete(y, 2, axis=1)).all()
        rows = np.delete(np.arange(n), 2)
        wr = w[rows]
        wr.mx = (codes[rows], scales[rows])
        assert_mxfp4_amx(y[:, rows], x, wr)
        exact = amx_x_values(x) @ w[1]  # row 1: every block exact, only x's two-part rounding
        np.testing.assert_allclose(y[:, 1], exact, rtol=1e-6, atol=1e-30)
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[1, 7], x[2, 9] = np.nan, np.inf
    y = _C.gemm(pw, x, path="amx")
    assert np.isnan(y[1:]).all() and np.isfinite(np.delete(y[0], 2)).all()


def test_mxfp4_amx_decode_tables(rng):
    """amx MXFP4 decodes a block whose 16 outputs all lie within 3 binades of their largest scale
    through a 64-entry table, any other through the 128-entry one: row blocks of real-checkpoint
    scales (every block within 3 binades), one block per row block with a single output 4-6
    binades down (rounded), and one row block with an output 7+ down, all against the oracle at
    every kernel (vpdpbusd up to 2 rows, stacked tiles up to 8, two tiles per part from 9)."""
    n, k = 64, 320
    codes, scales = random_mx(rng, "mxfp4", n, k, scale_lo=124, scale_hi=128)
    scales[20, :2] = [122, 127]                  # row block 1, block 0: output 4 five binades down
    scales[40, [0, 3]] = [127, 119]              # row block 2, block 3: output 8 eight down, drops out
    pw = _C.pack_mx("mxfp4", codes, scales, k)
    if "amx" not in _C.gemm_paths(pw, 1):
        pytest.skip("no amx level here")
    w = dequant("mxfp4", codes, scales, k).view(Dense)
    w.mx = (codes, scales)
    for m in (1, 2, 3, 8, 9, 16):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = _C.gemm(pw, x, path="amx")
        assert_mxfp4_amx(y, x, w)
        exact = amx_x_values(x) @ w[:16].T  # row block 0: every block exact, only x's rounding
        np.testing.assert_allclose(y[:, :16], exact, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_packed_properties_and_sizes(fmt, rng):
    n, k = 33, 100
    pw, _ = make_weight(rng, fmt, n, k)
    assert (pw.fmt, pw.n, pw.k) == (fmt, n, k)
    np_, kp = 48, 128
    bits_per_weight = {"bf16": 16, "mxfp4": 4.25, "mxfp6_e2m3": 6.25}.get(fmt, 8.25)
    assert pw.nbytes == int(np_ * kp * bits_per_weight / 8)
    bufs = pw.buffers()
    assert sum(b.nbytes for b in bufs.values()) == pw.nbytes
    assert all(b.dtype == np.uint8 and not b.flags.writeable for b in bufs.values())
    # owned buffers start on a 64-byte line (a tile or zmm row of them one line), small or large
    # (glibc puts large blocks 16 bytes past a page: every 64-byte load then spans two lines)
    big, _ = make_weight(rng, fmt, 512, 512)
    for p in (pw, big):
        assert all(b.__array_interface__["data"][0] % 64 == 0 for b in p.buffers().values())


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2"])
def test_from_buffers_borrows_zero_copy(fmt, rng):
    n, k = 20, 70
    pw, _ = make_weight(rng, fmt, n, k)
    x = rng.standard_normal((3, k)).astype(np.float32)
    want = _C.gemm(pw, x)
    copies = {name: np.array(b) for name, b in pw.buffers().items()}  # e.g. read from a file
    del pw
    pw2 = _C.PackedWeight.from_buffers(fmt, n, k, copies)
    views = pw2.buffers()
    for name, arr in copies.items():
        assert views[name].__array_interface__["data"][0] == arr.__array_interface__["data"][0]
    del copies, views  # the packed weight keeps the borrowed arrays alive
    np.testing.assert_array_equal(_C.gemm(pw2, x), want)
    pw3 = _C.PackedWeight.from_buffers(fmt, n, k, {nm: bytes(b) for nm, b in pw2.buffers().items()})
    np.testing.assert_array_equal(_C.gemm(pw3, x), want)


def test_bad_inputs_raise_value_error(rng):
    pw, _ = make_weight(rng, "bf16", 16, 64)
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError):
        _C.gemm(pw, x.astype(np.float64))
    with pytest.raises(ValueError):
        _C.gemm(pw, np.zeros((2, 63), np.float32))
    with pytest.raises(ValueError):
        _C.gemm(pw, np.zeros(64, np.float32))
    with pytest.raises(ValueError):
        _C.gemm(pw, x, out=np.zeros((2, 15), np.float32))
    with pytest.raises(ValueError):
        _C.gemm(pw, x, out=np.zeros((2, 16), np.float64))
    with pytest.raises(ValueError):
        _C.gemm(pw, np.zeros((64, 2), np.float32).T)
    with pytest.raises(ValueError):
        _C.gemm(pw, x, path="nope")
    for p in ["avx2", "avx512", "avx512_bf16", "amx"]:
        if p not in _C.gemm_paths(pw, 2):
            with pytest.raises(ValueError):
                _C.gemm(pw, x, path=p)
    with pytest.raises(ValueError):
        _C.pack_bf16(np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError):
        _C.pack_bf16(np.zeros(4, np.uint16))
    with pytest.raises(ValueError):
        _C.pack_mx("mxfp4", np.zeros((4, 32), np.uint8), np.zeros((4, 1), np.uint8), 33)  # kpad 64
    with pytest.raises(ValueError):
        _C.pack_mx("mxfp4", np.full((4, 32), 16, np.uint8), np.zeros((4, 1), np.uint8), 32)
    with pytest.raises(ValueError):
        _C.pack_mx("mxfp4", np.zeros((4, 32), np.uint8), np.zeros((4, 2), np.uint8), 32)
    with pytest.raises(ValueError):
        _C.pack_mx("fp3", np.zeros((4, 32), np.uint8), np.zeros((4, 1), np.uint8), 32)
    with pytest.raises(ValueError):
        _C.pack_mx("bf16", np.zeros((4, 32), np.uint8), np.zeros((4, 1), np.uint8), 32)
    bufs = {nm: np.array(b) for nm, b in pw.buffers().items()}
    with pytest.raises(ValueError):
        _C.PackedWeight.from_buffers("bf16", 16, 65, bufs)
    with pytest.raises(ValueError):
        _C.PackedWeight.from_buffers("mxfp4", 16, 64, bufs)
    with pytest.raises(ValueError):
        _C.PackedWeight.from_buffers("bf16", 16, 64, {"data": bufs["data"][:-1]})


# --------------------------------------------------------------------------- ref vs float64

SHAPES = [(m, k, n) for m in (1, 3, 7, 17) for k in (32, 33, 96, 100, 4128) for n in (1, 15, 33)]


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_ref_matches_float64(fmt, rng):
    for m, k, n in SHAPES[:: 3 if fmt != "bf16" else 1]:
        pw, w = make_weight(rng, fmt, n, k)
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = _C.gemm(pw, x, path="ref").astype(np.float64)
        exact = x.astype(np.float64) @ w.T
        bound = REF_VS_F64_TOL * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
        if fmt in Q8_FORMATS:
            bound = bound + q8_error_bound(x.astype(np.float64), w)
        err = np.abs(y - exact)
        assert (err <= bound).all(), (fmt, m, k, n, (err / bound).max())


@pytest.mark.parametrize("fmt", Q8_FORMATS)
def test_q8_formats_ref_is_q8_exact(fmt, rng):
    """MXFP4 / MXFP6-E2M3 = x quantized per 32-block to int8 (RNE of x*127/amax), exact integer dots."""
    m, k, n = 3, 96, 15
    codes, scales = random_mx(rng, fmt, n, k)
    pw = _C.pack_mx(fmt, codes, scales, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    xb = x.reshape(m, -1, 32)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    q = np.rint(xb * (np.float32(1) / d)).astype(np.float64)
    xq = (q * d.astype(np.float64)).reshape(m, k)
    exact = xq @ dequant(fmt, codes, scales, k).T
    y = _C.gemm(pw, x, path="ref")
    np.testing.assert_allclose(y, exact, rtol=1e-5, atol=1e-6 * np.abs(exact).max())


def test_special_values(rng):
    k, n = 64, 16
    # E8M0 0xFF is NaN: its row is NaN; 0x00 is 2^-127 (tiny, not zero).
    x = np.ones((2, k), np.float32)
    # (format, code of the max element, its value, rtol: the product of scales is an fp32 subnormal)
    for fmt, code, val, rtol in [("mxfp4", 7, 6.0, 1e-5), ("mxfp6_e2m3", 31, 7.5, 1e-3)]:
        codes, scales = random_mx(rng, fmt, n, k)
        scales[3, 1] = 255
        scales[5, :] = 0
        codes[5, :] = code
        pw = _C.pack_mx(fmt, codes, scales, k)
        for p in paths_for(pw, 2):
            y = _C.gemm(pw, x, path=p)
            assert np.isnan(y[:, 3]).all() and np.isfinite(np.delete(y, 3, axis=1)).all()
            np.testing.assert_allclose(y[:, 5], val * 64 * 2.0 ** -127, rtol=rtol)  # Q8: d = 1/127
    # E4M3 NaN code -> NaN; E5M2 Inf code -> Inf
    for fmt, code, check in [("mxfp8_e4m3", 0x7F, np.isnan), ("mxfp8_e5m2", 0x7C, np.isinf)]:
        codes, scales = random_mx(rng, fmt, n, k)
        codes[2, 10] = code
        pw = _C.pack_mx(fmt, codes, scales, k)
        for p in paths_for(pw, 2):
            y = _C.gemm(pw, x, path=p)
            assert check(y[:, 2]).all() and np.isfinite(np.delete(y, 2, axis=1)).all()


# ------------------------------------------------------------------------ fast paths vs ref


def amx_x_values(x):
    """x as the amx MXFP4 path reads it: per row u = x * (127 / max|x|) in fp32, hi = rne(u),
    lo = rne((u - hi) * 128), value (128 hi + lo) * rowf with rowf = 1 / ((127 / max|x|) * 128)."""
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    amax = np.abs(x32).max(axis=1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        rowf = np.where(amax > 0, np.float32(1) / (inv * np.float32(128)), np.float32(0)).astype(np.float32)
    u = x32 * inv[:, None]
    hi = np.rint(u)
    lo = np.rint((u - hi) * np.float32(128))
    return (hi.astype(np.float64) * 128 + lo) * rowf[:, None].astype(np.float64)


def amx_mxfp4_oracle(x, codes, scales, k):
    """(y, sum of |terms|) of the amx MXFP4 arithmetic in float64: per output S = largest block
    scale, d = S - e, weight rne(e2m1 * 2^(4 - d)) for d < 7 (else 0) times 2^(S - 131)."""
    big = scales.max(axis=1).astype(np.int64)
    d = np.repeat(np.minimum(big[:, None] - scales.astype(np.int64), 7), 32, axis=1)
    wi = np.where(d < 7, np.round(np.ldexp(decode_table("mxfp4")[codes], 4 - d)), 0.0)[:, :k]
    wq = wi * np.where(big == 255, np.nan, np.ldexp(1.0, big - 131))[:, None]
    xv = amx_x_values(x)
    return xv @ wq.T, np.abs(xv) @ np.abs(wq).T


def assert_mxfp4_amx(y, x, w):
    """amx MXFP4 against its float64 oracle (w: a Dense with its codes and scales)."""
    yo, mag = amx_mxfp4_oracle(x, *w.mx, x.shape[1])
    err = np.abs(y.astype(np.float64) - yo)
    bound = AMX_MXFP4_TOL * mag + 1e-30
    assert (err <= bound).all(), float(np.nanmax(err / bound))


def assert_close_to_ref(path, fmt, y, yref, x, w):
    if (path, fmt) == ("amx", "mxfp4"):
        return assert_mxfp4_amx(y, x, w)
    tol = PATH_VS_REF_TOL[path][fmt]
    if tol == 0.0:
        np.testing.assert_array_equal(y, yref, err_msg=path)
    else:
        bound = tol * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
        assert (np.abs(y.astype(np.float64) - yref) <= bound).all(), path


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_paths_match_ref_awkward_shapes(fmt, rng):
    for m, k, n in SHAPES:
        pw, w = make_weight(rng, fmt, n, k)
        x = rng.standard_normal((m, k)).astype(np.float32)
        yref = _C.gemm(pw, x, path="ref")
        for p in paths_for(pw, m)[1:]:
            assert_close_to_ref(p, pw.fmt, _C.gemm(pw, x, path=p), yref, x, w)


@pytest.mark.parametrize("fmt", ["bf16"] + MX_FORMATS)
def test_paths_match_ref_every_decode_m(fmt, rng):
    """Every register tile of the decode / verify range: M = 1..17 (one row tile up to 16 rows,
    then two), 33 (K chunked for L1), ragged N (a group of row blocks cut short) and padded K;
    avx512_bf16 with x's k pairs interleaved over the rows (GemmArgs::xbf_ld)."""
    for n, k in [(72, 100), (40, 1000)]:
        pw, w = make_weight(rng, fmt, n, k)
        for m in list(range(1, 18)) + [33]:
            x = rng.standard_normal((m, k)).astype(np.float32)
            yref = _C.gemm(pw, x, path="ref")
            for p in paths_for(pw, m)[1:]:
                assert_close_to_ref(p, pw.fmt, _C.gemm(pw, x, path=p), yref, x, w)


REAL_SHAPES = [(1536, 576), (576, 1536), (49152, 576)]  # SmolLM2-135M up/down, LM head


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("n,k", REAL_SHAPES)
def test_paths_match_ref_real_shapes(fmt, n, k, rng):
    pw, w = make_weight(rng, fmt, n, k)
    m = 5 if n < 10000 else 2  # the scalar ref is slow on the LM head
    x = rng.standard_normal((m, k)).astype(np.float32)
    yref = _C.gemm(pw, x, path="ref")
    out = np.empty((m, n), np.float32)
    for p in paths_for(pw, m)[1:]:
        assert _C.gemm(pw, x, out=out, path=p) is out
        assert_close_to_ref(p, pw.fmt, out, yref, x, w)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_paths_match_ref_llama8b_shape(fmt, rng):
    n, k = 14336, 4096
    pw, w = make_weight(rng, fmt, n, k)
    for m in (1, 9):
        x = rng.standard_normal((m, k)).astype(np.float32)
        yref = _C.gemm(pw, x, path="ref")
        for p in paths_for(pw, m)[1:]:
            assert_close_to_ref(p, pw.fmt, _C.gemm(pw, x, path=p), yref, x, w)


def test_prefill_sizes_match_ref(rng):
    pw, w = make_weight(rng, "bf16", 40, 96)
    for m in (65, 130):
        x = rng.standard_normal((m, 96)).astype(np.float32)
        yref = _C.gemm(pw, x, path="ref")
        for p in paths_for(pw, m)[1:]:
            assert_close_to_ref(p, pw.fmt, _C.gemm(pw, x, path=p), yref, x, w)
        assert _C.gemm_choose(pw, m) in paths_for(pw, m)


# ----------------------------------------------------------------------- batch invariance


def check_invariance(pw, k, rng, ms=(2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 25, 33, 64, 97)):
    row = rng.standard_normal((1, k)).astype(np.float32)
    for p in paths_for(pw, 1):
        alone = _C.gemm(pw, row, path=p)
        for m in ms:
            if p not in paths_for(pw, m):
                continue
            x = (rng.standard_normal((m, k)) * rng.choice([1e-3, 1.0, 1e3], size=(m, 1))).astype(np.float32)
            for i in {0, m // 2, m - 1}:
                xi = x.copy()
                xi[i] = row[0]
                y = _C.gemm(pw, xi, path=p)
                np.testing.assert_array_equal(y[i], alone[0], err_msg=f"{p} m={m} row={i}")


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_batch_invariance(fmt, rng):
    n, k = 72, 160  # several row blocks, ragged N tail
    pw, _ = make_weight(rng, fmt, n, k)
    check_invariance(pw, k, rng)


@pytest.mark.skipif(_C.isa_selected() not in ("avx512", "avx512_bf16", "amx"), reason="needs AVX-512")
def test_round_bf16_rows(rng):
    """The activations of the BF16 tile kernels: fp32 -> bf16 round to nearest even, NaN quieted,
    in rows, in the AMX A-tile order and with k pairs interleaved over rows alike (the binding
    compares the layouts), ragged K."""
    for m, k in ((1, 1), (3, 17), (17, 160), (40, 1000)):
        x = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-140, 120, (m, k)))).astype(np.float32)
        u = x.view(np.uint32)
        u.flat[::7] = (u.flat[::7] & 0xFFFF0000) | 0x8000  # ties: even and odd upper halves
        x.flat[::11] = np.inf
        x.flat[::13] = -np.inf
        x.flat[5::17] = np.float32(3.4028235e38)  # rounds up to inf
        nan_at = np.zeros((m, k), bool)
        nan_at.flat[3::19] = True
        u[nan_at] = 0x7F800001  # a signalling NaN with only a low payload bit
        got = _C.round_bf16(x)
        want = bf16_bits(np.where(nan_at, 0, x))
        want[nan_at] = 0x7FC0
        np.testing.assert_array_equal(got, want, err_msg=f"m={m} k={k}")


@pytest.mark.parametrize("n,k,ms", [(72, 160, (16, 17, 33, 48, 64, 65, 97, 130)), (600, 1100, (80, 300))])
def test_amx_rows_same_for_decode_and_prefill(rng, n, k, ms):
    """The amx path computes every row alike at any M, prefill included (one TDPBF16PS per 32 k):
    one row tile, pairs of row blocks by 32-row halves (17-64 rows, the last pair ragged here)
    and the prefill; the second case crosses the prefill's chunks of rows, row blocks and K
    (gemm_amx.cpp)."""
    pw, _ = make_weight(rng, "bf16", n, k)
    if "amx" not in paths_for(pw, 1):
        pytest.skip("no amx level here")
    row = rng.standard_normal((1, k)).astype(np.float32)
    alone = _C.gemm(pw, row, path="amx")
    for m in ms:
        x = rng.standard_normal((m, k)).astype(np.float32)
        for i in {0, 16, m // 2, m - 1} - {m}:
            xi = x.copy()
            xi[i] = row[0]
            np.testing.assert_array_equal(_C.gemm(pw, xi, path="amx")[i], alone[0], err_msg=f"m={m} row={i}")


# the last two cross K chunks (gemm_amx.cpp: at most 2,048 k at a time, C tiles parked between)
@pytest.mark.parametrize("d,f,m", [(128, 320, 65), (96, 64, 200), (256, 1024, 300), (2112, 64, 80), (64, 2304, 70)])
def test_fused_swiglu_mlp_keeps_the_bits(rng, d, f, m):
    """The amx prefill MLP without FP32 gate|up rows (gemm_swiglu + gemm_act_tiles) gives the bits of
    gemm -> silu_mul -> gemm, and each of its rows those of a one-row (decode) pass."""
    gu, _ = make_weight(rng, "bf16", 2 * f, d)
    dn, _ = make_weight(rng, "bf16", d, f)
    if not _C.gemm_swiglu_supported(gu, dn, m):
        pytest.skip("no amx level here")
    x = (rng.standard_normal((m, d)) * 2).astype(np.float32)
    x[3, :5] = [60.0, -60.0, 0.0, 1e-30, -1e-30]  # saturating and vanishing gates

    def unfused(rows):
        g = _C.gemm(gu, rows)
        act = np.stack([_C.silu_mul(np.ascontiguousarray(r[:f]), np.ascontiguousarray(r[f:]), "avx2") for r in g])
        return _C.gemm(dn, act)

    got = _C.mlp_swiglu(gu, dn, x)
    np.testing.assert_array_equal(got.view(np.uint32), unfused(x).view(np.uint32))
    for i in (0, 3, m - 1):
        np.testing.assert_array_equal(got[i].view(np.uint32), unfused(x[i:i + 1])[0].view(np.uint32), err_msg=f"row {i}")


def test_fused_swiglu_mlp_shapes_it_refuses(rng):
    gu, _ = make_weight(rng, "bf16", 2 * 48, 64)  # n / 2 = 48: not a multiple of 32
    dn, _ = make_weight(rng, "bf16", 64, 48)
    assert not _C.gemm_swiglu_supported(gu, dn, 200)
    with pytest.raises(ValueError, match="mlp_swiglu"):
        _C.mlp_swiglu(gu, dn, np.zeros((200, 64), np.float32))
    gu, _ = make_weight(rng, "bf16", 2 * 64, 64)
    dn, _ = make_weight(rng, "bf16", 64, 64)
    assert not _C.gemm_swiglu_supported(gu, dn, 64)  # 64 rows: decode / verify, not a prefill


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_batch_invariance_long_k(fmt, rng):
    """Long K exercises the K-chunked loop of the M-blocked kernels, and past kPrefillRows rows
    the prefill chunks of rows with their L2-sized K chunks (csrc/gemm_internal.h)."""
    pw, _ = make_weight(rng, fmt, 48, 4128)
    check_invariance(pw, 4128, rng, ms=(2, 3, 4, 5, 6, 9, 13, 30, 49, 100))


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "mxfp6_e2m3"])
def test_thread_count_invariance(fmt, rng, threads):
    n, k = 1000, 576
    pw, _ = make_weight(rng, fmt, n, k)
    x = rng.standard_normal((9, k)).astype(np.float32)
    for p in paths_for(pw, 9):
        _C.set_num_threads(1)
        y1 = _C.gemm(pw, x, path=p)
        _C.set_num_threads(2)
        y2 = _C.gemm(pw, x, path=p)
        np.testing.assert_array_equal(y1, y2, err_msg=p)


POOL_STRESS = """
import numpy as np
from qspec import _C
rng = np.random.default_rng(7)
w = (rng.standard_normal((1000, 576), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
pw = _C.pack_bf16(w)
x = rng.standard_normal((5, 576)).astype(np.float32)
_C.set_num_threads(1)
want = _C.gemm(pw, x)
for t in rng.integers(1, 7, size=300):
    _C.set_num_threads(int(t))  # workers stopped and started between jobs, some never joining
    assert _C.get_num_threads() == t
    np.testing.assert_array_equal(_C.gemm(pw, x), want)
print("ok")
"""


def test_thread_pool_resizes_without_hang_or_change():
    """More threads than cores and the count changed 300 times: same bits, no hang (own process,
    so a deadlock fails the test instead of stopping the run)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", POOL_STRESS], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_batch_invariance_exhaustive(fmt, rng):
    for n, k in [(1, 32), (15, 33), (33, 4128), (576, 1536)]:
        pw, _ = make_weight(rng, fmt, n, k)
        check_invariance(pw, k, rng, ms=range(2, 65))


def test_mx_path_env():
    """QSPEC_MX_PATH picks a process's MXFP4 path at the amx level (amx | avx512, default avx512);
    any other value is a ValueError naming the choices, at the first dispatch."""
    import subprocess
    import sys
    code = ("import numpy as np; from qspec import _C\n"
            "pw = _C.pack_mx('mxfp4', np.zeros((16, 32), np.uint8), np.zeros((16, 1), np.uint8), 32)\n"
            "try:\n    _C.gemm_choose(pw, 1); print(_C.mx_tiles())\n"
            "except ValueError as e:\n    print('ValueError', e)\n")
    def run(value):
        env = {k: v for k, v in __import__("os").environ.items() if k != "QSPEC_MX_PATH"}
        if value is not None:
            env["QSPEC_MX_PATH"] = value
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              check=True).stdout.strip()
    assert run(None) == "False" and run("avx512") == "False" and run("amx") == "True"
    assert run("tiles") == "ValueError QSPEC_MX_PATH='tiles' is not one of amx, avx512"
    env = dict(__import__("os").environ, QSPEC_MX_PATH="tiles")
    r = subprocess.run([sys.executable, "-m", "qspec", "generate", "hi", "--max-new-tokens", "2"], env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        "qspec: error: QSPEC_MX_PATH='tiles' is not one of amx, avx512"], r.stderr
