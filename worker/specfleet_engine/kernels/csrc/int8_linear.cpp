// y[M, N] = (x[M, K] @ Wq[N, K]^T) * scale[N] (+ bias[N]) for float activations and int8 weights,
// tuned for decoding and draft verification (M = 1..16 rows): each weight byte is read once for
// all the rows, and multiplied in registers by integer dot-product instructions.
//
// int8 weights ("packed"): [N_pad / 32, K4, 32, 4], K4 = ceil(K / 4). Block b holds output
// channels 32b..32b+31; for each group of 4 k-steps, channel c's 4 weights are 4 adjacent bytes,
// one 32-bit lane of a vector (what vpdpbusd and vpmaddwd sum), and the group's 32 channels are
// 128 contiguous bytes (two cache lines: channels 0-15, 16-31), so a thread's share of the weight
// (whole blocks, split by at::parallel_for) is one sequential stream. Channels past N and k-steps
// past K are zero.
//
// Activations are quantized per row like llama.cpp's Q8_0 (`quantize_rows`): per block of 32
// k-steps, d = max |x| / 127, q = round-to-nearest-even(x * (1 / d)) in [-127, 127]. A tile sums
// q[m, k] * w[k, n] over a block exactly in int32, converts that sum to fp32 once and adds it
// times d (y_acc = fma(sum, d, y_acc), blocks in order); y = fma(y_acc, scale[n], bias[n]) at the
// end. Integer sums are exact in any order, and every float step is the same for a row whatever
// else is in the call, so every path gives the same bits, and a row's result never depends on
// which rows share its call (greedy speculative decoding stays token-identical to plain). The
// rounding (at most 1/254 of a block's max |x| a value) is what this costs: SmolLM2-135M's int8
// greedy agreement with fp32, teacher-forced on 26 Spec-Bench answers, went from 0.982 (fp32
// activations) to 0.976.
//
// The same loops serve fp32 weights, packed [N_pad / 32, K, 32] (a k-step's 32 weights side by
// side, no scales) and multiplied in fp32 with FMAs: MKL's fp32 GEMM costs about 1.5x more at 5
// rows than at 1, this about 1.1x, which is what makes verifying a draft cheap.
//
// Five paths ("ISAs"), best first; the library holds every one its compiler can emit, whatever
// -march says, because each tile carries its own target attribute:
//   avx512vnni  AVX-512 VNNI: vpdpbusd on zmm, 16 channels x 4 k-steps an instruction. vpdpbusd
//               multiplies unsigned by signed bytes, so the weights go in as u8 = w + 128 (one
//               XOR for all the rows) and each block's sum starts at -128 * sum(q) (a scalar a row
//               and block, from `quantize_rows`) instead of 0. fp32 weights: the avx512 tiles.
//   avx512      AVX-512F + BW: vpmaddwd on zmm (see avx2); fp32 weights: FMA tiles of up to 12
//               rows (a block's 32 channels as two __m512).
//   avxvnni     AVX-VNNI (Alder Lake, Sapphire Rapids, Zen 5): vpdpbusd on ymm (VEX), as
//               avx512vnni; fp32 weights: the avx2 tiles.
//   avx2        AVX2 + FMA: vpmaddubsw saturates at int16, so these tiles multiply int16 instead:
//               a group's 4 bytes a lane split into (w0, w2) and (w1, w3) int16 pairs by two
//               shifts (for all the rows), and two vpmaddwd a row against (q0, q2) and (q1, q3):
//               exact, and one multiply uop per 16 products, fewer than the sign trick's
//               vpsignb + vpmaddubsw + vpmaddwd. fp32 weights: FMA tiles of 1-2 rows x 32
//               channels or 3-6 rows x 16. Where -march allows AVX-512 too, the compiler may
//               encode these as EVEX: the same operations.
//   portable    plain loops the compiler vectorizes for -march=native (any CPU, any architecture)
// An int8 tile holds MT rows x NV vectors of channels, its int32 and fp32 sums in registers, and
// takes the block's 32 channels in 32 / (NV x lanes) passes over the whole K (the first streams
// the block's weights, a later one finds its lines in L1 or L2): up to 12 rows on zmm, 6 on ymm.
// `linear` / `linear_f32` run the active path: at load, the best the CPU runs
// (__builtin_cpu_supports); set_isa(cap) makes it the best the CPU runs at or below cap
// (cpu_gemm.py does, from SPECFLEET_CPU_ISA). The *_isa ops run a named path, for tests and
// benchmarks.
//
// Built by worker/specfleet_engine/kernels/cpu_gemm.py (-O3 -march=native -fopenmp) and
// registered as ops:
//   specfleet_int8::linear(x[..., K], w_packed, scales[N], bias[N]?) -> y[..., N] in x's dtype
//   specfleet_int8::linear_f32(x, w_packed_fp32, n, bias?)        fp32 weights, the same loops
//   specfleet_int8::linear_isa(x, w, scales, bias?, isa), linear_f32_isa(x, w, n, bias?, isa)
//   specfleet_int8::cpu_isas() -> str[]     the paths this CPU can run, best first
//   specfleet_int8::active_isa() -> str     the path linear and linear_f32 run
//   specfleet_int8::set_isa(cap) -> str     make it the best the CPU runs, at most cap
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "cpu_gemm.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
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
// AVX2's on an AMD EPYC (Zen 3), the int8 tiles' on a Sapphire Rapids Xeon:
//   SF_PF            prefetch distance in k-steps of 32 int8 weights (128: 4 KiB ahead; fp32
//                    and the int8 layout's groups the same distance in bytes; 0: none)
//   SF_A2_PF         AVX2, fp32 tiles of whole blocks: 0, the hardware prefetcher alone streamed
//                    ~10% faster
//   SF_A2_PF_HALF    AVX2, fp32 half-block tiles (3-6 rows): 64, 10-25% faster than none (their
//                    passes go back and forth a chunk)
//   SF_PF_AMD_F32    AVX-512 on an AMD CPU, fp32 weights: 0, the hardware prefetcher alone
//                    streamed them 8-13% faster (1 and 5 rows, an EPYC with AVX-512, one thread)
//   SF_AMD_AVX2_ROWS AVX-512 on an AMD CPU, fp32 weights: tiles of at most this many rows run the
//                    AVX2 code (Zen 4 splits each 512-bit op in two): 1, 5% faster for one row;
//                    from 3 rows AVX-512's larger tiles win (1.5-2x at 5-8). int8 tiles keep
//                    their path: one zmm vpdpbusd does what takes AVX2 four ops
//   SF_HINT          prefetch hint
//   SF_KU1/SF_KU2    AVX-512 fp32: independent accumulator sets for 1- and 2-row tiles (FMA latency)
//   SF_A2_KU1        AVX2 fp32: the same for 1-row tiles (2 sets of 4 accumulators = 8 FMA chains)
//   SF_A2_CHUNK      AVX2 fp32: bytes of a block's weights that half-block tiles take at a time
//                    (both halves of it, the second from L1)
//   SF_A2_FULL3      AVX2 fp32: 3 rows in one whole-block tile (one accumulator spills, but the
//                    weights stream once: ~10% faster than halves)
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
#define SF_TARGET_AVX512BW __attribute__((target("avx512f,avx512bw,avx2,fma")))
#define SF_TARGET_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma")))
#define SF_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define SF_TARGET_AVXVNNI __attribute__((target("avxvnni,avx2,fma")))
#endif

namespace specfleet {
namespace {

constexpr int64_t NB = 32;       // output channels per block
constexpr int64_t KG = 4;        // int8 weights: k-steps a group (the bytes of a 32-bit lane)
constexpr int64_t GBYTES = NB * KG;  // bytes of a block's group
constexpr int64_t QK = 32;       // k-steps of an activation block (one scale)
constexpr int64_t QG = QK / KG;  // groups of an activation block

// Rows per register tile, at most, fp32 and int8 alike. fp32: AVX-512 2 * MT accumulators + 2
// weight vectors of 32 registers; AVX2 2 * MT (half blocks) of 16. int8: see each tile; the
// portable loops keep theirs in L1.
constexpr int max_tile_rows(Isa isa) { return isa == kAvx2 || isa == kAvxVnni ? 6 : 12; }

// The int8 tiles' activations: x quantized per row and block of QK k-steps (`quantize_rows`).
struct QuantX {
  const int8_t* q;     // [M, ldq], ldq = 4 * K4: the pad zero
  const int16_t* q16;  // [M, ldq]: q as int16, each group's 4 reordered (q0, q2, q1, q3) for vpmaddwd
  int64_t ldq;
  const float* d;      // [M, nqb]: each block's scale
  const int32_t* c;    // [M, nqb]: -128 * the sum of the block's q (vpdpbusd's u8 offset)
  int64_t nqb;         // ceil(K / QK)
};

struct QArgs : Args {
  QuantX xq;
};

// max |x[i]| over n <= QK values, in 16 lanes (a serial max is a chain of n dependent ops, and
// was half of the quantization's time). The order does not matter: max is exact. A NaN wins, so
// that the block's scale is NaN and so is every output of the row, as in fp32.
inline float abs_max(const float* x, int64_t n) {
  typedef float v16f __attribute__((vector_size(64)));
  v16f acc = {};
  for (int64_t i = 0; i + 16 <= n; i += 16) {
    v16f v;
    std::memcpy(&v, x + i, sizeof v);
    v = v < 0 ? -v : v;
    acc = (acc < v) | (v != v) ? v : acc;
  }
  float r = 0.f;
  for (int j = 0; j < 16; ++j) r = r < acc[j] || acc[j] != acc[j] ? acc[j] : r;
  for (int64_t i = n / 16 * 16; i < n; ++i) r = r < std::fabs(x[i]) || x[i] != x[i] ? std::fabs(x[i]) : r;
  return r;
}

// x [M, K] (row stride ldx) -> QuantX's arrays: the same for a row whatever M is.
void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, int16_t* q16, int64_t ldq,
                   float* d, int32_t* c, int64_t nqb) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    int8_t* qr = q + m * ldq;
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += QK, ++b) {
      const int64_t k1 = std::min(K, k0 + QK);
      const float amax = abs_max(xr + k0, k1 - k0);
      const float db = amax / 127.f;
      const float inv = db > 0.f && db <= FLT_MAX ? 1.f / db : 0.f;  // q = 0 where d is 0, inf or NaN
      int32_t sum = 0;
      for (int64_t k = k0; k < k1; ++k) {
        const float t = xr[k] * inv;  // NaN only where x is not finite
        const int v = t == t ? static_cast<int>(std::nearbyint(t)) : 0;
        qr[k] = static_cast<int8_t>(v);
        sum += v;
      }
      d[m * nqb + b] = db;
      c[m * nqb + b] = -128 * sum;
    }
    for (int64_t k = K; k < ldq; ++k) qr[k] = 0;
    int16_t* q16r = q16 + m * ldq;
    for (int64_t k = 0; k < ldq; k += KG) {
      q16r[k] = qr[k];
      q16r[k + 1] = qr[k + 2];
      q16r[k + 2] = qr[k + 1];
      q16r[k + 3] = qr[k + 3];
    }
  }
}

// y[m0 + m, n0 + j] = fma(f[m][j], scale, bias) for the block's nc channels: the int8 tiles' last
// step, the same plain code for every path.
template <int MT>
inline void store_int8_rows(const Args& a, int64_t m0, int64_t blk, const float (&f)[MT][NB]) {
  const int64_t n0 = blk * NB, nc = std::min<int64_t>(NB, a.N - n0);
  const float* s = a.scale + n0;
  for (int m = 0; m < MT; ++m) {
    float* y = a.y + (m0 + m) * a.ldy + n0;
    if (a.bias)
      for (int64_t j = 0; j < nc; ++j) y[j] = std::fma(f[m][j], s[j], a.bias[n0 + j]);
    else
      for (int64_t j = 0; j < nc; ++j) y[j] = std::fma(f[m][j], s[j], 0.f);
  }
}

// ---------------------------------------------------------------------------------------------
// Portable path: plain loops the compiler vectorizes (-O3 -march=native).
template <int MT>
void tile_portable(const Args& a, int64_t m0, int64_t blk) {
  float acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = 0.f;
  const float* w = static_cast<const float*>(a.w) + blk * a.K * NB;
  const float* x = a.x + m0 * a.ldx;
  for (int64_t k = 0; k < a.K; ++k) {
    for (int m = 0; m < MT; ++m) {
      const float xv = x[m * a.ldx + k];
      for (int j = 0; j < NB; ++j) acc[m][j] += xv * w[k * NB + j];
    }
  }
  const int64_t n0 = blk * NB, nc = std::min<int64_t>(NB, a.N - n0);
  for (int m = 0; m < MT; ++m) {
    float* y = a.y + (m0 + m) * a.ldy + n0;
    for (int64_t j = 0; j < nc; ++j) y[j] = acc[m][j] + (a.bias ? a.bias[n0 + j] : 0.f);
  }
}

// The int8 layout in plain loops: each block's int32 sums, then the same float steps as the SIMD
// tiles (std::fma: one rounding, as their FMAs).
template <int MT>
void tile_portable_int8(const Args& a_, int64_t m0, int64_t blk) {
  const QArgs& a = static_cast<const QArgs&>(a_);
  const int64_t K4 = (a.K + KG - 1) / KG;
  const int8_t* w = static_cast<const int8_t*>(a.w) + blk * K4 * GBYTES;
  const int8_t* xq = a.xq.q + m0 * a.xq.ldq;
  float f[MT][NB] = {};
  for (int64_t b = 0; b < a.xq.nqb; ++b) {
    int32_t acc[MT][NB] = {};
    for (int64_t g = b * QG; g < std::min(K4, (b + 1) * QG); ++g) {
      const int8_t* wg = w + g * GBYTES;
      for (int m = 0; m < MT; ++m) {
        const int8_t* xg = xq + m * a.xq.ldq + g * KG;
        for (int j = 0; j < NB; ++j)
          for (int i = 0; i < KG; ++i) acc[m][j] += static_cast<int32_t>(wg[j * KG + i]) * xg[i];
      }
    }
    for (int m = 0; m < MT; ++m) {
      const float db = a.xq.d[(m0 + m) * a.xq.nqb + b];
      for (int j = 0; j < NB; ++j) f[m][j] = std::fma(static_cast<float>(acc[m][j]), db, f[m][j]);
    }
  }
  store_int8_rows<MT>(a, m0, blk, f);
}

#if SF_X86
// Prefetch PF k-steps of int8 weights (PF * 32 bytes) ahead of k-step `k`, one call per k-step;
// fp32 weights the same distance in bytes (a k-step spans NB * 4 / 64 lines); PF = 0: none.
template <int PF, typename W>
static inline void prefetch_ahead(const W* w, int64_t k) {
  if constexpr (PF > 0) {
    const char* p = reinterpret_cast<const char*>(w + k * NB) + PF * NB;
    for (int l = 0; l < static_cast<int>(NB * sizeof(W) / 64); ++l) _mm_prefetch(p + 64 * l, SF_HINT);
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 fp32 tiles (the avx512 and avx512vnni paths' fp32 weights).
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
// AVX2 + FMA fp32 tiles (the avx2 and avxvnni paths' fp32 weights): a block's 32 channels are four
// 8-lane vectors, and the 16 ymm registers hold KU * MT * NV accumulators, the NV weight vectors
// of a k-step and a broadcast x. One or two rows take all four vectors at once (one row: KU = 2
// k-steps in flight, 8 FMA chains, what 2 FMA pipes x 4 cycles of latency need). Three to six
// rows take the block in two halves of 16 channels, one pass each, a 4 KiB chunk of the block at
// a time, so that the second half reads it from L1.
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
  const int64_t chunk = SF_A2_CHUNK / static_cast<int64_t>(NB * sizeof(W));  // k-steps a pass covers
  for (int64_t k0 = 0; k0 < a.K; k0 += chunk) {
    const int64_t kn = std::min<int64_t>(chunk, a.K - k0);
    for (int h = 0; h < halves; ++h)
      fma_avx2<MT, 2, KU, SF_A2_PF_HALF>(w + k0 * NB + 16 * h, x + k0, a.ldx, kn, acc[h]);
  }
  for (int h = 0; h < halves; ++h) store_avx2<MT, 2>(a, m0, n0 + 16 * h, std::min<int64_t>(16, nc - 16 * h), acc[h]);
}

// ---------------------------------------------------------------------------------------------
// int8 tiles: MT rows x NV vectors of channels, in NB / (NV * lanes) passes over the whole K (the
// first pass streams the block's weights, later ones find them in L1 or L2). For each block of QK
// k-steps a row's int32 sums start at its offset (VNNI) or at zero and take the block's groups;
// then f = fma(float(sum), d, f). Accumulators and f stay in registers (2 * MT * NV of them; a
// store per block would cost as much as the block's dot products), which bounds MT * NV; every
// loop over m and v is unrolled for it.

constexpr int64_t kPfGroups = SF_PF * 32 / GBYTES;  // SF_PF's distance, in groups

static inline int32_t load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A group's two cache lines, kPfGroups ahead.
static inline void prefetch_group(const int8_t* w, int64_t g) {
  if constexpr (kPfGroups > 0) {
    const char* p = reinterpret_cast<const char*>(w + (g + kPfGroups) * GBYTES);
    _mm_prefetch(p, SF_HINT);
    _mm_prefetch(p + 64, SF_HINT);
  }
}

// acc += vpdpbusd(w as u8, x as s8): in asm, because GCC 12 copies the accumulator of each
// intrinsic call twice a step (register moves and spills: the 8-row tile ran at a third of its
// rate). x[0..3] comes as a broadcast memory operand on zmm, in a register on ymm (VEX has none).
SF_TARGET_AVX512VNNI static inline __m512i dpbusd(__m512i acc, __m512i w, const int8_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}
SF_TARGET_AVXVNNI static inline __m256i dpbusd(__m256i acc, __m256i w, __m256i x) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x));
  return acc;
}

// acc += t, in place (asm for the reason dpbusd's is: GCC adds into a new register, then copies it
// back, one move an accumulator a step).
SF_TARGET_AVX512BW static inline __m512i add_into(__m512i acc, __m512i t) {
  asm("vpaddd %1, %0, %0" : "+v"(acc) : "v"(t));
  return acc;
}
SF_TARGET_AVX2 static inline __m256i add_into(__m256i acc, __m256i t) {
  asm("vpaddd %1, %0, %0" : "+v"(acc) : "v"(t));
  return acc;
}

// vpmaddwd on a group's 4 bytes a lane: (w0, w2) and (w1, w3) as int16 pairs, by shifts (once for
// all the rows), against x's (q0, q2) and (q1, q3) pairs from q16.
SF_TARGET_AVX512BW static inline void split_pairs(__m512i raw, __m512i& even, __m512i& odd) {
  even = _mm512_srai_epi16(_mm512_slli_epi16(raw, 8), 8);
  odd = _mm512_srai_epi16(raw, 8);
}
SF_TARGET_AVX2 static inline void split_pairs(__m256i raw, __m256i& even, __m256i& odd) {
  even = _mm256_srai_epi16(_mm256_slli_epi16(raw, 8), 8);
  odd = _mm256_srai_epi16(raw, 8);
}

// The pointers and sizes every int8 tile starts from.
struct Int8Tile {
  int64_t K4, ldq, nqb;
  const int8_t* w;    // the block's first group
  const int8_t* xq;   // row m0's q
  const int16_t* xw;  // row m0's q16
  const float* d;     // row m0's block scales
  const int32_t* c;   // row m0's block offsets
  Int8Tile(const QArgs& a, int64_t m0, int64_t blk)
      : K4((a.K + KG - 1) / KG), ldq(a.xq.ldq), nqb(a.xq.nqb),
        w(static_cast<const int8_t*>(a.w) + blk * K4 * GBYTES), xq(a.xq.q + m0 * ldq),
        xw(a.xq.q16 + m0 * ldq), d(a.xq.d + m0 * nqb), c(a.xq.c + m0 * nqb) {}
  int64_t group_end(int64_t b) const { return std::min(K4, (b + 1) * QG); }
};

// AVX-512 VNNI: 1-6 rows x 32 channels (one pass), 7-12 rows x 16 (two): 4 * MT * NV <= 24
// registers of 32, the weight vectors and the XOR mask besides.
template <int MT, int NV>
SF_TARGET_AVX512VNNI void tile_vnni512(const Args& a_, int64_t m0, int64_t blk) {
  const QArgs& a = static_cast<const QArgs&>(a_);
  const Int8Tile t(a, m0, blk);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // s8 -> u8 + 128
  alignas(64) float out[MT][NB];
  for (int p = 0; p < 2 / NV; ++p) {
    __m512 f[MT][NV];
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) f[m][v] = _mm512_setzero_ps();
    for (int64_t b = 0; b < t.nqb; ++b) {
      __m512i acc[MT][NV];
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_set1_epi32(t.c[m * t.nqb + b]);
      for (int64_t g = b * QG, g1 = t.group_end(b); g < g1; ++g) {
        if (p == 0) prefetch_group(t.w, g);
        __m512i wv[NV];
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v)
          wv[v] = _mm512_xor_si512(_mm512_loadu_si512(t.w + g * GBYTES + 64 * (p * NV + v)), flip);
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
          for (int v = 0; v < NV; ++v) acc[m][v] = dpbusd(acc[m][v], wv[v], t.xq + m * t.ldq + g * KG);
      }
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) {
        const __m512 dv = _mm512_set1_ps(t.d[m * t.nqb + b]);
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) f[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][v]), dv, f[m][v]);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) _mm512_store_ps(out[m] + 16 * (p * NV + v), f[m][v]);
  }
  store_int8_rows<MT>(a, m0, blk, out);
}

// AVX-VNNI: the same on ymm, where VEX vpdpbusd reaches ymm0-15 only: 1 row x 32 channels (one
// pass), 2-3 rows x 16 (two), 4-6 rows x 8 (four).
template <int MT, int NV>
SF_TARGET_AVXVNNI void tile_vnni256(const Args& a_, int64_t m0, int64_t blk) {
  const QArgs& a = static_cast<const QArgs&>(a_);
  const Int8Tile t(a, m0, blk);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  alignas(64) float out[MT][NB];
  for (int p = 0; p < 4 / NV; ++p) {
    __m256 f[MT][NV];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) f[m][v] = _mm256_setzero_ps();
    for (int64_t b = 0; b < t.nqb; ++b) {
      __m256i acc[MT][NV];
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_set1_epi32(t.c[m * t.nqb + b]);
      for (int64_t g = b * QG, g1 = t.group_end(b); g < g1; ++g) {
        if (p == 0) prefetch_group(t.w, g);
        __m256i wv[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
          wv[v] = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.w + g * GBYTES + 32 * (p * NV + v))), flip);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          const __m256i xv = _mm256_set1_epi32(load32(t.xq + m * t.ldq + g * KG));
#pragma GCC unroll 4
          for (int v = 0; v < NV; ++v) acc[m][v] = dpbusd(acc[m][v], wv[v], xv);
        }
      }
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const __m256 dv = _mm256_set1_ps(t.d[m * t.nqb + b]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) f[m][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][v]), dv, f[m][v]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) _mm256_store_ps(out[m] + 8 * (p * NV + v), f[m][v]);
  }
  store_int8_rows<MT>(a, m0, blk, out);
}

// AVX-512BW: vpmaddwd, shaped as tile_vnni512 (the split pairs take 2 * NV registers more).
template <int MT, int NV>
SF_TARGET_AVX512BW void tile_madd512(const Args& a_, int64_t m0, int64_t blk) {
  const QArgs& a = static_cast<const QArgs&>(a_);
  const Int8Tile t(a, m0, blk);
  alignas(64) float out[MT][NB];
  for (int p = 0; p < 2 / NV; ++p) {
    __m512 f[MT][NV];
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) f[m][v] = _mm512_setzero_ps();
    for (int64_t b = 0; b < t.nqb; ++b) {
      __m512i acc[MT][NV];
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_si512();
      for (int64_t g = b * QG, g1 = t.group_end(b); g < g1; ++g) {
        if (p == 0) prefetch_group(t.w, g);
        __m512i ev[NV], od[NV];
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v)
          split_pairs(_mm512_loadu_si512(t.w + g * GBYTES + 64 * (p * NV + v)), ev[v], od[v]);
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m) {
          const __m512i xe = _mm512_set1_epi32(load32(t.xw + m * t.ldq + g * KG));
          const __m512i xo = _mm512_set1_epi32(load32(t.xw + m * t.ldq + g * KG + 2));
#pragma GCC unroll 2
          for (int v = 0; v < NV; ++v)
            acc[m][v] =
                add_into(acc[m][v], _mm512_add_epi32(_mm512_madd_epi16(ev[v], xe), _mm512_madd_epi16(od[v], xo)));
        }
      }
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) {
        const __m512 dv = _mm512_set1_ps(t.d[m * t.nqb + b]);
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) f[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][v]), dv, f[m][v]);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) _mm512_store_ps(out[m] + 16 * (p * NV + v), f[m][v]);
  }
  store_int8_rows<MT>(a, m0, blk, out);
}

// AVX2: vpmaddwd on ymm, 16 registers: 1 row x 32 channels (one pass), 2 rows x 16 (two), 3-6
// rows x 8 (four).
template <int MT, int NV>
SF_TARGET_AVX2 void tile_madd256(const Args& a_, int64_t m0, int64_t blk) {
  const QArgs& a = static_cast<const QArgs&>(a_);
  const Int8Tile t(a, m0, blk);
  alignas(64) float out[MT][NB];
  for (int p = 0; p < 4 / NV; ++p) {
    __m256 f[MT][NV];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) f[m][v] = _mm256_setzero_ps();
    for (int64_t b = 0; b < t.nqb; ++b) {
      __m256i acc[MT][NV];
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_setzero_si256();
      for (int64_t g = b * QG, g1 = t.group_end(b); g < g1; ++g) {
        if (p == 0) prefetch_group(t.w, g);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
          __m256i ev, od;
          const int8_t* wp = t.w + g * GBYTES + 32 * (p * NV + v);
          split_pairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp)), ev, od);
#pragma GCC unroll 8
          for (int m = 0; m < MT; ++m) {
            const __m256i xe = _mm256_set1_epi32(load32(t.xw + m * t.ldq + g * KG));
            const __m256i xo = _mm256_set1_epi32(load32(t.xw + m * t.ldq + g * KG + 2));
            acc[m][v] = add_into(acc[m][v], _mm256_add_epi32(_mm256_madd_epi16(ev, xe), _mm256_madd_epi16(od, xo)));
          }
        }
      }
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const __m256 dv = _mm256_set1_ps(t.d[m * t.nqb + b]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) f[m][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][v]), dv, f[m][v]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) _mm256_store_ps(out[m] + 8 * (p * NV + v), f[m][v]);
  }
  store_int8_rows<MT>(a, m0, blk, out);
}
#endif  // SF_X86

// ---------------------------------------------------------------------------------------------
// Which paths this CPU runs, and which one `linear` takes.

// Whether this CPU (and its OS: __builtin_cpu_supports checks XGETBV) runs `isa`'s code.
bool detect_runs(Isa isa) {
#if SF_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  switch (isa) {
    case kPortable: return true;
    case kAvx2: return avx2;
    case kAvxVnni: return avx2 && __builtin_cpu_supports("avxvnni");
    case kAvx512: return avx512;
    case kAvx512Vnni: return avx512 && __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
#else
  return isa == kPortable;
#endif
}

bool cpu_runs(Isa isa) {
  static const auto runs = [] {
    std::vector<bool> r(kNumIsas);
    for (int i = 0; i < kNumIsas; ++i) r[i] = detect_runs(static_cast<Isa>(i));
    return r;
  }();
  return runs[isa];
}

// The best path this CPU runs at or below `cap` (portable runs everywhere).
Isa best_at_most(Isa cap) {
  int i = cap;
  while (i > kPortable && !cpu_runs(static_cast<Isa>(i))) --i;
  return static_cast<Isa>(i);
}

// The path `linear` and `linear_f32` take: the best until set_isa caps it.
std::atomic<int>& active() {
  static std::atomic<int> isa{best_at_most(static_cast<Isa>(kNumIsas - 1))};
  return isa;
}

Isa parse_isa(const std::string& name) {
  int i = 0;
  while (i < kNumIsas && name != kIsaNames[i]) ++i;
  TORCH_CHECK(i < kNumIsas, "unknown CPU kernel path '", name,
              "': expected avx512vnni, avx512, avxvnni, avx2 or portable");
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

template <int MT>
TileFn pick_f32_tile(Isa isa) {
#if SF_X86
  isa = isa == kAvx512Vnni ? kAvx512 : isa == kAvxVnni ? kAvx2 : isa;  // VNNI adds nothing to fp32
  if constexpr (MT <= SF_AMD_AVX2_ROWS) {
    if (isa == kAvx512 && cpu_is_amd()) isa = kAvx2;  // see SF_AMD_AVX2_ROWS
  }
  if (isa == kAvx512) {
    constexpr int KU = MT == 1 ? SF_KU1 : MT == 2 ? SF_KU2 : 1;
    if (cpu_is_amd()) return &tile_avx512<MT, KU, float, SF_PF_AMD_F32>;
    return &tile_avx512<MT, KU, float>;
  }
  if constexpr (MT <= 6) {  // see max_tile_rows
    if (isa == kAvx2) {
      if constexpr (MT == 1) return &tile_avx2<1, SF_A2_KU1, float>;
      else if constexpr (MT == 2 || (MT == 3 && SF_A2_FULL3)) return &tile_avx2<MT, 1, float>;
      else if constexpr (MT == 3) return &tile_avx2_halves<3, 2, float>;  // 2 k-steps: 12 FMA chains, not 6
      else return &tile_avx2_halves<MT, 1, float>;
    }
  }
#endif
  (void)isa;
  return &tile_portable<MT>;
}

template <int MT>
TileFn pick_int8_tile(Isa isa) {
#if SF_X86
  constexpr int nv512 = MT <= 6 ? 2 : 1, nv256 = MT == 1 ? 4 : MT <= 3 ? 2 : 1;
  switch (isa) {  // the shapes each tile's comment gives, within max_tile_rows
    case kAvx512Vnni: return &tile_vnni512<MT, nv512>;
    case kAvx512: return &tile_madd512<MT, nv512>;
    case kAvxVnni:
      if constexpr (MT <= 6) return &tile_vnni256<MT, nv256>;
      break;
    case kAvx2:
      if constexpr (MT <= 6) return &tile_madd256<MT, (MT == 1 ? 4 : MT == 2 ? 2 : 1)>;
      break;
    default: break;
  }
#endif
  (void)isa;
  return &tile_portable_int8<MT>;
}

template <int MT>
TileFn pick_tile(Isa isa, bool int8) {
  return int8 ? pick_int8_tile<MT>(isa) : pick_f32_tile<MT>(isa);
}

TileFn tile_for(int mt, Isa isa, bool int8) {
  switch (mt) {
    case 1: return pick_tile<1>(isa, int8);
    case 2: return pick_tile<2>(isa, int8);
    case 3: return pick_tile<3>(isa, int8);
    case 4: return pick_tile<4>(isa, int8);
    case 5: return pick_tile<5>(isa, int8);
    case 6: return pick_tile<6>(isa, int8);
    case 7: return pick_tile<7>(isa, int8);
    case 8: return pick_tile<8>(isa, int8);
    case 9: return pick_tile<9>(isa, int8);
    case 10: return pick_tile<10>(isa, int8);
    case 11: return pick_tile<11>(isa, int8);
    default: return pick_tile<12>(isa, int8);
  }
}

}  // namespace

void gemm(const Args& a, bool int8, Isa isa) {
  if (a.M == 0 || a.N == 0 || a.K == 0) return;  // callers handle empty shapes
  // Row tiles of near-equal size, at most max_tile_rows each (12: 16 -> 8 + 8, 13 -> 7 + 6).
  const int64_t M = a.M, K = a.K;
  const int64_t max_mt = max_tile_rows(isa);
  const int64_t n_mtiles = (M + max_mt - 1) / max_mt;
  const int64_t mt_small = M / n_mtiles, n_big = M % n_mtiles;  // n_big tiles get one more row
  const int64_t nblk = (a.N + NB - 1) / NB;
  // Enough work per task to be worth a thread: ~32 KiB of weights at one row.
  const int64_t bytes_per_blk = int8 ? (K + KG - 1) / KG * GBYTES : K * NB * 4;
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / std::max<int64_t>(1, bytes_per_blk) / std::max<int64_t>(1, M / 4 + 1));
  const TileFn f_big = tile_for(static_cast<int>(mt_small + 1), isa, int8);
  const TileFn f_small = tile_for(static_cast<int>(mt_small), isa, int8);
  QArgs qa{a, QuantX{}};
  if (int8) {  // every int8 tile reads x quantized, the same way on every path
    thread_local std::vector<int8_t> q;
    thread_local std::vector<int16_t> q16;
    thread_local std::vector<float> d;
    thread_local std::vector<int32_t> c;
    const int64_t ldq = (K + KG - 1) / KG * KG, nqb = (K + QK - 1) / QK;
    q.resize(static_cast<size_t>(M * ldq));
    q16.resize(static_cast<size_t>(M * ldq));
    d.resize(static_cast<size_t>(M * nqb));
    c.resize(static_cast<size_t>(M * nqb));
    quantize_rows(a.x, a.ldx, M, K, q.data(), q16.data(), ldq, d.data(), c.data(), nqb);
    qa.xq = QuantX{q.data(), q16.data(), ldq, d.data(), c.data(), nqb};
  }
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
// int8 [N_pad/32, ceil(K/4), 32, 4] (then scales [N], any floating dtype) or fp32
// [N_pad/32, K, 32] (then no scales, N given).
at::Tensor linear_impl(const at::Tensor& x_in, const at::Tensor& w_, const at::Tensor* scales_, int64_t N,
                       const std::optional<at::Tensor>& bias_, Isa isa) {
  const bool int8 = w_.scalar_type() == at::kChar;
  TORCH_CHECK(x_in.device().is_cpu() && w_.device().is_cpu(), "specfleet_int8::linear: CPU tensors only");
  TORCH_CHECK(x_in.dim() >= 1 && at::isFloatingType(x_in.scalar_type()), "x must be a floating tensor [..., K]");
  TORCH_CHECK(int8 ? w_.dim() == 4 && w_.size(2) == NB && w_.size(3) == KG
                   : w_.dim() == 3 && w_.size(2) == NB && w_.scalar_type() == at::kFloat,
              "w must be int8 packed as [N_pad/32, ceil(K/4), 32, 4] or fp32 packed as [N_pad/32, K, 32]");
  at::Tensor scales;
  if (int8) {
    TORCH_CHECK(scales_ && scales_->dim() == 1 && at::isFloatingType(scales_->scalar_type()),
                "scales must be a floating [N]");
    N = scales_->size(0);
    scales = scales_->to(at::kFloat).contiguous();
  }
  const int64_t K = x_in.size(-1);
  // int8: the layout pads K to a multiple of 4, so an x 1-3 features short of the weight's K
  // passes this check (the layers check their in_features)
  TORCH_CHECK(w_.size(1) == (int8 ? (K + KG - 1) / KG : K), "x has ", K, " features, the weight ",
              int8 ? "packs " : "", int8 ? w_.size(1) * KG : w_.size(1), int8 ? " (rounded up to 4)" : "");
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

std::string runnable_list() {
  std::string s;
  for (int i = kNumIsas - 1; i >= 0; --i)
    if (cpu_runs(static_cast<Isa>(i))) s += (s.empty() ? "" : ", ") + std::string(kIsaNames[i]);
  return s;
}

Isa runnable(const std::string& name) {
  const Isa isa = parse_isa(name);
  TORCH_CHECK(cpu_runs(isa), "this CPU cannot run the ", name, " kernel path (it runs ", runnable_list(), ")");
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

// y = x @ W^T (+ bias) with W fp32, packed [N_pad/32, K, 32]: the same few-row streaming for
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
  for (int i = kNumIsas - 1; i >= 0; --i)
    if (cpu_runs(static_cast<Isa>(i))) out.emplace_back(kIsaNames[i]);
  return out;
}

std::string active_isa() { return kIsaNames[active_path()]; }

std::string set_isa(std::string cap) {
  active().store(best_at_most(parse_isa(cap)));
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
