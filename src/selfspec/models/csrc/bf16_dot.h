// The bfloat16 products of the skinny linear on a CPU's bfloat16 dot-product units (bf16_dot.cpp).
#pragma once
#include <ATen/ATen.h>

namespace selfspec_bf16 {

// The paths a bfloat16 linear can take. auto prefers AMX, then AVX-512-BF16, where the CPU has them;
// each path gives its own bits, so one process takes one path for every row count.
enum Path : int {
  kWiden = 0,        // each bfloat16 value widened to float32, float32 FMAs (skinny_linear.cpp)
  kDpbf16 = 1,       // AVX-512-BF16: VDPBF16PS, two products per float32 lane and instruction
  kAmx = 2,          // AMX-BF16: TDPBF16PS on tiles of 16 weight rows by 32 values of K
  kAmxEmulated = 3,  // the AMX path's code with each tile instruction done in software (tests, any CPU)
};

// The path of every bfloat16 product in this process (the linears, and attention's scores): "auto"
// (-1) is AMX where the CPU has it, else AVX-512-BF16 where it has that, else widening. The paths give
// different bits, so the choice depends on the CPU and choose() alone, never on the rows of a pass:
// every pass of a process, prefill included, takes the same one.
Path current();
// set the path (-1: auto); the caller has checked supported()
void choose(int path);
// whether this CPU (and, for AMX, the OS: tile data granted to this process) can run the path
bool supported(Path path);
// y[M, N] = x[M, K] @ w[N, K]^T over bfloat16 x and w (both row-major, contiguous), summed in float32
// and rounded to bfloat16 once (as torch rounds: to nearest even), by
// `path` (kDpbf16, kAmx or kAmxEmulated). K is a multiple of 8. Every output element is the same
// sequence of instructions whatever M (bf16_dot.cpp), so row i of an M-row call equals a one-row call
// on row i alone.
void linear(Path path, const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, int64_t M, int64_t N, int64_t K);

}  // namespace selfspec_bf16
