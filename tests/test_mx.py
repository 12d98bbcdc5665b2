"""MX codecs against OCP MX v1.0 (rules as written in docs/mx.md).

Both implementations are tested: `impl="reference"` (float64 torch, reads like the spec) and
`impl="native"` (`_C.mx_quantize`, integer arithmetic); they must agree bit for bit.
"""

import math

import numpy as np
import pytest
import torch

from qspec import _C, mx

FORMATS = list(mx.FORMATS)
# Native cast at every ISA level this CPU has that has its own path (scalar, avx2), + reference.
NATIVE_LEVELS = [lv for lv in ("scalar", "avx2") if lv in _C.cpu_info()["isa_levels"]]
IMPLS = [f"native:{lv}" for lv in NATIVE_LEVELS] + ["reference"]


MSE_FORMATS = ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2"]  # where rule="mse" is defined
RULE_CASES = [(f, "ocp") for f in FORMATS] + [(f, "mse") for f in MSE_FORMATS]


def quantize(x, fmt, impl="native", rule="ocp"):
    """mx.quantize with `impl` = "reference", "native" or "native:<isa level>"."""
    if not impl.startswith("native:"):
        return mx.quantize(x, fmt, impl=impl, rule=rule)
    previous = _C.isa_selected()
    _C.set_isa_limit(impl.split(":")[1])
    try:
        return mx.quantize(x, fmt, impl="native", rule=rule)
    finally:
        _C.set_isa_limit(previous)


def assert_all_impls_agree(x, fmt, rule="ocp"):
    ts = [quantize(x, fmt, impl, rule) for impl in IMPLS]
    for t in ts[1:]:
        assert_same(ts[0], t)
    return ts[0]


def finite_codes(fmt):
    """(code, value) of every finite code the cast can produce: not the negative-zero code, and
    not INT8's -128 (-2.0: the cast saturates symmetrically to +-127, MX.md)."""
    f = mx.FORMATS[fmt]
    out = []
    for c in range(1 << f.bits):
        v = mx.element_value(fmt, c)
        if math.isfinite(v) and not (v == 0 and c != 0) and abs(v) <= f.max_normal:
            out.append((c, v))
    return out


def block(values, pad_to=32):
    x = torch.zeros(pad_to, dtype=torch.float32)
    x[: len(values)] = torch.tensor(values, dtype=torch.float64).to(torch.float32)
    return x


def assert_same(a: mx.MXTensor, b: mx.MXTensor):
    assert a.fmt == b.fmt and a.k == b.k
    assert torch.equal(a.scales, b.scales), "scales differ"
    assert torch.equal(a.codes, b.codes), f"codes differ at {(a.codes != b.codes).nonzero()[:5].tolist()}"


# --- the format table -------------------------------------------------------------------------


def test_format_table_matches_spec():
    expect = {  # bits, ebits, mbits, bias, emax, max normal (MX.md table)
        "mxfp4": (4, 2, 1, 1, 2, 6.0),
        "mxfp6_e2m3": (6, 2, 3, 1, 2, 7.5),
        "mxfp6_e3m2": (6, 3, 2, 3, 4, 28.0),
        "mxfp8_e4m3": (8, 4, 3, 7, 8, 448.0),
        "mxfp8_e5m2": (8, 5, 2, 15, 15, 57344.0),
        "mxint8": (8, 0, 7, 0, 0, 1.984375),
    }
    assert set(mx.FORMATS) == set(expect)
    for name, (bits, eb, mb, bias, emax, mx_) in expect.items():
        f = mx.FORMATS[name]
        assert (f.bits, f.ebits, f.mbits, f.bias, f.emax, f.max_normal) == (bits, eb, mb, bias, emax, mx_)
        finite = [abs(v) for _, v in finite_codes(name)]
        assert max(finite) == f.max_normal
        assert min(v for v in finite if v > 0) == f.min_subnormal
    # E2M1 codes per MX.md: 0..7 = +{0, 0.5, 1, 1.5, 2, 3, 4, 6}, 8..15 negative.
    assert [mx.element_value("mxfp4", c) for c in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert [mx.element_value("mxfp4", c + 8) for c in range(1, 8)] == [-0.5, -1, -1.5, -2, -3, -4, -6]
    assert math.isnan(mx.element_value("mxfp8_e4m3", 0x7F))
    assert mx.element_value("mxfp8_e5m2", 0x7C) == math.inf


@pytest.mark.parametrize("fmt", FORMATS)
def test_python_table_matches_native_decode(fmt):
    """qspec/mx.py decodes codes from bit fields independently of csrc/mx.h: they must agree."""
    n = 1 << mx.FORMATS[fmt].bits
    codes = np.zeros((1, 256), np.uint8)
    codes[0, :n] = np.arange(n)
    scales = np.full((1, 8), 127, np.uint8)  # X = 1
    native = _C.mx_dequantize(codes, scales, fmt, 256)[0, :n]
    ours = mx.element_values(fmt).numpy().astype(np.float32)
    np.testing.assert_array_equal(native, ours)


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_round_trips(fmt, impl):
    """A block holding every finite code value times X (with max normal present, so
    shared_exp = scale_exp) quantizes to exactly those codes and dequantizes to those values,
    at scales across the E8M0 range."""
    f = mx.FORMATS[fmt]
    pairs = finite_codes(fmt)
    rows = []
    for i in range(0, len(pairs), 31):
        chunk = pairs[i : i + 31] + [(None, f.max_normal)]  # max normal pins the shared exponent
        rows.append(chunk + [(0, 0.0)] * (32 - len(chunk)))
    want = torch.tensor([[-1 if c is None else c for c, _ in r] for r in rows])
    for scale_exp in (-127, -120, -60, -3, 0, 5, 90, 127 - f.emax):
        if f.max_normal * 2.0**scale_exp < 2.0**-126:
            continue  # the block max would be an FP32 subnormal (flushed, tested below)
        x = torch.tensor([[v * 2.0**scale_exp for _, v in r] for r in rows], dtype=torch.float64)
        assert torch.equal(x.float().double(), x)  # every value is an exact FP32 number
        t = quantize(x.float(), fmt, impl=impl)
        assert (t.scales == scale_exp + 127).all()
        known = want >= 0
        assert torch.equal(t.codes.long()[known], want[known]), scale_exp
        for dimpl in ("native", "reference"):
            np.testing.assert_array_equal(mx.dequantize(t, impl=dimpl).double().numpy(), x.numpy())


@pytest.mark.parametrize("impl", IMPLS)
def test_fp4_all_16_codes_several_scales(impl):
    values = [mx.element_value("mxfp4", c) for c in range(16)]
    for e in (-100, -1, 0, 1, 7, 100):
        x = block(values + [6.0]) * 2.0**e
        t = quantize(x, "mxfp4", impl=impl)
        assert t.scales.item() == 127 + e
        # Code 8 is -0: qspec encodes -0.0 as code 0.
        assert t.codes[:17].tolist() == list(range(8)) + [0] + list(range(9, 16)) + [7]
        got = mx.dequantize(t)
        assert torch.equal(got, x)


# --- rounding ---------------------------------------------------------------------------------


def midpoints(fmt, scale_exp=0):
    """(value * 2^scale_exp as FP32, expected code) for every midpoint between adjacent
    non-negative finite codes: ties go to the even code (mantissa LSB 0); plus the FP32
    neighbours on either side of each (scaled) midpoint."""
    pos = sorted((v, c) for c, v in finite_codes(fmt) if v >= 0)
    out = []
    for (lo, clo), (hi, chi) in zip(pos, pos[1:]):
        mid = np.float32((lo + hi) / 2 * 2.0**scale_exp)
        assert float(mid) == (lo + hi) / 2 * 2.0**scale_exp  # the midpoint itself is exact
        even = clo if clo % 2 == 0 else chi
        out.append((float(mid), even))
        out.append((float(np.nextafter(mid, np.float32(0))), clo))
        out.append((float(np.nextafter(mid, np.float32(np.inf))), chi))
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_ties_round_to_even(fmt, impl):
    f = mx.FORMATS[fmt]
    for scale_exp in (0, -127, 50):
        if f.max_normal * 2.0**scale_exp < 2.0**-126:
            continue  # the block max would be an FP32 subnormal (flushed)
        cases = midpoints(fmt, scale_exp)
        xs, want = [], []
        for i in range(0, len(cases), 31):
            chunk = cases[i : i + 31]
            xs.append([v for v, _ in chunk] + [f.max_normal * 2.0**scale_exp] + [0.0] * (31 - len(chunk)))
            want.append([c for _, c in chunk] + [None] * (32 - len(chunk)))
        x = torch.tensor(xs, dtype=torch.float64)
        assert torch.equal(x.float().double(), x)
        t = quantize(x.float(), fmt, impl=impl)
        assert (t.scales == 127 + scale_exp).all()
        for r, row in enumerate(want):
            for j, c in enumerate(row):
                if c is not None:
                    assert t.codes[r, j].item() == c, (fmt, scale_exp, xs[r][j], c, t.codes[r, j].item())
        # Negative values mirror with the sign bit (INT8: two's complement).
        tn = quantize(-x.float(), fmt, impl=impl)
        assert torch.equal(mx.dequantize(tn), -mx.dequantize(t))


@pytest.mark.parametrize("impl", IMPLS)
def test_fp4_ties_explicit(impl):
    # X = 1 (max 6 in the block): 0.25 -> 0 (even), 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2,
    # 2.5 -> 2, 3.5 -> 4, 5 -> 4 (even: code 6 vs 7), -2.5 -> -2.
    x = block([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5, 6.0])
    d = mx.dequantize(quantize(x, "mxfp4", impl=impl))
    assert d[:9].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -2.0, 6.0]


# --- saturation and the rounded-down exponent -----------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_fp4_block_max_7_saturates_to_6(impl):
    """floor(log2 7) = 2, so X = 2^(2-2) = 1 and 7 / X = 7 > 6: saturates (MX.md)."""
    for e in (-20, 0, 33):
        x = block([7.0, -7.0, 7.9, 1.0]) * 2.0**e
        t = quantize(x, "mxfp4", impl=impl)
        assert t.scales.item() == 127 + e
        assert mx.dequantize(t)[:4].tolist() == [6.0 * 2.0**e, -6.0 * 2.0**e, 6.0 * 2.0**e, 1.0 * 2.0**e]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_saturation_every_format(fmt, impl):
    f = mx.FORMATS[fmt]
    # The largest FP32 below 2^(emax+1): shared_exp stays 0 and it saturates to max normal.
    top = float(np.nextafter(np.float32(2.0 ** (f.emax + 1)), np.float32(0)))
    x = block([top, -top, f.max_normal, 1.0])
    t = quantize(x, fmt, impl=impl)
    assert t.scales.item() == 127
    assert mx.dequantize(t)[:3].tolist() == [f.max_normal, -f.max_normal, f.max_normal]
    # Never a NaN/Inf code from finite input.
    assert torch.isfinite(mx.dequantize(t)).all()


# --- special blocks ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_and_subnormal_blocks_flush(fmt, impl):
    tiny = 2.0**-149
    x = torch.stack([
        block([]),  # all zero
        block([-0.0] * 32),  # all negative zero
        block([1e-40, -3e-39, tiny]),  # FP32-subnormal max: flush (qspec)
        block([2.0**-126, 1e-40, -tiny]),  # smallest normal max: not flushed
    ])
    t = quantize(x, fmt, impl=impl)
    assert t.scales[:3, 0].tolist() == [0, 0, 0]
    assert (t.codes[:3] == 0).all()
    assert t.scales[3, 0].item() == max(-126 - mx.FORMATS[fmt].emax, -127) + 127
    d = mx.dequantize(t)
    assert (d[:3] == 0).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_inf_blocks(fmt, impl):
    x = torch.stack([
        block([1.0, math.nan, 2.0]),
        block([math.inf, 1.0]),
        block([-math.inf]),
        block([3.0, 1.0]),  # an ordinary block in between
        block([6.0]),
    ]).reshape(1, -1)  # one row, 5 blocks
    t = quantize(x, fmt, impl=impl)
    assert t.scales[0].tolist()[:3] == [0xFF, 0xFF, 0xFF]
    assert (t.codes[0, :96] == 0).all()  # qspec: codes of a NaN block are 0
    d = mx.dequantize(t)[0]
    assert torch.isnan(d[:96]).all()
    assert torch.isfinite(d[96:]).all() and d[96].item() == 3.0 and d[128].item() == 6.0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_negative_zero_is_code_zero(fmt, impl):
    f = mx.FORMATS[fmt]
    tiny = f.min_subnormal / 4  # rounds to zero under X = 1
    x = block([-0.0, -tiny, tiny, f.max_normal])
    t = quantize(x, fmt, impl=impl)
    assert t.codes[:3].tolist() == [0, 0, 0]
    assert not torch.signbit(mx.dequantize(t)[:3]).any()


# --- the E8M0 range ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_scale_clamped_at_bottom(fmt, impl):
    """Block max 2^-126 (smallest FP32 normal): shared_exp = -126 - emax < -127 clamps to -127;
    elements then land in the element's low range/subnormals, exactly where representable."""
    f = mx.FORMATS[fmt]
    x = block([2.0**-126, 2.0**-127, 2.0**-130, 2.0**-140, -(2.0**-126)])
    t = quantize(x, fmt, impl=impl)
    shared = max(-126 - f.emax, -127)
    assert t.scales.item() == shared + 127
    d = mx.dequantize(t).double()
    for i in range(5):
        p = x[i].item() / 2.0**shared
        ref = mx._round_to_element(torch.tensor([abs(p)], dtype=torch.float64), f).item()
        assert d[i].item() == math.copysign(ref * 2.0**shared, p) or (ref == 0 and d[i].item() == 0)
    assert d[0].item() == 2.0**-126  # 2^-126 / 2^-127 = 2 is representable in every format


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_scale_at_top(fmt, impl):
    """FP32's largest binade: shared_exp = 127 - emax <= 127, so no FP32 input reaches the NaN
    scale through the exponent (the clamp above 127 is unreachable but implemented); the
    largest finite FP32 saturates to max normal * X; INT8 uses the top scale 0xFE = 2^127."""
    f = mx.FORMATS[fmt]
    big = float(np.finfo(np.float32).max)
    x = block([big, -big, 2.0**127])
    t = quantize(x, fmt, impl=impl)
    assert t.scales.item() == 127 - f.emax + 127
    d = mx.dequantize(t).double()
    assert d[0].item() == min(f.max_normal * 2.0 ** (127 - f.emax), big) == -d[1].item()
    assert d[2].item() == 2.0**127


def test_reference_nan_scale_above_range():
    """The above-127 branch of step 1, fed a float64 block max FP32 cannot hold."""
    f = mx.FORMATS["mxint8"]
    v = torch.tensor([[2.0**128] + [0.0] * 31], dtype=torch.float64)
    codes, scales = mx._quantize_reference_chunk(v, f)
    assert scales.item() == 0xFF and (codes == 0).all()


# --- shapes, dtypes, agreement ----------------------------------------------------------------


@pytest.mark.parametrize("fmt,rule", RULE_CASES)
@pytest.mark.parametrize("k", [1, 3, 31, 32, 33, 4095])
def test_awkward_lengths(fmt, rule, k):
    torch.manual_seed(k)
    x = torch.randn(3, 2, k) * 3
    t = assert_all_impls_agree(x, fmt, rule)
    kpad = -(-k // 32) * 32
    assert t.codes.shape == (3, 2, kpad) and t.scales.shape == (3, 2, kpad // 32)
    assert t.shape == x.shape and t.k == k
    assert (t.codes[..., k:] == 0).all()
    d = mx.dequantize(t)
    assert d.shape == x.shape
    # Error bound of the direct cast: half an element ulp at the block max's binade, or the
    # saturation gap (max normal to 2^(emax+1)); loose but catches layout mistakes.
    blocks = torch.nn.functional.pad(x, (0, kpad - k)).reshape(3, 2, -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    err = torch.nn.functional.pad(d - x, (0, kpad - k)).reshape(3, 2, -1, 32).abs()
    assert (err <= amax * 0.6).all()


@pytest.mark.parametrize("fmt,rule", RULE_CASES)
def test_native_equals_reference_wide_range(fmt, rule):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(96, 1027, generator=g) * torch.pow(2.0, torch.randint(-140, 130, (96, 1027), generator=g).float())
    # Per-block wide range too: some blocks whose exponents vary only a little.
    x[:16] = torch.randn(16, 1027, generator=g) * torch.pow(2.0, torch.randint(-3, 4, (16, 1027), generator=g).float())
    x[16:20] = torch.randn(4, 1027, generator=g) * 2.0**-128  # FP32 subnormals mixed in
    x[20:24] = (torch.randn(4, 1027, generator=g) * 2.0**-120)  # near the bottom clamp
    x[24, 7] = math.nan
    x[25, 100] = -math.inf
    x[26, ::5] = -0.0
    x[27] = (torch.randn(1027, generator=g) * 2.0**126).clamp(-3e38, 3e38)  # near the FP32 top
    assert_all_impls_agree(x, fmt, rule)


@pytest.mark.parametrize("fmt,rule", RULE_CASES)
def test_native_equals_reference_adversarial_ties(fmt, rule):
    """Midpoints and their neighbours at random block scales, mixed with random values."""
    f = mx.FORMATS[fmt]
    g = torch.Generator().manual_seed(7)
    cases = torch.tensor([v for v, _ in midpoints(fmt)], dtype=torch.float64)
    idx = torch.randint(0, len(cases), (256, 32), generator=g)
    vals = cases[idx] * torch.where(torch.rand(256, 32, generator=g) < 0.5, -1.0, 1.0)
    vals[:, 0] = f.max_normal * torch.rand(256, generator=g).add(1.0).clamp(max=1.99)  # pins X
    e = torch.randint(-130, 127 - f.emax, (256, 1), generator=g).double()
    x = (vals * torch.pow(2.0, e)).float()
    assert_all_impls_agree(x, fmt, rule)


def nearest_error(x: torch.Tensor, fmt: str, e: torch.Tensor) -> torch.Tensor:
    """Independent oracle of the mse rule: each block's squared error when every element takes
    the nearest grid value at scale 2^e (saturating; at a tie either neighbour has the same
    error, so no tie rule is needed). x [B, 32] float64, e [B] -> [B] float64."""
    grid = torch.tensor(sorted({abs(v) for _, v in finite_codes(fmt)}), dtype=torch.float64)
    p = x.abs() / torch.pow(2.0, e.double()).unsqueeze(-1)
    return (((p.unsqueeze(-1) - grid).abs().amin(-1) * torch.pow(2.0, e.double()).unsqueeze(-1)) ** 2).sum(-1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", MSE_FORMATS)
def test_mse_rule_keeps_the_closer_exponent(fmt, impl):
    """Each block takes the spec's exponent or the one above, whichever has the smaller squared
    error against the float64 oracle; ties keep the spec's; the codes are the nearest ones at
    the chosen exponent (their error is the oracle's)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(512, 32, generator=g) * torch.pow(2.0, torch.randint(-4, 5, (512, 1), generator=g).float())
    x[:128] = x[:128] * torch.pow(2.0, torch.randint(-2, 3, (128, 32), generator=g).float())  # spread
    x[128:192] = torch.randn(64, 32, generator=g).sign() * torch.rand(64, 32, generator=g) * 0.1
    x[128:192, 0] = 7.9  # a saturating max over small values: one up is closer
    ocp, mse = quantize(x, fmt, impl, "ocp"), quantize(x, fmt, impl, "mse")
    e0 = ocp.scales[:, 0].long() - 127
    xd = x.double()
    err0, err1 = nearest_error(xd, fmt, e0), nearest_error(xd, fmt, e0 + 1)
    up = mse.scales[:, 0].long() - 127 - e0
    assert set(up.tolist()) <= {0, 1}
    assert (up[err1 < err0 * (1 - 1e-12)] == 1).all() and (up[err0 < err1 * (1 - 1e-12)] == 0).all()
    assert up.sum() > 0 and (up == 0).sum() > 0
    err = ((mx.dequantize(mse).double() - xd) ** 2).sum(-1)
    assert torch.allclose(err, torch.where(up == 1, err1, err0), rtol=1e-12, atol=0)
    assert (up[128:192] == 1).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_mse_rule_fp4_blocks_by_hand(impl):
    """FP4, X = 1 by the spec (block max in [4, 8)). 7.9 saturates to 6 (error 1.9^2); one up
    (X = 2) it is 8, and 31 x 0.25 round to 0 at both exponents: up. 6.2 over 1.5s: exact at
    X = 1, ties 0.75 -> 1.0 (x 2) at X = 2: stays. 6.2 over 1.25s: the same error at both
    (0.25^2 each, 6 for 6.2 either way): a tie keeps the spec's."""
    x = torch.stack([block([7.9] + [0.25] * 31), block([6.2] + [1.5] * 31), block([6.2] + [1.25] * 31)])
    t = quantize(x, "mxfp4", impl, "mse")
    assert t.scales[:, 0].tolist() == [128, 127, 127]
    assert mx.dequantize(t)[0, :2].tolist() == [8.0, 0.0]
    assert mx.dequantize(t)[1, :2].tolist() == [6.0, 1.5]


def test_mse_rule_bad_arguments():
    x = torch.ones(2, 32)
    for fmt in ("mxfp8_e4m3", "mxfp8_e5m2", "mxint8"):
        with pytest.raises(ValueError, match="4- and 6-bit"):
            mx.quantize(x, fmt, rule="mse")
        with pytest.raises(ValueError, match="4- and 6-bit"):
            _C.mx_quantize(x.numpy(), fmt, "mse")
    with pytest.raises(ValueError, match="scale rule"):
        mx.quantize(x, "mxfp4", rule="min")
    with pytest.raises(ValueError, match="scale rule"):
        _C.mx_quantize(x.numpy(), "mxfp4", "min")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_input_dtypes_are_exact(dtype):
    x = (torch.randn(4, 64) * 10).to(dtype)
    assert_same(mx.quantize(x), mx.quantize(x.float()))
    assert_same(mx.quantize(x, impl="reference"), mx.quantize(x.float()))


def test_dequantize_dtype_and_shape():
    x = torch.randn(2, 3, 40)
    t = mx.quantize(x, "mxfp8_e4m3")
    assert mx.dequantize(t, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(mx.dequantize(t, torch.bfloat16), mx.dequantize(t).to(torch.bfloat16))
    assert mx.dequantize(t).shape == (2, 3, 40)


# --- bad input --------------------------------------------------------------------------------


def test_bad_inputs_raise_value_error():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="mxfp4"):
        mx.quantize(x, "mxfp3")
    with pytest.raises(ValueError):
        mx.quantize(x, "bf16")
    with pytest.raises(ValueError):
        mx.quantize(x, impl="fast")
    with pytest.raises(ValueError):
        mx.quantize(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError):
        mx.quantize(torch.tensor(1.0))
    with pytest.raises(ValueError):
        mx.quantize(torch.ones(4, 0))
    with pytest.raises(ValueError):
        mx.quantize(x.numpy())
    # The native binding checks for itself.
    with pytest.raises(ValueError, match="mxint8"):
        _C.mx_quantize(x.numpy(), "nope")
    with pytest.raises(ValueError, match="not an MX format"):
        _C.mx_quantize(x.numpy(), "bf16")
    with pytest.raises(ValueError):
        _C.mx_quantize(x.numpy().astype(np.float64), "mxfp4")
    with pytest.raises(ValueError):
        _C.mx_quantize(np.asfortranarray(np.ones((4, 64), np.float32)), "mxfp4")
    with pytest.raises(ValueError):
        _C.mx_quantize(np.ones(64, np.float32), "mxfp4")
    codes, scales = _C.mx_quantize(x.numpy(), "mxfp4")
    with pytest.raises(ValueError):
        _C.mx_dequantize(codes, scales, "mxfp4", 33)  # codes not [R, 64]
    with pytest.raises(ValueError):
        _C.mx_dequantize(codes, scales[:2], "mxfp4", 32)
    with pytest.raises(ValueError):
        _C.mx_dequantize(codes | 0x10, scales, "mxfp4", 32)  # not FP4 codes
    t = mx.quantize(x)
    with pytest.raises(ValueError):
        mx.dequantize(mx.MXTensor("mxfp4", t.codes, t.scales, 40))


# --- exhaustive (slow) ------------------------------------------------------------------------


@pytest.fixture
def slow_only(request):
    """The slow sweeps run only when asked for (`-m slow`): the default run stays short."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("exhaustive sweep: run with -m slow")


@pytest.mark.slow
@pytest.mark.parametrize("fmt,rule", RULE_CASES)
def test_native_equals_reference_every_fp32_pattern(fmt, rule, slow_only):
    """All 2^24 top-24-bit FP32 patterns (sign, exponent, 15 mantissa bits; random low 8 bits,
    so NaN, Inf, subnormals, zeros included), shuffled into blocks."""
    g = torch.Generator().manual_seed(99)
    bits = torch.arange(0, 1 << 24, dtype=torch.int64) << 8
    bits |= torch.randint(0, 1 << 8, bits.shape, generator=g)
    x = bits.to(torch.int32).view(torch.float32)
    x = x[torch.randperm(len(x), generator=g)].reshape(-1, 32 * 64)
    assert_all_impls_agree(x, fmt, rule)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,rule", RULE_CASES)
def test_native_equals_reference_every_relative_value(fmt, rule, slow_only):
    """Within a block pinned to each shared exponent (block max = 2^(emax+1) - ulp), every
    element exponent from the max down to below the element's subnormals, every top 16
    mantissa bits, both signs: exercises every rounding position of every binade."""
    f = mx.FORMATS[fmt]
    g = torch.Generator().manual_seed(5)
    top = float(np.nextafter(np.float32(2.0 ** (f.emax + 1)), np.float32(0)))
    mant = (torch.arange(0, 1 << 16, dtype=torch.int64) << 7) | torch.randint(0, 1 << 7, (1 << 16,), generator=g)
    for shared_exp in (-127, -120, -60, 0, 60, 127 - f.emax):
        rows = []
        for e in range(f.emax, f.emin - f.mbits - 4, -1):
            efield = e + shared_exp + 127
            if efield < 1:
                continue
            vals = ((efield << 23) | mant).to(torch.int32).view(torch.float32)
            vals = torch.cat([vals, vals[:31 - len(vals) % 31]]).reshape(-1, 31)
            vals = torch.cat([vals, -vals], 0)
            pin = torch.full((len(vals), 1), top * 2.0**shared_exp)
            rows.append(torch.cat([pin, vals], 1))
        if not rows:
            continue  # every element would be an FP32 subnormal
        x = torch.cat(rows, 0)
        t = assert_all_impls_agree(x, fmt, rule)
        if rule == "ocp" and top * 2.0**shared_exp >= 2.0**-126:
            assert (t.scales == shared_exp + 127).all()
