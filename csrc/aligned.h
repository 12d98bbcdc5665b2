// Scratch vectors whose data starts on a 64-byte line. glibc's malloc returns 16-byte aligned
// blocks (large ones are mmap'd with a 16-byte header): rows of such a buffer straddle two cache
// lines, and every 64-byte tile row (TILELOADD / TILESTORED) or zmm access then touches both. On a
// model-167 AMX Xeon, 2 threads, `_C.gemm` of 2,048 rows through the Qwen2.5-Coder-1.5B shapes ran
// 1.3-1.4x slower from that alone (the GEMM driver's bf16 rows of x; csrc/x86/gemm_amx.cpp).
#pragma once
#include <cstddef>
#include <new>
#include <vector>

namespace qspec {

template <class T>
struct LineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  LineAllocator() = default;
  template <class U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlign); }
  template <class U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};

template <class T>
using LineVector = std::vector<T, LineAllocator<T>>;

}  // namespace qspec
