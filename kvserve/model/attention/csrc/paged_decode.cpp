// Paged decode attention for the CPU: one query token per sequence, keys and values read in place
// from the block pool (no gathered copy of each sequence's history).
//
// Layout (per layer): k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] in the query's
// dtype, or for a quantized cache (kind 1 = int8, 2 = fp8 e4m3) uint8 rows of head_dim + 2 bytes: the
// values, then a float16 scale for that token and head (see kv_quant.py); rows are dequantized on read.
// A sliding window (window > 0) makes a sequence attend to its last `window` tokens only: every kernel
// walks the block table from that start position (no mask), so the blocks before it are never read.
// Work is split over (sequence, kv head) pairs; the query heads of one GQA group share every
// key/value row they read, so each row is loaded once per group. A bf16 cache with head_dim 64 or
// 128 has its own kernel (decode_bf16), which also splits a few long sequences over the threads.
//
// With AVX-512 and head_dim % 16 == 0 (every cache kind) the kernel makes one pass over the keys and
// values, 16 tokens at a time, with an online softmax (running max and sum per query head); otherwise
// a scalar two-pass fallback.
#include "kernels.h"
#include "simd.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

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

// The first position a sequence of `seq_len` tokens attends to under a sliding window (0: none).
inline int64_t window_start(int64_t seq_len, int64_t window) {
  return window > 0 && seq_len > window ? seq_len - window : 0;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// Row readers: load the (slot, head) row of K or V as float32.
template <typename T>
struct DenseRows {
  const T* base;
  int64_t num_kv_heads, head_dim;
  void load(int64_t slot, int64_t head, float* row) const {
    const T* p = base + (slot * num_kv_heads + head) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) row[d] = to_float(p[d]);
  }
};

inline float fp16_to_float(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, sizeof(h));
  return static_cast<float>(h);
}

struct Int8Rows {
  const uint8_t* base;
  int64_t num_kv_heads, head_dim;
  void load(int64_t slot, int64_t head, float* row) const {
    const uint8_t* p = base + (slot * num_kv_heads + head) * (head_dim + 2);
    const float s = fp16_to_float(p + head_dim);
    const int8_t* v = reinterpret_cast<const int8_t*>(p);
    for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(v[d]) * s;
  }
};

// float8_e4m3fn -> float for all 256 bit patterns, built once.
const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

struct Fp8Rows {
  const uint8_t* base;
  int64_t num_kv_heads, head_dim;
  const float* table;
  void load(int64_t slot, int64_t head, float* row) const {
    const uint8_t* p = base + (slot * num_kv_heads + head) * (head_dim + 2);
    const float s = fp16_to_float(p + head_dim);
    for (int64_t d = 0; d < head_dim; ++d) row[d] = table[p[d]] * s;
  }
};

// Softmax of each of `rows` rows of `len` scores, in place, in float32.
inline void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * len;
    const float mx = *std::max_element(sg, sg + len);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
  }
}

template <typename T, typename Rows>
void decode_one(const T* q, const Rows& k_rows, const Rows& v_rows, const int64_t* table, int64_t t0,
                int64_t seq_end, int64_t block_size, int64_t head, int64_t group, int64_t head_dim, float scale,
                T* out, std::vector<float>& scores, std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& row) {
  const int64_t seq_len = seq_end - t0;  // tokens attended: positions t0 .. seq_end - 1
  scores.assign(group * seq_len, 0.f);
  qf.resize(group * head_dim);
  acc.assign(group * head_dim, 0.f);
  row.resize(head_dim);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(q[g * head_dim + d]) * scale;

  for (int64_t t = 0; t < seq_len; ++t) {
    const int64_t slot = table[(t0 + t) / block_size] * block_size + (t0 + t) % block_size;
    k_rows.load(slot, head, row.data());
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * head_dim;
      float s = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * row[d];
      scores[g * seq_len + t] = s;
    }
  }
  softmax_rows(scores.data(), group, seq_len);
  for (int64_t t = 0; t < seq_len; ++t) {
    const int64_t slot = table[(t0 + t) / block_size] * block_size + (t0 + t) % block_size;
    v_rows.load(slot, head, row.data());
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * seq_len + t];
      float* ag = acc.data() + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * row[d];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = static_cast<T>(acc[g * head_dim + d]);
}

#if defined(__AVX512F__)
constexpr int kChunk = 16;  // tokens handled together: one zmm holds their scores
constexpr int kAhead = 1;   // chunks between the prefetch of a row and its use
using simd::exp2_ps;

// Lane t of the result = the sum of v[t]'s 16 lanes (v is clobbered). A transposing add tree:
// 15 adds and 31 shuffles for all 16 tokens, instead of one slow horizontal reduction per token.
inline __m512 sum16(__m512* v) {
  for (int i = 0; i < 8; ++i)  // 256-bit halves: v[i] = [v_i lanes 0-7 | v_{i+8} lanes 0-7] partial sums
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 4], 0x88), _mm512_shuffle_f32x4(v[i], v[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i) {  // 64-bit pairs
    const __m512d a = _mm512_castps_pd(v[i]), b = _mm512_castps_pd(v[i + 2]);
    v[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
  // r's lanes hold tokens 0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15; put them in order.
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), r);
}

// An online softmax's running max m after a chunk of scores sc; returns the factor by which what
// was summed before must be rescaled (0 on the first chunk, where m = -inf). Checked per lane first,
// so most chunks need no horizontal max.
inline float raise_max(__m512 sc, float& m) {
  if (!_mm512_cmp_ps_mask(sc, _mm512_set1_ps(m), _CMP_GT_OQ)) return 1.f;
  const float m_new = std::max(m, _mm512_reduce_max_ps(sc));
  const float alpha = std::exp2(m - m_new);
  m = m_new;
  return alpha;
}

// Cache kinds of the vectorised kernel: Elem is the stored element type (uint8_t for the quantized kinds).
enum class Kind { kDense, kInt8, kFp8 };

// 16 cache values from p, as float32 (quantized kinds: before the row scale; fp8: / 256, see below).
template <Kind K, typename Elem>
inline __m512 load16(const Elem* p) {
  if constexpr (K == Kind::kInt8) {
    return simd::int8x16_to_ps(p);
  } else if constexpr (K == Kind::kFp8) {
    return simd::fp8x16_to_ps_div256(p);  // the 256 goes into the scale
  } else if constexpr (std::is_same_v<Elem, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<Elem, c10::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {  // bfloat16: the high half of a float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
}

// Per-thread scratch, sized once per call for up to `heads` query heads.
struct Scratch {
  simd::aligned_vector<float> q, kf, vf, acc, l;  // [heads, D] query, [kv heads, 16, D] keys and values as
                                                  // float32, [heads, D] weighted sums of values, [heads, 16]
                                                  // sums of weights
  simd::aligned_vector<float> pv, alpha, m;       // this chunk's [heads, 16] value weights, [heads] rescale
                                                  // factors, [heads] running maxima
  simd::aligned_vector<int16_t> q16;              // [heads, D] the query as int16 (int8 cache), and
  simd::aligned_vector<float> qstep;              // [heads] its step per head
  std::vector<int64_t> rows;             // [seq_len] element offsets of the first head's rows
  Scratch(int64_t heads, int64_t kv_heads, int64_t head_dim)
      : q(heads * head_dim), kf(kv_heads * kChunk * head_dim), vf(kv_heads * kChunk * head_dim),
        acc(heads * head_dim), l(heads * kChunk), pv(heads * kChunk), alpha(heads), m(heads), q16(heads * head_dim),
        qstep(heads) {}
};

// One sequence, kv heads h0 .. h0 + nh - 1: out[i] = softmax(q[i] . K^T * scale) V for their query
// heads i (group per kv head), chunk by chunk, every head of a chunk before the next chunk: a
// token's rows of all these heads are adjacent in the cache, so the reads stream through memory
// (one head at a time read 128 of every 384 bytes and left the prefetchers behind).
// Elem: the cache element type; T: the query/output type. Rows are addressed by index
// (slot * num_kv_heads + head) * stride, stride = D (dense) or D + 2 (quantized: values, fp16 scale).
template <Kind K, int kD, typename Elem, typename T>
void decode_vec(const T* q, const Elem* k_base, const Elem* v_base, int64_t num_kv_heads, const int64_t* table,
                int64_t t0, int64_t seq_end, int64_t block_size, int64_t h0, int64_t nh, int64_t group,
                int64_t head_dim, float scale, T* out, Scratch& s) {
  const int64_t seq_len = seq_end - t0;  // tokens attended: positions t0 .. seq_end - 1
  constexpr bool quantized = K != Kind::kDense;
  const int64_t D = kD ? kD : head_dim, stride = quantized ? D + 2 : D;  // kD: head_dim known at compile time
  const int64_t heads = nh * group;
#if defined(__AVX512BF16__)
  // bf16 cache and query: q.k straight from the cache with vdpbf16ps (exact bf16 products, float32 sums).
  constexpr bool bf16_types = std::is_same_v<Elem, c10::BFloat16> && std::is_same_v<T, c10::BFloat16>;
  const bool bf16_dot = bf16_types && D % 32 == 0;
#else
  constexpr bool bf16_types = false;
  const bool bf16_dot = false;
#endif
  // int8 cache, bf16 / float16 query: q.k in integers (vpdpwssd: int8 keys widened to int16 times the
  // query as int16, 32 products per instruction), the query quantized per head with a step of
  // max|q| / 32767 (relative error ~1e-5, far below the int8 keys' own). Converting each key to
  // float32 through scratch first would cost 2 loads, 2 conversions and a store per 16 values more.
  // float32 queries keep the float path (exact, for quality comparisons).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  constexpr bool int_types = K == Kind::kInt8 && !std::is_same_v<T, float>;
#else
  constexpr bool int_types = false;
#endif
  const bool int_dot = int_types && D % 32 == 0;
  // Scores are kept in base 2 (scaled by log2 e) so the softmax needs only 2^x.
  const float qscale = scale * 1.4426950408889634f * (K == Kind::kFp8 ? 256.f : 1.f);
  if (int_dot) {
    for (int64_t g = 0; g < heads; ++g) {
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_float(q[g * D + d])));
      const float step = amax > 0.f ? amax / 32767.f : 1.f;
      for (int64_t d = 0; d < D; ++d) s.q16[g * D + d] = static_cast<int16_t>(std::nearbyint(to_float(q[g * D + d]) / step));
      s.qstep[g] = step * qscale;
    }
  } else if (!bf16_dot) {
    for (int64_t i = 0; i < heads * D; ++i) s.q[i] = to_float(q[i]) * qscale;
  }
  std::fill(s.acc.begin(), s.acc.begin() + heads * D, 0.f);
  std::fill(s.l.begin(), s.l.begin() + heads * kChunk, 0.f);
  std::fill(s.m.begin(), s.m.begin() + heads, -std::numeric_limits<float>::infinity());

  // Element offset of every token's row of head h0, walking the block table (no division per token).
  if (static_cast<int64_t>(s.rows.size()) < seq_len) s.rows.resize(seq_len);
  for (int64_t t = 0, blk = t0 / block_size, off = t0 % block_size; t < seq_len; ++t) {
    s.rows[t] = ((table[blk] * block_size + off) * num_kv_heads + h0) * stride;
    if (++off == block_size) { off = 0; ++blk; }
  }
  const int64_t span_bytes = nh * stride * static_cast<int64_t>(sizeof(Elem));  // a token's rows of these heads

  for (int64_t start = 0; start < seq_len; start += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, seq_len - start));
    const int64_t* rows = &s.rows[start];
    // The blocks are scattered over the pool: the rows kAhead chunks on are prefetched a line at a
    // time while this chunk is computed (pump() below, once per token and head), so the requests
    // overlap the arithmetic instead of stalling it in one burst when the miss queue is full.
    const int64_t pf_start = start + kAhead * kChunk, pf_end = std::min(seq_len, pf_start + kChunk);
    // (No division in here: it runs four times per token and head, and a modulo per call cost more
    // than an int8 row's arithmetic.)
    int64_t pf_t = pf_start, pf_off = 0;
    bool pf_v = false;  // prefetching the V span of token pf_t (else its K span)
    auto pump = [&](int lines) {
      for (int i = 0; i < lines && pf_t < pf_end; ++i) {
        const char* base = reinterpret_cast<const char*>(pf_v ? v_base : k_base);
        _mm_prefetch(base + s.rows[pf_t] * static_cast<int64_t>(sizeof(Elem)) + pf_off, _MM_HINT_T0);
        pf_off += 64;
        if (pf_off >= span_bytes) {
          pf_off = 0;
          pf_t += pf_v;
          pf_v = !pf_v;
        }
      }
    };
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);

    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t hoff = hh * stride;  // this head's row within a token's span
      float* kf = &s.kf[hh * kChunk * D];
      float* vf = &s.vf[hh * kChunk * D];
      __m512 kscale = _mm512_set1_ps(1.f), vscale = _mm512_set1_ps(1.f);
      // Rows to float32 scratch (keys only where they are not read in place), and (quantized) their scales.
      for (int t = 0; t < n; ++t) {
        const Elem *kr = k_base + rows[t] + hoff, *vr = v_base + rows[t] + hoff;
        for (int64_t d = 0; d < D; d += 16) {
          if (!bf16_dot && !int_dot) _mm512_storeu_ps(&kf[t * D + d], load16<K>(kr + d));
          if constexpr (kD == 0) _mm512_storeu_ps(&vf[t * D + d], load16<K>(vr + d));  // kD: read in place below
        }
      }
      if constexpr (quantized) {
        uint16_t ks[kChunk] = {}, vs[kChunk] = {};
        for (int t = 0; t < n; ++t) {
          std::memcpy(&ks[t], k_base + rows[t] + hoff + D, 2);
          std::memcpy(&vs[t], v_base + rows[t] + hoff + D, 2);
        }
        kscale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ks)));
        vscale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vs)));
        if constexpr (K == Kind::kFp8) vscale = _mm512_mul_ps(vscale, _mm512_set1_ps(256.f));
      }

      for (int64_t g = hh * group; g < (hh + 1) * group; ++g) {  // this kv head's query heads
        // Scores of the n tokens: 16 partial-sum vectors, summed together.
        __m512 part[kChunk];
        for (int t = 0; t < kChunk; ++t) {
          __m512 acc = _mm512_setzero_ps();
          pump(1);
          if (t < n && int_dot) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
            if constexpr (int_types) {
              const auto* kr = reinterpret_cast<const int8_t*>(k_base + rows[t] + hoff);
              __m512i dot = _mm512_setzero_si512();
              for (int64_t d = 0; d < D; d += 32)
                dot = _mm512_dpwssd_epi32(dot, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kr + d))),
                                          _mm512_load_si512(&s.q16[g * D + d]));
              acc = _mm512_cvtepi32_ps(dot);
            }
#endif
          } else if (t < n) {
#if defined(__AVX512BF16__)
            if (bf16_types && bf16_dot) {
              const auto* kr = reinterpret_cast<const uint16_t*>(k_base + rows[t] + hoff);
              const auto* qg = reinterpret_cast<const uint16_t*>(q + g * D);
              for (int64_t d = 0; d < D; d += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(kr + d), (__m512bh)_mm512_loadu_si512(qg + d));
            } else
#endif
            {
              for (int64_t d = 0; d < D; d += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(&kf[t * D + d]), _mm512_loadu_ps(&s.q[g * D + d]), acc);
            }
          }
          part[t] = acc;
        }
        __m512 sc = _mm512_mul_ps(sum16(part), kscale);
        if (bf16_dot) sc = _mm512_mul_ps(sc, _mm512_set1_ps(qscale));
        if (int_dot) sc = _mm512_mul_ps(sc, _mm512_set1_ps(s.qstep[g]));
        sc = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid, sc);

        // Online softmax: rescale what has been summed so far when the max grows.
        float& m = s.m[g];
        const float alpha = raise_max(sc, m);
        const __m512 va = _mm512_set1_ps(alpha);
        const __m512 p = _mm512_maskz_mov_ps(valid, exp2_ps(_mm512_sub_ps(sc, _mm512_set1_ps(m))));
        _mm512_storeu_ps(&s.l[g * kChunk], _mm512_fmadd_ps(_mm512_loadu_ps(&s.l[g * kChunk]), va, p));  // per-lane sums
        float* pv = &s.pv[g * kChunk];  // weights of the value rows (times their scales)
        _mm512_storeu_ps(pv, _mm512_mul_ps(p, vscale));
        s.alpha[g] = alpha;

        if constexpr (kD == 0) {
          // acc[g] = acc[g] * alpha + sum_t pv[t] * v[t], 16 dims at a time, four independent chains.
          float* ag = &s.acc[g * D];
          for (int64_t d = 0; d < D; d += 16) {
            __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(ag + d), va), a1 = _mm512_setzero_ps(), a2 = a1, a3 = a1;
            const float* vd = &vf[d];
            int t = 0;
            for (; t + 4 <= n; t += 4) {
              a0 = _mm512_fmadd_ps(_mm512_set1_ps(pv[t]), _mm512_loadu_ps(vd + t * D), a0);
              a1 = _mm512_fmadd_ps(_mm512_set1_ps(pv[t + 1]), _mm512_loadu_ps(vd + (t + 1) * D), a1);
              a2 = _mm512_fmadd_ps(_mm512_set1_ps(pv[t + 2]), _mm512_loadu_ps(vd + (t + 2) * D), a2);
              a3 = _mm512_fmadd_ps(_mm512_set1_ps(pv[t + 3]), _mm512_loadu_ps(vd + (t + 3) * D), a3);
            }
            for (; t < n; ++t) a0 = _mm512_fmadd_ps(_mm512_set1_ps(pv[t]), _mm512_loadu_ps(vd + t * D), a0);
            _mm512_storeu_ps(ag + d, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
          }
        }
      }
      if constexpr (kD != 0) {
        // acc[g] = acc[g] * alpha[g] + sum_t pv[g][t] * v[t] for kGB query heads at once: each value row
        // is loaded (and converted) once for all of them, straight from the cache, and the kGB * kV
        // running sums in registers are independent chains (one head's 4 chains were latency-bound).
        constexpr int kV = kD / 16, kGB = kV <= 4 ? 4 : 2;
        for (int64_t g0 = hh * group; g0 < (hh + 1) * group; g0 += kGB) {
          const int gb = static_cast<int>(std::min<int64_t>(kGB, (hh + 1) * group - g0));
          __m512 a[kGB][kV];
          for (int j = 0; j < kGB; ++j)
            for (int c = 0; c < kV; ++c)
              a[j][c] = j < gb ? _mm512_mul_ps(_mm512_loadu_ps(&s.acc[(g0 + j) * kD + 16 * c]), _mm512_set1_ps(s.alpha[g0 + j]))
                               : _mm512_setzero_ps();
          for (int t = 0; t < n; ++t) {
            pump(1);
            const Elem* vr = v_base + rows[t] + hoff;
            __m512 v[kV];
            for (int c = 0; c < kV; ++c) v[c] = load16<K>(vr + 16 * c);
            for (int j = 0; j < kGB; ++j) {
              if (j >= gb) break;
              const __m512 w = _mm512_set1_ps(s.pv[(g0 + j) * kChunk + t]);
              for (int c = 0; c < kV; ++c) a[j][c] = _mm512_fmadd_ps(w, v[c], a[j][c]);
            }
          }
          for (int j = 0; j < gb; ++j)
            for (int c = 0; c < kV; ++c) _mm512_storeu_ps(&s.acc[(g0 + j) * kD + 16 * c], a[j][c]);
        }
      }
    }
  }
  for (int64_t g = 0; g < heads; ++g) {
    const float inv = seq_len > 0 ? 1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(&s.l[g * kChunk])) : 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(s.acc[g * D + d] * inv);
  }
}
#endif

#if defined(KVSERVE_AVX2)
// AVX2 (8 lanes), a dense cache (float32 / bf16 / float16 rows, the query's dtype), head_dim a
// multiple of 16: one online-softmax pass over the keys and values, 16 tokens at a time, for one kv
// head and its `group` query heads; it replaces the scalar two-pass kernel above, which is several
// times slower. Chunks of 16 tokens instead of 8 halve the per-chunk softmax work (lane sums, max,
// rescaling).
constexpr int kTok = 16;  // tokens per chunk: two vectors of scores per query head

// Lane t = the sum of v[t]'s 8 lanes.
inline __m256 sum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

struct Scratch8 {
  simd::aligned_vector<float> q, acc, p;  // [group, D] scaled query, [group, D] weighted values, [group, 8] weights
  std::vector<float> m, l;                 // [group] running max and sum of weights
  simd::aligned_vector<float> part;       // [group, 8, 8] per-lane partial dots of each head with each token
  void reset(int64_t group, int64_t head_dim) {
    q.resize(group * head_dim), acc.resize(group * head_dim), p.resize(group * kTok), m.resize(group), l.resize(group);
    part.resize(group * kTok * 8);
  }
};

// part[j][t] (8 floats): lane sums of query head j's dot with token t, for GB heads (q: [GB, D],
// scaled) and the n <= 8 key rows at k_base + rows[t]; each key vector is converted once for all GB
// heads. Tokens t >= n get zeros.
// While token t is computed, the key and value rows of token t of the next chunk (ahead[t], for
// t < n_ahead, else none) are prefetched: spread over the chunk, the requests do not overflow the
// miss queue as one burst of them did.
template <int GB, typename T>
inline void dots8(const T* k_base, const int64_t* rows, int n, const float* q, int64_t D, float* part,
                  const T* v_base, const int64_t* ahead, int n_ahead) {
  for (int t = 0; t < kTok; ++t) {
    if (t < n_ahead) {
      const char* kr = reinterpret_cast<const char*>(k_base + ahead[t]);
      const char* vr = reinterpret_cast<const char*>(v_base + ahead[t]);
      for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
        _mm_prefetch(kr + b, _MM_HINT_T0), _mm_prefetch(vr + b, _MM_HINT_T0);
    }
    __m256 a[GB][2];
    for (int j = 0; j < GB; ++j) a[j][0] = a[j][1] = _mm256_setzero_ps();
    if (t < n) {
      const T* kr = k_base + rows[t];
      for (int64_t d = 0; d < D; d += 16) {
        const __m256 k0 = simd::load8(kr + d), k1 = simd::load8(kr + d + 8);
        for (int j = 0; j < GB; ++j) {
          a[j][0] = _mm256_fmadd_ps(k0, _mm256_load_ps(q + j * D + d), a[j][0]);
          a[j][1] = _mm256_fmadd_ps(k1, _mm256_load_ps(q + j * D + d + 8), a[j][1]);
        }
      }
    }
    for (int j = 0; j < GB; ++j) _mm256_store_ps(part + (j * kTok + t) * 8, _mm256_add_ps(a[j][0], a[j][1]));
  }
}

// acc[j] += sum_t p[j][t] v[t] for GB query heads (acc: [GB, D], p: [GB, 8]) over the n value rows
// at v_base + rows[t], 16 dimensions at a time.
template <int GB, typename T>
inline void weigh8(const T* v_base, const int64_t* rows, int n, const float* p, int64_t D, float* acc) {
  for (int64_t d = 0; d < D; d += 16) {
    __m256 a[GB][2];
    for (int j = 0; j < GB; ++j) a[j][0] = _mm256_load_ps(acc + j * D + d), a[j][1] = _mm256_load_ps(acc + j * D + d + 8);
    for (int t = 0; t < n; ++t) {
      const T* vr = v_base + rows[t] + d;
      const __m256 v0 = simd::load8(vr), v1 = simd::load8(vr + 8);
      for (int j = 0; j < GB; ++j) {
        const __m256 w = _mm256_set1_ps(p[j * kTok + t]);
        a[j][0] = _mm256_fmadd_ps(w, v0, a[j][0]);
        a[j][1] = _mm256_fmadd_ps(w, v1, a[j][1]);
      }
    }
    for (int j = 0; j < GB; ++j) _mm256_store_ps(acc + j * D + d, a[j][0]), _mm256_store_ps(acc + j * D + d + 8, a[j][1]);
  }
}

template <int kD, typename T>
void decode_avx2(const T* q, const T* k_base, const T* v_base, int64_t num_kv_heads, const int64_t* table,
                 int64_t t0, int64_t seq_end, int64_t block_size, int64_t head, int64_t group, int64_t head_dim,
                 float scale, T* out, Scratch8& s) {
  const int64_t seq_len = seq_end - t0;  // tokens attended: positions t0 .. seq_end - 1
  const int64_t D = kD ? kD : head_dim;
  for (int64_t i = 0; i < group * D; ++i) s.q[i] = to_float(q[i]) * scale;
  std::fill(s.acc.begin(), s.acc.begin() + group * D, 0.f);
  std::fill(s.m.begin(), s.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.end(), 0.f);
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  // The block-table walk: the next token's row is at (table[blk], off). Each chunk's rows are
  // found one chunk ahead and prefetched while the chunk before them is computed, a token's rows
  // at a time (dots8): the blocks are scattered over the pool, beyond the hardware prefetchers'
  // reach. They are spread over the chunk: issued in one burst per chunk, they stall the kernel.
  int64_t blk = t0 / block_size, off = t0 % block_size;
  int64_t rows[kTok], next[kTok];
  auto walk = [&](int64_t start, int64_t* out) {
    const int n = static_cast<int>(std::min<int64_t>(kTok, seq_len - start));
    for (int t = 0; t < n; ++t) {
      out[t] = ((table[blk] * block_size + off) * num_kv_heads + head) * D;
      if (++off == block_size) off = 0, ++blk;
    }
    return n;
  };
  int n_next = seq_len > 0 ? walk(0, next) : 0;
  for (int64_t start = 0; start < seq_len; start += kTok) {
    const int n = n_next;
    std::copy(next, next + n, rows);
    n_next = start + kTok < seq_len ? walk(start + kTok, next) : 0;
    const __m256 valid0 = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
    const __m256 valid1 = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n - 8)), _CMP_LT_OQ);
    // q.k: each key row is loaded (and converted) once for up to four query heads.
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      const int pf = g0 == 0 ? n_next : 0;  // the next chunk's rows, prefetched once
      switch (std::min<int64_t>(4, group - g0)) {
        case 4: dots8<4>(k_base, rows, n, &s.q[g0 * D], D, &s.part[g0 * kTok * 8], v_base, next, pf); break;
        case 3: dots8<3>(k_base, rows, n, &s.q[g0 * D], D, &s.part[g0 * kTok * 8], v_base, next, pf); break;
        case 2: dots8<2>(k_base, rows, n, &s.q[g0 * D], D, &s.part[g0 * kTok * 8], v_base, next, pf); break;
        default: dots8<1>(k_base, rows, n, &s.q[g0 * D], D, &s.part[g0 * kTok * 8], v_base, next, pf); break;
      }
    }
    const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t g = 0; g < group; ++g) {
      __m256 part[8];  // scores of tokens 0-7, then 8-15
      for (int t = 0; t < 8; ++t) part[t] = _mm256_load_ps(&s.part[(g * kTok + t) * 8]);
      const __m256 sc0 = _mm256_blendv_ps(neg_inf, sum8(part), valid0);
      for (int t = 0; t < 8; ++t) part[t] = _mm256_load_ps(&s.part[(g * kTok + 8 + t) * 8]);
      const __m256 sc1 = _mm256_blendv_ps(neg_inf, sum8(part), valid1);
      const float mx = simd::hmax8(_mm256_max_ps(sc0, sc1));
      float alpha = 1.f;
      if (mx > s.m[g]) {
        alpha = std::exp(s.m[g] - mx);  // 0 on the first chunk (m = -inf)
        s.m[g] = mx;
      }
      const __m256 m = _mm256_set1_ps(s.m[g]);
      const __m256 p0 = _mm256_and_ps(simd::exp8_nonpositive(_mm256_sub_ps(sc0, m)), valid0);
      const __m256 p1 = _mm256_and_ps(simd::exp8_nonpositive(_mm256_sub_ps(sc1, m)), valid1);
      s.l[g] = s.l[g] * alpha + simd::hsum8(_mm256_add_ps(p0, p1));
      _mm256_store_ps(&s.p[g * kTok], p0);
      _mm256_store_ps(&s.p[g * kTok + 8], p1);
      if (alpha != 1.f) {
        const __m256 va = _mm256_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(&s.acc[g * D + d], _mm256_mul_ps(_mm256_load_ps(&s.acc[g * D + d]), va));
      }
    }
    // acc[g] += sum_t p[g][t] v[t], each value row loaded (and converted) once for up to four heads.
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      float* acc = &s.acc[g0 * D];
      const float* p = &s.p[g0 * kTok];
      switch (std::min<int64_t>(4, group - g0)) {
        case 4: weigh8<4>(v_base, rows, n, p, D, acc); break;
        case 3: weigh8<3>(v_base, rows, n, p, D, acc); break;
        case 2: weigh8<2>(v_base, rows, n, p, D, acc); break;
        default: weigh8<1>(v_base, rows, n, p, D, acc); break;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = seq_len > 0 ? 1.f / s.l[g] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(s.acc[g * D + d] * inv);
  }
}
#endif  // KVSERVE_AVX2

#if defined(__AVX512BF16__)
// bf16 cache and query, head_dim kD = 64 or 128 (the common case): both products on vdpbf16ps.
// q.k as in decode_vec; p.V pairs two tokens per instruction: their value rows are interleaved
// (vpunpck{l,h}wd) so each lane holds one dimension of both, and the pair of weights, rounded to
// bf16 as a GPU flash kernel rounds them, is broadcast. Per token and query head that is 2 + 2
// instructions where decode_vec's float path spent 2 + 4 plus a conversion of every value.
// The interleave puts dimension 32 r + 8 (i / 4) + i % 4 (+ 4 for the high half) in lane i of
// accumulator 2 r (2 r + 1); the result is put back in order once, at the end.
//
// A task is tokens [t0, t1) of one sequence, all its kv heads (nh); it leaves its unnormalized
// state (base-2 running max m, sum of weights l, weighted sum of values acc, per query head) for
// merge_partials, so that a long sequence can be split over threads (flash-decoding).
constexpr int64_t kBf16Ahead = 2;

struct Bf16Scratch {
  simd::aligned_vector<float> acc;   // [heads, kD] weighted value sums, in the interleaved lane order
  simd::aligned_vector<float> l;     // [heads, 16] per-lane sums of the (rounded) weights
  simd::aligned_vector<uint16_t> pb; // [heads, 16] this chunk's weights in bf16
  std::vector<float> m, alpha;       // [heads] running max, this chunk's rescale factor
  std::vector<int64_t> rows;         // [t1 - t0] element offsets of each token's first head's row
  Bf16Scratch(int64_t heads, int64_t head_dim)
      : acc(heads * head_dim), l(heads * kChunk), pb(heads * kChunk), m(heads), alpha(heads) {}
};

// Where a task leaves its state: m[heads], l[heads], acc[heads * kD] (dimensions in order).
struct Partial {
  float* m;
  float* l;
  float* acc;
};

template <int kD>
void decode_bf16(const uint16_t* q, const uint16_t* k_base, const uint16_t* v_base, int64_t nh,
                 const int64_t* table, int64_t block_size, int64_t t0, int64_t t1, int64_t group, float qscale, Partial out, Bf16Scratch& s) {
  constexpr int kR = kD / 32;             // zmm registers per bf16 row
  constexpr int kV = kD / 16;             // float32 accumulators per query head
  constexpr int kQB = 4;                  // query heads scored together (their q in registers)
  constexpr int kGB = kV <= 4 ? 4 : 2;    // query heads summing values together: kGB * kV accumulators
  const int64_t heads = nh * group;
  std::fill(s.acc.begin(), s.acc.begin() + heads * kD, 0.f);
  std::fill(s.l.begin(), s.l.begin() + heads * kChunk, 0.f);
  std::fill(s.m.begin(), s.m.begin() + heads, -std::numeric_limits<float>::infinity());
  const int64_t len = t1 - t0;
  if (static_cast<int64_t>(s.rows.size()) < len) s.rows.resize(len);
  for (int64_t t = t0, blk = t0 / block_size, off = t0 % block_size; t < t1; ++t) {
    s.rows[t - t0] = (table[blk] * block_size + off) * nh * kD;
    if (++off == block_size) { off = 0; ++blk; }
  }
  const int64_t span_lines = (nh * kD * 2 + 63) / 64;  // cache lines of a token's rows (all heads)
  // Rows are asked for kBf16Ahead chunks before they are used (into L2: into L1 evicts rows still
  // in use, and one chunk ahead arrives too late), the first chunks' at once.
  for (int64_t t = 0; t < std::min<int64_t>(len, kBf16Ahead * kChunk); ++t)
    for (int64_t i = 0; i < span_lines; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(k_base + s.rows[t]) + 64 * i, _MM_HINT_T2);
      _mm_prefetch(reinterpret_cast<const char*>(v_base + s.rows[t]) + 64 * i, _MM_HINT_T2);
    }

  for (int64_t start = 0; start < len; start += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, len - start));
    const int64_t* rows = &s.rows[start];
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    // Chunk + kBf16Ahead's rows (scattered blocks) are asked for while this one is computed, a few
    // lines per key row read (all at once, they filled the miss queue and stalled the loads).
    // No division in the pump (decode_vec's lesson): with a modulo per line a token cost 35 ns
    // instead of 26 (one thread, 2,048 tokens, 9 query heads on 3 kv heads of 64).
    const int64_t pf_end = std::min(len, start + (kBf16Ahead + 1) * kChunk);
    int64_t pf_t = start + kBf16Ahead * kChunk, pf_off = 0;  // the next line: byte pf_off of token pf_t's K (then V) span
    bool pf_v = false;
    const int64_t pf_per_row = (2 * span_lines * kChunk + nh * kChunk - 1) / (nh * kChunk);
    auto pump = [&] {
      for (int64_t i = 0; i < pf_per_row && pf_t < pf_end; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>((pf_v ? v_base : k_base) + s.rows[pf_t]) + pf_off, _MM_HINT_T2);
        pf_off += 64;
        if (pf_off == 64 * span_lines) {
          pf_off = 0;
          pf_t += pf_v;
          pf_v = !pf_v;
        }
      }
    };
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t hoff = hh * kD, g_end = (hh + 1) * group;
      // Scores and weights, kQB query heads at a time: each key row is loaded once for them.
      for (int64_t g0 = hh * group; g0 < g_end; g0 += kQB) {
        const int gb = static_cast<int>(std::min<int64_t>(kQB, g_end - g0));
        __m512bh qv[kQB][kR];
        for (int j = 0; j < kQB; ++j)
          for (int r = 0; r < kR; ++r)
            qv[j][r] = (__m512bh)(j < gb ? _mm512_loadu_si512(q + (g0 + j) * kD + 32 * r) : _mm512_setzero_si512());
        __m512 part[kQB][kChunk];
        for (int t = 0; t < kChunk; ++t) {
          pump();
          __m512bh kr[kR];
          for (int r = 0; r < kR; ++r)
            kr[r] = (__m512bh)(t < n ? _mm512_loadu_si512(k_base + rows[t] + hoff + 32 * r) : _mm512_setzero_si512());
          for (int j = 0; j < kQB; ++j) {
            if (j >= gb) break;
            __m512 acc = _mm512_setzero_ps();
            for (int r = 0; r < kR; ++r) acc = _mm512_dpbf16_ps(acc, kr[r], qv[j][r]);
            part[j][t] = acc;
          }
        }
        for (int j = 0; j < gb; ++j) {
          const int64_t g = g0 + j;
          __m512 sc = _mm512_mul_ps(sum16(part[j]), _mm512_set1_ps(qscale));
          sc = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid, sc);
          float& m = s.m[g];
          const float alpha = raise_max(sc, m);
          const __m256i p = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(valid, exp2_ps(_mm512_sub_ps(sc, _mm512_set1_ps(m)))));
          _mm256_store_si256(reinterpret_cast<__m256i*>(&s.pb[g * kChunk]), p);
          // The sum of the weights as rounded, so that they are normalized by what was summed.
          const __m512 pf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(p), 16));
          _mm512_store_ps(&s.l[g * kChunk], _mm512_fmadd_ps(_mm512_load_ps(&s.l[g * kChunk]), _mm512_set1_ps(alpha), pf));
          s.alpha[g] = alpha;
        }
      }
      // Weighted values, kGB query heads at a time, two tokens per instruction.
      for (int64_t g0 = hh * group; g0 < g_end; g0 += kGB) {
        const int gb = static_cast<int>(std::min<int64_t>(kGB, g_end - g0));
        __m512 a[kGB][kV];
        for (int j = 0; j < kGB; ++j)
          for (int c = 0; c < kV; ++c)
            a[j][c] = j < gb ? _mm512_mul_ps(_mm512_load_ps(&s.acc[(g0 + j) * kD + 16 * c]), _mm512_set1_ps(s.alpha[g0 + j]))
                             : _mm512_setzero_ps();
        for (int t = 0; t < n; t += 2) {
          // An odd chunk's last token pairs with itself; its partner's weight is 0.
          const uint16_t* va = v_base + rows[t] + hoff;
          const uint16_t* vb = v_base + rows[t + 1 < n ? t + 1 : t] + hoff;
          __m512bh v[kV];
          for (int r = 0; r < kR; ++r) {
            const __m512i x = _mm512_loadu_si512(va + 32 * r), y = _mm512_loadu_si512(vb + 32 * r);
            v[2 * r] = (__m512bh)_mm512_unpacklo_epi16(x, y);
            v[2 * r + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
          }
          for (int j = 0; j < kGB; ++j) {
            if (j >= gb) break;
            int32_t pair;
            std::memcpy(&pair, &s.pb[(g0 + j) * kChunk + t], sizeof(pair));
            const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < kV; ++c) a[j][c] = _mm512_dpbf16_ps(a[j][c], v[c], w);
          }
        }
        for (int j = 0; j < gb; ++j)
          for (int c = 0; c < kV; ++c) _mm512_store_ps(&s.acc[(g0 + j) * kD + 16 * c], a[j][c]);
      }
    }
  }
  for (int64_t g = 0; g < heads; ++g) {
    out.m[g] = s.m[g];
    out.l[g] = _mm512_reduce_add_ps(_mm512_load_ps(&s.l[g * kChunk]));
    for (int c = 0; c < kV; ++c)
      for (int i = 0; i < 16; ++i)
        out.acc[g * kD + 32 * (c / 2) + 8 * (i / 4) + 4 * (c % 2) + i % 4] = s.acc[g * kD + 16 * c + i];
  }
}

constexpr int64_t kMaxParts = 16;  // token ranges a sequence is cut into at most

// One sequence's output rows from the states of its `parts` tasks over consecutive token ranges:
// out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p, M the largest m_p.
void merge_partials(const float* m, const float* l, const float* acc, int64_t parts, int64_t heads, int64_t head_dim,
                    c10::BFloat16* out) {
  for (int64_t g = 0; g < heads; ++g) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, m[p * heads + g]);
    float total = 0.f, w[kMaxParts];
    for (int64_t p = 0; p < parts; ++p) {
      w[p] = l[p * heads + g] > 0.f ? std::exp2(m[p * heads + g] - mx) : 0.f;
      total += w[p] * l[p * heads + g];
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t d = 0; d < head_dim; ++d) {
      float sum = 0.f;
      for (int64_t p = 0; p < parts; ++p) sum += w[p] * acc[(p * heads + g) * head_dim + d];
      out[g * head_dim + d] = static_cast<c10::BFloat16>(sum * inv);
    }
  }
}

// The bf16 path of paged_decode_attention. With at least two sequences per thread a task is one
// sequence (all its kv heads: their rows are adjacent, so the reads stream); with fewer, each
// sequence's tokens are also cut into ranges of at least kMinSplit tokens so that every thread has
// work (otherwise a long single stream's attention runs on one thread while the others wait).
// Shorter ranges cost more than they share: each starts its reads cold and is merged after, and
// on the default model (3 kv heads of 64) one thread read a few hundred tokens faster alone. The cut
// depends on `split_batch` sequences, not on the rows: a verify step's rows (several per sequence)
// are then cut, and rounded, as a plain decode step of that many sequences cuts each of them.
void run_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
              const at::Tensor& lens, double scale, int64_t window, int64_t split_batch, at::Tensor& out) {
  constexpr int64_t kMinSplit = 512;
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2), block_size = k_cache.size(1), group = num_heads / num_kv_heads;
  const int64_t width = tables.size(1), threads = at::get_num_threads();
  const int64_t* bt = tables.data_ptr<int64_t>();
  const int64_t* sl = lens.data_ptr<int64_t>();
  const int64_t seqs = split_batch > 0 ? split_batch : batch;
  const int64_t want = seqs >= 2 * threads ? 1 : std::min(kMaxParts, (2 * threads + seqs - 1) / seqs);  // parts per sequence
  std::vector<int64_t> first_task(batch + 1, 0), task_seq, task_t0, task_t1;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t first = window_start(sl[b], window), len = sl[b] - first;
    const int64_t parts = std::max<int64_t>(1, std::min(want, len / kMinSplit));
    // Ranges are whole chunks of 16 tokens from the first attended one (the last ends at the sequence's end).
    const int64_t chunks = (len + kChunk - 1) / kChunk;
    for (int64_t p = 0; p < parts; ++p) {
      task_seq.push_back(b);
      task_t0.push_back(first + std::min(len, chunks * p / parts * kChunk));
      task_t1.push_back(first + std::min(len, chunks * (p + 1) / parts * kChunk));
    }
    first_task[b + 1] = static_cast<int64_t>(task_seq.size());
  }
  const int64_t tasks = static_cast<int64_t>(task_seq.size());
  const bool split = tasks > batch;
  // Split sequences leave their tasks' states here for merge_partials; the others finish in their task.
  std::vector<float> m, l, acc;
  if (split) {
    m.resize(tasks * num_heads);
    l.resize(tasks * num_heads);
    acc.resize(tasks * num_heads * head_dim);
  }
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<c10::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<c10::BFloat16>());
  auto* op = out.data_ptr<c10::BFloat16>();
  const float qscale = static_cast<float>(scale) * 1.4426950408889634f;
  auto* f = head_dim == 64 ? decode_bf16<64> : decode_bf16<128>;
  parallel_for_dynamic(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Bf16Scratch s(num_heads, head_dim);
    std::vector<float> own_m(num_heads), own_l(num_heads), own_acc(num_heads * head_dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = task_seq[i];
      const Partial state = split ? Partial{&m[i * num_heads], &l[i * num_heads], &acc[i * num_heads * head_dim]}
                                  : Partial{own_m.data(), own_l.data(), own_acc.data()};
      f(qp + b * num_heads * head_dim, kp, vp, num_kv_heads, bt + b * width, block_size, task_t0[i], task_t1[i], group,
        qscale, state, s);
      if (!split) merge_partials(state.m, state.l, state.acc, 1, num_heads, head_dim, op + b * num_heads * head_dim);
    }
  });
  if (split)
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t i = first_task[b];
      merge_partials(&m[i * num_heads], &l[i * num_heads], &acc[i * num_heads * head_dim], first_task[b + 1] - i,
                     num_heads, head_dim, op + b * num_heads * head_dim);
    }
}
#endif  // __AVX512BF16__

template <typename T, typename Rows>
void run(const at::Tensor& q, const Rows& k_rows, const Rows& v_rows, int64_t block_size, int64_t num_kv_heads,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window, at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t group = num_heads / num_kv_heads, width = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
#if defined(__AVX512F__)
  constexpr Kind kind = std::is_same_v<Rows, Int8Rows> ? Kind::kInt8 : std::is_same_v<Rows, Fp8Rows> ? Kind::kFp8 : Kind::kDense;
  const bool vectorised = head_dim % 16 == 0;
  using Elem = std::remove_const_t<std::remove_pointer_t<decltype(k_rows.base)>>;
#endif
  // A task is one sequence's kv heads (their rows are adjacent, so they stream); with fewer sequences
  // than two per thread, one kv head of one sequence, so that the threads still share the work.
  const int64_t per_task = batch >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / per_task, tasks = batch * tasks_per_seq;
  // A second thread costs a wake-up (tens of microseconds) that a short batch never earns back:
  // split only when there are at least ~64K cached values per thread to read. The AVX2 kernel is
  // slower per value (no bf16 arithmetic), so there a few thousand per thread already pay: on the
  // default model, a single stream's attention from ~64 tokens on (its 3 kv heads over 2 threads).
#if defined(KVSERVE_AVX2)
  constexpr int64_t split_values = int64_t{1} << 13;
#else
  constexpr int64_t split_values = int64_t{1} << 17;
#endif
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) total += sl[b] - window_start(sl[b], window);
  const int64_t grain = total * num_kv_heads * head_dim < split_values ? tasks : 1;
  parallel_for_dynamic(0, tasks, grain, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    if (vectorised) {
      Scratch s(per_task * group, per_task, head_dim);
      auto* f = head_dim == 64 ? decode_vec<kind, 64, Elem, T> : head_dim == 128 ? decode_vec<kind, 128, Elem, T>
                                                                                 : decode_vec<kind, 0, Elem, T>;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / tasks_per_seq, h0 = i % tasks_per_seq * per_task;
        const int64_t offset = (b * num_heads + h0 * group) * head_dim;
        f(qp + offset, k_rows.base, v_rows.base, num_kv_heads, bt + b * width, window_start(sl[b], window), sl[b],
          block_size, h0, per_task, group, head_dim, static_cast<float>(scale), op + offset, s);
      }
      return;
    }
#endif
#if defined(KVSERVE_AVX2)
    if (std::is_same_v<Rows, DenseRows<T>> && head_dim % 16 == 0) {  // a dense cache in the query's dtype
      thread_local Scratch8 s;  // the running thread's, reused: a call per layer and step
      s.reset(group, head_dim);
      auto* f = head_dim == 64 ? decode_avx2<64, T> : head_dim == 128 ? decode_avx2<128, T> : decode_avx2<0, T>;
      const T* kb = reinterpret_cast<const T*>(k_rows.base);
      const T* vb = reinterpret_cast<const T*>(v_rows.base);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / tasks_per_seq;
        for (int64_t h = i % tasks_per_seq * per_task; h < (i % tasks_per_seq + 1) * per_task; ++h) {
          const int64_t offset = (b * num_heads + h * group) * head_dim;
          f(qp + offset, kb, vb, num_kv_heads, bt + b * width, window_start(sl[b], window), sl[b], block_size, h,
            group, head_dim, static_cast<float>(scale), op + offset, s);
        }
      }
      return;
    }
#endif
    std::vector<float> scores, qf, acc, row;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / tasks_per_seq;
      for (int64_t h = i % tasks_per_seq * per_task; h < (i % tasks_per_seq + 1) * per_task; ++h) {
        const int64_t offset = (b * num_heads + h * group) * head_dim;
        decode_one<T, Rows>(qp + offset, k_rows, v_rows, bt + b * width, window_start(sl[b], window), sl[b],
                            block_size, h, group, head_dim, static_cast<float>(scale), op + offset, scores, qf,
                            acc, row);
      }
    }
  });
}

template <typename T>
void run_kind(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
              const at::Tensor& lens, double scale, int64_t kind, int64_t window, int64_t split_batch, at::Tensor& out) {
  [[maybe_unused]] const int64_t split = split_batch;
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), head_dim = q.size(2);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (kind == 0 && k_cache.scalar_type() == at::kBFloat16 && (head_dim == 64 || head_dim == 128)) {
      run_bf16(q, k_cache, v_cache, tables, lens, scale, window, split, out);
      return;
    }
  }
#endif
  if (kind == 0) {
    TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "cache and query dtypes differ");
    run<T>(q, DenseRows<T>{k_cache.data_ptr<T>(), num_kv_heads, head_dim},
           DenseRows<T>{v_cache.data_ptr<T>(), num_kv_heads, head_dim}, block_size, num_kv_heads, tables, lens, scale, window, out);
    return;
  }
  TORCH_CHECK(k_cache.scalar_type() == at::kByte && k_cache.size(3) == head_dim + 2, "quantized cache rows must be uint8 [head_dim + 2]");
  const uint8_t* kp = k_cache.data_ptr<uint8_t>();
  const uint8_t* vp = v_cache.data_ptr<uint8_t>();
  if (kind == 1) run<T>(q, Int8Rows{kp, num_kv_heads, head_dim}, Int8Rows{vp, num_kv_heads, head_dim}, block_size,
                        num_kv_heads, tables, lens, scale, window, out);
  else if (kind == 2) run<T>(q, Fp8Rows{kp, num_kv_heads, head_dim, fp8_table()}, Fp8Rows{vp, num_kv_heads, head_dim, fp8_table()},
                             block_size, num_kv_heads, tables, lens, scale, window, out);
  else TORCH_CHECK(false, "unknown cache kind ", kind);
}

}  // namespace

// q: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (kind 0) or uint8
// [num_blocks, block_size, Hkv, D + 2] (kind 1 int8, 2 fp8); block_tables: [B, W] int64;
// seq_lens: [B] int64; window: attend to each sequence's last `window` tokens (0: all); split_batch:
// the sequences the B rows belong to, for how they are cut over threads (0: B). Returns [B, Hq, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t kind, int64_t window, int64_t split_batch) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) run_kind<float>(q, k_cache, v_cache, tables, lens, scale, kind, window, split_batch, out);
  else if (q.scalar_type() == at::kBFloat16) run_kind<c10::BFloat16>(q, k_cache, v_cache, tables, lens, scale, kind, window, split_batch, out);
  else if (q.scalar_type() == at::kHalf) run_kind<c10::Half>(q, k_cache, v_cache, tables, lens, scale, kind, window, split_batch, out);
  else TORCH_CHECK(false, "unsupported dtype");
  return out;
}
