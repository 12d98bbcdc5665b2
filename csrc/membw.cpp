// Read-bandwidth probe for bench/ (the "floor" every % of bandwidth is taken against): a threaded
// sum of a buffer far larger than the caches, with the widest loads the selected ISA level allows
// (sse2 16 B, avx2 32 B in csrc/x86/membw_avx2.cpp, avx512 64 B in csrc/x86/membw_avx512.cpp),
// several streams read in lockstep per thread (the GEMM kernels read 4 row blocks at once; one
// stream leaves a Zen 3 core's memory parallelism unused) and pieces claimed dynamically by the
// threads, so a thread that loses its core on a shared machine does not hold the pass.
// Every width computes the same checksum (the uint64 words summed modulo 2^64): the probe checks
// it on every pass, and tests/test_membw.py checks it against numpy on small buffers.
#include <emmintrin.h>  // SSE2 (x86-64 baseline)
#include <omp.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/mman.h>
#include <xmmintrin.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "cpu.h"
#include "membw_internal.h"

namespace qspec {
namespace detail {
namespace {

template <int S>
uint64_t sum_s_sse2(const uint8_t* p, int64_t sb, int64_t prefetch) {
  __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t off = 0; off < sb; off += 128) {
    for (int s = 0; s < S; ++s) {
      const uint8_t* q = p + s * sb + off;
      if (prefetch > 0) {
        _mm_prefetch(reinterpret_cast<const char*>(q + prefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(q + prefetch + 64), _MM_HINT_T0);
      }
      const __m128i* v = reinterpret_cast<const __m128i*>(q);
      a0 = _mm_add_epi64(a0, _mm_add_epi64(_mm_loadu_si128(v + 0), _mm_loadu_si128(v + 1)));
      a1 = _mm_add_epi64(a1, _mm_add_epi64(_mm_loadu_si128(v + 2), _mm_loadu_si128(v + 3)));
      a2 = _mm_add_epi64(a2, _mm_add_epi64(_mm_loadu_si128(v + 4), _mm_loadu_si128(v + 5)));
      a3 = _mm_add_epi64(a3, _mm_add_epi64(_mm_loadu_si128(v + 6), _mm_loadu_si128(v + 7)));
    }
  }
  const __m128i t = _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3));
  alignas(16) uint64_t w[2];
  _mm_store_si128(reinterpret_cast<__m128i*>(w), t);
  return w[0] + w[1];
}

template <int... I>
constexpr auto sse2_table(std::integer_sequence<int, I...>) {
  using Fn = uint64_t (*)(const uint8_t*, int64_t, int64_t);
  return std::array<Fn, sizeof...(I)>{&sum_s_sse2<I + 1>...};
}

}  // namespace

uint64_t read_streams_sse2(const uint8_t* p, int64_t stream_bytes, int streams, int64_t prefetch) {
  static constexpr auto kFns = sse2_table(std::make_integer_sequence<int, kMaxReadStreams>{});
  return kFns[streams - 1](p, stream_bytes, prefetch);
}

}  // namespace detail

namespace {

// Load widths, narrowest first; each needs the ISA level beside it.
struct Width {
  const char* name;
  int bytes;
  Isa isa;
  uint64_t (*fn)(const uint8_t*, int64_t, int, int64_t);
};
constexpr Width kWidths[] = {
    {"sse2", 16, Isa::scalar, detail::read_streams_sse2},
    {"avx2", 32, Isa::avx2, detail::read_streams_avx2},
    {"avx512", 64, Isa::avx512, detail::read_streams_avx512},
};

// Defaults, from bench.membw --sweep on a Zen 3 EPYC VM (2 cores, AVX2), all settings interleaved:
// 2 threads read 40.4 GB/s with 4 or 8 streams per thread, 39.7 with 2; 1 thread 30.5 with 8,
// 29.8 with 4, 28.7 with 2. A software prefetch 1 KB ahead cost 1-8%, 4 KB 5-15% (the hardware
// prefetchers follow 8 streams per core); ymm and xmm loads read alike there.
constexpr int kDefaultStreams = 8;
constexpr int64_t kDefaultPrefetch = 0;

std::vector<std::string> allowed_widths() {
  std::vector<std::string> v;
  for (const Width& w : kWidths)
    if (int(isa_selected()) >= int(w.isa)) v.push_back(w.name);
  return v;
}

const Width& width_of(const std::string& name) {
  if (name == "auto") {
    const Width* best = &kWidths[0];
    for (const Width& w : kWidths)
      if (int(isa_selected()) >= int(w.isa)) best = &w;
    return *best;
  }
  for (const Width& w : kWidths)
    if (name == w.name) {
      if (int(isa_selected()) < int(w.isa))
        throw std::invalid_argument(std::string("read width '") + name + "' is not usable here (isa_selected=" +
                                    isa_name(isa_selected()) + ")");
      return w;
    }
  throw std::invalid_argument("unknown read width '" + name + "' (expected auto, sse2, avx2 or avx512)");
}

struct ReadCfg {
  const Width* width;
  int threads, streams;
  int64_t chunk, prefetch;
};

ReadCfg resolve(int64_t nbytes, int threads, const std::string& width, int streams, int64_t chunk,
                int64_t prefetch) {
  ReadCfg c;
  c.width = &width_of(width);
  c.threads = threads < 1 ? omp_get_max_threads() : threads;
  c.streams = streams < 1 ? kDefaultStreams : streams;
  if (c.streams > detail::kMaxReadStreams)
    throw std::invalid_argument("read probe: streams <= " + std::to_string(detail::kMaxReadStreams));
  // Bytes per stream per piece: long enough for the hardware prefetchers to run, small enough
  // for ~8 pieces per thread (dynamic claiming evens out a descheduled thread).
  if (chunk <= 0) chunk = std::clamp<int64_t>(nbytes / (int64_t(c.threads) * c.streams * 8), 4096, 256 << 10);
  c.chunk = std::max<int64_t>(128, chunk / 128 * 128);
  c.prefetch = prefetch < 0 ? kDefaultPrefetch : prefetch;
  return c;
}

// One threaded pass: pieces of streams x chunk bytes claimed dynamically, then the remainder in
// one smaller piece and a scalar tail. Returns the sum of the uint64 words modulo 2^64.
uint64_t read_pass(const uint8_t* p, int64_t nbytes, const ReadCfg& c) {
  const int64_t piece = c.streams * c.chunk;
  const int64_t npieces = nbytes / piece;
  const auto fn = c.width->fn;
  uint64_t total = 0;
  if (npieces > 0) {
#pragma omp parallel for num_threads(std::min<int64_t>(c.threads, npieces)) schedule(dynamic, 1) reduction(+ : total)
    for (int64_t i = 0; i < npieces; ++i) total += fn(p + i * piece, c.chunk, c.streams, c.prefetch);
  }
  int64_t off = npieces * piece;
  const int64_t sb = (nbytes - off) / (c.streams * 128) * 128;
  if (sb > 0) {
    total += fn(p + off, sb, c.streams, c.prefetch);
    off += sb * c.streams;
  }
  for (; off + 8 <= nbytes; off += 8) {
    uint64_t w;
    std::memcpy(&w, p + off, 8);
    total += w;
  }
  return total;
}

// A buffer far larger than the caches, filled once, read by run(): one timed pass per rep, each
// pass's checksum checked against the fill (so the reads cannot be optimised away or go wrong).
class ReadProbe {
 public:
  ReadProbe(int64_t nbytes, const ReadCfg& c, bool hugepages) : c_(c), words_(nbytes / 8) {
    if (nbytes < (1 << 20)) throw std::invalid_argument("read probe: nbytes >= 1 MiB");
    constexpr size_t kHuge = 2 << 20;
    const size_t alloc = (size_t(words_) * 8 + kHuge - 1) / kHuge * kHuge;
    p_ = static_cast<uint8_t*>(std::aligned_alloc(kHuge, alloc));
    if (!p_) throw std::runtime_error("read probe: out of memory");
    // Transparent huge pages where the system allows them: a 4 KB page walk every 4 KB of each
    // stream costs bandwidth, and the floor is what the memory can deliver.
    if (hugepages) madvise(p_, alloc, MADV_HUGEPAGE);
    uint64_t* w = reinterpret_cast<uint64_t*>(p_);
    const int64_t words = words_;
#pragma omp parallel for num_threads(c.threads) schedule(static)
    for (int64_t i = 0; i < words; ++i) w[i] = uint64_t(i) * kMul;
    const uint64_t n = uint64_t(words_);  // sum of i * kMul for i < n, modulo 2^64
    expected_ = (n % 2 == 0 ? (n / 2) * (n - 1) : n * ((n - 1) / 2)) * kMul;
  }
  ~ReadProbe() { std::free(p_); }
  ReadProbe(const ReadProbe&) = delete;
  ReadProbe& operator=(const ReadProbe&) = delete;

  std::vector<double> run(int reps) const {
    if (reps < 1) throw std::invalid_argument("read probe: reps >= 1");
    std::vector<double> secs;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      const uint64_t sum = read_pass(p_, words_ * 8, c_);
      const auto t1 = std::chrono::steady_clock::now();
      if (sum != expected_)
        throw std::runtime_error(std::string("read probe: checksum mismatch (") + c_.width->name + ")");
      secs.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
    return secs;
  }

  const ReadCfg& cfg() const { return c_; }
  int64_t nbytes() const { return words_ * 8; }

 private:
  static constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  ReadCfg c_;
  int64_t words_;
  uint8_t* p_ = nullptr;
  uint64_t expected_ = 0;
};

}  // namespace

namespace py = pybind11;

void bind_membw(py::module_& m) {
  py::class_<ReadProbe>(m, "ReadProbe",
                        "A read-bandwidth probe: a buffer of nbytes (filled once) and how it is read. width: auto "
                        "(the widest the selected ISA level allows), sse2, avx2 or avx512; threads 0 = all; streams "
                        "read in lockstep per thread (0: default); chunk: bytes per stream per piece the threads "
                        "claim (0: auto); prefetch: software prefetch distance in bytes (0: none, -1: default)")
      .def(py::init([](int64_t nbytes, int threads, const std::string& width, int streams, int64_t chunk,
                       int64_t prefetch, bool hugepages) {
             const ReadCfg c = resolve(nbytes, threads, width, streams, chunk, prefetch);
             py::gil_scoped_release nogil;
             return new ReadProbe(nbytes, c, hugepages);
           }),
           py::arg("nbytes"), py::arg("threads") = 0, py::arg("width") = "auto", py::arg("streams") = 0,
           py::arg("chunk") = 0, py::arg("prefetch") = -1, py::arg("hugepages") = true)
      .def("run", [](const ReadProbe& p, int reps) {
        py::gil_scoped_release nogil;
        return p.run(reps);
      }, py::arg("reps") = 1, "Seconds per pass (checksum checked on every pass)")
      .def_property_readonly("nbytes", &ReadProbe::nbytes)
      .def_property_readonly("width", [](const ReadProbe& p) { return std::string(p.cfg().width->name); })
      .def_property_readonly("load_bytes", [](const ReadProbe& p) { return p.cfg().width->bytes; })
      .def_property_readonly("threads", [](const ReadProbe& p) { return p.cfg().threads; })
      .def_property_readonly("streams", [](const ReadProbe& p) { return p.cfg().streams; })
      .def_property_readonly("chunk", [](const ReadProbe& p) { return p.cfg().chunk; })
      .def_property_readonly("prefetch", [](const ReadProbe& p) { return p.cfg().prefetch; });
  m.def("read_bandwidth_probe", [](int64_t nbytes, int reps, int threads, const std::string& width, int streams,
                                   int64_t chunk, int64_t prefetch, bool hugepages) {
    const ReadCfg c = resolve(nbytes, threads, width, streams, chunk, prefetch);
    py::gil_scoped_release nogil;
    return ReadProbe(nbytes, c, hugepages).run(reps);
  }, py::arg("nbytes"), py::arg("reps") = 5, py::arg("threads") = 0, py::arg("width") = "auto",
     py::arg("streams") = 0, py::arg("chunk") = 0, py::arg("prefetch") = -1, py::arg("hugepages") = true,
     "Seconds per pass of ReadProbe(nbytes, threads, width, ...).run(reps): a fresh buffer each call");
  m.def("read_sum", [](py::buffer b, const std::string& width, int streams, int threads, int64_t chunk,
                       int64_t prefetch) {
    py::buffer_info info = b.request();
    if (info.ndim != 1 || info.strides[0] != info.itemsize)
      throw std::invalid_argument("read_sum: a contiguous 1-D buffer");
    const int64_t nbytes = info.size * info.itemsize;
    if (nbytes % 8) throw std::invalid_argument("read_sum: a multiple of 8 bytes");
    const ReadCfg c = resolve(nbytes, threads, width, streams, chunk, prefetch);
    const uint8_t* p = static_cast<const uint8_t*>(info.ptr);
    py::gil_scoped_release nogil;
    return read_pass(p, nbytes, c);
  }, py::arg("buf"), py::arg("width") = "auto", py::arg("streams") = 0, py::arg("threads") = 1,
     py::arg("chunk") = 0, py::arg("prefetch") = -1,
     "The probe's pass over a caller's buffer: sum of its uint64 words modulo 2^64 (for tests)");
  m.def("read_widths", &allowed_widths, "Load widths the probe may use at the selected ISA level, narrowest first");
  m.def("read_probe_defaults", [] {
    py::dict d;
    d["width"] = width_of("auto").name;
    d["streams"] = kDefaultStreams;
    d["prefetch"] = kDefaultPrefetch;
    d["max_streams"] = detail::kMaxReadStreams;
    return d;
  }, "The probe's defaults at the selected ISA level");
}

}  // namespace qspec
