// y[M, N] = (x[M, K] @ Wq[N, K]^T) * scale[N] (+ bias[N]) for float activations and int8 weights,
// tuned for decoding and draft verification (M = 1..16 rows): each weight byte is read once for
// all the rows, converted to fp32 in registers, and accumulated in fp32.
//
// Weight layout ("packed"): int8 [N_pad / 32, K, 32]. Block b holds output channels 32b..32b+31;
// for each k its 32 weights are contiguous, so one 64-byte cache line feeds 2 k-steps of 32 lanes
// and a thread's share of the weight (whole blocks, split by at::parallel_for) is one sequential
// stream. Channels past N are zero. Larger M (prefill) is cut into tiles of at most 12 rows
// that re-read a block from L1/L2, which keeps it about as fast as MKL's fp32 GEMM.
//
// The same loops serve fp32 weights (packed alike, no scales): MKL's fp32 GEMM costs about 1.5x
// more at 5 rows than at 1, this about 1.1x, which is what makes verifying a draft cheap.
//
// Built by worker/specfleet_worker/quant.py (-O3 -march=native -fopenmp) and registered as ops:
//   specfleet_int8::linear(x[..., K], w_packed, scales[N], bias[N]?) -> y[..., N] in x's dtype
//   specfleet_int8::linear_portable(...)  the same through the plain-C++ loops (what a CPU
//                                         without AVX-512 runs; tests compare the two)
//   specfleet_int8::linear_f32(x, w_packed_fp32, n, bias?) and linear_f32_portable: fp32 weights
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "build with -fopenmp: at::parallel_for runs serially without it"
#endif

// Tuning knobs (defaults measured on an Ice Lake Xeon; -D to override when experimenting):
//   SF_PF    prefetch distance in k-steps of 32 bytes (128: 4 KiB ahead; 0 disables)
//   SF_HINT  prefetch hint
//   SF_KU1/SF_KU2  independent accumulator sets for 1- and 2-row tiles (FMA latency hiding)
//   SF_NS    the torch.ops namespace
#ifndef SF_PF
#define SF_PF 128
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
#ifndef SF_PRO
#define SF_PRO 1
#endif
#ifndef SF_NS
#define SF_NS specfleet_int8
#endif

namespace {

constexpr int64_t NB = 32;    // output channels per block
constexpr int MAX_MT = 12;    // rows per register tile (2 * MT accumulators + 2 weight vectors)

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

// ---------------------------------------------------------------------------------------------
#ifdef __AVX512F__
static inline __m512 load_w16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline __m512 load_w16(const float* p) { return _mm512_loadu_ps(p); }

// One register tile: MT rows x 32 channels over the whole K. With few rows the FMA chains are too
// short to hide the FMA latency, so KU k-steps go to separate accumulators (summed at the end).
template <int MT, int KU, typename W>
void tile_avx512(const Args& a, int64_t m0, int64_t blk) {
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
#if SF_PF > 0
      if constexpr (sizeof(W) == 1) {
        if (KU == 1 || u % 2 == 0)  // one prefetch per 64-byte line (2 k-steps)
          _mm_prefetch(reinterpret_cast<const char*>(w + (k + u + SF_PF) * NB), SF_HINT);
      } else {  // the same distance in bytes; a k-step spans NB * sizeof(W) / 64 lines
        const char* p = reinterpret_cast<const char*>(w + (k + u) * NB) + SF_PF * NB;
        for (int l = 0; l < static_cast<int>(NB * sizeof(W) / 64); ++l) _mm_prefetch(p + 64 * l, SF_HINT);
      }
#endif
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
#endif

using TileFn = void (*)(const Args&, int64_t, int64_t);

template <int MT, typename W>
TileFn pick_tile(bool portable) {
#ifdef __AVX512F__
  if (!portable) return MT <= 2 ? &tile_avx512<MT, (MT == 1 ? SF_KU1 : SF_KU2), W> : &tile_avx512<MT, 1, W>;
#endif
  (void)portable;
  return &tile_portable<MT, W>;
}

template <typename W>
TileFn tile_for(int mt, bool portable) {
  switch (mt) {
    case 1: return pick_tile<1, W>(portable);
    case 2: return pick_tile<2, W>(portable);
    case 3: return pick_tile<3, W>(portable);
    case 4: return pick_tile<4, W>(portable);
    case 5: return pick_tile<5, W>(portable);
    case 6: return pick_tile<6, W>(portable);
    case 7: return pick_tile<7, W>(portable);
    case 8: return pick_tile<8, W>(portable);
    case 9: return pick_tile<9, W>(portable);
    case 10: return pick_tile<10, W>(portable);
    case 11: return pick_tile<11, W>(portable);
    default: return pick_tile<12, W>(portable);
  }
}

// x: [..., K] of any floating dtype (computed in fp32; y comes back in x's dtype). Packed weight
// [N_pad/32, K, 32] int8 (then scales [N], any floating dtype) or fp32 (then no scales, N given).
at::Tensor linear_impl(const at::Tensor& x_in, const at::Tensor& w_, const at::Tensor* scales_, int64_t N,
                       const std::optional<at::Tensor>& bias_, bool portable) {
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

  // Row tiles of near-equal size, at most MAX_MT rows each (16 -> 8 + 8, 13 -> 7 + 6).
  const int64_t n_mtiles = (M + MAX_MT - 1) / MAX_MT;
  const int64_t mt_small = M / n_mtiles, n_big = M % n_mtiles;  // n_big tiles get one more row
  const int64_t nblk = w.size(0);
  // Enough work per task to be worth a thread: ~32 KiB of weights at one row.
  const int64_t bytes_per_blk = K * NB * static_cast<int64_t>(w.element_size());
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / std::max<int64_t>(1, bytes_per_blk) / std::max<int64_t>(1, M / 4 + 1));
  const TileFn f_big = int8 ? tile_for<int8_t>(static_cast<int>(mt_small + 1), portable)
                            : tile_for<float>(static_cast<int>(mt_small + 1), portable);
  const TileFn f_small = int8 ? tile_for<int8_t>(static_cast<int>(mt_small), portable)
                              : tile_for<float>(static_cast<int>(mt_small), portable);
  at::parallel_for(0, nblk, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t m0 = 0;
      for (int64_t t = 0; t < n_mtiles; ++t) {
        const bool big = t < n_big;
        (big ? f_big : f_small)(a, m0, b);
        m0 += big ? mt_small + 1 : mt_small;
      }
    }
  });
  return finish(y);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kChar, "linear: w must be int8 (linear_f32 takes fp32 weights)");
  return linear_impl(x, w, &scales, 0, bias, false);
}

at::Tensor linear_portable(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kChar, "linear_portable: w must be int8");
  return linear_impl(x, w, &scales, 0, bias, true);
}

// y = x @ W^T (+ bias) with W fp32, packed like the int8 weights: the same few-row streaming for
// full-precision models, where MKL's GEMM costs 1.5x more at 5 rows than at one.
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kFloat, "linear_f32: w must be fp32");
  return linear_impl(x, w, nullptr, n, bias, false);
}

at::Tensor linear_f32_portable(const at::Tensor& x, const at::Tensor& w, int64_t n,
                               const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kFloat, "linear_f32_portable: w must be fp32");
  return linear_impl(x, w, nullptr, n, bias, true);
}

bool has_avx512() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(SF_NS, m) {
  m.def("linear(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor", &linear);
  m.def("linear_portable(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor", &linear_portable);
  m.def("linear_f32(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor", &linear_f32);
  m.def("linear_f32_portable(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor", &linear_f32_portable);
  m.def("has_avx512() -> bool", &has_avx512);
}
