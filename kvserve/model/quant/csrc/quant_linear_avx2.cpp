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
// Every row of x goes through the same instructions whatever the number of rows in the call, so a
// speculative verify (k + 1 rows) gets for each row bitwise what a 1-row call gives it.
#include "kernels.h"
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
// Rows of W per pass: several share each chunk of x for few rows of x; with more rows of x, fewer,
// so the accumulators (rows of x times rows of W) fit the 16 registers.
constexpr int int_w_rows(int mb) { return mb <= 2 ? 4 : mb <= 4 ? 2 : 1; }

// Rows of W per parallel task: a second thread costs a wake-up (tens of microseconds) that a small
// matrix never earns back, so split only beyond ~256 KB of W per task.
inline int64_t rows_per_task(int64_t row_bytes) { return std::max<int64_t>(16, (int64_t{1} << 18) / row_bytes); }

// The sums of 4 adjacent u8 * s8 products in each int32 lane.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// x quantized: per row, `chunks` blocks of 32 bytes (zero past K), the step of each chunk and the sum
// of step * q over each group (zero-padded to a multiple of 8 groups).
struct QuantizedX {
  std::vector<int8_t, simd::CacheLineAllocator<int8_t>> q;
  std::vector<float> step, xsum;
  int64_t chunks = 0, gpad = 0;
  const int8_t* row_q(int64_t m) const { return q.data() + m * chunks * 32; }
  const float* row_step(int64_t m) const { return step.data() + m * chunks; }
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

// One row of x (k values, k a multiple of 16) into chunk bytes, steps and group sums.
template <typename T>
void quantize_row(const T* x, int64_t k, int64_t group, int64_t chunks, int8_t* q, float* step, float* xsum,
                  int64_t gpad) {
  std::fill(xsum, xsum + gpad, 0.f);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t c = 0; c < chunks; ++c) {
    const bool half = 32 * c + 32 > k;  // the last chunk of a row ending in half a chunk
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = half && i >= 2 ? _mm256_setzero_ps() : simd::load8(x + 32 * c + 8 * i);
    const __m256 amax8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    const float amax = simd::hmax8(amax8);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));  // to nearest even
    _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32 * c), pack_bytes(qi[0], qi[1], qi[2], qi[3]));
    step[c] = amax / 127.f;
    xsum[32 * c / group] += step[c] * hsum_epi32(_mm256_add_epi32(qi[0], qi[1]));
    if (!half) xsum[(32 * c + 16) / group] += step[c] * hsum_epi32(_mm256_add_epi32(qi[2], qi[3]));
  }
}

template <typename T>
void quantize_x(const at::Tensor& x, int64_t group, int64_t groups, QuantizedX& out) {
  const int64_t m = x.size(0), k = x.size(1);
  out.chunks = (k + 31) / 32, out.gpad = (groups + 7) / 8 * 8;
  out.q.resize(m * out.chunks * 32), out.step.resize(m * out.chunks), out.xsum.resize(m * out.gpad);
  const T* xp = x.data_ptr<T>();
  auto rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(xp + r * k, k, group, out.chunks, out.q.data() + r * out.chunks * 32,
                   out.step.data() + r * out.chunks, out.xsum.data() + r * out.gpad, out.gpad);
  };
  if (m <= kIntRows) rows(0, m);  // decode: not worth waking the other threads
  else parallel_for_dynamic(0, m, 16, rows);
}

// Scales and zero points of row n as floats: scales at params[0, groups), zeros at params[gpad, gpad +
// groups) (0 without zero points); the caller keeps the rest of each gpad-long half at zero.
void row_params(const QuantWeightRef& w, int64_t n, int64_t gpad, float* params) {
  const int64_t groups = w.k / w.group;
  float* zeros = params + gpad;
  if (w.factors) {
    const uint8_t* sc = static_cast<const uint8_t*>(w.scales) + n * groups;
    const float fs = w.factors[2 * n], fz = w.factors[2 * n + 1];
    for (int64_t g = 0; g < groups; ++g) params[g] = sc[g] * fs;
    for (int64_t g = 0; w.zeros && g < groups; ++g) zeros[g] = static_cast<const int8_t*>(w.zeros)[n * groups + g] * fz;
    return;
  }
  const c10::Half* sc = static_cast<const c10::Half*>(w.scales) + n * groups;
  const c10::Half* zc = w.zeros ? static_cast<const c10::Half*>(w.zeros) + n * groups : nullptr;
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    _mm256_storeu_ps(params + g, simd::load8(sc + g));
    if (w.zeros) _mm256_storeu_ps(zeros + g, simd::load8(zc + g));
  }
  for (; g < groups; ++g) {
    params[g] = static_cast<float>(sc[g]);
    if (w.zeros) zeros[g] = static_cast<float>(zc[g]);
  }
}

// Chunk c of a row of W as 32 unsigned bytes (`u`) and, for int8, the bytes whose sign x takes (`s`).
// int4: byte j holds value j in its low nibble and 16 + j in its high one. `half`: the chunk has only
// its first 16 values (an int8 row ending in half a chunk): the rest reads as zero.
template <int BITS>
inline void load_chunk(const uint8_t* row, int64_t c, bool half, __m256i& u, __m256i& s) {
  if (BITS == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
    u = _mm256_and_si256(both, _mm256_set1_epi8(15));
    return;
  }
  s = half ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * c)))
           : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c));
  u = _mm256_abs_epi8(s);  // -128 becomes 0x80: 128 as the unsigned operand
}

// The float factor of chunk c's lanes: lanes 0-3 hold its first 16 values, 4-7 its last 16.
template <bool SPLIT>
inline __m256 chunk_scale(const float* scales, const int32_t* group_of, int64_t c) {
  const __m256 lo = _mm256_broadcast_ss(scales + group_of[2 * c]);
  if (!SPLIT) return lo;
  return _mm256_blend_ps(lo, _mm256_broadcast_ss(scales + group_of[2 * c + 1]), 0xF0);
}

// Rows [n, n + NR) of W against MB rows of quantized x (from row m0), into y (float32, ldy = N).
template <int BITS, bool SPLIT, int MB, int NR>
inline void int_block(const QuantWeightRef& w, const int32_t* group_of, const QuantizedX& xq, int64_t m0,
                      const float* params, int64_t n, float* y) {
  const int64_t row_bytes = BITS == 4 ? w.k / 2 : w.k, last = w.k % 32 ? xq.chunks - 1 : xq.chunks;
  __m256 acc[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t c = 0; c < xq.chunks; ++c) {
    for (int r = 0; r < NR; ++r) {
      __m256i u, s = _mm256_setzero_si256();
      load_chunk<BITS>(w.data + (n + r) * row_bytes, c, c == last, u, s);
      const __m256 scale = chunk_scale<SPLIT>(params + r * 2 * xq.gpad, group_of, c);
      for (int m = 0; m < MB; ++m) {
        const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq.row_q(m0 + m) + 32 * c));
        const __m256i d = dot_u8s8(u, BITS == 4 ? xv : _mm256_sign_epi8(xv, s));
        const __m256 f = _mm256_mul_ps(scale, _mm256_broadcast_ss(xq.row_step(m0 + m) + c));
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), f, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    const float* zeros = params + r * 2 * xq.gpad + xq.gpad;
    for (int m = 0; m < MB; ++m) {
      const float* xsum = xq.row_xsum(m0 + m);
      for (int64_t g = 0; w.zeros && g < xq.gpad; g += 8)
        acc[r][m] = _mm256_fmadd_ps(_mm256_loadu_ps(zeros + g), _mm256_loadu_ps(xsum + g), acc[r][m]);
      y[(m0 + m) * w.n + n + r] = simd::hsum8(acc[r][m]);
    }
  }
}

// Rows [n0, n1) of W against every row of x, NR rows of W at a time (the last few one at a time).
template <int BITS, bool SPLIT, int MB>
void int_rows(const QuantWeightRef& w, const int32_t* group_of, const QuantizedX& xq, int64_t m0, int64_t n0,
              int64_t n1, float* params, float* y) {
  constexpr int NR = int_w_rows(MB);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    for (int r = 0; r < NR; ++r) row_params(w, n + r, xq.gpad, params + r * 2 * xq.gpad);
    int_block<BITS, SPLIT, MB, NR>(w, group_of, xq, m0, params, n, y);
  }
  for (; n < n1; ++n) {
    row_params(w, n, xq.gpad, params);
    int_block<BITS, SPLIT, MB, 1>(w, group_of, xq, m0, params, n, y);
  }
}

template <int BITS, bool SPLIT>
at::Tensor int_linear(const QuantWeightRef& w, const at::Tensor& x) {
  const int64_t m = x.size(0), groups = w.k / w.group;
  thread_local QuantizedX xq;  // the calling thread's, reused across calls; the workers read it
  switch (x.scalar_type()) {
    case at::kFloat: quantize_x<float>(x, w.group, groups, xq); break;
    case at::kBFloat16: quantize_x<c10::BFloat16>(x, w.group, groups, xq); break;
    case at::kHalf: quantize_x<c10::Half>(x, w.group, groups, xq); break;
    default: TORCH_CHECK(false, "quant_linear: x must be float32, bfloat16 or float16");
  }
  std::vector<int32_t> group_of(2 * xq.chunks);  // the group of each half-chunk (past K: the last group)
  for (int64_t h = 0; h < 2 * xq.chunks; ++h) group_of[h] = static_cast<int32_t>(std::min(groups - 1, 16 * h / w.group));
  const QuantizedX& xr = xq;
  at::Tensor y = at::empty({m, w.n}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  parallel_for_dynamic(0, w.n, rows_per_task(BITS == 4 ? w.k / 2 : w.k), [&](int64_t n0, int64_t n1) {
    std::vector<float> params(4 * 2 * xr.gpad, 0.f);  // NR rows' scales and zeros, zero-padded
    for (int64_t m0 = 0; m0 < m; m0 += kIntRows)
      with_few_rows<kIntRows>(std::min<int64_t>(kIntRows, m - m0), [&](auto mb) {
        int_rows<BITS, SPLIT, decltype(mb)::value>(w, group_of.data(), xr, m0, n0, n1, params.data(), yp);
      });
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

bool int_linear_avx2_supported(const QuantWeightRef& w, int64_t bits) {
  return w.group % 16 == 0 && (bits == 8 || w.k % 32 == 0);
}

at::Tensor int_linear_avx2(const QuantWeightRef& w, int64_t bits, const at::Tensor& x) {
  TORCH_CHECK(int_linear_avx2_supported(w, bits), "int_linear_avx2: groups must be multiples of 16");
  const bool split = w.group % 32 != 0;
  if (bits == 4) return split ? int_linear<4, true>(w, x) : int_linear<4, false>(w, x);
  return split ? int_linear<8, true>(w, x) : int_linear<8, false>(w, x);
}

#else

bool int_linear_avx2_supported(const QuantWeightRef&, int64_t) { return false; }

at::Tensor int_linear_avx2(const QuantWeightRef&, int64_t, const at::Tensor&) {
  TORCH_CHECK(false, "int_linear_avx2: built without AVX2 (or with AVX-512)");
}

#endif
