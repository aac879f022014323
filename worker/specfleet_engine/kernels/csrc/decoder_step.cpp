// The decoder layers of a few-row step (decoding, verifying a draft chain or tree) in one call.
//
// At one token a step a 135M model's layer is ~0.7 ms of weight streaming and, run op by op from
// Python, ~0.25 ms of everything else: module calls, a dozen small tensors per layer, RMSNorm and
// RoPE and attention as separate dispatches. Here the whole stack runs in C++ over buffers
// allocated once per call: per layer RMSNorm -> QKV GEMM (+ bias) -> RoPE -> K/V written to the
// paged cache -> attention over each sequence's context (causal, or a tree's mask) -> output GEMM
// + residual -> RMSNorm -> gate/up GEMM -> SiLU * up -> down GEMM + residual. The GEMMs are the
// library's few-row kernel (cpu_gemm.h: every weight byte read once for all rows, on the active
// ISA path); the rest is plain loops and 16-float vectors the compiler lowers to the CPU's SIMD.
// The final norm and LM head come along when the caller hands them over (`lm_head`); the
// embedding stays with the caller (model.py's `FusedStack`), which also decides when this runs:
// fp32 activations and caches, no sliding window, interleaved RoPE, fewer than 32 rows a sequence.
//
//   specfleet_int8::decoder_step(x[T, D], weights (11 a layer, see LayerW), k_caches, v_caches
//       ([Hkv, slots, hd] each, written), positions[T], slot_mapping[T], rope_cos/sin[P, hd/2],
//       seqs[B, 6], ctx_slots[*], masks (bool, flat), dims [H, Hkv, hd, I], eps, scale,
//       feature_layers, lm_head ([] or [final norm [D], packed weight, scales or empty]), vocab,
//       rows) -> (x after the last layer [T, D], or with lm_head the logits of `rows` (all when
//       empty) [R, vocab]; features [T, len(feature_layers) * D])
//
// seqs row b: first row, end row, context length S (new rows included), first slot when the
// context is one run of slots (else -1: its S slots are ctx_slots[slots_at...]), slots_at, and
// mask_at: -1 for causal attention (row i sees context 0..S - n + i), else the offset in `masks`
// of its [n, S] row-major mask (true: may attend).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "cpu_gemm.h"

#ifndef SF_NS
#define SF_NS specfleet_int8
#endif

namespace specfleet {
namespace {

constexpr int64_t kPerLayer = 11;  // tensors per layer in `weights`
constexpr int64_t kSeqCols = 6;    // columns of `seqs`
constexpr int kLanes = 16;         // independent partial sums: the compiler vectorizes them

// A layer's weights: norms [D]; GEMM weights packed [ceil(N/32), K, 32] int8 (with scales [N]) or
// fp32 (scales empty); the QKV bias [N] or empty.
struct LayerW {
  const float* attn_norm;
  const void* wqkv;
  const float* wqkv_s;
  const float* wqkv_b;
  const void* wo;
  const float* wo_s;
  const float* ffn_norm;
  const void* w13;
  const float* w13_s;
  const void* w2;
  const float* w2_s;
  bool int8;
};

// 16 floats as one vector (GCC's and clang's vector extension): one zmm on AVX-512, two ymm on
// AVX2, whatever the build's -march allows.
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
static_assert(kLanes == 16, "v16f holds kLanes floats");

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#if defined(__clang__)
#define SF_SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SF_SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, v16i{__VA_ARGS__})
#endif

// The sums of 16 vectors' lanes, as one vector (lane j: the sum of v[j]'s lanes): four rounds of
// pairing, each adding two shuffles of a pair of vectors: 15 adds and 30 shuffles where 16
// horizontal sums take 64 of each.
inline v16f sum_lanes16(v16f (&v)[16]) {
  for (int j = 0; j < 8; ++j)
    v[j] = SF_SHUFFLE2(v[j], v[j + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SF_SHUFFLE2(v[j], v[j + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int j = 0; j < 4; ++j)
    v[j] = SF_SHUFFLE2(v[j], v[j + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           SF_SHUFFLE2(v[j], v[j + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int j = 0; j < 2; ++j)
    v[j] = SF_SHUFFLE2(v[j], v[j + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SF_SHUFFLE2(v[j], v[j + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return SF_SHUFFLE2(v[0], v[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         SF_SHUFFLE2(v[0], v[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int w = kLanes / 2; w > 0; w /= 2)  // a tree of vector adds, not kLanes dependent ones
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return s + acc[0];
}

// max and sum over kLanes independent partials (a serial reduction does not vectorize)
inline float max_of(const float* x, int64_t n) {
  float acc[kLanes];
  std::fill(acc, acc + kLanes, -std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] = std::max(acc[j], x[i + j]);
  float m = -std::numeric_limits<float>::infinity();
  for (; i < n; ++i) m = std::max(m, x[i]);
  for (int j = 0; j < kLanes; ++j) m = std::max(m, acc[j]);
  return m;
}

inline float sum_of(const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j];
  float s = 0.f;
  for (; i < n; ++i) s += x[i];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return s + acc[0];
}

// x[i] = e^x[i] in place, in a loop the compiler vectorizes (std::exp is a scalar call: at a
// context of 1024 the softmax's exps were most of a step's attention). Cephes' expf: e^x =
// 2^n e^f with n = round(x / ln 2), |f| <= ln 2 / 2, e^f by a degree-6 polynomial; within 2 ulp
// of std::exp. Below -87.3 (e^x under FLT_MIN, and -inf) gives 0; above 88.7, e^88.7.
void exp_inplace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::min(std::max(x[i], -87.3f), 88.7f);
    const float t = v * 1.44269504088896341f + 12582912.f;  // + 1.5 * 2^23: rounds to an integer
    int32_t ti;
    std::memcpy(&ti, &t, sizeof ti);
    const float fn = t - 12582912.f;
    const float f = (v - fn * 0.693359375f) + fn * 2.12194440e-4f;  // x - n ln 2 in two parts
    float y = 1.9875691500e-4f;
    y = y * f + 1.3981999507e-3f;
    y = y * f + 8.3334519073e-3f;
    y = y * f + 4.1665795894e-2f;
    y = y * f + 1.6666665459e-1f;
    y = y * f + 5.0000001201e-1f;
    y = y * f * f + f + 1.f;
    const int32_t bits = ((ti - 0x4B400000) + 127) << 23;  // 2^n (ti's low bits hold n + 2^22 * 3)
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    x[i] = x[i] < -87.3f ? 0.f : y * scale;
  }
}

void rms_norm_rows(const float* x, const float* w, float* y, int64_t T, int64_t D, float eps) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * D;
    float* yr = y + t * D;
    const float r = 1.f / std::sqrt(dot(xr, xr, D) / static_cast<float>(D) + eps);
    for (int64_t d = 0; d < D; ++d) yr[d] = xr[d] * r * w[d];
  }
}

void add_rows(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

// RoPE on interleaved pairs (model.py's `interleave_rope` layout): (a, b) at features 2i, 2i + 1
// of each of the first `heads` heads of each row is multiplied by cos + i sin of its position.
void rope_rows(float* qkv, int64_t ld, int64_t T, int64_t heads, int64_t hd, const int64_t* pos, const float* cos_t,
               const float* sin_t) {
  const int64_t half = hd / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos_t + pos[t] * half;
    const float* s = sin_t + pos[t] * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = qkv + t * ld + h * hd;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * c[i] - b * s[i];
        v[2 * i + 1] = a * s[i] + b * c[i];
      }
    }
  }
}

struct Seq {
  int64_t lo, hi, S, start, slots_at, mask_at;
};

// KV head g of sequence `sq` for its `group` query heads at once: every row of each reads a
// context row's key and value once (they are shared: grouped-query attention), computes
// softmax(q.k * scale) v. Rows r = i * group + j: the sequence's row i, query head g * group + j.
void attend_group(const Seq& sq, int64_t g, int64_t group, int64_t H, int64_t hd, int64_t ld_qkv, const float* qkv,
                  const float* kc, const float* vc, int64_t nslots, const int64_t* ctx_slots, const bool* masks,
                  float scale, float* out, std::vector<float>& p) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t n = sq.hi - sq.lo, S = sq.S, R = n * group;
  const float* kh = kc + g * nslots * hd;
  const float* vh = vc + g * nslots * hd;
  const int64_t* slots = sq.start < 0 ? ctx_slots + sq.slots_at : nullptr;
  const bool* mask = sq.mask_at >= 0 ? masks + sq.mask_at : nullptr;
  p.resize(R * S);
  // per row: its query, its output, its row in the sequence (no division in the loops below)
  constexpr int64_t kMaxRows = 256;
  TORCH_CHECK(R <= kMaxRows, "decoder_step: ", R, " query rows share a KV head, at most ", kMaxRows);
  const float* q[kMaxRows];
  float* o[kMaxRows];
  int64_t last[kMaxRows];  // causal: the last context index row r sees
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = r / group, h = g * group + r % group;
    q[r] = qkv + (sq.lo + i) * ld_qkv + h * hd;
    o[r] = out + (sq.lo + i) * H * hd + h * hd;
    last[r] = mask ? S - 1 : S - n + i;
    std::fill(o[r], o[r] + hd, 0.f);
  }
  // q.k for kLanes context rows at a time: each row's products summed lane by lane, then the
  // kLanes x kLanes partial sums reduced column-wise, which vectorizes (a dot product's own
  // horizontal sum, row by row, cost most of the attention)
  const int64_t hd_vec = hd / kLanes * kLanes;
  for (int64_t s0 = 0; s0 < S; s0 += kLanes) {
    const int64_t nb = std::min<int64_t>(kLanes, S - s0);
    const float* kr[kLanes];  // the block's key rows (the last block repeats its last row)
    for (int64_t j = 0; j < kLanes; ++j) {
      const int64_t sj = s0 + std::min(j, nb - 1);
      kr[j] = kh + (slots ? slots[sj] : sq.start + sj) * hd;
    }
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = q[r];
      v16f acc[kLanes];
      for (int j = 0; j < kLanes; ++j) acc[j] = v16f{};
      for (int64_t d = 0; d < hd_vec; d += kLanes) {
        const v16f qv = load16(qr + d);
        for (int j = 0; j < kLanes; ++j) acc[j] += qv * load16(kr[j] + d);
      }
      for (int64_t d = hd_vec; d < hd; ++d)  // a head size not a multiple of 16
        for (int j = 0; j < kLanes; ++j) acc[j][0] += qr[d] * kr[j][d];
      const v16f sc = sum_lanes16(acc) * scale;
      float* pr = p.data() + r * S + s0;
      const bool* mr = mask ? mask + (r / group) * S + s0 : nullptr;
      for (int64_t j = 0; j < nb; ++j) pr[j] = (mr ? mr[j] : s0 + j <= last[r]) ? sc[j] : kNegInf;
    }
  }
  for (int64_t r = 0; r < R; ++r) {  // softmax of each row
    float* pr = p.data() + r * S;
    const float mx = max_of(pr, S);
    if (mx == kNegInf) {  // nothing to attend to (a mask's row): zeros
      std::fill(pr, pr + S, 0.f);
      continue;
    }
    for (int64_t s = 0; s < S; ++s) pr[s] -= mx;
    exp_inplace(pr, S);  // 0 where masked (-inf)
    const float inv = 1.f / sum_of(pr, S);
    for (int64_t s = 0; s < S; ++s) pr[s] *= inv;
  }
  if (hd % kLanes == 0 && hd <= kLanes * kLanes) {  // each row's output in registers, over the context
    const int64_t nv = hd / kLanes;
    for (int64_t r = 0; r < R; ++r) {
      const float* pr = p.data() + r * S;
      v16f acc[kLanes];
      for (int64_t c = 0; c < nv; ++c) acc[c] = v16f{};
      for (int64_t s = 0; s < S; ++s) {
        const float w = pr[s];
        if (w == 0.f) continue;
        const float* v = vh + (slots ? slots[s] : sq.start + s) * hd;
        for (int64_t c = 0; c < nv; ++c) acc[c] += w * load16(v + c * kLanes);
      }
      for (int64_t c = 0; c < nv; ++c) std::memcpy(o[r] + c * kLanes, &acc[c], sizeof(v16f));
    }
    return;
  }
  for (int64_t s = 0; s < S; ++s) {
    const float* v = vh + (slots ? slots[s] : sq.start + s) * hd;
    for (int64_t r = 0; r < R; ++r) {
      const float w = p[r * S + s];
      if (w == 0.f) continue;
      float* orow = o[r];
      for (int64_t d = 0; d < hd; ++d) orow[d] += w * v[d];
    }
  }
}

const float* floats_or_null(const at::Tensor& t, int64_t n, const char* what, int64_t layer) {
  if (!t.defined() || t.numel() == 0) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1 && t.size(0) == n,
              "decoder_step: layer ", layer, "'s ", what, " must be a contiguous fp32 [", n, "]");
  return t.data_ptr<float>();
}

const void* packed(const at::Tensor& w, int64_t n, int64_t k, bool int8, const char* what, int64_t layer) {
  TORCH_CHECK(w.dim() == 3 && w.size(0) == (n + 31) / 32 && w.size(1) == k && w.size(2) == 32 && w.is_contiguous() &&
                  w.scalar_type() == (int8 ? at::kChar : at::kFloat),
              "decoder_step: layer ", layer, "'s ", what, " must be packed as ", int8 ? "int8" : "fp32", " [",
              (n + 31) / 32, ", ", k, ", 32], got ", w.sizes());
  return w.data_ptr();
}

LayerW layer_weights(at::TensorList ws, int64_t l, int64_t D, int64_t Nqkv, int64_t HD, int64_t I) {
  const at::Tensor* w = ws.data() + l * kPerLayer;
  LayerW r{};
  r.int8 = w[1].scalar_type() == at::kChar;
  r.attn_norm = floats_or_null(w[0], D, "attention norm", l);
  r.wqkv = packed(w[1], Nqkv, D, r.int8, "wqkv", l);
  r.wqkv_s = floats_or_null(w[2], Nqkv, "wqkv scales", l);
  r.wqkv_b = floats_or_null(w[3], Nqkv, "wqkv bias", l);
  r.wo = packed(w[4], D, HD, r.int8, "wo", l);
  r.wo_s = floats_or_null(w[5], D, "wo scales", l);
  r.ffn_norm = floats_or_null(w[6], D, "feed-forward norm", l);
  r.w13 = packed(w[7], 2 * I, D, r.int8, "w13", l);
  r.w13_s = floats_or_null(w[8], 2 * I, "w13 scales", l);
  r.w2 = packed(w[9], D, I, r.int8, "w2", l);
  r.w2_s = floats_or_null(w[10], D, "w2 scales", l);
  TORCH_CHECK(r.attn_norm && r.ffn_norm, "decoder_step: layer ", l, " has no norm weights");
  TORCH_CHECK(!r.int8 || (r.wqkv_s && r.wo_s && r.w13_s && r.w2_s), "decoder_step: layer ", l,
              "'s int8 weights need their scales");
  TORCH_CHECK(r.int8 || !(r.wqkv_s || r.wo_s || r.w13_s || r.w2_s), "decoder_step: layer ", l,
              "'s fp32 weights take no scales");
  return r;
}

void check_long(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu(),
              "decoder_step: ", what, " must be a contiguous int64 CPU tensor");
}

std::tuple<at::Tensor, at::Tensor> decoder_step(const at::Tensor& x_in, at::TensorList weights, at::TensorList k_caches,
                                                at::TensorList v_caches, const at::Tensor& positions,
                                                const at::Tensor& slot_mapping, const at::Tensor& rope_cos,
                                                const at::Tensor& rope_sin, const at::Tensor& seqs_t,
                                                const at::Tensor& ctx_slots_t, const at::Tensor& masks_t,
                                                at::IntArrayRef dims, double eps_d, double scale_d,
                                                at::IntArrayRef feature_layers, at::TensorList lm_head,
                                                int64_t vocab, const at::Tensor& rows_t) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "decoder_step: x must be an fp32 CPU [T, D]");
  TORCH_CHECK(dims.size() == 4, "decoder_step: dims are [n_heads, n_kv_heads, head_dim, intermediate]");
  const int64_t T = x_in.size(0), D = x_in.size(1);
  const int64_t H = dims[0], Hkv = dims[1], hd = dims[2], I = dims[3];
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && hd > 0 && hd % 2 == 0 && I > 0, "decoder_step: bad dims");
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == L && static_cast<int64_t>(weights.size()) == L * kPerLayer,
              "decoder_step: ", L, " K caches, ", v_caches.size(), " V caches and ", weights.size(),
              " weights (", kPerLayer, " a layer)");
  const int64_t Nqkv = (H + 2 * Hkv) * hd, HD = H * hd, group = H / Hkv;
  check_long(positions, "positions");
  check_long(slot_mapping, "slot_mapping");
  check_long(seqs_t, "seqs");
  check_long(ctx_slots_t, "ctx_slots");
  TORCH_CHECK(positions.numel() == T && slot_mapping.numel() == T, "decoder_step: positions and slot_mapping need ",
              T, " entries");
  TORCH_CHECK(seqs_t.dim() == 2 && seqs_t.size(1) == kSeqCols, "decoder_step: seqs must be [B, ", kSeqCols, "]");
  TORCH_CHECK(masks_t.scalar_type() == at::kBool && masks_t.is_contiguous(), "decoder_step: masks must be bool");
  TORCH_CHECK(rope_cos.scalar_type() == at::kFloat && rope_sin.scalar_type() == at::kFloat && rope_cos.is_contiguous() &&
                  rope_sin.is_contiguous() && rope_cos.dim() == 2 && rope_cos.size(1) == hd / 2 &&
                  rope_sin.sizes() == rope_cos.sizes(),
              "decoder_step: rope tables must be contiguous fp32 [P, head_dim / 2]");
  int64_t nslots = -1;
  for (int64_t l = 0; l < L; ++l)
    for (const at::Tensor* c : {&k_caches[l], &v_caches[l]}) {
      TORCH_CHECK(c->scalar_type() == at::kFloat && c->is_contiguous() && c->dim() == 3 && c->size(0) == Hkv &&
                      c->size(2) == hd && (nslots < 0 || c->size(1) == nslots),
                  "decoder_step: layer ", l, "'s caches must be contiguous fp32 [", Hkv, ", slots, ", hd, "]");
      nslots = c->size(1);
    }

  // The batch description, checked against the cache and the tables: a bad index is an error,
  // never a read or write out of bounds.
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot_map = slot_mapping.data_ptr<int64_t>();
  const int64_t P = rope_cos.size(0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "decoder_step: position ", pos[t], " outside the RoPE table (", P, ")");
    TORCH_CHECK(slot_map[t] >= 0 && slot_map[t] < nslots, "decoder_step: slot ", slot_map[t], " outside the cache");
  }
  const int64_t B = seqs_t.size(0), n_ctx = ctx_slots_t.numel(), n_mask = masks_t.numel();
  const int64_t* ctx_slots = ctx_slots_t.data_ptr<int64_t>();
  std::vector<Seq> seqs(B);
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* r = seqs_t.data_ptr<int64_t>() + b * kSeqCols;
    Seq s{r[0], r[1], r[2], r[3], r[4], r[5]};
    const int64_t n = s.hi - s.lo;
    TORCH_CHECK(0 <= s.lo && s.lo < s.hi && s.hi <= T && s.S >= n, "decoder_step: sequence ", b, " has rows [", s.lo,
                ", ", s.hi, ") of ", T, " and a context of ", s.S);
    if (s.start >= 0) {
      TORCH_CHECK(s.start + s.S <= nslots, "decoder_step: sequence ", b, "'s context runs past the cache");
    } else {
      TORCH_CHECK(s.slots_at >= 0 && s.slots_at + s.S <= n_ctx, "decoder_step: sequence ", b,
                  "'s context slots run past ctx_slots");
      for (int64_t i = 0; i < s.S; ++i)
        TORCH_CHECK(ctx_slots[s.slots_at + i] >= 0 && ctx_slots[s.slots_at + i] < nslots, "decoder_step: sequence ",
                    b, "'s context slot ", ctx_slots[s.slots_at + i], " outside the cache");
    }
    TORCH_CHECK(s.mask_at < 0 || s.mask_at + n * s.S <= n_mask, "decoder_step: sequence ", b,
                "'s mask runs past masks");
    work += n * s.S;
    seqs[b] = s;
  }
  std::vector<int64_t> feat_slot(L, -1);
  for (size_t i = 0; i < feature_layers.size(); ++i) {
    TORCH_CHECK(feature_layers[i] >= 0 && feature_layers[i] < L, "decoder_step: feature layer ", feature_layers[i],
                " of ", L);
    feat_slot[feature_layers[i]] = static_cast<int64_t>(i);
  }
  std::vector<LayerW> layers(L);
  for (int64_t l = 0; l < L; ++l) layers[l] = layer_weights(weights, l, D, Nqkv, HD, I);

  const auto opt = x_in.options();
  at::Tensor x = x_in.contiguous().clone();
  at::Tensor feats = at::empty({T, static_cast<int64_t>(feature_layers.size()) * D}, opt);
  at::Tensor h_t = at::empty({T, D}, opt), tmp_t = at::empty({T, D}, opt), qkv_t = at::empty({T, Nqkv}, opt);
  at::Tensor att_t = at::empty({T, HD}, opt), gu_t = at::empty({T, 2 * I}, opt), act_t = at::empty({T, I}, opt);
  float *xp = x.data_ptr<float>(), *h = h_t.data_ptr<float>(), *tmp = tmp_t.data_ptr<float>();
  float *qkv = qkv_t.data_ptr<float>(), *att = att_t.data_ptr<float>(), *gu = gu_t.data_ptr<float>();
  float* act = act_t.data_ptr<float>();
  const float eps = static_cast<float>(eps_d), scale = static_cast<float>(scale_d);
  const bool* masks = masks_t.data_ptr<bool>();
  const Isa isa = active_path();
  // attention tasks (sequence, KV head): one thread takes them all when they are small
  const int64_t tasks = B * Hkv;
  const int64_t attn_grain = work * hd * H < (1 << 16) ? tasks : 1;

  for (int64_t l = 0; l < L; ++l) {
    const LayerW& w = layers[l];
    float* kc = k_caches[l].data_ptr<float>();
    float* vc = v_caches[l].data_ptr<float>();
    rms_norm_rows(xp, w.attn_norm, h, T, D, eps);
    gemm(Args{h, D, w.wqkv, w.wqkv_s, w.wqkv_b, qkv, Nqkv, T, Nqkv, D}, w.int8, isa);
    rope_rows(qkv, Nqkv, T, H + Hkv, hd, pos, rope_cos.data_ptr<float>(), rope_sin.data_ptr<float>());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < Hkv; ++g) {
        std::memcpy(kc + (g * nslots + slot_map[t]) * hd, qkv + t * Nqkv + (H + g) * hd, hd * sizeof(float));
        std::memcpy(vc + (g * nslots + slot_map[t]) * hd, qkv + t * Nqkv + (H + Hkv + g) * hd, hd * sizeof(float));
      }
    at::parallel_for(0, tasks, attn_grain, [&](int64_t t0, int64_t t1) {
      std::vector<float> p;
      for (int64_t task = t0; task < t1; ++task)
        attend_group(seqs[task / Hkv], task % Hkv, group, H, hd, Nqkv, qkv, kc, vc, nslots, ctx_slots, masks, scale,
                     att, p);
    });
    gemm(Args{att, HD, w.wo, w.wo_s, nullptr, tmp, D, T, D, HD}, w.int8, isa);
    add_rows(xp, tmp, T * D);
    rms_norm_rows(xp, w.ffn_norm, h, T, D, eps);
    gemm(Args{h, D, w.w13, w.w13_s, nullptr, gu, 2 * I, T, 2 * I, D}, w.int8, isa);
    for (int64_t t = 0; t < T; ++t) {
      const float* g = gu + t * 2 * I;
      float* a = act + t * I;
      for (int64_t i = 0; i < I; ++i) a[i] = -g[i];
      exp_inplace(a, I);
      for (int64_t i = 0; i < I; ++i) a[i] = g[i] / (1.f + a[i]) * g[I + i];  // silu(gate) * up
    }
    gemm(Args{act, I, w.w2, w.w2_s, nullptr, tmp, D, T, D, I}, w.int8, isa);
    add_rows(xp, tmp, T * D);
    if (feat_slot[l] >= 0) {
      float* f = feats.data_ptr<float>() + feat_slot[l] * D;
      const int64_t ldf = feats.size(1);
      for (int64_t t = 0; t < T; ++t) std::memcpy(f + t * ldf, xp + t * D, D * sizeof(float));
    }
  }
  if (lm_head.empty()) return {x, feats};
  // the final norm and the LM head over the rows asked for
  TORCH_CHECK(lm_head.size() == 3, "decoder_step: lm_head is [final norm, packed weight, scales or empty]");
  check_long(rows_t, "rows");
  const bool int8 = lm_head[1].scalar_type() == at::kChar;
  const float* norm = floats_or_null(lm_head[0], D, "final norm", L);
  const void* w = packed(lm_head[1], vocab, D, int8, "LM head", L);
  const float* scales = floats_or_null(lm_head[2], vocab, "LM head scales", L);
  TORCH_CHECK(norm && int8 == (scales != nullptr), "decoder_step: the LM head needs a norm, and scales iff int8");
  const int64_t R = rows_t.numel() ? rows_t.numel() : T;
  const int64_t* rows = rows_t.numel() ? rows_t.data_ptr<int64_t>() : nullptr;
  at::Tensor hn = at::empty({R, D}, opt);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = rows ? rows[r] : r;
    TORCH_CHECK(t >= 0 && t < T, "decoder_step: logits row ", t, " of ", T);
    rms_norm_rows(xp + t * D, norm, hn.data_ptr<float>() + r * D, 1, D, eps);
  }
  at::Tensor logits = at::empty({R, vocab}, opt);
  gemm(Args{hn.data_ptr<float>(), D, w, scales, nullptr, logits.data_ptr<float>(), vocab, R, vocab, D}, int8, isa);
  return {logits, feats};
}

}  // namespace
}  // namespace specfleet

TORCH_LIBRARY_FRAGMENT(SF_NS, m) {
  m.def(
      "decoder_step(Tensor x, Tensor[] weights, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor positions, "
      "Tensor slot_mapping, Tensor rope_cos, Tensor rope_sin, Tensor seqs, Tensor ctx_slots, Tensor masks, "
      "int[] dims, float eps, float scale, int[] feature_layers, Tensor[] lm_head, int vocab, Tensor rows) "
      "-> (Tensor, Tensor)",
      &specfleet::decoder_step);
}
