// MX direct cast (OCP Microscaling Formats v1.0 conversion; Rouhani et al. 2023, arXiv
// 2310.10537, Algorithm 1; the rules as qspec reads them are docs/mx.md) and its exact inverse, plus the pybind11 bindings `_C.mx_quantize` /
// `_C.mx_dequantize`.
//
// The cast is done in integer arithmetic on the FP32 bit patterns, so it is exact and does not
// depend on the floating-point environment (rounding mode, FTZ/DAZ): the readable oracle is
// qspec/mx.py (impl="reference") and the two agree bit for bit (tests/test_mx.py).
//
// qspec choices where the spec leaves one (see docs/mx.md, marked **qspec**):
// - ties round to even;
// - a block holding NaN or ±Inf gets the NaN scale 0xFF and all-zero codes;
// - a block whose max |V| is zero or an FP32 subnormal gets scale 0x00 and all-zero codes;
// - an element that rounds to zero (incl. -0.0) is code 0: no negative-zero codes are emitted;
// - K is padded with zeros to a multiple of 32.
// Besides the spec's rule for the shared exponent, the "mse" rule (MxRule in mx.h; the drafts'
// cast) may take the exponent one above it per block, exactly decided in integers.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <string>

#include "bindings.h"
#include "cpu.h"
#include "mx.h"

namespace py = pybind11;

namespace qspec {
namespace {

// Largest finite code magnitude (sign bit clear) of each element format: max normal.
// E4M3: S.1111.111 is NaN so 0x7E (448); E5M2: exponent 11111 is Inf/NaN so 0x7B (57344).
int max_code_magnitude(WFormat f) {
  switch (f) {
    case WFormat::mxfp4: return 0x7;        // 0.11.1 = 6
    case WFormat::mxfp6_e2m3: return 0x1F;  // 0.11.111 = 7.5
    case WFormat::mxfp6_e3m2: return 0x1F;  // 0.111.11 = 28
    case WFormat::mxfp8_e4m3: return 0x7E;  // 0.1111.110 = 448
    case WFormat::mxfp8_e5m2: return 0x7B;  // 0.11110.11 = 57344
    case WFormat::mxint8: return 127;       // 127 * 2^-6
    default: throw std::invalid_argument("not an MX format: " + std::string(mx_format(f).name));
  }
}

// Round m * 2^-shift to the nearest integer, ties to even (m < 2^24, shift may be <= 0).
inline uint32_t shift_round_even(uint32_t m, int shift) {
  if (shift <= 0) return m << -shift;  // only tiny FP32-subnormal inputs; exact
  if (shift > 25) return 0;            // m < 2^24 <= half of 2^shift: rounds to 0
  const uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  return q + ((rem > half || (rem == half && (q & 1))) ? 1 : 0);
}

MxCastConsts cast_consts(WFormat f) {
  const MxFormat& m = mx_format(f);
  MxCastConsts p;
  p.emax = m.emax;
  p.emin = 1 - m.bias;
  p.mbits = m.mbits;
  p.qmin = p.emin - m.mbits;
  p.bits = m.bits;
  p.maxmag = uint32_t(max_code_magnitude(f));
  p.is_int = f == WFormat::mxint8;
  p.mse = false;
  return p;
}

// One element: bits of V (finite) and the block's shared exponent -> canonical code.
inline uint8_t cast_element(const MxCastConsts& p, uint32_t vbits, int shared_exp) {
  const uint32_t a = vbits & 0x7FFFFFFFu;
  if (a == 0) return 0;
  const uint32_t sign = vbits >> 31;
  // |V| = m * 2^ev exactly, m < 2^24.
  const int efield = int(a >> 23);
  const uint32_t m = efield ? ((a & 0x7FFFFFu) | 0x800000u) : a;
  const int ev = (efield ? efield : 1) - 150;
  // |P| = |V| / X = m * 2^(ev - shared_exp); its quantum 2^q in the element format.
  int q;
  if (p.is_int) {
    q = -6;  // INT8: value = code * 2^-6, one fixed spacing
  } else {
    const int log2m = 31 - __builtin_clz(m);
    const int e = log2m + ev - shared_exp;  // floor(log2 |P|)
    q = (e > p.emin ? e : p.emin) - p.mbits;  // normals: 2^(e-mbits); subnormals: 2^qmin
  }
  const uint32_t n = shift_round_even(m, q - (ev - shared_exp));  // |P| / 2^q, rounded
  if (n == 0) return 0;  // qspec: zero is always code 0 (no -0 codes)
  uint32_t mag;
  if (p.is_int) {
    mag = n;
  } else {
    // n * 2^q as a code: exponent field (q - qmin) above the mantissa, n's leading bit carries
    // into it (n = 2^(mbits+1) after rounding up is the next binade's 1.0).
    mag = (uint32_t(q - p.qmin) << p.mbits) + n;
  }
  if (mag > p.maxmag) mag = p.maxmag;  // saturate to ±max normal (MX.md step 3)
  if (p.is_int) return uint8_t(sign ? -int32_t(mag) : int32_t(mag));  // two's complement
  return uint8_t((sign << (p.bits - 1)) | mag);
}

// One block of 32 (already zero-padded) -> 32 codes + its E8M0 scale.
inline uint8_t cast_block(const MxCastConsts& p, const uint32_t* vbits, uint8_t* codes) {
  uint32_t amax = 0;  // max |V| as bits: integer order == float order for non-negative values
  for (int i = 0; i < kMxBlock; ++i) {
    const uint32_t a = vbits[i] & 0x7FFFFFFFu;
    amax = a > amax ? a : amax;
  }
  std::memset(codes, 0, kMxBlock);
  if (amax >= 0x7F800000u) return kE8M0Nan;  // NaN or Inf in the block (qspec: NaN scale)
  if (amax < 0x00800000u) return 0;          // zero or FP32-subnormal max (qspec: flush)
  // Step 1: shared_exp = floor(log2(max|V|)) - emax_elem, clamped to E8M0.
  int shared_exp = int(amax >> 23) - 127 - p.emax;
  if (shared_exp > 127) return kE8M0Nan;  // unreachable from FP32 input; kept as the spec says
  if (shared_exp < -127) shared_exp = -127;
  for (int i = 0; i < kMxBlock; ++i) codes[i] = cast_element(p, vbits[i], shared_exp);
  return uint8_t(shared_exp + kE8M0Bias);
}

// Magnitude of an FP element code in units of the format's subnormal spacing 2^qmin.
inline int64_t code_units(const MxCastConsts& p, uint8_t code) {
  const uint32_t mag = code & ((1u << (p.bits - 1)) - 1);
  const uint32_t ef = mag >> p.mbits, mf = mag & ((1u << p.mbits) - 1);
  return ef ? int64_t((1u << p.mbits) | mf) << (ef - 1) : int64_t(mf);
}

// The mse rule (MxRule, mx.h): whether codes1 (the block cast at e0 + 1) have a smaller squared
// error than codes0 (at e0). err1 - err0 = sum (q1 - q0)(q1 + q0 - 2|V|) over the block (signs
// cancel: q0, q1 and V share theirs). In units of 2^(e0 + qmin) q0 = u0, q1 = 2 u1; an element
// with q0 != q1 has |V| > 2^(e0 + qmin - 1) (half the smallest nonzero q0), so 2|V| is an
// integer in units of 2^(e0 + qmin - 24) and every term, and the sum, is an exact int64 (below
// 2^50 for E3M2, the widest 6-bit grid). Elements with q0 == q1 (e.g. both zero) add nothing.
inline bool next_exponent_closer(const MxCastConsts& p, const uint32_t* vbits, const uint8_t* codes0,
                                 const uint8_t* codes1, int e0) {
  int64_t d = 0;
  for (int i = 0; i < kMxBlock; ++i) {
    const int64_t u0 = code_units(p, codes0[i]), u1 = 2 * code_units(p, codes1[i]);
    if (u0 == u1) continue;
    const uint32_t a = vbits[i] & 0x7FFFFFFFu;
    const int efield = int(a >> 23);
    const int64_t m = efield ? ((a & 0x7FFFFFu) | 0x800000u) : a;  // |V| = m * 2^ev
    const int ev = (efield ? efield : 1) - 150;
    const int shift = ev - e0 - p.qmin + 25;  // 2|V| = m << shift units; >= 1 here (see above)
    d += (u1 - u0) * (((u1 + u0) << 24) - (m << shift));
  }
  return d < 0;
}

// The mse rule over one row already cast by the spec's rule: each finite block whose exponent
// can go one up is cast there too and keeps the closer of the two. Only a block with an element
// above max normal * 2^e0 can move: up to max normal, twice each grid value at e0 + 1 is a value
// of the grid at e0 (an FP grid doubled is itself one exponent up), so the finer grid's nearest
// value is at least as close for every element and a tie keeps e0.
void closer_exponents(const MxCastConsts& p, const float* x, int64_t k, uint8_t* codes, uint8_t* scales) {
  const int64_t max_units = code_units(p, uint8_t(p.maxmag));  // max normal in units of 2^qmin
  for (int64_t b = 0; b * kMxBlock < k; ++b) {
    uint32_t vbits[kMxBlock] = {0};  // padding elements are +0
    const int64_t n = std::min<int64_t>(kMxBlock, k - b * kMxBlock);
    std::memcpy(vbits, x + b * kMxBlock, size_t(n) * sizeof(float));
    uint32_t amax = 0;
    for (int i = 0; i < kMxBlock; ++i) amax = std::max(amax, vbits[i] & 0x7FFFFFFFu);
    const int e0 = int(scales[b]) - kE8M0Bias;
    if (amax >= 0x7F800000u || amax < 0x00800000u || e0 >= 127) continue;  // NaN, flushed, top of E8M0
    float amax_f;
    std::memcpy(&amax_f, &amax, sizeof amax_f);
    if (double(amax_f) <= std::ldexp(double(max_units), e0 + p.qmin)) continue;  // nothing saturates
    uint8_t* c0 = codes + b * kMxBlock;
    uint8_t c1[kMxBlock];
    for (int i = 0; i < kMxBlock; ++i) c1[i] = cast_element(p, vbits[i], e0 + 1);
    if (next_exponent_closer(p, vbits, c0, c1, e0)) {
      std::memcpy(c0, c1, kMxBlock);
      scales[b] = uint8_t(e0 + 1 + kE8M0Bias);
    }
  }
}

void cast_row(const MxCastConsts& p, const float* x, int64_t k, uint8_t* codes, uint8_t* scales) {
  if (int(isa_selected()) >= int(Isa::avx2)) {
    mx_quantize_row_avx2(x, k, codes, scales, p);
  } else {
    for (int64_t b = 0; b * kMxBlock < k; ++b) {
      uint32_t vbits[kMxBlock] = {0};  // padding elements are +0
      const int64_t n = std::min<int64_t>(kMxBlock, k - b * kMxBlock);
      std::memcpy(vbits, x + b * kMxBlock, size_t(n) * sizeof(float));
      scales[b] = cast_block(p, vbits, codes + b * kMxBlock);
    }
  }
  if (p.mse) closer_exponents(p, x, k, codes, scales);
}

}  // namespace

void mx_quantize_rows(WFormat f, const float* x, int64_t rows, int64_t k, uint8_t* codes,
                      uint8_t* scales, MxRule rule) {
  MxCastConsts p = cast_consts(f);
  if (rule == MxRule::mse) {
    if (p.is_int || p.bits > 6)
      throw std::invalid_argument(std::string("the mse scale rule is defined for the 4- and 6-bit formats, not ") +
                                  mx_format(f).name);
    p.mse = true;
  }
  const int64_t nblocks = (k + kMxBlock - 1) / kMxBlock;
  const int64_t kpad = nblocks * kMxBlock;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) cast_row(p, x + r * k, k, codes + r * kpad, scales + r * nblocks);
}

void mx_dequantize_rows(WFormat f, const uint8_t* codes, const uint8_t* scales, int64_t rows,
                        int64_t k, float* out) {
  (void)max_code_magnitude(f);  // rejects bf16
  const std::array<float, 256> table = mx_decode_table(f);
  const int64_t nblocks = (k + kMxBlock - 1) / kMxBlock;
  const int64_t kpad = nblocks * kMxBlock;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t s = scales[r * nblocks + b];
      // Exact: every element value times a power of two in [2^-127, 2^127] is an FP32 number
      // (or overflows to Inf for codes the cast never produces); the product is formed in
      // double so the 2^-127 scale is never an FP32-subnormal operand (DAZ would zero it).
      const double x = s == kE8M0Nan ? double(NAN) : std::ldexp(1.0, int(s) - kE8M0Bias);
      const uint8_t* c = codes + r * kpad + b * kMxBlock;
      float* o = out + r * k + b * kMxBlock;
      const int64_t n = std::min<int64_t>(kMxBlock, k - b * kMxBlock);
      for (int64_t j = 0; j < n; ++j) o[j] = float(double(table[c[j]]) * x);
    }
  }
}

namespace {

WFormat mx_format_arg(const std::string& name) {
  const WFormat f = wformat_from_name(name);
  if (f == WFormat::bf16)
    throw std::invalid_argument("'bf16' is not an MX format (expected mxfp4, mxfp6_e2m3, "
                                "mxfp6_e3m2, mxfp8_e4m3, mxfp8_e5m2 or mxint8)");
  return f;
}

template <typename T>
py::array_t<T> checked_2d(const py::array& a, const char* what) {
  if (!py::isinstance<py::array_t<T>>(a) || a.ndim() != 2 ||
      !(a.flags() & py::array::c_style))
    throw std::invalid_argument(std::string(what) + " must be a C-contiguous 2-D " +
                                (std::is_same<T, float>::value ? "float32" : "uint8") +
                                " array");
  return py::reinterpret_borrow<py::array_t<T>>(a);
}

}  // namespace

void bind_mx(py::module_& m) {
  m.def(
      "mx_quantize",
      [](const py::array& x_in, const std::string& fmt, const std::string& rule) {
        const WFormat f = mx_format_arg(fmt);
        if (rule != "ocp" && rule != "mse")
          throw std::invalid_argument("unknown scale rule '" + rule + "' (expected ocp or mse)");
        const auto x = checked_2d<float>(x_in, "x");
        const int64_t rows = x.shape(0), k = x.shape(1);
        if (k < 1) throw std::invalid_argument("x must have at least one column");
        const int64_t nblocks = (k + kMxBlock - 1) / kMxBlock;
        py::array_t<uint8_t> codes({rows, nblocks * kMxBlock});
        py::array_t<uint8_t> scales({rows, nblocks});
        const float* xp = x.data();
        uint8_t* cp = codes.mutable_data();
        uint8_t* sp = scales.mutable_data();
        {
          py::gil_scoped_release nogil;
          mx_quantize_rows(f, xp, rows, k, cp, sp, rule == "mse" ? MxRule::mse : MxRule::ocp);
        }
        return py::make_tuple(codes, scales);
      },
      py::arg("x"), py::arg("fmt"), py::arg("rule") = "ocp",
      "MX direct cast (OCP MX v1.0) of fp32 [R, K] along K: -> (codes uint8 [R, Kpad], "
      "E8M0 scales uint8 [R, Kpad/32]), one canonical element code per byte; rule 'ocp' (the "
      "spec's shared exponent) or 'mse' (that or the one above, whichever is closer; 4/6-bit formats)");
  m.def(
      "mx_dequantize",
      [](const py::array& codes_in, const py::array& scales_in, const std::string& fmt,
         int64_t k) {
        const WFormat f = mx_format_arg(fmt);
        const auto codes = checked_2d<uint8_t>(codes_in, "codes");
        const auto scales = checked_2d<uint8_t>(scales_in, "scales");
        const int64_t rows = codes.shape(0);
        const int64_t nblocks = (k + kMxBlock - 1) / kMxBlock;
        if (k < 1) throw std::invalid_argument("k must be >= 1");
        if (codes.shape(1) != nblocks * kMxBlock)
          throw std::invalid_argument("codes must have ceil(k/32)*32 = " +
                                      std::to_string(nblocks * kMxBlock) + " columns, got " +
                                      std::to_string(codes.shape(1)));
        if (scales.shape(0) != rows || scales.shape(1) != nblocks)
          throw std::invalid_argument("scales must be [" + std::to_string(rows) + ", " +
                                      std::to_string(nblocks) + "]");
        const uint8_t* cp = codes.data();
        const int bits = mx_format(f).bits;
        if (bits < 8) {
          const size_t n = size_t(codes.size());
          uint8_t any = 0;
          for (size_t i = 0; i < n; ++i) any |= cp[i];
          if (any >> bits)
            throw std::invalid_argument("codes hold values >= 2^" + std::to_string(bits) +
                                        ", not " + fmt + " codes");
        }
        py::array_t<float> out({rows, k});
        const uint8_t* sp = scales.data();
        float* op = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          mx_dequantize_rows(f, cp, sp, rows, k, op);
        }
        return out;
      },
      py::arg("codes"), py::arg("scales"), py::arg("fmt"), py::arg("k"),
      "Exact inverse view of mx_quantize: element value * 2^(scale-127) (0xFF -> NaN), fp32 [R, k]");
}

}  // namespace qspec
