// Run-time CPU probe: CPUID + XGETBV + AMX tile-data permission, ordered ISA levels,
// QSPEC_ISA override. Everything that dispatches on the ISA asks isa_selected().
#pragma once
#include <string>

namespace qspec {

enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3, amx = 4 };

struct CpuFeatures {
  std::string vendor, model;
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false, avx512_fp16 = false;
  bool avx512_vnni = false;  // vpdpbusd (Cascade Lake and later Xeons, Zen 4)
  bool avx_vnni = false;     // VEX vpdpbusd on ymm, no AVX-512 needed (Sierra Forest Xeons, Alder Lake and later)
  bool avx512_vbmi = false;  // vpermb / vpermt2b (every AMX CPU; the amx level needs it)
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  bool os_avx = false;     // XCR0 enables YMM state
  bool os_avx512 = false;  // XCR0 enables opmask + ZMM state
  bool os_amx = false;     // XCR0 enables XTILECFG + XTILEDATA
  bool amx_permitted = false;  // arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) granted
};

const CpuFeatures& cpu_features();
Isa isa_detected();
// min(detected, QSPEC_ISA) unless overridden by set_isa_limit(); read once, cached.
Isa isa_selected();
// Lower the selected level for this process (tests use it to walk the levels); returns it.
Isa set_isa_limit(Isa limit);
const char* isa_name(Isa isa);
// Throws std::invalid_argument on an unknown name.
Isa isa_from_name(const std::string& name);
// A process-wide switch read from the environment variable `var`: `on` or `off`; unset or empty:
// `unset`; anything else is a user error (std::invalid_argument naming the choices).
bool env_switch(const char* var, const char* on, const char* off, bool unset);

}  // namespace qspec
