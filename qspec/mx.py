"""MX (microscaling) codecs per OCP Microscaling Formats v1.0.

A tensor is cast along its last dimension in blocks of 32 elements; each block shares one E8M0
scale X = 2^shared_exp and stores one element code per value: V_i ~= X * P_i. The rules are the
direct cast of the spec (Rouhani et al. 2023, arXiv 2310.10537, Algorithm 1), as written down
in docs/mx.md:

1. shared_exp = floor(log2(max_i |V_i|)) - emax_elem, clamped to the E8M0 range
   (above 127 -> NaN scale 0xFF; below -127 -> -127);
2. X = 2^shared_exp;
3. P_i = V_i / X rounded to nearest, ties to even, in the element format (incl. subnormals),
   saturating to +-max normal.

qspec choices where the spec leaves one:

- a block holding NaN or +-Inf gets the NaN scale 0xFF; its codes are all 0 and it dequantizes
  to NaN (Inf is not clamped to max normal);
- a block whose max |V| is 0 or an FP32 subnormal gets scale 0x00 and all-zero codes (flush);
- an element that rounds to zero, including -0.0, gets code 0: no negative-zero codes are ever
  emitted, so padding, flushed blocks and rounded-away values all look the same;
- the last dimension is padded with zeros to Kpad = ceil(K/32)*32;
- input is bf16/fp16/fp32, converted to fp32 exactly (float64 is rounded to fp32 first).

``rule="mse"`` (the drafts' cast, qspec/draft.py; the 4- and 6-bit FP formats) changes step 1
only: per block, shared_exp or shared_exp + 1, whichever gives the block the smaller squared error
(ties keep shared_exp). The spec's exponent saturates every |V| in [max normal, 2^(emax+1)) * X
to max normal (FP4: [6, 8) -> 6); one binade up keeps those values at half the resolution. On
Qwen2.5-Coder-1.5B's weights the squared error of the MXFP4 cast falls by 5-10% (13-21% of the
blocks move up). The codes are valid MX data either way.

Two implementations agree bit for bit (tests/test_mx.py): ``impl="native"`` is
``_C.mx_quantize`` (integer arithmetic on the FP32 bits, OpenMP over rows) and
``impl="reference"`` is the float64 torch code below, written to read like the spec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 32  # elements per shared scale (OCP MX v1.0: k = 32)
RULES = ("ocp", "mse")  # how step 1 picks a block's shared exponent (module docstring)
E8M0_BIAS = 127
E8M0_NAN = 0xFF


@dataclass(frozen=True)
class MXFormat:
    """One element format of the spec's table (codes as in csrc/mx.h: sign in the top bit)."""

    name: str
    bits: int  # element width
    ebits: int  # exponent bits (0 for INT8)
    mbits: int  # mantissa bits (INT8: 7, the bits below the sign)
    bias: int  # exponent bias (0 for INT8)
    emax: int  # emax_elem: exponent of the largest normal
    max_normal: float  # largest finite magnitude

    @property
    def is_int(self) -> bool:
        return self.ebits == 0

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal (1 - bias); INT8 has one fixed spacing 2^-6."""
        return 1 - self.bias

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** -6 if self.is_int else 2.0 ** (self.emin - self.mbits)


FORMATS: dict[str, MXFormat] = {
    f.name: f
    for f in (
        MXFormat("mxfp4", 4, 2, 1, 1, 2, 6.0),  # FP4 E2M1
        MXFormat("mxfp6_e2m3", 6, 2, 3, 1, 2, 7.5),  # FP6 E2M3
        MXFormat("mxfp6_e3m2", 6, 3, 2, 3, 4, 28.0),  # FP6 E3M2
        MXFormat("mxfp8_e4m3", 8, 4, 3, 7, 8, 448.0),  # FP8 E4M3, NaN only (S.1111.111)
        MXFormat("mxfp8_e5m2", 8, 5, 2, 15, 15, 57344.0),  # FP8 E5M2, IEEE Inf/NaN
        MXFormat("mxint8", 8, 0, 7, 0, 0, 127 * 2.0 ** -6),  # INT8: value = code * 2^-6
    )
}


def get_format(fmt: str) -> MXFormat:
    """The format named `fmt`, or ValueError naming the valid ones."""
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown MX format {fmt!r} (expected one of: {', '.join(FORMATS)})"
        ) from None


def element_value(fmt: str, code: int) -> float:
    """Value of one element code (before the shared scale), from its bit fields."""
    f = get_format(fmt)
    if not 0 <= code < 1 << f.bits:
        raise ValueError(f"code {code} out of range for {fmt}")
    if f.is_int:
        return (code - 256 if code >= 128 else code) * 2.0 ** -6  # two's complement
    sign = -1.0 if code >> (f.bits - 1) else 1.0
    e = (code >> f.mbits) & ((1 << f.ebits) - 1)
    m = code & ((1 << f.mbits) - 1)
    if f.name == "mxfp8_e4m3" and e == 15 and m == 7:
        return math.nan
    if f.name == "mxfp8_e5m2" and e == 31:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:  # subnormal
        return sign * m / (1 << f.mbits) * 2.0 ** f.emin
    return sign * (1 + m / (1 << f.mbits)) * 2.0 ** (e - f.bias)


def element_values(fmt: str) -> torch.Tensor:
    """All 2^bits codes of `fmt` decoded, float64 [2^bits] (index = code)."""
    f = get_format(fmt)
    return torch.tensor([element_value(fmt, c) for c in range(1 << f.bits)], dtype=torch.float64)


@dataclass
class MXTensor:
    """A tensor cast to an MX format along its last dimension.

    codes:  uint8 [..., Kpad], one canonical element code per byte (sign in the element's top
            bit; INT8 two's complement), Kpad = ceil(k/32)*32, padding codes are 0.
    scales: uint8 [..., Kpad/32], E8M0 (value 2^(s-127); 0xFF = NaN).
    k:      logical length of the last dimension.
    """

    fmt: str
    codes: torch.Tensor
    scales: torch.Tensor
    k: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:-1], self.k))

    @property
    def kpad(self) -> int:
        return self.codes.shape[-1]

    @property
    def nbytes(self) -> int:
        """Bytes when packed (bits per element, plus one byte per 32-element block)."""
        n_elems = self.codes.numel()
        return (n_elems * FORMATS[self.fmt].bits + 7) // 8 + self.scales.numel()


def _as_fp32_rows(x: torch.Tensor) -> torch.Tensor:
    """Check the input and view it as contiguous fp32 [R, K] (exact for bf16/fp16/fp32)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"expected a tensor with a non-empty last dimension, got shape {tuple(x.shape)}")
    return x.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1, x.shape[-1])


def quantize(x: torch.Tensor, fmt: str = "mxfp4", *, impl: str = "native", rule: str = "ocp") -> MXTensor:
    """MX direct cast of `x` along its last dimension (see the module docstring for the rules;
    `rule`: "ocp", the spec's shared exponent, or "mse", the closer of it and the one above)."""
    f = get_format(fmt)
    if rule not in RULES:
        raise ValueError(f"unknown scale rule {rule!r} (expected one of: {', '.join(RULES)})")
    if rule == "mse" and (f.is_int or f.bits > 6):
        raise ValueError(f"the mse scale rule is defined for the 4- and 6-bit formats, not {f.name}")
    rows = _as_fp32_rows(x)  # [R, K]
    k = rows.shape[1]
    if impl == "native":
        from qspec import _C

        codes_np, scales_np = _C.mx_quantize(rows.numpy(), f.name, rule)
        codes, scales = torch.from_numpy(codes_np), torch.from_numpy(scales_np)
    elif impl == "reference":
        codes, scales = _quantize_reference(rows, f, rule == "mse")
    else:
        raise ValueError(f"unknown impl {impl!r} (expected 'native' or 'reference')")
    lead = tuple(x.shape[:-1])
    return MXTensor(f.name, codes.reshape(*lead, -1), scales.reshape(*lead, -1), k)


def dequantize(t: MXTensor, dtype: torch.dtype = torch.float32, *, impl: str = "native") -> torch.Tensor:
    """Values X * P_i of `t` in its logical shape. Exact in fp32 (NaN-scale blocks -> NaN);
    other dtypes are one rounding of the fp32 result."""
    f = get_format(t.fmt)
    kpad = -(-t.k // BLOCK) * BLOCK
    if t.codes.dtype != torch.uint8 or t.scales.dtype != torch.uint8:
        raise ValueError("MXTensor codes and scales must be uint8")
    if t.codes.shape[-1] != kpad or t.scales.shape[:-1] != t.codes.shape[:-1] or t.scales.shape[-1] != kpad // BLOCK:
        raise ValueError(
            f"inconsistent MXTensor: k={t.k}, codes {tuple(t.codes.shape)}, scales {tuple(t.scales.shape)}"
        )
    codes = t.codes.cpu().contiguous().reshape(-1, kpad)
    scales = t.scales.cpu().contiguous().reshape(-1, kpad // BLOCK)
    if impl == "native":
        from qspec import _C

        out = torch.from_numpy(_C.mx_dequantize(codes.numpy(), scales.numpy(), f.name, t.k))
    elif impl == "reference":
        out = _dequantize_reference(codes, scales, f)[:, : t.k]
    else:
        raise ValueError(f"unknown impl {impl!r} (expected 'native' or 'reference')")
    return out.reshape(t.shape).to(dtype)


# ----------------------------------------------------------------------------------------------
# Reference implementation: float64 torch, one spec step per line. Every float64 operation used
# here is exact (fp32 inputs times powers of two within range; frexp; round-half-even of values
# with < 53 significant bits), so it is an oracle for the integer code in csrc/mx.cpp.

_ELEMS_PER_CHUNK = 1 << 22  # bounds the float64 temporaries of the reference (~32 MB each)


def _quantize_reference(x: torch.Tensor, f: MXFormat, mse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, K] -> (codes uint8 [R, Kpad], scales uint8 [R, Kpad/32])."""
    step = max(1, _ELEMS_PER_CHUNK // x.shape[1])
    chunks = [_quantize_reference_chunk(x[i : i + step], f, mse) for i in range(0, max(len(x), 1), step)]
    return torch.cat([c for c, _ in chunks]), torch.cat([s for _, s in chunks])


def _quantize_reference_chunk(x: torch.Tensor, f: MXFormat, mse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    rows, k = x.shape
    kpad = -(-k // BLOCK) * BLOCK
    v = torch.zeros(rows, kpad, dtype=torch.float64)
    v[:, :k] = x  # padding elements are +0
    v = v.view(rows, kpad // BLOCK, BLOCK)  # [R, nb, 32]

    # Block classes: NaN/Inf anywhere -> NaN scale; max |V| zero or FP32-subnormal -> flush.
    has_special = ~torch.isfinite(v).all(-1)  # [R, nb]
    amax = torch.where(has_special, 0.0, v.abs().amax(-1))  # [R, nb]
    normal = amax >= 2.0 ** -126  # smallest FP32 normal

    # Step 1: shared_exp = floor(log2(max|V|)) - emax_elem. frexp: amax = m * 2^e, m in [0.5, 1),
    # so floor(log2(amax)) = e - 1 exactly.
    _, e = torch.frexp(torch.where(normal, amax, 1.0))
    shared_exp = (e.to(torch.int64) - 1) - f.emax
    nan_scale = has_special | (shared_exp > 127)  # above the E8M0 range -> NaN
    shared_exp = shared_exp.clamp(min=-127)  # below the E8M0 range -> -127
    scales = torch.where(nan_scale, E8M0_NAN, torch.where(normal, shared_exp + E8M0_BIAS, 0))

    # Steps 2-3: P_i = V_i / X, X = 2^shared_exp (exact in float64), rounded in the element format.
    # NaN-scale and flushed blocks get all-zero codes (qspec), so only finite blocks are cast.
    cast = (normal & ~nan_scale).unsqueeze(-1)  # [R, nb, 1]
    p = torch.ldexp(torch.where(cast, v, 0.0), -shared_exp.unsqueeze(-1).to(torch.float64))
    codes = _encode_elements(p, f)  # [R, nb, 32]
    if mse:
        # The block cast one exponent up (P / 2), kept where its squared error is smaller:
        # err(up) - err = sum (q_up - q)(q_up + q - 2P) in units of X. Exact in float64: a term
        # is nonzero only where q_up != q, which needs |P| > 2^(qmin - 1), so P is a multiple of
        # 2^(qmin - 24) and every product and partial sum a multiple of 2^(2 qmin - 24) below 2^50 of them.
        codes_up = _encode_elements(p / 2, f)
        values = element_values(f.name)
        q, q_up = values[codes], 2 * values[codes_up]
        closer = ((q_up - q) * (q_up + q - 2 * p)).sum(-1) < 0
        up = cast.squeeze(-1) & closer & (shared_exp < 127)
        codes = torch.where(up.unsqueeze(-1), codes_up, codes)
        scales = scales + up.to(scales.dtype)
    return codes.reshape(rows, kpad).to(torch.uint8), scales.to(torch.uint8)


def _round_to_element(mag: torch.Tensor, f: MXFormat) -> torch.Tensor:
    """|P| (float64, >= 0) -> nearest element magnitude, ties to even, saturated to max normal."""
    if f.is_int:
        quantum_exp = torch.full_like(mag, -6, dtype=torch.int64)  # value = code * 2^-6
    else:
        _, e = torch.frexp(torch.where(mag > 0, mag, 1.0))
        e = e.to(torch.int64) - 1  # floor(log2 |P|)
        # Spacing of the element grid at |P|: 2^(e - mbits) for normals, 2^(emin - mbits) below.
        quantum_exp = e.clamp(min=f.emin) - f.mbits
    q = quantum_exp.to(torch.float64)
    n = torch.round(torch.ldexp(mag, -q))  # torch.round: half to even
    return torch.ldexp(n, q).clamp(max=f.max_normal)


def _encode_elements(p: torch.Tensor, f: MXFormat) -> torch.Tensor:
    """Finite P (float64) -> canonical codes (int64)."""
    mag = _round_to_element(p.abs(), f)
    negative = (p < 0) & (mag > 0)  # qspec: zero is code 0 whatever its sign
    if f.is_int:
        n = torch.ldexp(mag, torch.tensor(6.0, dtype=torch.float64)).to(torch.int64)
        return torch.where(negative, (256 - n) % 256, n)
    # Look the rounded magnitude up among the format's non-negative codes 0 .. max normal.
    values = element_values(f.name)[: (1 << (f.bits - 1))]
    n_finite = int(torch.searchsorted(values, torch.tensor(f.max_normal, dtype=torch.float64))) + 1
    values = values[:n_finite]  # ascending, index = code
    mag_code = torch.searchsorted(values, mag.contiguous())
    assert torch.equal(values[mag_code], mag), "rounded value not on the element grid"
    return mag_code + torch.where(negative, 1 << (f.bits - 1), 0)


def _dequantize_reference(codes: torch.Tensor, scales: torch.Tensor, f: MXFormat) -> torch.Tensor:
    """codes uint8 [R, Kpad], scales uint8 [R, Kpad/32] -> fp32 [R, Kpad]: P_i * 2^(s - 127)."""
    table = element_values(f.name)
    p = table[codes.long()].view(codes.shape[0], -1, BLOCK)  # [R, nb, 32]
    s = scales.long()
    x = torch.ldexp(p, (s - E8M0_BIAS).unsqueeze(-1).to(torch.float64))
    x = torch.where((s == E8M0_NAN).unsqueeze(-1), math.nan, x)
    return x.reshape(codes.shape[0], -1).to(torch.float32)


__all__ = ["BLOCK", "FORMATS", "MXFormat", "MXTensor", "dequantize", "element_value", "element_values", "get_format", "quantize"]
