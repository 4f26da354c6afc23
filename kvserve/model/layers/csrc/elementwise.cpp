// The decoder's elementwise steps as one C++ call each, for the CPU: RMSNorm (optionally adding the
// residual first), rotary embedding in place, and SiLU(gate) * up.
//
// In PyTorch each of these is 5-15 small ops; at decode (a few rows) every op costs more in dispatch
// and allocation than in arithmetic, several times over per layer. Here each
// row is read once, the math is float32 and results are rounded to the tensor's dtype at the same
// points as the reference (Hugging Face) implementation, so bf16 outputs match it.
// With AVX-512 the rows go 16 values at a time (a scalar loop handles the tail, and everything on
// other CPUs): GCC does not vectorise the plain loops.
#include "kernels.h"
#include "simd.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(KVSERVE_AVX2)
#include <immintrin.h>
#endif

namespace {

// bf16 <-> float as integer arithmetic (round to nearest even), which the compiler vectorises.
inline float load(const c10::BFloat16* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::Half* p, int64_t i) { return static_cast<float>(p[i]); }

inline void store(c10::BFloat16* p, int64_t i, float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7fff + ((bits >> 16) & 1);  // finite values only, which activations are
  reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(bits >> 16);
}
inline void store(float* p, int64_t i, float f) { p[i] = f; }
inline void store(c10::Half* p, int64_t i, float f) { p[i] = static_cast<c10::Half>(f); }

// The value as the dtype holds it (rounding in between steps like the reference does).
template <typename T>
inline float round_to(float f) {
  T t;
  store(&t, 0, f);
  return load(&t, 0);
}

// exp(x) for x <= 0 to about 2e-7 relative: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2].
// Arithmetic and bit operations only, so a loop of it vectorises (std::exp would not).
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-06f;  // ln2 split in two for accuracy
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n >= -126 here
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// x / (1 + exp(-x)), with exp only of non-positive arguments (no overflow).
inline float silu(float x) {
  const float e = exp_nonpositive(x > 0 ? -x : x);
  return x > 0 ? x / (1.f + e) : x * e / (1.f + e);
}

#if defined(__AVX512F__)
// load16: 16 values as float32 (simd.h); store16 rounds to nearest even like store().
using simd::bf16_bits;
using simd::load16;
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// v as the dtype holds it (round_to for 16 values).
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    return _mm512_castsi512_ps(_mm512_and_si512(bf16_bits(v), _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
  else if constexpr (std::is_same_v<T, c10::Half>)
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  else
    return v;
}

using simd::silu16;
constexpr int64_t kVec = 16;
#else
constexpr int64_t kVec = 0;  // no vector loop: the scalar one does every value
#endif

// Rows [r0, r1) of a [rows, dim] view with row stride `ld`.
template <typename T>
void rms_norm_rows(T* x, int64_t ld, T* residual, int64_t ld_res, const T* weight, T* out, int64_t ld_out,
                   int64_t dim, float eps, int64_t r0, int64_t r1) {
  std::vector<float> row(dim);
  const int64_t vec_end = kVec ? dim / kVec * kVec : 0;
  for (int64_t r = r0; r < r1; ++r) {
    const T* src = x + r * ld;
    T* res = residual ? residual + r * ld_res : nullptr;  // residual += x (in the dtype), then normalise the sum
    float ss = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 ss16 = _mm512_setzero_ps();
    for (; i < vec_end; i += kVec) {
      __m512 v = load16(src + i);
      if (res) {
        v = round16<T>(_mm512_add_ps(load16(res + i), v));
        store16(res + i, v);
      }
      _mm512_storeu_ps(row.data() + i, v);
      ss16 = _mm512_fmadd_ps(v, v, ss16);
    }
    ss = _mm512_reduce_add_ps(ss16);
#endif
    for (; i < dim; ++i) {
      const float v = res ? round_to<T>(load(res, i) + load(src, i)) : load(src, i);
      if (res) store(res, i, v);
      row[i] = v;
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / dim + eps);
    T* dst = out + r * ld_out;
    i = 0;
#if defined(__AVX512F__)
    for (const __m512 inv16 = _mm512_set1_ps(inv); i < vec_end; i += kVec)
      store16(dst + i, _mm512_mul_ps(load16(weight + i), round16<T>(_mm512_mul_ps(_mm512_loadu_ps(row.data() + i), inv16))));
#endif
    for (; i < dim; ++i) store(dst, i, load(weight, i) * round_to<T>(row[i] * inv));
  }
}

// Rows per parallel task: below ~16K values a second thread costs more than it saves.
int64_t grain_rows(int64_t dim) { return std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(dim, 1)); }

template <typename T>
at::Tensor rms_norm_typed(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                          double eps) {
  const int64_t dim = x.size(-1), rows = x.numel() / std::max<int64_t>(dim, 1);
  at::Tensor x2 = x.reshape({rows, dim});
  at::Tensor out = at::empty({rows, dim}, x.options());
  at::Tensor w = weight.contiguous();
  T* res = nullptr;
  int64_t ld_res = 0;
  if (residual.has_value()) {
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == rows && residual->size(1) == dim && residual->stride(1) == 1,
                "residual must be a [rows, dim] tensor with unit stride in dim");
    res = residual->data_ptr<T>();
    ld_res = residual->stride(0);
  }
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t r0, int64_t r1) {
    rms_norm_rows<T>(x2.data_ptr<T>(), x2.stride(0), res, ld_res, w.data_ptr<T>(), out.data_ptr<T>(), dim, dim,
                     static_cast<float>(eps), r0, r1);
  });
  return out.view(x.sizes());
}

// Rotate-half RoPE of x [tokens, heads, dim] in place; cos/sin: float32 [max_position, dim / 2].
template <typename T>
void rotary_typed(at::Tensor& x, const int64_t* positions, const float* cos, const float* sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t st = x.stride(0), sh = x.stride(1), vec_end = kVec ? half / kVec * kVec : 0;
  T* base = x.data_ptr<T>();
  at::parallel_for(0, tokens, grain_rows(heads * 2 * half), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = base + t * st + h * sh;
        int64_t i = 0;  // rounded where the reference rounds: the tables, each product, each sum
#if defined(__AVX512F__)
        for (; i < vec_end; i += kVec) {
          const __m512 a = load16(v + i), b = load16(v + i + half);
          const __m512 ci = round16<T>(_mm512_loadu_ps(c + i)), si = round16<T>(_mm512_loadu_ps(s + i));
          store16(v + i, _mm512_sub_ps(round16<T>(_mm512_mul_ps(a, ci)), round16<T>(_mm512_mul_ps(b, si))));
          store16(v + i + half, _mm512_add_ps(round16<T>(_mm512_mul_ps(b, ci)), round16<T>(_mm512_mul_ps(a, si))));
        }
#endif
        for (; i < half; ++i) {
          const float a = load(v, i), b = load(v, i + half);
          const float ci = round_to<T>(c[i]), si = round_to<T>(s[i]);
          store(v, i, round_to<T>(a * ci) - round_to<T>(b * si));
          store(v, i + half, round_to<T>(b * ci) + round_to<T>(a * si));
        }
      }
    }
  });
}

template <typename T>
at::Tensor silu_mul_typed(const at::Tensor& x) {
  const int64_t width = x.size(-1) / 2, rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  at::Tensor x2 = x.reshape({rows, 2 * width});
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = width;
  at::Tensor out = at::empty({rows, width}, x.options());
  at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gate = x2.data_ptr<T>() + r * x2.stride(0);
      const T* up = gate + width;
      T* dst = out.data_ptr<T>() + r * width;
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        for (; i + kVec <= width; i += kVec)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), simd::silu_mul16_bf16(load16(gate + i), load16(up + i)));
      }
      for (; i + kVec <= width; i += kVec) store16(dst + i, _mm512_mul_ps(round16<T>(silu16(load16(gate + i))), load16(up + i)));
#elif defined(KVSERVE_AVX2)
      // bf16: the packed linear's SiLU * up epilogue (simd::silu_mul8_bf16) computes the same bits
      for (; i + 8 <= width; i += 8) {
        const __m256 g = simd::silu8(simd::load8(gate + i));
        __m256 rg = g;
        if constexpr (std::is_same_v<T, c10::BFloat16>) rg = simd::round8_bf16(g);
        else if constexpr (std::is_same_v<T, c10::Half>) rg = _mm256_cvtph_ps(_mm256_cvtps_ph(g, _MM_FROUND_TO_NEAREST_INT));
        simd::store8(dst + i, _mm256_mul_ps(rg, simd::load8(up + i)));
      }
#endif
      for (; i < width; ++i) store(dst, i, round_to<T>(silu(load(gate, i))) * load(up, i));
    }
  });
  return out.view(sizes);
}

// Index of the largest value of a row (the first one on ties, as torch's max().indices).
template <typename T>
int64_t argmax_row(const T* row, int64_t width) {
  float best = -INFINITY;
  int64_t best_i = 0, i = 0;
#if defined(__AVX512F__)
  if (width >= kVec) {
    // Per lane: the largest value so far and where it was first seen; then the lanes' winner.
    __m512 lane_max = _mm512_set1_ps(-INFINITY);
    __m512i lane_idx = _mm512_setzero_si512(), idx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4,
                                                                     3, 2, 1, 0);
    const __m512i step = _mm512_set1_epi32(kVec);
    for (; i + kVec <= width; i += kVec) {
      const __m512 v = load16(row + i);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, lane_max, _CMP_GT_OQ);
      lane_max = _mm512_mask_mov_ps(lane_max, greater, v);
      lane_idx = _mm512_mask_mov_epi32(lane_idx, greater, idx);
      idx = _mm512_add_epi32(idx, step);
    }
    alignas(64) float m[kVec];
    alignas(64) int32_t at[kVec];
    _mm512_store_ps(m, lane_max);
    _mm512_store_si512(at, lane_idx);
    for (int l = 0; l < kVec; ++l) {
      if (m[l] > best || (m[l] == best && at[l] < best_i)) best = m[l], best_i = at[l];
    }
  }
#elif defined(KVSERVE_AVX2)
  if (width >= 8) {  // as above, 8 lanes
    __m256 lane_max = _mm256_set1_ps(-INFINITY);
    __m256i lane_idx = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    for (; i + 8 <= width; i += 8) {
      const __m256 v = simd::load8(row + i);
      const __m256 greater = _mm256_cmp_ps(v, lane_max, _CMP_GT_OQ);
      lane_max = _mm256_blendv_ps(lane_max, v, greater);
      lane_idx = _mm256_blendv_epi8(lane_idx, idx, _mm256_castps_si256(greater));
      idx = _mm256_add_epi32(idx, step);
    }
    alignas(32) float m[8];
    alignas(32) int32_t at[8];
    _mm256_store_ps(m, lane_max);
    _mm256_store_si256(reinterpret_cast<__m256i*>(at), lane_idx);
    for (int l = 0; l < 8; ++l) {
      if (m[l] > best || (m[l] == best && at[l] < best_i)) best = m[l], best_i = at[l];
    }
  }
#endif
  for (; i < width; ++i) {
    const float v = load(row, i);
    if (v > best) best = v, best_i = i;
  }
  return best_i;
}

template <typename T>
void argmax_rows_typed(const at::Tensor& x, int64_t* out) {
  const int64_t rows = x.size(0), width = x.size(1);
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out[r] = argmax_row(x.data_ptr<T>() + r * x.stride(0), width);
  });
}

// One row's filters, as SamplingParams has them: top_k <= 0 or >= the vocabulary, top_p = 1 and
// min_p = 0 are off.
struct RowFilter {
  int64_t top_k = 0;
  float top_p = 1.f;
  float min_p = 0.f;
};

// A thread's buffers, reused row after row.
struct SampleScratch {
  std::vector<float> w;  // each token's weight, the best's exactly 1
  std::vector<double> block_sums;
  std::vector<int32_t> candidates, bucket_a, bucket_b;  // candidates: grown to the vocabulary, never cleared
  int64_t counts[1024];
  double masses[1024];
};

constexpr int64_t kBlock = 16;

// Weights w_j = 2^d_j, d_j = (x_j - max) * scale (scale = log2(e) / temperature), summed in blocks of
// 16 and the blocks' sums in order, in double; returns the total. A token 2^-126 or more below the
// best gets weight 0 (so does -inf).
template <typename T>
double row_weights(const T* row, int64_t width, float scale, float mx, SampleScratch& s) {
  constexpr float kFloor = -126.f;
  const int64_t blocks = (width + kBlock - 1) / kBlock;
  s.w.resize(blocks * kBlock);
  s.block_sums.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i0 = b * kBlock, i1 = std::min(width, i0 + kBlock);
    float sum = 0.f;
    int64_t i = i0;
#if defined(__AVX512F__)
    if (i1 - i0 == kBlock) {
      const __m512 d = _mm512_mul_ps(_mm512_sub_ps(load16(row + i0), _mm512_set1_ps(mx)), _mm512_set1_ps(scale));
      const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(kFloor), _CMP_GE_OQ), simd::exp2_ps(d));
      _mm512_storeu_ps(s.w.data() + i0, e);
      sum = _mm512_reduce_add_ps(e);
      i = i1;
    }
#elif defined(KVSERVE_AVX2)
    if (i1 - i0 == kBlock) {
      __m256 total8 = _mm256_setzero_ps();
      for (int64_t j = i0; j < i1; j += 8) {
        const __m256 d = _mm256_mul_ps(_mm256_sub_ps(simd::load8(row + j), _mm256_set1_ps(mx)), _mm256_set1_ps(scale));
        const __m256 e = _mm256_and_ps(_mm256_cmp_ps(d, _mm256_set1_ps(kFloor), _CMP_GE_OQ), simd::exp2_8(d));
        _mm256_storeu_ps(s.w.data() + j, e);
        total8 = _mm256_add_ps(total8, e);
      }
      sum = simd::hsum8(total8);
      i = i1;
    }
#endif
    for (; i < i1; ++i) {
      const float d = (load(row, i) - mx) * scale;
      s.w[i] = d >= kFloor ? std::exp2(d) : 0.f;
      sum += s.w[i];
    }
    s.block_sums[b] = sum;
    total += sum;
  }
  return total;
}

template <typename T>
float row_max(const T* row, int64_t width) {
  float mx = -INFINITY;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 mx16 = _mm512_set1_ps(-INFINITY);
  for (; i + kVec <= width; i += kVec) mx16 = _mm512_max_ps(mx16, load16(row + i));
  mx = _mm512_reduce_max_ps(mx16);
#elif defined(KVSERVE_AVX2)
  __m256 mx8 = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= width; i += 8) mx8 = _mm256_max_ps(mx8, simd::load8(row + i));
  mx = simd::hmax8(mx8);
#endif
  for (; i < width; ++i) mx = std::max(mx, load(row, i));
  return mx;
}

// The first token whose cumulative weight exceeds u * total, searched block by block with the same
// sums the total was made of, so a target below the total always lands in a block; rounding inside
// that block falls back to its last token of weight > 0.
int64_t pick_in_blocks(const SampleScratch& s, int64_t width, double total, float u) {
  const int64_t blocks = static_cast<int64_t>(s.block_sums.size());
  double target = static_cast<double>(u) * total;
  if (target >= total) target = std::nextafter(total, 0.0);
  double before = 0.0;
  int64_t b = 0;
  while (b + 1 < blocks && before + s.block_sums[b] <= target) before += s.block_sums[b++];
  const int64_t i0 = b * kBlock, i1 = std::min(width, i0 + kBlock);
  int64_t last = -1;
  for (int64_t i = i0; i < i1; ++i) {
    if (s.w[i] <= 0.f) continue;
    before += s.w[i];
    last = i;
    if (before > target) return i;
  }
  return last;
}

inline uint32_t float_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// Where a filter cuts the tokens in the order best first (weight descending, then index ascending):
// the last token kept and the weight of all kept up to it. `all` when the cut falls beyond the
// candidates (every one is kept).
struct Cut {
  bool all = true;
  float w = 0.f;
  int32_t index = 0;
  double mass = 0.0;
};

// True if token (wa, ia) comes before (wb, ib) in that order.
inline bool ranks_before(float wa, int32_t ia, float wb, int32_t ib) { return wa > wb || (wa == wb && ia < ib); }

// The first candidate, best first, at which `count` tokens are kept (count > 0) or their weight
// reaches `mass` (mass >= 0). A radix select on the weights' float bits (which order like the
// weights, all >= 0) instead of a sort: a histogram of 10 bits at a time finds the bucket where the
// cut falls, and only that bucket's tokens go on to the next 10 bits; after three rounds a bucket's
// tokens have equal weights and, gathered in index order, are in rank order already. A bucket of a
// few tokens is sorted instead. `candidates` must be a prefix of the order (all tokens above some
// weight), in index order.
Cut find_cut(const float* w, const int32_t* candidates, int64_t n, int64_t count, double mass, SampleScratch& s) {
  int64_t count_before = 0;
  double mass_before = 0.0;
  const auto reached = [&](int64_t c, double m) { return (count > 0 && c >= count) || (mass >= 0 && m >= mass); };
  const int32_t* cur = candidates;
  for (int level = 0; level <= 3; ++level) {
    if (level == 3 || n <= 32) {
      std::vector<int32_t>& order = level % 2 ? s.bucket_b : s.bucket_a;
      if (order.data() != cur) order.assign(cur, cur + n);
      if (level < 3) std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ranks_before(w[a], a, w[b], b); });
      for (const int32_t j : order) {
        mass_before += w[j];
        if (reached(++count_before, mass_before)) return Cut{false, w[j], j, mass_before};
      }
      // Short of the target: among all candidates, only by the weights' rounding (keep them all);
      // inside a bucket whose sum did reach it, by rounding too (keep the bucket, up to its last).
      return level == 0 ? Cut{} : Cut{false, w[order.back()], order.back(), mass_before};
    }
    const int shift = 20 - 10 * level;  // float bits 29..20, 19..10, 9..0 (weights <= 1 leave bits 31 and 30 clear)
    std::fill(s.counts, s.counts + 1024, 0);
    std::fill(s.masses, s.masses + 1024, 0.0);
    for (int64_t e = 0; e < n; ++e) {
      const uint32_t key = (float_bits(w[cur[e]]) >> shift) & 1023;
      s.counts[key] += 1;
      s.masses[key] += w[cur[e]];
    }
    int key = 1023;
    for (; key >= 0; --key) {
      if (reached(count_before + s.counts[key], mass_before + s.masses[key])) break;
      count_before += s.counts[key];
      mass_before += s.masses[key];
    }
    if (key < 0) {  // short of the target, as above
      if (level == 0) return Cut{};
      int32_t last = cur[0];
      for (int64_t e = 1; e < n; ++e)
        if (ranks_before(w[last], last, w[cur[e]], cur[e])) last = cur[e];
      return Cut{false, w[last], last, mass_before};
    }
    std::vector<int32_t>& next = level % 2 ? s.bucket_a : s.bucket_b;  // never the buffer `cur` is in
    next.clear();
    for (int64_t e = 0; e < n; ++e)
      if (static_cast<int>((float_bits(w[cur[e]]) >> shift) & 1023) == key) next.push_back(cur[e]);
    cur = next.data();
    n = static_cast<int64_t>(next.size());
  }
  return Cut{};
}

// A weight the k-th best token is sure to reach: the largest of 2^-1, 2^-2, 2^-4, ..., 2^-64 that at
// least k weights reach, else the smallest positive weight. Its tokens are top-k's candidates.
float top_k_bound(const float* w, int64_t width, int64_t k) {
  constexpr int kLevels = 7;
  const float levels[kLevels] = {0x1p-1f, 0x1p-2f, 0x1p-4f, 0x1p-8f, 0x1p-16f, 0x1p-32f, 0x1p-64f};
  int64_t reach[kLevels] = {};
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + kVec <= width; i += kVec) {
    const __m512 v = _mm512_loadu_ps(w + i);
    for (int l = 0; l < kLevels; ++l)
      reach[l] += __builtin_popcount(_mm512_cmp_ps_mask(v, _mm512_set1_ps(levels[l]), _CMP_GE_OQ));
  }
#endif
  for (; i < width; ++i)
    for (int l = 0; l < kLevels; ++l) reach[l] += w[i] >= levels[l];
  for (int l = 0; l < kLevels; ++l)
    if (reach[l] >= k) return levels[l];
  return std::numeric_limits<float>::denorm_min();
}

// The tokens a row's filters keep: top-k, then top-p over the top-k's renormalised weights, then min-p,
// as sampler.py's filtered_probs defines them. Only candidates are ranked: tokens above a weight that
// every kept one reaches. For top-p that is (1 - top_p) x total / vocabulary (all tokens below it
// together weigh less than the 1 - top_p that the nucleus leaves out; halved against rounding), for
// top-k top_k_bound, and min_p (relative to the best's weight, 1) where it does not change the mass
// top-p is taken of. The candidates are s.candidates[0, n), in index order.
struct Kept {
  int64_t n = 0;
  Cut cut;
  float min_p = 0.f;
  bool operator()(const float* w, int32_t j) const {
    return w[j] >= min_p && (cut.all || !ranks_before(cut.w, cut.index, w[j], j));
  }
};

Kept filter_tokens(int64_t width, double total, const RowFilter& f, SampleScratch& s) {
  const float* w = s.w.data();
  const bool use_k = f.top_k > 0 && f.top_k < width, use_p = f.top_p < 1.f;
  float lower = f.min_p;
  if (use_k) lower = use_p ? top_k_bound(w, width, f.top_k) : std::max(lower, top_k_bound(w, width, f.top_k));
  else if (use_p) lower = std::max(lower, static_cast<float>(0.5 * (1.0 - f.top_p) * total / width));
  lower = std::max(lower, std::numeric_limits<float>::denorm_min());  // weight 0 is never drawn
  if (static_cast<int64_t>(s.candidates.size()) < width) s.candidates.resize(width);
  int32_t* cand = s.candidates.data();
  int64_t n = 0, i = 0;
#if defined(__AVX512F__)
  const __m512 lower16 = _mm512_set1_ps(lower);
  __m512i index16 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (; i + kVec <= width; i += kVec) {
    const __mmask16 keep = _mm512_cmp_ps_mask(_mm512_loadu_ps(w + i), lower16, _CMP_GE_OQ);
    _mm512_mask_compressstoreu_epi32(cand + n, keep, index16);
    n += __builtin_popcount(keep);
    index16 = _mm512_add_epi32(index16, _mm512_set1_epi32(kVec));
  }
#endif
  for (; i < width; ++i)
    if (w[i] >= lower) cand[n++] = static_cast<int32_t>(i);
  Cut cut;
  if (use_k) cut = find_cut(w, cand, n, f.top_k, -1.0, s);
  if (use_p) {
    double of = total;  // top-p's mass: of every token, or of the top-k
    if (use_k) {
      of = cut.mass;
      if (cut.all)
        for (int64_t e = 0; e < n; ++e) of += w[cand[e]];
    }
    const Cut nucleus = find_cut(w, cand, n, 0, static_cast<double>(f.top_p) * of, s);
    if (cut.all || (!nucleus.all && ranks_before(nucleus.w, nucleus.index, cut.w, cut.index))) cut = nucleus;
  }
  return Kept{n, cut, f.min_p};
}

bool is_filtered(const RowFilter* filters, int64_t r, int64_t width) {
  return filters != nullptr && ((filters[r].top_k > 0 && filters[r].top_k < width) || filters[r].top_p < 1.f ||
                                filters[r].min_p > 0.f);
}

// One row's token among those its filters keep, by inverse CDF over them in index order (as
// sample_from_probs).
int64_t pick_filtered(int64_t width, double total, float u, const RowFilter& f, SampleScratch& s) {
  const Kept kept = filter_tokens(width, total, f, s);
  const float* w = s.w.data();
  const int32_t* cand = s.candidates.data();
  double kept_total = 0.0;
  for (int64_t e = 0; e < kept.n; ++e)
    if (kept(w, cand[e])) kept_total += w[cand[e]];
  double target = static_cast<double>(u) * kept_total;
  if (target >= kept_total) target = std::nextafter(kept_total, 0.0);
  double before = 0.0;
  int64_t last = -1;
  for (int64_t e = 0; e < kept.n; ++e) {
    const int32_t j = cand[e];
    if (!kept(w, j)) continue;
    before += w[j];
    last = j;
    if (before > target) return j;
  }
  return last;
}

// Row r's token: its argmax at temperature 0, else drawn at uniforms[r] as above (filtered where
// `filters` is given).
template <typename T>
void sample_rows_typed(const at::Tensor& x, const float* temperatures, const float* uniforms,
                       const RowFilter* filters, int64_t* out) {
  const int64_t rows = x.size(0), width = x.size(1);
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    SampleScratch s;
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x.data_ptr<T>() + r * x.stride(0);
      if (temperatures[r] == 0.f) {
        out[r] = argmax_row(row, width);
        continue;
      }
      const float mx = row_max(row, width);
      const double total = row_weights(row, width, static_cast<float>(1.4426950408889634 / temperatures[r]), mx, s);
      int64_t token = is_filtered(filters, r, width) ? pick_filtered(width, total, uniforms[r], filters[r], s)
                                                     : pick_in_blocks(s, width, total, uniforms[r]);
      if (token < 0) token = argmax_row(row, width);  // unreachable unless every weight rounded away
      out[r] = token;
    }
  });
}

// Row r's whole distribution as sample_rows draws from it, normalised, into out [rows, width] float:
// the kept tokens' weights over their sum, 0 elsewhere; temperature 0 puts all on the argmax.
template <typename T>
void filtered_probs_typed(const at::Tensor& x, const float* temperatures, const RowFilter* filters, float* out) {
  const int64_t rows = x.size(0), width = x.size(1);
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    SampleScratch s;
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x.data_ptr<T>() + r * x.stride(0);
      float* o = out + r * width;
      if (temperatures[r] == 0.f) {
        std::fill(o, o + width, 0.f);
        o[argmax_row(row, width)] = 1.f;
        continue;
      }
      const float mx = row_max(row, width);
      const double total = row_weights(row, width, static_cast<float>(1.4426950408889634 / temperatures[r]), mx, s);
      const float* w = s.w.data();
      if (!is_filtered(filters, r, width)) {
        const float scale = static_cast<float>(1.0 / total);
        for (int64_t j = 0; j < width; ++j) o[j] = w[j] * scale;
        continue;
      }
      const Kept kept = filter_tokens(width, total, filters[r], s);
      const int32_t* cand = s.candidates.data();
      double kept_total = 0.0;
      for (int64_t e = 0; e < kept.n; ++e)
        if (kept(w, cand[e])) kept_total += w[cand[e]];
      std::fill(o, o + width, 0.f);
      for (int64_t e = 0; e < kept.n; ++e)
        if (kept(w, cand[e])) o[cand[e]] = static_cast<float>(w[cand[e]] / kept_total);
    }
  });
}

// The `k` largest values of a row, largest first (the first index on ties, as a stable sort), into
// vals/ids: one pass that compares 16 values at a time with the k-th best so far and inserts only
// those above it, which after the first few hundred values is rarely any.
template <typename T>
void top_values(const T* row, int64_t width, int64_t k, float* vals, int64_t* ids) {
  int64_t n = 0;
  const auto insert = [&](float v, int64_t i) {
    if (n == k && !(v > vals[k - 1])) return;
    int64_t j = n < k ? n++ : k - 1;
    for (; j > 0 && vals[j - 1] < v; --j) vals[j] = vals[j - 1], ids[j] = ids[j - 1];
    vals[j] = v;
    ids[j] = i;
  };
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + kVec <= width; i += kVec) {
    const __m512 v = load16(row + i);
    __mmask16 above = n < k ? __mmask16{0xFFFF} : _mm512_cmp_ps_mask(v, _mm512_set1_ps(vals[k - 1]), _CMP_GT_OQ);
    while (above) {
      const int lane = __builtin_ctz(above);
      above &= above - 1;
      insert(load(row, i + lane), i + lane);
    }
  }
#endif
  for (; i < width; ++i) insert(load(row, i), i);
}

template <typename T>
void row_logprobs_typed(const at::Tensor& x, const int64_t* rows, const int64_t* targets, int64_t n, int64_t k,
                        float* chosen, float* top_vals, int64_t* top_ids) {
  const int64_t width = x.size(1);
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    SampleScratch s;
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x.data_ptr<T>() + rows[r] * x.stride(0);
      const float mx = row_max(row, width);
      // log-sum-exp from the weights 2^((x - max) log2(e)) summed in double
      const double total = row_weights(row, width, 1.4426950408889634f, mx, s);
      const float lse = mx + static_cast<float>(std::log(total));
      chosen[r] = load(row, targets[r]) - lse;
      if (k == 0) continue;
      top_values(row, width, k, top_vals + r * k, top_ids + r * k);
      for (int64_t j = 0; j < k; ++j) top_vals[r * k + j] -= lse;
    }
  });
}

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU");
  TORCH_CHECK(t.size(-1) == 0 || t.stride(-1) == 1, what, " must have unit stride in its last dimension");
}

#define KVSERVE_DISPATCH(dtype, NAME, ...)                                                       \
  switch (dtype) {                                                                              \
    case at::kFloat: { using NAME = float; __VA_ARGS__; break; }                                 \
    case at::kBFloat16: { using NAME = c10::BFloat16; __VA_ARGS__; break; }                      \
    case at::kHalf: { using NAME = c10::Half; __VA_ARGS__; break; }                              \
    default: TORCH_CHECK(false, "expected float32, bfloat16 or float16, got ", dtype);           \
  }

}  // namespace

// RMSNorm over the last dimension: weight * (x / rms(x)); with `residual` ([rows, dim]), first
// residual += x in place and normalise that sum instead (the decoder's pre-norm residual stream).
at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                    double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(weight.numel() == x.size(-1) && weight.scalar_type() == x.scalar_type(), "weight must be [dim] in x's dtype");
  if (residual.has_value()) TORCH_CHECK(residual->scalar_type() == x.scalar_type(), "residual must be in x's dtype");
  at::Tensor out;
  KVSERVE_DISPATCH(x.scalar_type(), T, out = rms_norm_typed<T>(x, residual, weight, eps));
  return out;
}

// Rotary embedding applied in place to q [tokens, heads, dim] and k [tokens, kv_heads, dim] (views
// into the fused qkv output are fine), at `positions` [tokens] int64.
void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  check_cpu(q, "q");
  check_cpu(k, "k");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "q, k must be [tokens, heads, even dim]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == q.size(2) / 2,
              "cos/sin must be contiguous float32 [positions, dim / 2]");
  at::Tensor pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == q.size(0), "one position per token");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.numel(); ++t)  // a bad position would read outside the tables
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "position ", pp[t], " is outside the rotary table (", cos.size(0), ")");
  KVSERVE_DISPATCH(q.scalar_type(), T,
                   rotary_typed<T>(q, pp, cos.data_ptr<float>(), sin.data_ptr<float>());
                   rotary_typed<T>(k, pp, cos.data_ptr<float>(), sin.data_ptr<float>()));
}

// SiLU(x[..., :n]) * x[..., n:] for x [..., 2n] (the fused gate/up projection's output).
at::Tensor silu_mul(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.size(-1) % 2 == 0, "last dimension must be even (gate then up)");
  at::Tensor out;
  KVSERVE_DISPATCH(x.scalar_type(), T, out = silu_mul_typed<T>(x));
  return out;
}

// sample_rows' and filtered_probs' checks: logits [rows, vocab], one float32 temperature (>= 0) per
// row, and each row's filters ([rows, 3] float32: top_k, top_p, min_p) if given.
static std::vector<RowFilter> row_filters(const at::Tensor& x, const at::Tensor& temps,
                                          const c10::optional<at::Tensor>& filters) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "expected logits [rows, vocab]");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "rows longer than 2^31 values");
  TORCH_CHECK(temps.scalar_type() == at::kFloat && temps.numel() == x.size(0), "one float32 temperature per row");
  TORCH_CHECK(temps.ge(0).all().item<bool>(), "temperatures must be >= 0");
  std::vector<RowFilter> rows;
  if (filters.has_value()) {
    const at::Tensor f = filters->contiguous();
    TORCH_CHECK(f.scalar_type() == at::kFloat && f.dim() == 2 && f.size(0) == x.size(0) && f.size(1) == 3,
                "filters must be float32 [rows, 3]: top_k, top_p, min_p");
    const float* p = f.data_ptr<float>();
    for (int64_t r = 0; r < x.size(0); ++r, p += 3) {
      TORCH_CHECK(p[1] > 0.f && p[1] <= 1.f && p[2] >= 0.f && p[2] <= 1.f, "row ", r, ": top_p must be in (0, 1], min_p in [0, 1]");
      rows.push_back(RowFilter{static_cast<int64_t>(p[0]), p[1], p[2]});
    }
  }
  return rows;
}

// Sampling of logits [rows, vocab] in one call: row r's token from softmax(x_r / temperatures[r]) at
// uniforms[r] in [0, 1] by inverse CDF, as sampler.py's sample_from_probs(filtered_probs(...)), and
// without their float copy, softmax, sort or cumsum over the vocabulary; temperature 0 takes the
// row's argmax. With `filters` ([rows, 3] float32: top_k, top_p, min_p per row, SamplingParams'
// values) each row keeps only the tokens those leave; several times faster than torch's path.
at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& temperatures, const at::Tensor& uniforms,
                       const c10::optional<at::Tensor>& filters) {
  const at::Tensor temps = temperatures.contiguous(), u = uniforms.contiguous();
  const std::vector<RowFilter> rows = row_filters(x, temps, filters);
  TORCH_CHECK(u.scalar_type() == at::kFloat && u.numel() == x.size(0), "one float32 uniform number per row");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  KVSERVE_DISPATCH(x.scalar_type(), T,
                   sample_rows_typed<T>(x, temps.data_ptr<float>(), u.data_ptr<float>(),
                                        rows.empty() ? nullptr : rows.data(), out.data_ptr<int64_t>()));
  return out;
}

// The distributions sample_rows draws from, [rows, vocab] float32 (sampler.py's filtered_probs, which
// takes torch's topk, softmax and cumsum over a float copy): for speculative verification, which
// reads p at the proposed tokens and draws from what rejection leaves.
at::Tensor filtered_probs(const at::Tensor& x, const at::Tensor& temperatures,
                          const c10::optional<at::Tensor>& filters) {
  const at::Tensor temps = temperatures.contiguous();
  const std::vector<RowFilter> rows = row_filters(x, temps, filters);
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kFloat));
  KVSERVE_DISPATCH(x.scalar_type(), T,
                   filtered_probs_typed<T>(x, temps.data_ptr<float>(), rows.empty() ? nullptr : rows.data(),
                                           out.data_ptr<float>()));
  return out;
}

// Log-softmax read at a few places of logits [*, vocab], as sampler.py's token_logprobs needs them:
// for rows[i], the value at targets[i] and the num_top largest (ids and values, largest first, the
// first index on ties). Without the float copy and the [rows, vocab] log_softmax that torch makes,
// which cost more than the rest of sampling, and for prompt_logprobs a large share of a prefill.
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_logprobs(const at::Tensor& x, const at::Tensor& rows,
                                                            const at::Tensor& targets, int64_t num_top) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.size(1) < (int64_t{1} << 31), "expected logits [rows, vocab]");
  TORCH_CHECK(num_top >= 0 && num_top <= x.size(1), "num_top must be in [0, vocab]");
  const at::Tensor r = rows.to(at::kLong).contiguous(), t = targets.to(at::kLong).contiguous();
  TORCH_CHECK(r.dim() == 1 && t.dim() == 1 && r.numel() == t.numel(), "one target per row");
  const int64_t n = r.numel();
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* tp = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < x.size(0), "row ", rp[i], " is outside the logits");
    TORCH_CHECK(tp[i] >= 0 && tp[i] < x.size(1), "token ", tp[i], " is outside the vocabulary");
  }
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor chosen = at::empty({n}, f32), vals = at::empty({n, num_top}, f32);
  at::Tensor ids = at::empty({n, num_top}, x.options().dtype(at::kLong));
  KVSERVE_DISPATCH(x.scalar_type(), T,
                   row_logprobs_typed<T>(x, rp, tp, n, num_top, chosen.data_ptr<float>(), vals.data_ptr<float>(),
                                         ids.data_ptr<int64_t>()));
  return {chosen, vals, ids};
}

// Greedy sampling's argmax over the vocabulary, for logits [rows, vocab]: one pass at memory speed,
// where torch's max(dim=-1) runs far below it on bf16.
at::Tensor argmax_rows(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "expected logits [rows, vocab]");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "rows longer than 2^31 values");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  KVSERVE_DISPATCH(x.scalar_type(), T, argmax_rows_typed<T>(x, out.data_ptr<int64_t>()));
  return out;
}
