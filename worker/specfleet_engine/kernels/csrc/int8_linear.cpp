// y[M, N] = (x[M, K] @ Wq[N, K]^T) * scale[N] (+ bias[N]) for float activations and int8 weights,
// tuned for decoding and draft verification (M = 1..16 rows): each weight byte is read once for
// all the rows, and multiplied in registers (as fp32; on the AVX2 path as int16, see below).
//
// Weight layout ("packed"): int8 [N_pad / 32, K, 32]. Block b holds output channels 32b..32b+31;
// for each k its 32 weights are contiguous, so one 64-byte cache line feeds 2 k-steps of 32 lanes
// and a thread's share of the weight (whole blocks, split by at::parallel_for) is one sequential
// stream. Channels past N are zero. Larger M (prefill) is cut into register tiles of a few rows
// that re-read a block from L1/L2, which keeps it about as fast as MKL's fp32 GEMM.
//
// The same loops serve fp32 weights (packed alike, no scales): MKL's fp32 GEMM costs about 1.5x
// more at 5 rows than at 1, this about 1.1x, which is what makes verifying a draft cheap.
//
// Three paths ("ISAs") compute the same thing; the library holds every one its compiler can emit,
// whatever -march says, because each path's tiles carry their own target attribute:
//   avx512    AVX-512F: a block's 32 channels are two __m512, tiles of up to 12 rows
//   avx2      AVX2 + FMA: four __m256; tiles of 1-2 rows x 32 channels, or of 3-6 rows x 16
//             channels (two passes over a block), fitting the 16 ymm registers. fp32 weights:
//             FMAs; int8 weights: integer dot products on x rounded to int16 (tile_avx2_int).
//             Where -march allows AVX-512 too, the compiler may encode these as EVEX: the same
//             operations.
//   portable  plain loops the compiler vectorizes for -march=native (any CPU, any architecture)
// `linear` / `linear_f32` run the active path: at load, the best the CPU has
// (__builtin_cpu_supports: avx512 > avx2 > portable); set_isa caps it (cpu_gemm.py does, from
// SPECFLEET_CPU_ISA). The *_isa ops run a named path, for tests and benchmarks.
//
// Built by worker/specfleet_engine/kernels/cpu_gemm.py (-O3 -march=native -fopenmp) and
// registered as ops:
//   specfleet_int8::linear(x[..., K], w_packed, scales[N], bias[N]?) -> y[..., N] in x's dtype
//   specfleet_int8::linear_f32(x, w_packed_fp32, n, bias?)        fp32 weights, the same loops
//   specfleet_int8::linear_isa(x, w, scales, bias?, isa), linear_f32_isa(x, w, n, bias?, isa)
//   specfleet_int8::cpu_isas() -> str[]     the paths this CPU can run, best first
//   specfleet_int8::active_isa() -> str     the path linear and linear_f32 run
//   specfleet_int8::set_isa(cap) -> str     make it the best the CPU has, at most cap
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "cpu_gemm.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#ifndef SF_X86  // -DSF_X86=0 builds what a non-x86 CPU gets (the portable path only) anywhere
#if defined(__x86_64__) || defined(__i386__)
#define SF_X86 1
#else
#define SF_X86 0
#endif
#endif
#if SF_X86
#include <immintrin.h>
#endif

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "build with -fopenmp: at::parallel_for runs serially without it"
#endif

// Tuning knobs (-D to override when experimenting); AVX-512's measured on an Ice Lake Xeon,
// AVX2's on an AMD EPYC (Zen 3):
//   SF_PF            prefetch distance in k-steps of 32 int8 weights (128: 4 KiB ahead; fp32
//                    weights the same distance in bytes; 0: none)
//   SF_A2_PF         AVX2, tiles of whole blocks: 0, the hardware prefetcher alone streamed fp32
//                    ~10% faster (int8 alike either way)
//   SF_A2_PF_HALF    AVX2, half-block tiles (3-6 rows): 64, 10-25% faster than none (their
//                    passes go back and forth a chunk)
//   SF_PF_AMD_F32    AVX-512 on an AMD CPU, fp32 weights: 0, the hardware prefetcher alone
//                    streamed them 8-13% faster (1 and 5 rows, an EPYC with AVX-512, one thread;
//                    int8 alike either way)
//   SF_AMD_AVX2_ROWS AVX-512 on an AMD CPU: tiles of at most this many rows run the AVX2 code
//                    (Zen 4 splits each 512-bit op in two): 1, 5% faster for one row, fp32 and
//                    int8 alike; from 3 rows AVX-512's larger tiles win (1.5-2x fp32 at 5-8)
//   SF_HINT          prefetch hint
//   SF_KU1/SF_KU2    AVX-512: independent accumulator sets for 1- and 2-row tiles (FMA latency)
//   SF_A2_KU1        AVX2: the same for 1-row tiles (2 sets of 4 accumulators = 8 FMA chains)
//   SF_A2_CHUNK      AVX2: bytes of a block's fp32 weights that half-block tiles take at a time
//                    (both halves of it, the second from L1); int8 blocks go whole
//   SF_A2_FULL3      AVX2: 3 rows of fp32 weights in one whole-block tile (one accumulator
//                    spills, but the weights stream once: ~10% faster than halves)
//   SF_X86           0: build the portable path alone, as a non-x86 CPU gets it
//   SF_NS            the torch.ops namespace
#ifndef SF_PF
#define SF_PF 128
#endif
#ifndef SF_PF_AMD_F32
#define SF_PF_AMD_F32 0
#endif
#ifndef SF_AMD_AVX2_ROWS
#define SF_AMD_AVX2_ROWS 1
#endif
#ifndef SF_HINT
#define SF_HINT _MM_HINT_T0
#endif
#ifndef SF_KU1
#define SF_KU1 4
#endif
#ifndef SF_KU2
#define SF_KU2 2
#endif
#ifndef SF_A2_KU1
#define SF_A2_KU1 2
#endif
#ifndef SF_A2_PF
#define SF_A2_PF 0
#endif
#ifndef SF_A2_PF_HALF
#define SF_A2_PF_HALF 64
#endif
#ifndef SF_A2_CHUNK
#define SF_A2_CHUNK 4096
#endif
#ifndef SF_A2_FULL3
#define SF_A2_FULL3 1
#endif
#ifndef SF_NS
#define SF_NS specfleet_int8
#endif

#if SF_X86
#define SF_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma")))
#define SF_TARGET_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace specfleet {
namespace {

constexpr int64_t NB = 32;  // output channels per block

// Rows per register tile, at most: AVX-512 2 * MT accumulators + 2 weight vectors of 32
// registers; AVX2 2 * MT (half blocks) of 16; the portable loops keep their tile in L1.
constexpr int max_tile_rows(Isa isa) { return isa == kAvx2 ? 6 : 12; }

// The AVX2 int8 tiles' activations (tile_avx2_int): x quantized to int16, one scale per row and
// block of KQ k-steps.
constexpr int64_t KQ = 64;

struct QuantX {
  const int16_t* q;  // [M, K2]: K2 = K rounded up to even, the pad zero
  int64_t ldq;
  const float* s;    // [M, ceil(K / KQ)]
  int64_t lds;
};

struct QArgs : Args {
  QuantX xq;
};

// x [M, K] (row stride ldx) -> q [M, K2], s [M, ceil(K / KQ)]: the same for a row whatever M is.
void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int16_t* q, int64_t ldq, float* s,
                   int64_t lds) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    int16_t* qr = q + m * ldq;
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += KQ, ++b) {
      const int64_t k1 = std::min(K, k0 + KQ);
      float amax = 0.f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xr[k]));
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      s[m * lds + b] = amax / 32767.f;
      for (int64_t k = k0; k < k1; ++k) qr[k] = static_cast<int16_t>(std::nearbyint(xr[k] * inv));
    }
    for (int64_t k = K; k < ldq; ++k) qr[k] = 0;
  }
}

// ---------------------------------------------------------------------------------------------
// Portable path: plain loops the compiler vectorizes (-O3 -march=native).
template <int MT, typename W>
void tile_portable(const Args& a, int64_t m0, int64_t blk) {
  float acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = 0.f;
  const W* w = static_cast<const W*>(a.w) + blk * a.K * NB;
  const float* x = a.x + m0 * a.ldx;
  for (int64_t k = 0; k < a.K; ++k) {
    float wf[NB];
    for (int j = 0; j < NB; ++j) wf[j] = static_cast<float>(w[k * NB + j]);
    for (int m = 0; m < MT; ++m) {
      const float xv = x[m * a.ldx + k];
      for (int j = 0; j < NB; ++j) acc[m][j] += xv * wf[j];
    }
  }
  const int64_t n0 = blk * NB, nc = std::min<int64_t>(NB, a.N - n0);
  for (int m = 0; m < MT; ++m) {
    float* y = a.y + (m0 + m) * a.ldy + n0;
    for (int64_t j = 0; j < nc; ++j)
      y[j] = acc[m][j] * (a.scale ? a.scale[n0 + j] : 1.f) + (a.bias ? a.bias[n0 + j] : 0.f);
  }
}

#if SF_X86
// Prefetch PF k-steps of int8 weights (PF * 32 bytes) ahead of k-step `k`, one call per k-step
// (int8 k-steps share 64-byte lines two by two, so odd ones skip); PF = 0: none.
template <int PF, typename W>
static inline void prefetch_ahead(const W* w, int64_t k) {
  if constexpr (PF > 0) {
    if constexpr (sizeof(W) == 1) {
      if (k % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (k + PF) * NB), SF_HINT);
    } else {  // the same distance in bytes; a k-step spans NB * sizeof(W) / 64 lines
      const char* p = reinterpret_cast<const char*>(w + k * NB) + PF * NB;
      for (int l = 0; l < static_cast<int>(NB * sizeof(W) / 64); ++l) _mm_prefetch(p + 64 * l, SF_HINT);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 path.
SF_TARGET_AVX512 static inline __m512 load_w16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
SF_TARGET_AVX512 static inline __m512 load_w16(const float* p) { return _mm512_loadu_ps(p); }

// One register tile: MT rows x 32 channels over the whole K. With few rows the FMA chains are too
// short to hide the FMA latency, so KU k-steps go to separate accumulators (summed at the end).
template <int MT, int KU, typename W, int PF = SF_PF>
SF_TARGET_AVX512 void tile_avx512(const Args& a, int64_t m0, int64_t blk) {
  __m512 acc[KU][MT][2];
  for (int u = 0; u < KU; ++u)
    for (int m = 0; m < MT; ++m) acc[u][m][0] = acc[u][m][1] = _mm512_setzero_ps();
  const W* w = static_cast<const W*>(a.w) + blk * a.K * NB;
  const float* x = a.x + m0 * a.ldx;
  const int64_t ldx = a.ldx, K = a.K;
  int64_t k = 0;
  for (; k + KU <= K; k += KU) {
#pragma GCC unroll 4
    for (int u = 0; u < KU; ++u) {
      prefetch_ahead<PF>(w, k + u);
      const __m512 w0 = load_w16(w + (k + u) * NB), w1 = load_w16(w + (k + u) * NB + 16);
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) {
        const __m512 xv = _mm512_set1_ps(x[m * ldx + k + u]);
        acc[u][m][0] = _mm512_fmadd_ps(xv, w0, acc[u][m][0]);
        acc[u][m][1] = _mm512_fmadd_ps(xv, w1, acc[u][m][1]);
      }
    }
  }
  for (; k < K; ++k) {
    const __m512 w0 = load_w16(w + k * NB), w1 = load_w16(w + k * NB + 16);
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
      acc[0][m][0] = _mm512_fmadd_ps(xv, w0, acc[0][m][0]);
      acc[0][m][1] = _mm512_fmadd_ps(xv, w1, acc[0][m][1]);
    }
  }
  for (int u = 1; u < KU; ++u)
    for (int m = 0; m < MT; ++m) {
      acc[0][m][0] = _mm512_add_ps(acc[0][m][0], acc[u][m][0]);
      acc[0][m][1] = _mm512_add_ps(acc[0][m][1], acc[u][m][1]);
    }
  const int64_t n0 = blk * NB, nc = std::min<int64_t>(NB, a.N - n0);
  const __mmask16 k0 = nc >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nc) - 1);
  const __mmask16 k1 = nc >= 32 ? 0xFFFF : nc <= 16 ? 0 : static_cast<__mmask16>((1u << (nc - 16)) - 1);
  const __m512 s0 = a.scale ? _mm512_maskz_loadu_ps(k0, a.scale + n0) : _mm512_set1_ps(1.f);
  const __m512 s1 = a.scale ? _mm512_maskz_loadu_ps(k1, a.scale + n0 + 16) : _mm512_set1_ps(1.f);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (a.bias) {
    b0 = _mm512_maskz_loadu_ps(k0, a.bias + n0);
    b1 = _mm512_maskz_loadu_ps(k1, a.bias + n0 + 16);
  }
  for (int m = 0; m < MT; ++m) {
    float* y = a.y + (m0 + m) * a.ldy + n0;
    _mm512_mask_storeu_ps(y, k0, _mm512_fmadd_ps(acc[0][m][0], s0, b0));
    _mm512_mask_storeu_ps(y + 16, k1, _mm512_fmadd_ps(acc[0][m][1], s1, b1));
  }
}

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA path: a block's 32 channels are four 8-lane vectors, and the 16 ymm registers hold
// KU * MT * NV accumulators, the NV weight vectors of a k-step and a broadcast x. One or two rows
// take all four vectors at once (one row: KU = 2 k-steps in flight, 8 FMA chains, what 2 FMA
// pipes x 4 cycles of latency need). Three to six rows take the block in two halves of 16
// channels, one pass each (fp32: a 4 KiB chunk of the block at a time, so that the second half
// reads it from L1), so that one int8 -> fp32 conversion serves up to 6 rows.
SF_TARGET_AVX2 static inline __m256 load_w8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
SF_TARGET_AVX2 static inline __m256 load_w8(const float* p) { return _mm256_loadu_ps(p); }

// acc[m][j] += x[m, k] * w[k, 8j..8j+7] for k in 0..kn-1: w points at the first k-step's first
// channel (row stride NB), x at row 0's first k (row stride ldx). Every loop over u, m and j is
// unrolled, so that the accumulators live in registers (GCC keeps an array it indexes at run time
// in memory, and stores to it every k-step).
template <int MT, int NV, int KU, int PF, typename W>
SF_TARGET_AVX2 __attribute__((always_inline)) static inline void fma_avx2(const W* w, const float* x, int64_t ldx,
                                                                          int64_t kn, __m256 (&acc)[MT][NV]) {
  __m256 r[KU][MT][NV];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      r[0][m][j] = acc[m][j];
#pragma GCC unroll 4
      for (int u = 1; u < KU; ++u) r[u][m][j] = _mm256_setzero_ps();
    }
  int64_t k = 0;
  for (; k + KU <= kn; k += KU) {
#pragma GCC unroll 4
    for (int u = 0; u < KU; ++u) {
      prefetch_ahead<PF>(w, k + u);
      __m256 wv[NV];
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) wv[j] = load_w8(w + (k + u) * NB + 8 * j);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * ldx + k + u);
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) r[u][m][j] = _mm256_fmadd_ps(xv, wv[j], r[u][m][j]);
      }
    }
  }
  for (; k < kn; ++k) {
    __m256 wv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) wv[j] = load_w8(w + k * NB + 8 * j);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * ldx + k);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) r[0][m][j] = _mm256_fmadd_ps(xv, wv[j], r[0][m][j]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
#pragma GCC unroll 4
      for (int u = 1; u < KU; ++u) r[0][m][j] = _mm256_add_ps(r[0][m][j], r[u][m][j]);
      acc[m][j] = r[0][m][j];
    }
}

// y[m0 + m, n0 + 8j + i] = acc[m][j][i] * scale + bias for the nc <= 8 * NV channels from n0.
template <int MT, int NV>
SF_TARGET_AVX2 __attribute__((always_inline)) static inline void store_avx2(const Args& a, int64_t m0, int64_t n0,
                                                                            int64_t nc, const __m256 (&acc)[MT][NV]) {
  // Fewer than 8 * NV channels (the last block): scales and bias are read into zero-padded
  // copies and the rows written through a buffer (AVX2's masked loads and stores are slow).
  alignas(32) float sbuf[8 * NV], bbuf[8 * NV], ybuf[8 * NV];
  const float* scale = a.scale ? a.scale + n0 : nullptr;
  const float* bias = a.bias ? a.bias + n0 : nullptr;
  if (nc < 8 * NV) {
    for (int64_t j = 0; j < 8 * NV; ++j) {
      sbuf[j] = j < nc && scale ? scale[j] : 0.f;
      bbuf[j] = j < nc && bias ? bias[j] : 0.f;
    }
    scale = scale ? sbuf : nullptr;
    bias = bias ? bbuf : nullptr;
  }
  __m256 sv[NV], bv[NV];
#pragma GCC unroll 4
  for (int j = 0; j < NV; ++j) {
    sv[j] = scale ? _mm256_loadu_ps(scale + 8 * j) : _mm256_set1_ps(1.f);
    bv[j] = bias ? _mm256_loadu_ps(bias + 8 * j) : _mm256_setzero_ps();
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    float* y = a.y + (m0 + m) * a.ldy + n0;
    float* out = nc < 8 * NV ? ybuf : y;
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + 8 * j, _mm256_fmadd_ps(acc[m][j], sv[j], bv[j]));
    if (nc < 8 * NV) std::memcpy(y, ybuf, nc * sizeof(float));
  }
}

// One register tile: rows m0..m0+MT-1 x the 32 channels of block blk, over the whole K.
template <int MT, int KU, typename W>
SF_TARGET_AVX2 void tile_avx2(const Args& a, int64_t m0, int64_t blk) {
  __m256 acc[MT][4];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
  fma_avx2<MT, 4, KU, SF_A2_PF>(static_cast<const W*>(a.w) + blk * a.K * NB, a.x + m0 * a.ldx, a.ldx, a.K, acc);
  store_avx2<MT, 4>(a, m0, blk * NB, std::min<int64_t>(NB, a.N - blk * NB), acc);
}

// The same in two halves of 16 channels, SF_A2_CHUNK bytes of fp32 weights at a time (the other
// half's accumulators wait in L1).
template <int MT, int KU, typename W>
SF_TARGET_AVX2 void tile_avx2_halves(const Args& a, int64_t m0, int64_t blk) {
  const int64_t n0 = blk * NB, nc = std::min<int64_t>(NB, a.N - n0);
  const int halves = nc > 16 ? 2 : 1;  // the last block's second half may hold no channel
  __m256 acc[2][MT][2];
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h)
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) acc[h][m][0] = acc[h][m][1] = _mm256_setzero_ps();
  const W* w = static_cast<const W*>(a.w) + blk * a.K * NB;
  const float* x = a.x + m0 * a.ldx;
  // k-steps a pass covers: int8 blocks (18-48 KiB for SmolLM2) go whole, a pass a half, which
  // the hardware prefetcher streams best; the second half finds them in L1 or L2
  const int64_t chunk = sizeof(W) == 1 ? a.K : SF_A2_CHUNK / static_cast<int64_t>(NB * sizeof(W));
  for (int64_t k0 = 0; k0 < a.K; k0 += chunk) {
    const int64_t kn = std::min<int64_t>(chunk, a.K - k0);
    for (int h = 0; h < halves; ++h)
      fma_avx2<MT, 2, KU, SF_A2_PF_HALF>(w + k0 * NB + 16 * h, x + k0, a.ldx, kn, acc[h]);
  }
  for (int h = 0; h < halves; ++h) store_avx2<MT, 2>(a, m0, n0 + 16 * h, std::min<int64_t>(16, nc - 16 * h), acc[h]);
}

// ---------------------------------------------------------------------------------------------
// AVX2 int8 tiles: integer dot products. Converting each int8 weight to fp32 (vpmovsxbd +
// vcvtdq2ps) before its FMA costs more than the weights take to stream where a 256-bit op is two
// 128-bit halves (Zen 1: int8 decoding ran at 0.80x llama.cpp's Q8_0). These tiles multiply the
// weights as int16 instead: each row of x is quantized to int16 per block of KQ k-steps (scale =
// the block's max |x| / 32767, round to nearest even; `quantize_rows`), two k-steps' weights are
// interleaved in registers (punpck{l,h}bw of two 16-channel rows, no other layout) and widened
// to int16, and vpmaddwd sums x[k] w[k] + x[k+1] w[k+1] per channel into int32, exactly; each
// block's sums go to fp32 once, times its scale. A block of 64 k-steps stays far from int32's
// range (64 x 32767 x 127 < 2^28). The error this adds, about 1e-5 of a block's largest |x|, is far
// below the int8 weights' own; the integer sums make a row's result independent of how many rows
// its tile holds.
// f[m][g] += (sum over the block's k of x[m, k] w[k, 16 * H + 8 * g' + i]) * scale, for the
// NH 16-channel halves from H (g = 2 * (h - H) + {0, 1}), over every block of K.
template <int MT, int NH>
SF_TARGET_AVX2 __attribute__((always_inline)) static inline void madd_avx2(const QArgs& a, int64_t m0, const int8_t* w,
                                                                           int H, __m256 (&f)[MT][2 * NH]) {
  const int64_t K = a.K;
  const __m128i zero = _mm_setzero_si128();
  for (int64_t k0 = 0, b = 0; k0 < K; k0 += KQ, ++b) {
    const int64_t k1 = std::min(K, k0 + KQ);
    __m256i acc[MT][2 * NH];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
      for (int j = 0; j < 2 * NH; ++j) acc[m][j] = _mm256_setzero_si256();
    // two k-steps at a time; an odd K's last k-step pairs with zeros (x's pad is zero too)
    for (int64_t k = k0; k < k1; k += 2) {
      const int8_t* wk = w + k * NB + 16 * H;
      __m256i wv[2 * NH];
      if (k + 1 < k1) [[likely]] {
#pragma GCC unroll 2
        for (int h = 0; h < NH; ++h) {
          const __m128i w0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wk + 16 * h));
          const __m128i w1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wk + NB + 16 * h));
          wv[2 * h] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(w0, w1));
          wv[2 * h + 1] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(w0, w1));
        }
      } else {
#pragma GCC unroll 2
        for (int h = 0; h < NH; ++h) {
          const __m128i w0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wk + 16 * h));
          wv[2 * h] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(w0, zero));
          wv[2 * h + 1] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(w0, zero));
        }
      }
      const int16_t* xk = a.xq.q + m0 * a.xq.ldq + k;
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        int32_t xx;  // x[m, k] and x[m, k + 1], broadcast as a pair
        std::memcpy(&xx, xk + m * a.xq.ldq, sizeof(xx));
        const __m256i xv = _mm256_set1_epi32(xx);
#pragma GCC unroll 4
        for (int j = 0; j < 2 * NH; ++j) acc[m][j] = _mm256_add_epi32(acc[m][j], _mm256_madd_epi16(wv[j], xv));
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m256 sv = _mm256_set1_ps(a.xq.s[(m0 + m) * a.xq.lds + b]);
#pragma GCC unroll 4
      for (int j = 0; j < 2 * NH; ++j) f[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][j]), sv, f[m][j]);
    }
  }
}

// One tile: rows m0..m0+MT-1 x block blk's 32 channels, both halves in one pass (1-2 rows: 4
// int32 accumulators a row) or one half a pass (3-6 rows: 2 a row, so they stay in registers).
template <int MT>
SF_TARGET_AVX2 void tile_avx2_int(const Args& a_, int64_t m0, int64_t blk) {
  const QArgs& a = static_cast<const QArgs&>(a_);
  const int8_t* w = static_cast<const int8_t*>(a.w) + blk * a.K * NB;
  const int64_t n0 = blk * NB, nc = std::min<int64_t>(NB, a.N - n0);
  if constexpr (MT <= 2) {
    __m256 f[MT][4];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < 4; ++j) f[m][j] = _mm256_setzero_ps();
    madd_avx2<MT, 2>(a, m0, w, 0, f);
    store_avx2<MT, 4>(a, m0, n0, nc, f);
  } else {
    const int halves = nc > 16 ? 2 : 1;
    for (int h = 0; h < halves; ++h) {
      __m256 f[MT][2];
      for (int m = 0; m < MT; ++m) f[m][0] = f[m][1] = _mm256_setzero_ps();
      madd_avx2<MT, 1>(a, m0, w, h, f);
      store_avx2<MT, 2>(a, m0, n0 + 16 * h, std::min<int64_t>(16, nc - 16 * h), f);
    }
  }
}
#endif  // SF_X86

// ---------------------------------------------------------------------------------------------
// Which paths this CPU runs, and which one `linear` takes.

// The best path compiled in that this CPU (and its OS: __builtin_cpu_supports checks XGETBV) runs;
// every path below it runs too (AVX-512F CPUs have AVX2 and FMA).
Isa detect_best_isa() {
#if SF_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kPortable;
}

Isa cpu_best_isa() {
  static const Isa best = detect_best_isa();
  return best;
}

// The path `linear` and `linear_f32` take: the best until set_isa caps it.
std::atomic<int>& active() {
  static std::atomic<int> isa{cpu_best_isa()};
  return isa;
}

Isa parse_isa(const std::string& name) {
  int i = 0;
  while (i < kNumIsas && name != kIsaNames[i]) ++i;
  TORCH_CHECK(i < kNumIsas, "unknown CPU kernel path '", name, "': expected avx512, avx2 or portable");
  return static_cast<Isa>(i);
}

// AMD's hardware prefetcher streams fp32 weights best alone (see SF_PF_AMD_F32).
bool cpu_is_amd() {
#if SF_X86
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd");
  }();
  return amd;
#else
  return false;
#endif
}

using TileFn = void (*)(const Args&, int64_t, int64_t);

template <int MT, typename W>
TileFn pick_tile(Isa isa) {
#if SF_X86
  bool from_avx512 = false;  // AVX-512's own fp32-arithmetic tile, in AVX2 code (see SF_AMD_AVX2_ROWS)
  if constexpr (MT <= SF_AMD_AVX2_ROWS) {
    if (isa == kAvx512 && cpu_is_amd()) isa = kAvx2, from_avx512 = true;
  }
  if (isa == kAvx512) {
    constexpr int KU = MT == 1 ? SF_KU1 : MT == 2 ? SF_KU2 : 1;
    if (sizeof(W) == 4 && cpu_is_amd()) return &tile_avx512<MT, KU, W, SF_PF_AMD_F32>;
    return &tile_avx512<MT, KU, W>;
  }
  if constexpr (MT <= 6) {  // see max_tile_rows
    if (isa == kAvx2 && sizeof(W) == 1 && !from_avx512) return &tile_avx2_int<MT>;  // int8: integer dots
    if (isa == kAvx2) {
      if constexpr (MT == 1) return &tile_avx2<1, SF_A2_KU1, W>;
      else if constexpr (MT == 2 || (MT == 3 && SF_A2_FULL3 && sizeof(W) == 4)) return &tile_avx2<MT, 1, W>;
      else if constexpr (MT == 3) return &tile_avx2_halves<3, 2, W>;  // 2 k-steps: 12 FMA chains, not 6
      else return &tile_avx2_halves<MT, 1, W>;
    }
  }
#endif
  (void)isa;
  return &tile_portable<MT, W>;
}

template <typename W>
TileFn tile_for(int mt, Isa isa) {
  switch (mt) {
    case 1: return pick_tile<1, W>(isa);
    case 2: return pick_tile<2, W>(isa);
    case 3: return pick_tile<3, W>(isa);
    case 4: return pick_tile<4, W>(isa);
    case 5: return pick_tile<5, W>(isa);
    case 6: return pick_tile<6, W>(isa);
    case 7: return pick_tile<7, W>(isa);
    case 8: return pick_tile<8, W>(isa);
    case 9: return pick_tile<9, W>(isa);
    case 10: return pick_tile<10, W>(isa);
    case 11: return pick_tile<11, W>(isa);
    default: return pick_tile<12, W>(isa);
  }
}

}  // namespace

void gemm(const Args& a, bool int8, Isa isa) {
  if (a.M == 0 || a.N == 0 || a.K == 0) return;  // callers handle empty shapes
  // Row tiles of near-equal size, at most max_tile_rows each (AVX-512: 16 -> 8 + 8, 13 -> 7 + 6).
  const int64_t M = a.M, K = a.K;
  const int64_t max_mt = max_tile_rows(isa);
  const int64_t n_mtiles = (M + max_mt - 1) / max_mt;
  const int64_t mt_small = M / n_mtiles, n_big = M % n_mtiles;  // n_big tiles get one more row
  const int64_t nblk = (a.N + NB - 1) / NB;
  // Enough work per task to be worth a thread: ~32 KiB of weights at one row.
  const int64_t bytes_per_blk = K * NB * (int8 ? 1 : 4);
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / std::max<int64_t>(1, bytes_per_blk) / std::max<int64_t>(1, M / 4 + 1));
  const TileFn f_big = int8 ? tile_for<int8_t>(static_cast<int>(mt_small + 1), isa)
                            : tile_for<float>(static_cast<int>(mt_small + 1), isa);
  const TileFn f_small = int8 ? tile_for<int8_t>(static_cast<int>(mt_small), isa)
                              : tile_for<float>(static_cast<int>(mt_small), isa);
  QArgs qa{a, QuantX{}};
#if SF_X86
  if (int8 && isa == kAvx2) {  // the integer tiles read x quantized (tile_avx2_int)
    thread_local std::vector<int16_t> q;
    thread_local std::vector<float> s;
    const int64_t ldq = (K + 1) / 2 * 2, lds = (K + KQ - 1) / KQ;
    q.resize(static_cast<size_t>(M * ldq));
    s.resize(static_cast<size_t>(M * lds));
    quantize_rows(a.x, a.ldx, M, K, q.data(), ldq, s.data(), lds);
    qa.xq = QuantX{q.data(), ldq, s.data(), lds};
  }
#endif
  at::parallel_for(0, nblk, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t m0 = 0;
      for (int64_t t = 0; t < n_mtiles; ++t) {
        const bool big = t < n_big;
        (big ? f_big : f_small)(qa, m0, b);
        m0 += big ? mt_small + 1 : mt_small;
      }
    }
  });
}

namespace {

// x: [..., K] of any floating dtype (computed in fp32; y comes back in x's dtype). Packed weight
// [N_pad/32, K, 32] int8 (then scales [N], any floating dtype) or fp32 (then no scales, N given).
at::Tensor linear_impl(const at::Tensor& x_in, const at::Tensor& w_, const at::Tensor* scales_, int64_t N,
                       const std::optional<at::Tensor>& bias_, Isa isa) {
  const bool int8 = w_.scalar_type() == at::kChar;
  TORCH_CHECK(x_in.device().is_cpu() && w_.device().is_cpu(), "specfleet_int8::linear: CPU tensors only");
  TORCH_CHECK(x_in.dim() >= 1 && at::isFloatingType(x_in.scalar_type()), "x must be a floating tensor [..., K]");
  TORCH_CHECK(w_.dim() == 3 && w_.size(2) == NB && (int8 || w_.scalar_type() == at::kFloat),
              "w must be int8 or fp32 packed as [N_pad/32, K, 32]");
  at::Tensor scales;
  if (int8) {
    TORCH_CHECK(scales_ && scales_->dim() == 1 && at::isFloatingType(scales_->scalar_type()),
                "scales must be a floating [N]");
    N = scales_->size(0);
    scales = scales_->to(at::kFloat).contiguous();
  }
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(w_.size(1) == K, "x has ", K, " features, the weight ", w_.size(1));
  TORCH_CHECK(N >= 0 && (N + NB - 1) / NB == w_.size(0), "weight blocks (", w_.size(0), ") do not match N=", N);
  const at::ScalarType out_dtype = x_in.scalar_type();
  at::Tensor x = x_in.dim() == 2 ? x_in : x_in.reshape({-1, K});
  if (x.scalar_type() != at::kFloat) x = x.to(at::kFloat);
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t M = x.size(0);
  const at::Tensor w = w_.contiguous();
  at::Tensor bias;
  if (bias_.has_value() && bias_->defined()) {
    bias = bias_->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == N, "bias must be [N]");
  }
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  auto finish = [&](const at::Tensor& t) {
    at::Tensor r = out_dtype == at::kFloat ? t : t.to(out_dtype);
    return x_in.dim() == 2 ? r : r.view(out_shape);
  };
  if (M == 0 || N == 0) return finish(y);
  if (K == 0) {
    if (bias.defined()) y.copy_(bias.unsqueeze(0).expand({M, N}));
    else y.zero_();
    return finish(y);
  }
  Args a{x.data_ptr<float>(), x.stride(0), w.data_ptr(), int8 ? scales.data_ptr<float>() : nullptr,
         bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>(), N, M, N, K};
  gemm(a, int8, isa);
  return finish(y);
}

Isa runnable(const std::string& name) {
  const Isa isa = parse_isa(name);
  TORCH_CHECK(isa <= cpu_best_isa(), "this CPU cannot run the ", name, " kernel path (it runs ",
              kIsaNames[cpu_best_isa()], " at best)");
  return isa;
}

}  // namespace

Isa active_path() { return static_cast<Isa>(active().load(std::memory_order_relaxed)); }

namespace {


at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kChar, "linear: w must be int8 (linear_f32 takes fp32 weights)");
  return linear_impl(x, w, &scales, 0, bias, active_path());
}

at::Tensor linear_isa(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                      const std::optional<at::Tensor>& bias, std::string isa) {
  TORCH_CHECK(w.scalar_type() == at::kChar, "linear_isa: w must be int8 (linear_f32_isa takes fp32 weights)");
  return linear_impl(x, w, &scales, 0, bias, runnable(isa));
}

// y = x @ W^T (+ bias) with W fp32, packed like the int8 weights: the same few-row streaming for
// full-precision models, where MKL's GEMM costs 1.5x more at 5 rows than at one.
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kFloat, "linear_f32: w must be fp32");
  return linear_impl(x, w, nullptr, n, bias, active_path());
}

at::Tensor linear_f32_isa(const at::Tensor& x, const at::Tensor& w, int64_t n, const std::optional<at::Tensor>& bias,
                          std::string isa) {
  TORCH_CHECK(w.scalar_type() == at::kFloat, "linear_f32_isa: w must be fp32");
  return linear_impl(x, w, nullptr, n, bias, runnable(isa));
}

std::vector<std::string> cpu_isas() {
  std::vector<std::string> out;
  for (int i = cpu_best_isa(); i >= 0; --i) out.emplace_back(kIsaNames[i]);
  return out;
}

std::string active_isa() { return kIsaNames[active_path()]; }

std::string set_isa(std::string cap) {
  active().store(std::min(parse_isa(cap), cpu_best_isa()));
  return active_isa();
}

}  // namespace
}  // namespace specfleet

using namespace specfleet;

TORCH_LIBRARY(SF_NS, m) {
  m.def("linear(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor", &linear);
  m.def("linear_f32(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor", &linear_f32);
  m.def("linear_isa(Tensor x, Tensor w, Tensor scales, Tensor? bias, str isa) -> Tensor", &linear_isa);
  m.def("linear_f32_isa(Tensor x, Tensor w, int n, Tensor? bias, str isa) -> Tensor", &linear_f32_isa);
  m.def("cpu_isas() -> str[]", &cpu_isas);
  m.def("active_isa() -> str", &active_isa);
  m.def("set_isa(str cap) -> str", &set_isa);
}
