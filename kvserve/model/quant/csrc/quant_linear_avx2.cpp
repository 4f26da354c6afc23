// int4 / int8 W times int8 x on AVX2 (no AVX-512): quant_linear's integer path on such a CPU, for
// x of any dtype when the caller asks for quantized activations (quant/methods.py).
//
// Each row of x is quantized once per call to int8 with a step dx per 32-input chunk (amax / 127,
// round to nearest even: the AVX512-VNNI kernels' rule), so 32 weights meet 32 inputs as bytes:
// vpmaddubsw multiplies an unsigned by a signed byte and adds pairs into int16, vpmaddwd adds those
// pairs into int32 (or one vpdpbusd where the compiler has AVX-VNNI). int4 weights are the unsigned
// operand as they are (0..15); int8 weights take the sign trick, |w| times x with w's sign, so each
// int16 pair sum stays below 2 * 128 * 127 and never saturates. Chunk c of row n then adds
// scale[group] * dx[c] * dot to a float accumulator (the two halves of a chunk scale apart where a
// group of 16, 48, ... splits it), and the zero points add sum_g zero[g] * xsum[g], with xsum the sum
// of the *quantized* x over group g: the result is exactly w . x_hat, |x_hat - x| <= dx / 2 per input.
//
// The loop walks W in units of 32 bytes: for int4 a pair of chunks (both nibbles of a 32-byte load
// are used: the low ones hold the first halves of chunks c and c + 1, the high ones their second
// halves), for int8 one chunk. x is stored in the same order, so one unit's products for one row of
// x come out as 8 int32 lanes, lanes 0-3 in chunk c and 4-7 in chunk c + 1 for int4, and take one
// float multiply-add with a per-lane factor (two where a group of 16, 48, ... splits a chunk). int4's
// two byte products are added as int16 before the pairs are summed (at most 2 * 2 * 15 * 127).
//
// Every row of x goes through the same instructions whatever the number of rows in the call, so a
// speculative verify (k + 1 rows) gets for each row bitwise what a 1-row call gives it.
//
// int4 and int8 W repacked as strips at load (methods.py decides; the section at the end) have a kernel
// of their own, with the same quantization of x; W that cannot be cut into strips stays on the rows.
#include "kernels.h"
#include "quant_rows.h"
#include "simd.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(KVSERVE_AVX2)
namespace {

constexpr int kIntRows = 8;  // rows of x per pass over a block of W's rows
// Rows of W per pass: several share each unit of x for few rows of x; with more rows of x, fewer,
// so the accumulators (rows of x times rows of W) fit the 16 registers.
constexpr int int_w_rows(int mb) { return mb <= 2 ? 4 : mb <= 4 ? 2 : 1; }

// Rows of W ahead of the current one to prefetch (a line per 64 bytes read): cold weights come from
// DRAM, which the hardware prefetcher alone did not keep up with; more rows ahead did no better.
constexpr int64_t kPrefetchRows = 16;

// Rows of W per parallel task of a prefill call: split only beyond ~256 KB of W, into equal tasks (not
// a full task and a sliver); decode cuts W its own way (int_linear).
inline int64_t rows_per_task(int64_t rows, int64_t row_bytes) {
  const int64_t tasks = std::max<int64_t>(1, rows * row_bytes / (int64_t{1} << 18));
  return std::max<int64_t>(16, (rows + tasks - 1) / tasks);
}

// The sums of 4 adjacent u8 * s8 products in each int32 lane.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// dot_u8s8(a, b) + dot_u8s8(c, d) for int4 weights (a, c <= 15: the int16 sums cannot overflow).
inline __m256i dot2_u4s8(__m256i a, __m256i b, __m256i c, __m256i d) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b), c, d);
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(a, b), _mm256_maddubs_epi16(c, d)),
                           _mm256_set1_epi16(1));
#endif
}

// x quantized, in the units of W (above): int4, 64 bytes per pair of chunks (the first halves of
// chunks c, c + 1, then their second halves); int8, 32 bytes per chunk. With each unit the 8 lanes'
// steps (dx of the lane's chunk). Rows go in blocks of kIntRows and a block stores unit by unit:
// unit u of its row i at q[((block * units + u) * kIntRows + i) * unit_bytes], so the kernel reaches
// every row of a block from one pointer. xsum: per row, the sum of dx * q over each group
// (zero-padded to a multiple of 8 groups). Chunks past K (an odd last one for int4) are zero.
struct QuantizedX {
  std::vector<int8_t, simd::CacheLineAllocator<int8_t>> q;
  std::vector<float, simd::CacheLineAllocator<float>> step;
  std::vector<float> xsum;
  int64_t units = 0, unit_bytes = 0, gpad = 0;
  const int8_t* block_q(int64_t m0) const { return q.data() + m0 * units * unit_bytes; }  // m0: a multiple of kIntRows
  const float* block_step(int64_t m0) const { return step.data() + m0 * units * 8; }
  const float* row_xsum(int64_t m) const { return xsum.data() + m * gpad; }
};

// 32 int32 values (each within int8) as 32 bytes in order.
inline __m256i pack_bytes(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // undo the per-lane packs
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// 32 inputs v to int8 qi with the step amax / 127 (within +-127), rounded to nearest even; returns amax.
inline float quantize32(const __m256* v, __m256i* qi) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 amax8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  const float amax = simd::hmax8(amax8);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  for (int j = 0; j < 4; ++j) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
  return amax;
}

// Row r of x (k values, a multiple of 16) into its units (see QuantizedX) and its group sums.
template <int BITS, typename T>
void quantize_row(const T* x, int64_t k, int64_t group, QuantizedX& out, int64_t r) {
  float* xsum = out.xsum.data() + r * out.gpad;
  std::fill(xsum, xsum + out.gpad, 0.f);
  const int64_t chunks_per_unit = BITS == 4 ? 2 : 1, block = r / kIntRows, i = r % kIntRows;
  for (int64_t c = 0; 32 * c < k; ++c) {
    const bool half = 32 * c + 32 > k;  // the last chunk of a row ending in half a chunk
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = half && j >= 2 ? _mm256_setzero_ps() : simd::load8(x + 32 * c + 8 * j);
    __m256i qi[4];
    const float amax = quantize32(v, qi);
    const __m256i bytes = pack_bytes(qi[0], qi[1], qi[2], qi[3]);
    const int64_t unit = (block * out.units + c / chunks_per_unit) * kIntRows + i, part = c % chunks_per_unit;
    int8_t* dst = out.q.data() + unit * out.unit_bytes;
    if (BITS == 4) {  // the chunk's first half beside its pair's, then its second half
      _mm_store_si128(reinterpret_cast<__m128i*>(dst + 16 * part), _mm256_castsi256_si128(bytes));
      _mm_store_si128(reinterpret_cast<__m128i*>(dst + 32 + 16 * part), _mm256_extracti128_si256(bytes, 1));
    } else {
      _mm256_store_si256(reinterpret_cast<__m256i*>(dst), bytes);
    }
    const float dx = amax / 127.f;
    std::fill_n(out.step.data() + unit * 8 + 4 * part, 8 / chunks_per_unit, dx);
    xsum[32 * c / group] += dx * hsum_epi32(_mm256_add_epi32(qi[0], qi[1]));
    if (!half) xsum[(32 * c + 16) / group] += dx * hsum_epi32(_mm256_add_epi32(qi[2], qi[3]));
  }
}

template <int BITS, typename T>
void quantize_x(const at::Tensor& x, int64_t group, int64_t groups, QuantizedX& out) {
  const int64_t m = x.size(0), k = x.size(1), padded = (m + kIntRows - 1) / kIntRows * kIntRows;
  out.units = BITS == 4 ? (k + 63) / 64 : (k + 31) / 32, out.unit_bytes = BITS == 4 ? 64 : 32;
  out.gpad = (groups + 7) / 8 * 8;
  out.q.assign(padded * out.units * out.unit_bytes, 0);  // zero: the chunks past K
  out.step.assign(padded * out.units * 8, 0.f);
  out.xsum.resize(m * out.gpad);
  const T* xp = x.data_ptr<T>();
  auto rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row<BITS>(xp + r * k, k, group, out, r);
  };
  if (m <= kIntRows) rows(0, m);  // decode: not worth waking the other threads
  else parallel_for_dynamic(0, m, 16, rows);
}

// Scale factors of a unit's lanes 0-3 and 4-7: the groups of half-chunks h0 and h1.
inline __m256 lane_scales(const float* scales, int32_t h0, int32_t h1) {
  return _mm256_blend_ps(_mm256_broadcast_ss(scales + h0), _mm256_broadcast_ss(scales + h1), 0xF0);
}

// Rows [n, n + NR) of W against MB rows of quantized x (from row m0, a multiple of kIntRows), into y
// (ldy = N, each sum rounded once to Y's dtype). Each row of x and of W is reached from one pointer
// with constant offsets: with a pointer per row GCC ran out of registers at 8 rows and reloaded them
// for every product.
template <int BITS, bool SPLIT, int MB, int NR, typename Y>
inline void int_block(const QuantWeightRef& w, const int32_t* group_of, const QuantizedX& xq, int64_t m0,
                      const float* params, int64_t n, Y* y) {
  const int64_t row_bytes = BITS == 4 ? w.k / 2 : w.k, units = xq.units, gpad = xq.gpad;
  const int64_t last = row_bytes % 32 ? units - 1 : units;  // a unit with only its first 16 bytes, if any
  const int8_t* xb = xq.block_q(m0);
  const float* sb = xq.block_step(m0);
  const uint8_t* wr = w.data + n * row_bytes;
  const __m256i low4 = _mm256_set1_epi8(15);
  __m256 acc[NR][MB];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t u = 0; u < units; ++u) {
    // half-chunks of lanes 0-3 / 4-7: int4, the first (lo) or second (hi) halves of chunks 2u, 2u + 1;
    // int8, the two halves of chunk u
    const int32_t* h = group_of + (BITS == 4 ? 4 * u : 2 * u);
    const int32_t lo0 = h[0], lo1 = BITS == 4 ? h[2] : h[1], hi0 = h[1], hi1 = BITS == 4 ? h[3] : h[1];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const uint8_t* wp = wr + r * row_bytes + 32 * u;
      if (u % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchRows * row_bytes), _MM_HINT_T0);
      const __m256i wv = u == last ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)))
                                   : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
      const float* sc = params + r * 2 * gpad;
      // int8 without split groups: one group for the whole chunk
      const __m256 slo = BITS == 4 || SPLIT ? lane_scales(sc, lo0, lo1) : _mm256_broadcast_ss(sc + lo0);
      if constexpr (BITS == 4) {
        const __m256i wlo = _mm256_and_si256(wv, low4), whi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low4);
        const __m256 shi = SPLIT ? lane_scales(sc, hi0, hi1) : slo;
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          const int8_t* xp = xb + (u * kIntRows + m) * 64;
          const __m256i xlo = _mm256_load_si256(reinterpret_cast<const __m256i*>(xp));
          const __m256i xhi = _mm256_load_si256(reinterpret_cast<const __m256i*>(xp + 32));
          const __m256 dx = _mm256_load_ps(sb + (u * kIntRows + m) * 8);
          if constexpr (SPLIT) {
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(wlo, xlo)), _mm256_mul_ps(slo, dx), acc[r][m]);
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(whi, xhi)), _mm256_mul_ps(shi, dx), acc[r][m]);
          } else {
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2_u4s8(wlo, xlo, whi, xhi)), _mm256_mul_ps(slo, dx),
                                        acc[r][m]);
          }
        }
      } else {
        const __m256i wabs = _mm256_abs_epi8(wv);  // -128 becomes 0x80: 128 as the unsigned operand
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(xb + (u * kIntRows + m) * 32));
          const __m256 dx = _mm256_load_ps(sb + (u * kIntRows + m) * 8);
          const __m256i d = dot_u8s8(wabs, _mm256_sign_epi8(xv, wv));
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(slo, dx), acc[r][m]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    const float* zeros = params + r * 2 * gpad + gpad;
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      __m256 sum = acc[r][m];
      const float* xsum = xq.row_xsum(m0 + m);
      for (int64_t g = 0; w.zeros && g < gpad; g += 8)
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(zeros + g), _mm256_loadu_ps(xsum + g), sum);
      y[(m0 + m) * w.n + n + r] = static_cast<Y>(simd::hsum8(sum));
    }
  }
}

// Rows [n0, n1) of W against MB rows of x from m0, NR rows of W at a time (the last few one at a time).
// params: every row's scales and zeros from n0 on, converted already (`converted`), or room for NR
// rows', converted here.
template <int BITS, bool SPLIT, int MB, typename Y>
void int_rows(const QuantWeightRef& w, const int32_t* group_of, const QuantizedX& xq, int64_t m0, int64_t n0,
              int64_t n1, float* params, bool converted, Y* y) {
  constexpr int NR = int_w_rows(MB);
  const int64_t per_row = 2 * xq.gpad;
  const auto rows_at = [&](int64_t n, int rows) {
    if (converted) return params + (n - n0) * per_row;
    for (int r = 0; r < rows; ++r) row_scales_zeros(w, n + r, params + r * per_row, params + r * per_row + xq.gpad);
    return params;
  };
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) int_block<BITS, SPLIT, MB, NR>(w, group_of, xq, m0, rows_at(n, NR), n, y);
  for (; n < n1; ++n) int_block<BITS, SPLIT, MB, 1>(w, group_of, xq, m0, rows_at(n, 1), n, y);
}

// f(T{}) for x's dtype T: the kernels read x and write y in it.
template <typename F>
at::Tensor with_x_dtype(const at::Tensor& x, const F& f) {
  switch (x.scalar_type()) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, "quant_linear: x must be float32, bfloat16 or float16");
  }
}

template <int BITS, bool SPLIT, typename T>
at::Tensor int_linear(const QuantWeightRef& w, const at::Tensor& x) {
  const int64_t m = x.size(0), groups = w.k / w.group;
  thread_local QuantizedX xq;  // the calling thread's, reused across calls; the workers read it
  quantize_x<BITS, T>(x, w.group, groups, xq);
  // The group of each half-chunk of the units (past K: the last group, where x is zero).
  std::vector<int32_t> group_of(xq.units * xq.unit_bytes / 16);
  for (size_t h = 0; h < group_of.size(); ++h)
    group_of[h] = static_cast<int32_t>(std::min<int64_t>(groups - 1, 16 * static_cast<int64_t>(h) / w.group));
  const QuantizedX& xr = xq;
  at::Tensor y = at::empty({m, w.n}, x.options());  // in x's dtype: each output rounded once, as y.to() would
  T* yp = y.data_ptr<T>();
  const int64_t row_bytes = BITS == 4 ? w.k / 2 : w.k;
  const auto rows = [&](int64_t n0, int64_t n1) {
    // Several blocks of x (prefill): the task's rows' scales and zeros converted once, not once per
    // block; one block (decode) converts each row's as it reaches it, in L1 (converting the task's
    // rows first made decode ~20% slower).
    const bool converted = m > kIntRows;
    thread_local std::vector<float> params;  // the running thread's, reused across pieces and calls
    params.assign((converted ? n1 - n0 : 4) * 2 * xr.gpad, 0.f);  // zero-padded per row
    for (int64_t n = n0; converted && n < n1; ++n) {
      float* row = params.data() + (n - n0) * 2 * xr.gpad;
      row_scales_zeros(w, n, row, row + xr.gpad);
    }
    for (int64_t m0 = 0; m0 < m; m0 += kIntRows)
      with_few_rows<kIntRows>(std::min<int64_t>(kIntRows, m - m0), [&](auto mb) {
        int_rows<BITS, SPLIT, decltype(mb)::value>(w, group_of.data(), xr, m0, n0, n1, params.data(), converted, yp);
      });
  };
  if (m <= kIntRows) {
    // Decode: both threads stream shares of W in pieces of ~32 KB, cut at blocks of 4 rows (int_rows'
    // widest). Splitting only beyond 256 KB of W, as for prefill, left the default model's layers to
    // one thread: its single stream decoded ~20% slower.
    const int64_t quads = (w.n + 3) / 4;
    parallel_for_streams(quads, std::max<int64_t>(1, (int64_t{1} << 15) / (4 * row_bytes)), [&](int64_t q0, int64_t q1) {
      rows(4 * q0, std::min(w.n, 4 * q1));
    });
  } else {
    parallel_for_dynamic(0, w.n, rows_per_task(w.n, row_bytes), rows);
  }
  return y;
}

// ---- int4 and int8 W repacked as strips (packing.to_strips; quant_linear.cpp's strips section) ------
// A lane is an output channel, so neither the scales nor the sums cross lanes. int4: W's 64-byte
// vector j of chunk c holds channels 0-7 of the strip in its first 32 bytes and 8-15 in its second;
// each half is multiplied with x's inputs 32c + 8j .. + 3 (low nibbles) and + 4 .. + 7 (high
// nibbles), broadcast. A chunk's 8 int16 pair sums per lane add up in int16 (at most 8 * 2 * 15 * 127
// = 30480) before one vpmaddwd makes them int32. int8: vector j (of 8) holds w + 128 for inputs
// 32c + 4j .. + 3, channels 0-7 then 8-15; flipping the top bit gives w back for the sign trick, and
// each product goes to int32 at once. Then one multiply-add applies the 8 channels' scales times dx.
// Against the row-major kernel above this drops the per-row scale conversion, the blended per-lane
// scales and every row's horizontal sum: the default model's decode step spent most of its kernel
// time there (for its int8 head, ~0.7x the rows' time on Zen 3).
struct StripXAvx2 {  // rows of x quantized for the strip kernel, each row at a stride of its own
  const int8_t* q;     // [rows][k]: int8, natural order
  const float* step;   // [rows][chunks]: dx of each chunk
  const float* xsum;   // [rows][groups]: sum of dx * q over each group (the zero points' term)
  int64_t k, chunks, groups;
};

// Row x (k values, a multiple of 32) quantized per chunk of 32 as quantize_row does it.
template <typename T>
void quantize_strip_row(const T* x, int64_t k, int64_t group, int8_t* q, float* step, float* xsum) {
  std::fill(xsum, xsum + k / group, 0.f);
  for (int64_t c = 0; c < k / 32; ++c) {
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = simd::load8(x + 32 * c + 8 * j);
    __m256i qi[4];
    const float amax = quantize32(v, qi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * c), pack_bytes(qi[0], qi[1], qi[2], qi[3]));
    step[c] = amax / 127.f;
    xsum[32 * c / group] += step[c] * hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
  }
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// 8 channels' scales (CODED: the codes) or zero points of group g of strip s, from channel 8 * half.
template <bool CODED>
inline __m256 strip_scales8(const QuantWeightRef& w, int64_t at) {
  if (CODED) return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(w.scales) + at))));
  return simd::load8(static_cast<const c10::Half*>(w.scales) + at);
}
template <bool CODED>
inline __m256 strip_zeros8(const QuantWeightRef& w, int64_t at) {
  if (CODED) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(w.zeros) + at))));
  return simd::load8(static_cast<const c10::Half*>(w.zeros) + at);
}

// How far ahead (bytes) the strip kernel prefetches W into L1, as the VNNI strip kernel does.
constexpr int64_t kStripPrefetchBytes = 4096;

// f(j) for j in [0, N): unrolled for one row of x; for several, one j at a time. Unrolled, GCC
// computed every product of the chunk first and spilled them to the stack: with several rows each
// row cost as much as a 1-row call (verify steps, prefill).
template <int N, int MB, typename F>
inline void chunk_parts(const F& f) {
  if constexpr (MB == 1) {
    for (int j = 0; j < N; ++j) f(j);
  } else {
#pragma GCC unroll 1
    for (int j = 0; j < N; ++j) f(j);
  }
}

// The int32 sums, per channel of H halves of a strip from `half`, of int4 chunk c's products with MB
// rows of x (wc: the chunk's first byte of that half), at sum[h * MB + m].
template <int MB, int H>
inline void chunk_dot4(const uint8_t* wc, const StripXAvx2& x, int64_t c, __m256i* sum) {
  const __m256i low4 = _mm256_set1_epi8(15);
  __m256i pairs[H * MB];
  for (int i = 0; i < H * MB; ++i) pairs[i] = _mm256_setzero_si256();
  const auto quarter = [&](int j) {
    for (int h = 0; h < H; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 64 * j + 32 * h));
      const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xm = x.q + m * x.k + 32 * c + 8 * j;
        pairs[h * MB + m] = _mm256_add_epi16(pairs[h * MB + m],
                                             _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(xm)),
                                                              _mm256_maddubs_epi16(hi, broadcast4(xm + 4))));
      }
    }
  };
  chunk_parts<4, MB>(quarter);
  for (int i = 0; i < H * MB; ++i) sum[i] = _mm256_madd_epi16(pairs[i], _mm256_set1_epi16(1));
}

// The same for int8 chunk wc (w + 128 as bytes): |w| times x with w's sign, into int32 at once.
template <int MB, int H>
inline void chunk_dot8(const uint8_t* wc, const StripXAvx2& x, int64_t c, __m256i* sum) {
  for (int i = 0; i < H * MB; ++i) sum[i] = _mm256_setzero_si256();
  const auto eighth = [&](int j) {
    for (int h = 0; h < H; ++h) {
      const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 64 * j + 32 * h)),
                                         _mm256_set1_epi8(static_cast<char>(0x80)));
      const __m256i wabs = _mm256_abs_epi8(w);
      for (int m = 0; m < MB; ++m)
        sum[h * MB + m] = _mm256_add_epi32(sum[h * MB + m],
                                           dot_u8s8(wabs, _mm256_sign_epi8(broadcast4(x.q + m * x.k + 32 * c + 4 * j), w)));
    }
  };
  chunk_parts<8, MB>(eighth);
}

// Channels 16s + 8 half .. + 8 (half + H) - 1 of W against MB rows of x, into y (rows at ldy), stored
// in Y's dtype. One row takes both halves in one pass (H = 2): they share x's broadcasts, and the two
// halves' independent sums keep more work in flight (1.15-1.2x from memory on a Zen 3); several rows
// go half by half, for want of registers. Each channel's sum is the same either way.
template <int BITS, bool CODED, int MB, int H, typename Y>
void strip_halves(const QuantWeightRef& w, const StripXAvx2& x, int64_t s, int half, Y* y, int64_t ldy) {
  constexpr int64_t kChunkBytes = BITS == 4 ? 256 : 512;
  const int64_t per_group = w.group / 32;
  const uint8_t* ws = w.data + s * x.chunks * kChunkBytes + 32 * half;
  __m256 acc[H * MB], zacc[H * MB];
  for (int i = 0; i < H * MB; ++i) acc[i] = zacc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < x.groups; ++g) {
    const int64_t at = (s * x.groups + g) * 16 + 8 * half;
    __m256 scale[H];
    for (int h = 0; h < H; ++h) scale[h] = strip_scales8<CODED>(w, at + 8 * h);
    for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
      const uint8_t* wc = ws + c * kChunkBytes;
      if (half == 0)  // a second pass over half 1 reads the same lines, from L1
        for (int64_t line = 0; line < kChunkBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(wc + kStripPrefetchBytes + line), _MM_HINT_T0);
      __m256i sum[H * MB];
      if constexpr (BITS == 4) chunk_dot4<MB, H>(wc, x, c, sum);
      else chunk_dot8<MB, H>(wc, x, c, sum);
      for (int h = 0; h < H; ++h)
        for (int m = 0; m < MB; ++m)
          acc[h * MB + m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h * MB + m]),
                                            _mm256_mul_ps(scale[h], _mm256_set1_ps(x.step[m * x.chunks + c])),
                                            acc[h * MB + m]);
    }
    if (w.zeros) {
      for (int h = 0; h < H; ++h) {
        const __m256 zero = strip_zeros8<CODED>(w, at + 8 * h);
        for (int m = 0; m < MB; ++m)
          zacc[h * MB + m] = _mm256_fmadd_ps(zero, _mm256_set1_ps(x.xsum[m * x.groups + g]), zacc[h * MB + m]);
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    for (int m = 0; m < MB; ++m) {
      __m256 out;
      if (CODED) {
        const float* f = w.factors + s * 32 + 8 * (half + h);  // the strip's 16 scale steps, then its 16 zero steps
        out = _mm256_fmadd_ps(acc[h * MB + m], _mm256_loadu_ps(f), _mm256_mul_ps(zacc[h * MB + m], _mm256_loadu_ps(f + 16)));
      } else {
        out = _mm256_add_ps(acc[h * MB + m], zacc[h * MB + m]);
      }
      simd::store8(y + m * ldy + 16 * s + 8 * (half + h), out);
    }
  }
}

template <int BITS, bool CODED, typename T>
at::Tensor strip_linear(const QuantWeightRef& w, const at::Tensor& x) {
  const int64_t m = x.size(0), chunks = w.k / 32, groups = w.k / w.group, strips = w.n / 16;
  // The calling thread's buffers, reused across calls; the workers reach them through these pointers
  // (a thread_local named inside a worker would be the worker's own).
  thread_local simd::aligned_vector<int8_t> q_buf;
  thread_local std::vector<float> step_buf, xsum_buf;
  q_buf.resize(m * w.k), step_buf.resize(m * chunks), xsum_buf.resize(m * groups);
  int8_t* q = q_buf.data();
  float* step = step_buf.data();
  float* xsum = xsum_buf.data();
  const T* xp = x.data_ptr<T>();
  auto quantize = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_strip_row(xp + r * w.k, w.k, w.group, q + r * w.k, step + r * chunks, xsum + r * groups);
  };
  if (m <= kIntRows) quantize(0, m);  // decode: not worth waking the other threads
  else parallel_for_dynamic(0, m, 16, quantize);
  // y in x's dtype, each output rounded once as it is stored (as float32 y.to(dtype) would round it).
  at::Tensor y = at::empty({m, w.n}, x.options());
  T* yp = y.data_ptr<T>();
  // Each thread streams its share of the strips (pieces of ~32 KB of W); a strip's every block of
  // x runs while the strip is in L1, so prefill also reads W once.
  const int64_t strip_bytes = chunks * (BITS == 4 ? 256 : 512);
  parallel_for_streams(strips, std::max<int64_t>(1, (int64_t{1} << 15) / strip_bytes), [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s)
      for (int64_t m0 = 0; m0 < m; m0 += 4) {
        const StripXAvx2 xs{q + m0 * w.k, step + m0 * chunks, xsum + m0 * groups, w.k, chunks, groups};
        with_few_rows<4>(std::min<int64_t>(4, m - m0), [&](auto mb) {
          constexpr int MB = decltype(mb)::value, H = MB == 1 ? 2 : 1;
          for (int half = 0; half < 2; half += H) strip_halves<BITS, CODED, MB, H>(w, xs, s, half, yp + m0 * w.n, w.n);
        });
      }
  });
  return y;
}

}  // namespace

bool int_linear_avx2_supported(const QuantWeightRef& w, int64_t bits) {
  return w.group % 16 == 0 && (bits == 8 || w.k % 32 == 0);
}

at::Tensor int_linear_avx2(const QuantWeightRef& w, int64_t bits, const at::Tensor& x) {
  TORCH_CHECK(int_linear_avx2_supported(w, bits), "int_linear_avx2: groups must be multiples of 16");
  const bool split = w.group % 32 != 0;
  return with_x_dtype(x, [&](auto t) {
    using T = decltype(t);
    if (bits == 4) return split ? int_linear<4, true, T>(w, x) : int_linear<4, false, T>(w, x);
    return split ? int_linear<8, true, T>(w, x) : int_linear<8, false, T>(w, x);
  });
}

bool strip_linear_avx2_supported(int64_t bits) { return bits == 4 || bits == 8; }

at::Tensor strip_linear_avx2(const QuantWeightRef& w, int64_t bits, const at::Tensor& x) {
  TORCH_CHECK(strip_linear_avx2_supported(bits), "strip_linear_avx2: int4 or int8 only");
  return with_x_dtype(x, [&](auto t) {
    using T = decltype(t);
    if (bits == 4) return w.factors ? strip_linear<4, true, T>(w, x) : strip_linear<4, false, T>(w, x);
    return w.factors ? strip_linear<8, true, T>(w, x) : strip_linear<8, false, T>(w, x);
  });
}

#else

bool int_linear_avx2_supported(const QuantWeightRef&, int64_t) { return false; }
bool strip_linear_avx2_supported(int64_t) { return false; }

at::Tensor strip_linear_avx2(const QuantWeightRef&, int64_t, const at::Tensor&) {
  TORCH_CHECK(false, "strip_linear_avx2: built without AVX2 (or with AVX-512)");
}

at::Tensor int_linear_avx2(const QuantWeightRef&, int64_t, const at::Tensor&) {
  TORCH_CHECK(false, "int_linear_avx2: built without AVX2 (or with AVX-512)");
}

#endif
