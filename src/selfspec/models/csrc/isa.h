// Which vector instructions the runtime's CPU kernels use: AVX2 everywhere, AVX-512 paths chosen at
// runtime where the CPU has them (skinny_linear.cpp holds the setting, torch.ops.selfspec.skinny_isa).
// Every AVX-512 path gives the bits of its AVX2 path (each kernel says how), so the choice is speed
// alone.
#pragma once

namespace selfspec_isa {

enum Isa : int { kAuto = 0, kAvx2 = 1, kAvx512 = 2 };
// what skinny_isa last set
Isa setting();
// AVX-512 F, DQ, BW and VL, and the OS saving the ZMM state
bool cpu_has_avx512();
// whether a kernel whose AVX-512 path pays at every size takes it: the CPU has it and the setting is
// not kAvx2
inline bool avx512() { return setting() == kAvx512 || (setting() == kAuto && cpu_has_avx512()); }

}  // namespace selfspec_isa
