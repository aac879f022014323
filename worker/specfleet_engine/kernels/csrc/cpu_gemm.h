// What the CPU kernel library's sources share: the instruction-set paths and the few-row GEMM
// (int8_linear.cpp) that the fused decoder step (decoder_step.cpp) calls without a tensor.
#pragma once

#include <cstdint>

namespace specfleet {

// The paths, worst to best; kIsaNames[isa] is what the ops and SPECFLEET_CPU_ISA call them.
enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kNumIsas = 3 };
constexpr const char* kIsaNames[kNumIsas] = {"portable", "avx2", "avx512"};

// y[M, N] = x[M, K] @ W^T * scale + bias, W packed [ceil(N / 32), K, 32] (int8 or fp32).
struct Args {
  const float* x;      // [M, K], row stride ldx
  int64_t ldx;
  const void* w;       // packed: int8_t or float
  const float* scale;  // [N] or nullptr (float weights: no scale)
  const float* bias;   // [N] or nullptr
  float* y;            // [M, N], row stride ldy
  int64_t ldy;
  int64_t M, N, K;
};

// Not exported: a second build of the library (another SF_NS) loaded beside this one keeps its own.
#define SF_INTERNAL __attribute__((visibility("hidden")))

// Runs `a` on the path `isa` (int8: the weights are int8_t, else float), split over
// at::parallel_for's threads by blocks of output channels.
SF_INTERNAL void gemm(const Args& a, bool int8, Isa isa);

// The path `linear` and `linear_f32` take (set_isa caps it).
SF_INTERNAL Isa active_path();

}  // namespace specfleet
