// Weight-only quantized matmul for the CPU: y = x W^T, with W stored as int8 or packed int4 values
// plus a scale (and optional zero point) per group of `group` inputs:
//     w[n][k] = q[n][k] * scale[n][k / group] + zero[n][k / group]
// Scales and zeros are either float16, or 8-bit codes of a per-row step (`factors` [N, 2] float32):
//     scale = scale_code (uint8) * factors[n][0],  zero = zero_code (int8) * factors[n][1]
//
// int8: qweight int8 [N, K].
// int4: qweight uint8 [N, K / 2]. Each row is cut into chunks of 32 values; chunk c is bytes
//       16c .. 16c + 15, byte 16c + j holding value 32c + j in its low nibble and 32c + 16 + j in
//       its high nibble (llama.cpp's Q4_0 order, so GGUF Q4 blocks copy straight in).
//
// On CPUs with VNNI and without AMX, W may instead be repacked at load as strips of 16 output channels
// (qweight [S, C, 256 or 512], see the strips' section), which a kernel of its own reads for up to a
// few hundred rows of 16-bit x; past those rows, and for float32 x, tiles of W are dequantized for
// at::mm as for rows. On AVX2 int4 W is repacked the same way; quant_linear_avx2.cpp's strip kernel
// serves every number of rows there, x quantized to int8.
//
// Few rows of x (decode): a fused kernel reads each weight once and uses it for up to kFusedRows rows
// of x; memory traffic is the packed weight only. Where the caller asks for quantized activations
// (quantize_x), x is quantized to int8 per 32 inputs and multiplied with W's nibbles as bytes: with
// VNNI int4_fused and int8_fused below, on AVX2 quant_linear_avx2.cpp (which serves every number of
// rows there). Otherwise each weight is dequantized to float in registers.
// More rows (up to max_mid_rows): bf16 x with AMX present: 16 x 32 tiles of W dequantized in
// registers straight into AMX A tiles; AVX2 without AVX-512: float32 panels of W (below). Many rows
// (prefill) or other CPUs: dequantize a tile of W into x's dtype and hand it to at::mm (oneDNN, MKL),
// so the dequantization is amortised over every row of x.
#include "kernels.h"
#include "quant_rows.h"
#include "simd.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <vector>
#if defined(__AVX512F__) || defined(KVSERVE_AVX2)
#include <immintrin.h>
#endif

namespace {

constexpr int kFusedRows = 4;  // rows of x that share one pass over the weights
constexpr int64_t kDenseTileBytes = int64_t{1} << 20;  // dense_tiled's float32 tile of W

struct QuantWeight : QuantWeightRef {  // the fields are kernels.h's, shared with the AVX2 file
  int64_t row_bytes(int bits) const { return bits == 4 ? k / 2 : bits == 8 ? k : 2 * k; }
  int64_t groups() const { return k / group; }
};

// Float scales and zeros of row n, converted once per row into `buf` (2 * groups floats).
inline void row_params(const QuantWeight& w, int64_t n, float* buf) { row_scales_zeros(w, n, buf, buf + w.groups()); }

// The group of every half-chunk (16 values) of a row: a division per chunk costs more than the chunk.
std::vector<int32_t> half_chunk_groups(const QuantWeight& w) {
  std::vector<int32_t> out((w.k + 15) / 16);
  for (size_t h = 0; h < out.size(); ++h) out[h] = static_cast<int32_t>(h * 16 / w.group);
  return out;
}

// ---- fused dequantize + dot, rows [n0, n1) of W against MB rows of x (float32) ----------------------
#if defined(__AVX512F__)
// Chunk c (values 32c .. 32c + 31) of a row, dequantized: lo = values 0-15, hi = 16-31 of the chunk;
// g0 / g1: the groups of the two halves (equal unless groups of 16).
template <int BITS>
inline void dequant_chunk(const uint8_t* row, int64_t c, const float* params, int64_t groups, int64_t g0, int64_t g1,
                          __m512& lo, __m512& hi) {
  if (BITS == 16) {  // a dense bf16 row: bf16 -> float is a 16-bit shift
    const uint16_t* r = reinterpret_cast<const uint16_t*>(row) + c * 32;
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r))), 16));
    hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 16))), 16));
    return;
  }
  __m512i q0, q1;
  if (BITS == 4) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 16)));
    q0 = _mm512_and_si512(v, _mm512_set1_epi32(15)), q1 = _mm512_srli_epi32(v, 4);
  } else {
    q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 32)));
    q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 32 + 16)));
  }
  lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), _mm512_set1_ps(params[g0]), _mm512_set1_ps(params[groups + g0]));
  hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), _mm512_set1_ps(params[g1]), _mm512_set1_ps(params[groups + g1]));
}

// group_of[h]: the group of half-chunk h (values 16h .. 16h + 15), precomputed once per call.
template <int BITS, int MB>
void fused_rows(const QuantWeight& w, const int32_t* group_of, const float* x, int64_t ldx, int64_t n0, int64_t n1,
                float* y, int64_t ldy) {
  const int64_t groups = w.groups(), chunks = w.k / 32;
  std::vector<float> params(2 * groups);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.data + n * w.row_bytes(BITS);
    if (BITS != 16) row_params(w, n, params.data());
    __m512 acc[4][MB];  // two chunks per step, four independent chains per row of x
    for (int m = 0; m < MB; ++m) acc[0][m] = acc[1][m] = acc[2][m] = acc[3][m] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 2 <= chunks; c += 2) {
      __m512 lo0, hi0, lo1, hi1;
      dequant_chunk<BITS>(row, c, params.data(), groups, group_of[2 * c], group_of[2 * c + 1], lo0, hi0);
      dequant_chunk<BITS>(row, c + 1, params.data(), groups, group_of[2 * c + 2], group_of[2 * c + 3], lo1, hi1);
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + m * ldx + c * 32;
        acc[0][m] = _mm512_fmadd_ps(lo0, _mm512_loadu_ps(xm), acc[0][m]);
        acc[1][m] = _mm512_fmadd_ps(hi0, _mm512_loadu_ps(xm + 16), acc[1][m]);
        acc[2][m] = _mm512_fmadd_ps(lo1, _mm512_loadu_ps(xm + 32), acc[2][m]);
        acc[3][m] = _mm512_fmadd_ps(hi1, _mm512_loadu_ps(xm + 48), acc[3][m]);
      }
    }
    if (c < chunks) {
      __m512 lo, hi;
      dequant_chunk<BITS>(row, c, params.data(), groups, group_of[2 * c], group_of[2 * c + 1], lo, hi);
      for (int m = 0; m < MB; ++m) {
        acc[0][m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + m * ldx + c * 32), acc[0][m]);
        acc[1][m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + m * ldx + c * 32 + 16), acc[1][m]);
      }
    }
    if (w.k % 32) {  // int8 rows ending in half a chunk (groups of 16)
      const int64_t k = chunks * 32, g = group_of[2 * chunks];
      const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)));
      const __m512 wv = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(params[g]), _mm512_set1_ps(params[groups + g]));
      for (int m = 0; m < MB; ++m) acc[0][m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * ldx + k), acc[0][m]);
    }
    for (int m = 0; m < MB; ++m)
      y[m * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0][m], acc[1][m]), _mm512_add_ps(acc[2][m], acc[3][m])));
  }
}
#elif defined(KVSERVE_AVX2)
// The same with 8 lanes (AVX2 + FMA): chunk c of a row dequantized into v[0..3] = values 0-7, 8-15,
// 16-23 and 24-31 of the chunk; g0 / g1 the groups of its two halves.
template <int BITS>
inline void dequant_chunk(const uint8_t* row, int64_t c, const float* params, int64_t groups, int64_t g0, int64_t g1,
                          __m256 v[4]) {
  if (BITS == 16) {  // a dense bf16 row
    const c10::BFloat16* r = reinterpret_cast<const c10::BFloat16*>(row) + c * 32;
    for (int i = 0; i < 4; ++i) v[i] = simd::load8(r + 8 * i);
    return;
  }
  __m256i q[4];
  if (BITS == 4) {  // byte j: value j in its low nibble, value 16 + j in its high one
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 16));
    const __m256i a0 = _mm256_cvtepu8_epi32(b), a1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256i m15 = _mm256_set1_epi32(15);
    q[0] = _mm256_and_si256(a0, m15), q[1] = _mm256_and_si256(a1, m15);
    q[2] = _mm256_srli_epi32(a0, 4), q[3] = _mm256_srli_epi32(a1, 4);
  } else {
    const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 32));
    const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 32 + 16));
    q[0] = _mm256_cvtepi8_epi32(b0), q[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(b0, 8));
    q[2] = _mm256_cvtepi8_epi32(b1), q[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(b1, 8));
  }
  const __m256 s0 = _mm256_set1_ps(params[g0]), z0 = _mm256_set1_ps(params[groups + g0]);
  const __m256 s1 = _mm256_set1_ps(params[g1]), z1 = _mm256_set1_ps(params[groups + g1]);
  v[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[0]), s0, z0);
  v[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[1]), s0, z0);
  v[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[2]), s1, z1);
  v[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[3]), s1, z1);
}

// Four independent chains per row of x for one or two rows (an FMA's latency is four cycles), two for
// more (the accumulators and a chunk of W fill the 16 registers).
template <int BITS, int MB>
void fused_rows(const QuantWeight& w, const int32_t* group_of, const float* x, int64_t ldx, int64_t n0, int64_t n1,
                float* y, int64_t ldy) {
  constexpr int kChains = MB <= 2 ? 4 : 2;
  const int64_t groups = w.groups(), chunks = w.k / 32;
  std::vector<float> params(2 * groups);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.data + n * w.row_bytes(BITS);
    if (BITS != 16) row_params(w, n, params.data());
    __m256 acc[kChains][MB];
    for (int j = 0; j < kChains; ++j)
      for (int m = 0; m < MB; ++m) acc[j][m] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      __m256 v[4];
      dequant_chunk<BITS>(row, c, params.data(), groups, group_of[2 * c], group_of[2 * c + 1], v);
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + m * ldx + c * 32;
        for (int i = 0; i < 4; ++i) acc[i % kChains][m] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xm + 8 * i), acc[i % kChains][m]);
      }
    }
    if (w.k % 32) {  // int8 rows ending in half a chunk (groups of 16)
      const int64_t k = chunks * 32, g = group_of[2 * chunks];
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
      const __m256 s = _mm256_set1_ps(params[g]), z = _mm256_set1_ps(params[groups + g]);
      const __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s, z);
      const __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), s, z);
      for (int m = 0; m < MB; ++m) {
        acc[0][m] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + m * ldx + k), acc[0][m]);
        acc[1][m] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + m * ldx + k + 8), acc[1][m]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      __m256 sum = acc[0][m];
      for (int j = 1; j < kChains; ++j) sum = _mm256_add_ps(sum, acc[j][m]);
      y[m * ldy + n] = simd::hsum8(sum);
    }
  }
}
#endif

// Value k of row `row` (int4 values are 0..15, int8 values -128..127, BITS 16: a dense bf16 weight).
template <int BITS>
inline float value_at(const uint8_t* row, int64_t k) {
  if (BITS == 16) {
    const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(row)[k]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  if (BITS == 8) return static_cast<int8_t>(row[k]);
  const int64_t chunk = k / 32, j = k % 32;
  const uint8_t byte = row[chunk * 16 + (j % 16)];
  return j < 16 ? (byte & 15) : (byte >> 4);
}

template <int BITS>
void fused_rows_scalar(const QuantWeight& w, const float* x, int64_t ldx, int64_t mb, int64_t n0, int64_t n1,
                       float* y, int64_t ldy) {
  const int64_t num_groups = w.groups();
  std::vector<float> params(2 * num_groups);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.data + n * w.row_bytes(BITS);
    if (BITS == 16) params[0] = 1.f, params[1] = 0.f;
    else row_params(w, n, params.data());
    for (int64_t m = 0; m < mb; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < num_groups; ++g) {
        const float s = params[g], z = params[num_groups + g];
        for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k) acc += (value_at<BITS>(row, k) * s + z) * x[m * ldx + k];
      }
      y[m * ldy + n] = acc;
    }
  }
}

template <int BITS>
void fused_block(const QuantWeight& w, const int32_t* group_of, const float* x, int64_t ldx, int64_t mb, int64_t n0,
                 int64_t n1, float* y, int64_t ldy) {
#if defined(__AVX512F__) || defined(KVSERVE_AVX2)
  if (w.group % 16 == 0) {
    with_few_rows(mb, [&](auto r) { fused_rows<BITS, decltype(r)::value>(w, group_of, x, ldx, n0, n1, y, ldy); });
    return;
  }
#endif
  fused_rows_scalar<BITS>(w, x, ldx, mb, n0, n1, y, ldy);
}

template <int BITS>
at::Tensor fused(const QuantWeight& w, const at::Tensor& x) {
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const int64_t m = x32.size(0);
  at::Tensor y = at::empty({m, w.n}, x32.options());
  const float* xp = x32.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const std::vector<int32_t> group_of = half_chunk_groups(w);
  parallel_for_dynamic(0, w.n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < m; m0 += kFusedRows)
      fused_block<BITS>(w, group_of.data(), xp + m0 * w.k, w.k, std::min<int64_t>(kFusedRows, m - m0), n0, n1,
                        yp + m0 * w.n, w.n);
  });
  return y.to(x.scalar_type());
}

// ---- int4 W x int8 x (VNNI): few rows of x, with quantize_x ----------------------------------------
// Each row of x is quantized once per call to int8 with a step dx per 32-input chunk (amax / 127), so
// W's nibbles multiply x as bytes (vpdpbusd: 64 u8 x s8 products per instruction) instead of being
// converted to float one by one. W and x are walked in blocks of 128 inputs (4 chunks): one 64-byte
// load of W holds the low nibbles (inputs 0-15 of each chunk) and the high nibbles (16-31); x's bytes
// are stored in that same order, so int32 lane i of the dot covers chunk i / 4 of the block and gets
// its float factor scale[group] * dx[chunk] from a lane table. The zero points add
// sum_g zero[g] * xsum[g], with xsum the sum of the *quantized* x over group g: the result is exactly
// w . x_hat, so the error is w . (x_hat - x) with |x_hat - x| <= dx / 2 per input.
// quantize_x = false keeps the exact float path above (what quality comparisons run in).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVSERVE_VNNI 1

// Rows of W ahead of the current one to prefetch: the hardware prefetcher alone leaves a cold (DRAM)
// weight markedly slower than this on the default model's shapes.
constexpr int64_t kPrefetchRows = 64;

// Rows of x per pass over W: a speculative verify (k + 1 <= 8 rows of one request) reads W once.
constexpr int kVnniRows = 8;
// Rows of W per pass: 4 share each block of x; past 4 rows of x, 2, so the accumulators fit the registers.
constexpr int vnni_w_rows(int mb) { return mb <= 4 ? 4 : 2; }

// Rows of W per parallel task for the few-row kernels: a second thread costs a wake-up (tens of
// microseconds) that a small matrix never earns back, so split only beyond ~256 KB of W per task.
inline int64_t rows_per_task(int64_t row_bytes) { return std::max<int64_t>(16, (int64_t{1} << 18) / row_bytes); }

struct alignas(64) QBlock {  // 128 inputs of one row of x
  int8_t lo[64], hi[64];     // inputs 0-15 / 16-31 of chunks 0-3, 16 bytes per chunk
  float step[16];            // lane i: dx of chunk i / 4
};

struct alignas(64) BlockLanes {  // per 128-input block; the same for every row of W
  __mmask64 wmask;                // bytes of W inside the row (the last block may be partial)
  __mmask8 pmask;                 // which of groups g0 .. g0 + 7 exist
  int32_t g0;                     // first group the block touches
  alignas(64) int32_t lo[16], hi[16];  // lane i: group - g0 of the low / high half of chunk i / 4
};

void block_lanes(const QuantWeight& w, BlockLanes* lanes, int64_t blocks) {
  const int64_t chunks = w.k / 32, groups = w.groups();
  for (int64_t b = 0; b < blocks; ++b) {
    BlockLanes& L = lanes[b];
    L.g0 = static_cast<int32_t>(128 * b / w.group);
    const int64_t end = std::min(groups, (std::min(128 * b + 128, w.k) - 1) / w.group + 1);
    L.pmask = static_cast<__mmask8>((1u << (end - L.g0)) - 1);  // at most 8: groups are >= 16 inputs
    const int64_t bytes = std::min<int64_t>(64, w.k / 2 - 64 * b);
    L.wmask = bytes == 64 ? ~0ull : (1ull << bytes) - 1;
    for (int j = 0; j < 4; ++j) {
      const int64_t c = 4 * b + j;  // chunks past the row: x is zero there, any group will do
      for (int i = 0; i < 4; ++i) {
        L.lo[4 * j + i] = c < chunks ? static_cast<int32_t>(32 * c / w.group - L.g0) : 0;
        L.hi[4 * j + i] = c < chunks ? static_cast<int32_t>((32 * c + 16) / w.group - L.g0) : 0;
      }
    }
  }
}

using simd::load16;

// The 32 values of x at chunk c as int8 (lo: the first 16, hi: the rest) with one step, amax / 127.
struct XChunk {
  __m512i lo, hi;
  float step;
};
template <typename T>
inline XChunk quantize_chunk(const T* x, int64_t c) {
  const __m512 a = load16(x + 32 * c), b = load16(x + 32 * c + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  // _mm512_cvtps_epi32 rounds to nearest even
  return {_mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv))), _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv))),
          amax / 127.f};
}

// One row of x -> int8 blocks (zero past K) and xsum[g] = sum over group g of dx * q (zeroed here).
template <typename T>
void quantize_x(const T* x, int64_t k, int64_t group, int64_t blocks, QBlock* out, float* xsum, int64_t gpad) {
  std::memset(static_cast<void*>(out), 0, blocks * sizeof(QBlock));
  std::fill(xsum, xsum + gpad, 0.f);
  for (int64_t c = 0; c < k / 32; ++c) {
    const XChunk xc = quantize_chunk(x, c);
    QBlock& q = out[c / 4];
    const int j = static_cast<int>(c % 4);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q.lo + 16 * j), _mm512_cvtepi32_epi8(xc.lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q.hi + 16 * j), _mm512_cvtepi32_epi8(xc.hi));
    for (int i = 0; i < 4; ++i) q.step[4 * j + i] = xc.step;
    xsum[32 * c / group] += xc.step * _mm512_reduce_add_epi32(xc.lo);
    xsum[(32 * c + 16) / group] += xc.step * _mm512_reduce_add_epi32(xc.hi);
  }
}

// Scales of groups g0 .. g0 + 7 of row n as floats in lanes 0-7 (missing groups: 0).
template <bool CODED>
inline __m512 scale_window(const QuantWeight& w, int64_t n, int64_t g0, __mmask8 mask) {
  const int64_t at = n * w.groups() + g0;
  __m256 s;
  if (CODED) {
    const __m128i codes = _mm_maskz_loadu_epi8(mask, static_cast<const uint8_t*>(w.scales) + at);
    s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), _mm256_set1_ps(w.factors[2 * n]));
  } else {
    s = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(mask, static_cast<const c10::Half*>(w.scales) + at));
  }
  return _mm512_castps256_ps512(s);  // lanes 8-15 undefined: the lane tables index 0-7 only
}

// Zero points of groups g .. g + 15 of row n (missing groups: 0).
template <bool CODED>
inline __m512 zero_window(const QuantWeight& w, int64_t n, int64_t g, __mmask16 mask) {
  const int64_t at = n * w.groups() + g;
  if (CODED) {
    const __m128i codes = _mm_maskz_loadu_epi8(mask, static_cast<const int8_t*>(w.zeros) + at);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), _mm512_set1_ps(w.factors[2 * n + 1]));
  }
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const c10::Half*>(w.zeros) + at));
}

// The sums of a, b, c, d in lanes 0, 4, 8, 12 (one reduction for four rows instead of four).
inline __m512 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));
  return _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
}

// The end of NR rows of W against MB rows of x (both VNNI kernels): add the zero points' term
// sum_g zero[g] * xsum[g] to the accumulators, reduce them and store y in x's dtype.
template <bool CODED, typename T, int MB, int NR>
inline void finish_rows(const QuantWeight& w, __m512 (&acc)[NR][MB], const float* xsum, int64_t gpad, int64_t n,
                        T* y, int64_t ldy) {
  const int64_t groups = w.groups();
  if (w.zeros) {
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 mask = groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (groups - g)) - 1);
      for (int r = 0; r < NR; ++r) {
        const __m512 z = zero_window<CODED>(w, n + r, g, mask);
        for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(z, _mm512_loadu_ps(xsum + m * gpad + g), acc[r][m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    if constexpr (NR == 4 || NR == 2) {  // reduce4 sums each vector alike, so two rows round as four do
      alignas(64) float sums[16];
      _mm512_store_ps(sums, reduce4(acc[0][m], acc[1][m], acc[NR - 2][m], acc[NR - 1][m]));
      for (int r = 0; r < NR; ++r) y[m * ldy + n + r] = static_cast<T>(sums[4 * r]);
    } else {
      for (int r = 0; r < NR; ++r) y[m * ldy + n + r] = static_cast<T>(_mm512_reduce_add_ps(acc[r][m]));
    }
  }
}

// Rows [n0, n1) of W (a multiple of NR of them) against MB rows of quantized x; NR rows of W per pass
// share each block of x. SPLIT: groups that split a chunk (16, 48, ...), so its halves scale apart.
template <typename T, bool CODED, bool SPLIT, int MB, int NR>
void int4_rows(const QuantWeight& w, const BlockLanes* lanes, int64_t blocks, const QBlock* xq, const float* xsum,
               int64_t gpad, int64_t n0, int64_t n1, T* y, int64_t ldy) {
  const int64_t groups = w.groups(), row_bytes = w.k / 2;
  const __m512i low4 = _mm512_set1_epi8(15), zero = _mm512_setzero_si512();
  for (int64_t n = n0; n < n1; n += NR) {
    __m512 acc[NR][MB];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int r = 0; r < NR; ++r) {  // the scales and zeros rows ahead too (bytes: 1 per code, 2 per float16)
      const int64_t at = (n + r + kPrefetchRows) * groups * (CODED ? 1 : 2);
      _mm_prefetch(static_cast<const char*>(w.scales) + at, _MM_HINT_T0);
      if (w.zeros) _mm_prefetch(static_cast<const char*>(w.zeros) + at, _MM_HINT_T0);
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const BlockLanes& L = lanes[b];
      for (int r = 0; r < NR; ++r) {
        const uint8_t* wp = w.data + (n + r) * row_bytes + 64 * b;
        _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchRows * row_bytes), _MM_HINT_T0);
        const __m512i wv = _mm512_maskz_loadu_epi8(L.wmask, wp);
        const __m512i wlo = _mm512_and_si512(wv, low4), whi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low4);
        const __m512 win = scale_window<CODED>(w, n + r, L.g0, L.pmask);
        const __m512 slo = _mm512_permutexvar_ps(_mm512_load_si512(L.lo), win);
        const __m512 shi = SPLIT ? _mm512_permutexvar_ps(_mm512_load_si512(L.hi), win) : slo;
        for (int m = 0; m < MB; ++m) {
          const QBlock& q = xq[m * blocks + b];
          const __m512 step = _mm512_load_ps(q.step);
          const __m512i dlo = _mm512_dpbusd_epi32(zero, wlo, _mm512_load_si512(q.lo));
          if constexpr (SPLIT) {
            const __m512i dhi = _mm512_dpbusd_epi32(zero, whi, _mm512_load_si512(q.hi));
            const __m512 d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dhi), shi, _mm512_mul_ps(_mm512_cvtepi32_ps(dlo), slo));
            acc[r][m] = _mm512_fmadd_ps(d, step, acc[r][m]);
          } else {
            const __m512i d = _mm512_dpbusd_epi32(dlo, whi, _mm512_load_si512(q.hi));
            acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(slo, step), acc[r][m]);
          }
        }
      }
    }
    finish_rows<CODED, T, MB, NR>(w, acc, xsum, gpad, n, y, ldy);
  }
}

template <typename T, bool CODED, bool SPLIT, int MB>
void int4_block(const QuantWeight& w, const BlockLanes* lanes, int64_t blocks, const QBlock* xq, const float* xsum,
                int64_t gpad, int64_t n0, int64_t n1, T* y, int64_t ldy) {
  const int64_t n4 = n0 + (n1 - n0) / 4 * 4;
  int4_rows<T, CODED, SPLIT, MB, vnni_w_rows(MB)>(w, lanes, blocks, xq, xsum, gpad, n0, n4, y, ldy);
  int4_rows<T, CODED, SPLIT, MB, 1>(w, lanes, blocks, xq, xsum, gpad, n4, n1, y, ldy);
}

template <typename T, bool CODED, bool SPLIT>
at::Tensor int4_fused(const QuantWeight& w, const at::Tensor& x) {
  const int64_t m = x.size(0), blocks = (w.k / 32 + 3) / 4, gpad = (w.groups() + 15) / 16 * 16;
  // One scratch buffer per calling thread, reused across calls (the lane table, x's blocks, xsum).
  thread_local std::vector<__m512i> scratch;
  const int64_t lane_vecs = blocks * sizeof(BlockLanes) / 64, x_vecs = m * blocks * sizeof(QBlock) / 64;
  scratch.resize(lane_vecs + x_vecs + m * gpad / 16);
  BlockLanes* lanes = reinterpret_cast<BlockLanes*>(scratch.data());
  QBlock* xq = reinterpret_cast<QBlock*>(scratch.data() + lane_vecs);
  float* xsum = reinterpret_cast<float*>(scratch.data() + lane_vecs + x_vecs);
  block_lanes(w, lanes, blocks);
  const T* xp = x.data_ptr<T>();
  for (int64_t r = 0; r < m; ++r) quantize_x(xp + r * w.k, w.k, w.group, blocks, xq + r * blocks, xsum + r * gpad, gpad);
  at::Tensor y = at::empty({m, w.n}, x.options());
  T* yp = y.data_ptr<T>();
  parallel_for_dynamic(0, w.n, rows_per_task(w.row_bytes(4)), [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < m; m0 += kVnniRows) {
      const QBlock* xm = xq + m0 * blocks;
      const float* sm = xsum + m0 * gpad;
      T* ym = yp + m0 * w.n;
      with_few_rows<kVnniRows>(std::min<int64_t>(kVnniRows, m - m0), [&](auto mb) {
        int4_block<T, CODED, SPLIT, decltype(mb)::value>(w, lanes, blocks, xm, sm, gpad, n0, n1, ym, w.n);
      });
    }
  });
  return y;
}

template <typename T>
at::Tensor int4_fused_any(const QuantWeight& w, const at::Tensor& x) {
  const bool split = w.group % 32 != 0;
  if (w.factors) return split ? int4_fused<T, true, true>(w, x) : int4_fused<T, true, false>(w, x);
  return split ? int4_fused<T, false, true>(w, x) : int4_fused<T, false, false>(w, x);
}

// ---- int8 W x int8 x (VNNI): few rows of bf16 / float16 x ------------------------------------------
// The same idea for int8 weights (int8 quantization, GGUF Q8_0 and the K-quants kept as int8): x is
// quantized to int8 per 32 inputs in natural order, and 64 weights (one load) multiply it per
// vpdpbusd. vpdpbusd wants one unsigned operand, so x is stored offset by 128 (1..255) and
// 128 * sum(w), itself a vpdpbusd of W with ones, is taken off again. Lane i of block b covers
// inputs 64b + 4i .. 64b + 4i + 3: one group and one chunk of x, so one float factor per lane.
struct alignas(64) Int8Block {  // per 64-input block of a row of W; the same for every row
  __mmask64 wmask;              // bytes of W inside the row
  __mmask8 pmask;               // which of groups g0 .. g0 + 7 exist
  int32_t g0;
  alignas(64) int32_t group[16];  // lane i: group - g0
};

struct Int8X {  // one row of x, quantized: 64 * blocks bytes (x + 128), then the step of each lane
  uint8_t* q;
  float* step;  // [blocks][16]
};

template <typename T>
void quantize_x_u8(const T* x, int64_t k, int64_t group, int64_t blocks, Int8X out, float* xsum, int64_t gpad) {
  std::memset(out.q, 128, blocks * 64);  // x = 0 past K (W is masked there too)
  std::fill(xsum, xsum + gpad, 0.f);
  for (int64_t c = 0; c < k / 32; ++c) {
    const __m512 a = load16(x + 32 * c), b = load16(x + 32 * c + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float step = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
    const __m512i off = _mm512_set1_epi32(128);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q + 32 * c), _mm512_cvtepi32_epi8(_mm512_add_epi32(qa, off)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q + 32 * c + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(qb, off)));
    float* lane_steps = out.step + (c / 2) * 16 + (c % 2) * 8;
    std::fill(lane_steps, lane_steps + 8, step);
    xsum[32 * c / group] += step * _mm512_reduce_add_epi32(qa);
    xsum[(32 * c + 16) / group] += step * _mm512_reduce_add_epi32(qb);
  }
}

template <typename T, int MB, int NR>
void int8_rows(const QuantWeight& w, const Int8Block* lanes, int64_t blocks, const Int8X* xq, const float* xsum,
               int64_t gpad, int64_t n0, int64_t n1, T* y, int64_t ldy) {
  const int64_t groups = w.groups();
  const __m512i ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
  for (int64_t n = n0; n < n1; n += NR) {
    __m512 acc[NR][MB];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int r = 0; r < NR; ++r) {
      const int64_t at = (n + r + kPrefetchRows) * groups * 2;
      _mm_prefetch(static_cast<const char*>(w.scales) + at, _MM_HINT_T0);
      if (w.zeros) _mm_prefetch(static_cast<const char*>(w.zeros) + at, _MM_HINT_T0);
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const Int8Block& L = lanes[b];
      for (int r = 0; r < NR; ++r) {
        const uint8_t* wp = w.data + (n + r) * w.k + 64 * b;
        _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchRows * w.k), _MM_HINT_T0);
        const __m512i wv = _mm512_maskz_loadu_epi8(L.wmask, wp);
        const __m512i offset = _mm512_slli_epi32(_mm512_dpbusd_epi32(zero, ones, wv), 7);  // 128 * sum(w)
        const __m512 scale = _mm512_permutexvar_ps(_mm512_load_si512(L.group), scale_window<false>(w, n + r, L.g0, L.pmask));
        for (int m = 0; m < MB; ++m) {
          const __m512i d = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, _mm512_loadu_si512(xq[m].q + 64 * b), wv), offset);
          const __m512 f = _mm512_mul_ps(scale, _mm512_loadu_ps(xq[m].step + 16 * b));
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), f, acc[r][m]);
        }
      }
    }
    finish_rows<false, T, MB, NR>(w, acc, xsum, gpad, n, y, ldy);
  }
}

template <typename T>
at::Tensor int8_fused(const QuantWeight& w, const at::Tensor& x) {
  const int64_t m = x.size(0), blocks = (w.k + 63) / 64, gpad = (w.groups() + 15) / 16 * 16;
  thread_local std::vector<__m512i> scratch;  // lane table; per row of x: bytes, lane steps; then xsum
  const int64_t lane_vecs = blocks * sizeof(Int8Block) / 64;
  scratch.resize(lane_vecs + m * 2 * blocks + m * gpad / 16);
  Int8Block* lanes = reinterpret_cast<Int8Block*>(scratch.data());
  float* xsum = reinterpret_cast<float*>(scratch.data() + lane_vecs + m * 2 * blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    Int8Block& L = lanes[b];
    L.g0 = static_cast<int32_t>(64 * b / w.group);
    const int64_t end = std::min(w.groups(), (std::min(64 * b + 64, w.k) - 1) / w.group + 1);
    L.pmask = static_cast<__mmask8>((1u << (end - L.g0)) - 1);  // at most 4: groups are >= 16 inputs
    const int64_t bytes = std::min<int64_t>(64, w.k - 64 * b);
    L.wmask = bytes == 64 ? ~0ull : (1ull << bytes) - 1;
    for (int i = 0; i < 16; ++i)  // lanes past K: x is zero there, any group will do
      L.group[i] = 64 * b + 4 * i < w.k ? static_cast<int32_t>((64 * b + 4 * i) / w.group - L.g0) : 0;
  }
  std::vector<Int8X> xq(m);
  const T* xp = x.data_ptr<T>();
  for (int64_t r = 0; r < m; ++r) {
    __m512i* row = scratch.data() + lane_vecs + r * 2 * blocks;
    xq[r] = Int8X{reinterpret_cast<uint8_t*>(row), reinterpret_cast<float*>(row + blocks)};
    quantize_x_u8(xp + r * w.k, w.k, w.group, blocks, xq[r], xsum + r * gpad, gpad);
  }
  at::Tensor y = at::empty({m, w.n}, x.options());
  T* yp = y.data_ptr<T>();
  parallel_for_dynamic(0, w.n, rows_per_task(w.row_bytes(8)), [&](int64_t n0, int64_t n1) {
    const int64_t n4 = n0 + (n1 - n0) / 4 * 4;
    for (int64_t m0 = 0; m0 < m; m0 += kVnniRows) {
      const Int8X* xm = xq.data() + m0;
      const float* sm = xsum + m0 * gpad;
      T* ym = yp + m0 * w.n;
      with_few_rows<kVnniRows>(std::min<int64_t>(kVnniRows, m - m0), [&](auto mb) {
        constexpr int MB = decltype(mb)::value;
        int8_rows<T, MB, vnni_w_rows(MB)>(w, lanes, blocks, xm, sm, gpad, n0, n4, ym, w.n);
        int8_rows<T, MB, 1>(w, lanes, blocks, xm, sm, gpad, n4, n1, ym, w.n);
      });
    }
  });
  return y;
}
#endif

// ---- dequantize rows [n0, n1) of W into out (row-major [n1 - n0, K]) -------------------------------
#if defined(__AVX512F__)
inline void store16(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
inline void store16(c10::Half* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store16(c10::BFloat16* dst, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else  // round to nearest even by integer arithmetic (finite values only, which these are)
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
#endif
}
#endif

template <typename T, int BITS>
void dequant_rows(const QuantWeight& w, int64_t n0, int64_t n1, T* out) {
  const int64_t num_groups = w.groups();
  std::vector<float> params(2 * num_groups);
#if !defined(__AVX512F__) && defined(KVSERVE_AVX2)
  if (std::is_same_v<T, float> && w.k % 32 == 0 && w.group % 16 == 0) {
    // Whole chunks of 32 values, one 16-byte load each (the fused kernel's dequant_chunk): the AVX2
    // panels dequantize every weight once per call, and the 8-value loop below made the int4 gate_up
    // 1.8x as slow at 8 rows (0.88 vs 0.47 ms) and 1.26x at 32 (1.78 vs 1.41).
    const std::vector<int32_t> group_of = half_chunk_groups(w);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w.data + n * w.row_bytes(BITS);
      float* dst = reinterpret_cast<float*>(out) + (n - n0) * w.k;
      row_params(w, n, params.data());
      for (int64_t c = 0; c < w.k / 32; ++c) {
        __m256 v[4];
        dequant_chunk<BITS>(row, c, params.data(), num_groups, group_of[2 * c], group_of[2 * c + 1], v);
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(dst + c * 32 + 8 * j, v[j]);
      }
    }
    return;
  }
#endif
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.data + n * w.row_bytes(BITS);
    T* dst = out + (n - n0) * w.k;
    row_params(w, n, params.data());
    for (int64_t g = 0; g < num_groups; ++g) {
      const float s = params[g], z = params[num_groups + g];
      int64_t k = g * w.group;
      const int64_t k_end = k + w.group;
#if defined(__AVX512F__)
      const __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z);
      for (; k % 16 == 0 && k + 16 <= k_end; k += 16) {  // 16 values: half a 32-value chunk
        __m512i v;
        if (BITS == 4) {
          v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (k / 32) * 16)));
          v = (k % 32) ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
        } else {
          v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)));
        }
        store16(dst + k, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), sv, zv));
      }
#elif defined(KVSERVE_AVX2)
      const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);
      for (; k % 8 == 0 && k + 8 <= k_end; k += 8) {  // 8 values: a quarter of a 32-value chunk
        __m256i v;
        if (BITS == 4) {
          const int64_t j = k % 32;
          v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + (k / 32) * 16 + j % 16)));
          v = j >= 16 ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
        } else {
          v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k)));
        }
        simd::store8(dst + k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), sv, zv));
      }
#endif
      for (; k < k_end; ++k) dst[k] = static_cast<T>(value_at<BITS>(row, k) * s + z);
    }
  }
}

#if defined(KVSERVE_VNNI)
// ---- Strips: W repacked at load for the few-row VNNI kernels (packing.py, to_strips) ---------------
// The row-major kernels above sum each output channel across the lanes of a vector: every block of W
// needs its groups' scales permuted into lanes, and every row ends in a reduction, which on the
// default model's short rows (576 inputs) cost as much as the dot products. Here a lane is an output
// channel, as in the packed bf16 layout: W is cut into strips of 16 channels and chunks of 32 inputs,
//   int4 (qweight [S, C, 256]): vector j (64 bytes) of chunk c, lane l = channel 16s + l, byte b:
//        input 32c + 8j + b in its low nibble, 32c + 8j + 4 + b in its high one;
//   int8 (qweight [S, C, 512]): vector j, lane l, byte b: w + 128 of input 32c + 4j + b (unsigned,
//        so that x is the signed operand of vpdpbusd; the 128 * sum(x) it adds is taken off per chunk);
//   scales, zeros [S, G, 16]: group g of the strip's 16 channels (codes or float16), factors [S, 2, 16].
// Each 4 bytes of x (int8 per 32 inputs, as for the row-major kernels) is broadcast against 16 channels,
// a chunk's integer sums are scaled once by a vector of 16 channels' scales, and a strip ends in one
// store of 16 outputs. Every row of x goes through the same instructions in the same order whatever
// the rows of the call, so each row's result is bitwise that of a 1-row call.
struct StripX {  // rows of x quantized for the strip kernels, each row at a stride of its own
  const int8_t* q;      // [rows][k]: int8, natural order
  const float* step;    // [rows][chunks]: dx of each chunk
  const int32_t* qsum;  // [rows][chunks]: 128 * sum(q) of each chunk (the int8 weights' offset)
  const float* xsum;    // [rows][groups]: sum of dx * q over each group (the zero points' term)
  int64_t k, chunks, groups;
};

template <typename T>
void quantize_strip_x(const T* x, int64_t k, int64_t group, int8_t* q, float* step, int32_t* qsum, float* xsum) {
  std::fill(xsum, xsum + k / group, 0.f);
  for (int64_t c = 0; c < k / 32; ++c) {
    const XChunk xc = quantize_chunk(x, c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * c), _mm512_cvtepi32_epi8(xc.lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * c + 16), _mm512_cvtepi32_epi8(xc.hi));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(xc.lo, xc.hi));
    step[c] = xc.step;
    qsum[c] = 128 * sum;
    xsum[32 * c / group] += xc.step * static_cast<float>(sum);
  }
}

// Scales (CODED: the codes, the factors come at the end) or zero points of group g of strip s.
template <bool CODED>
inline __m512 strip_scales(const QuantWeight& w, int64_t s, int64_t g) {
  const int64_t at = (s * w.groups() + g) * 16;
  if (CODED) return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(w.scales) + at))));
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const c10::Half*>(w.scales) + at)));
}
template <bool CODED>
inline __m512 strip_zeros(const QuantWeight& w, int64_t s, int64_t g) {
  const int64_t at = (s * w.groups() + g) * 16;
  if (CODED) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(w.zeros) + at))));
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const c10::Half*>(w.zeros) + at)));
}

// How far ahead (bytes) the strip kernels prefetch W, into L1. Without it one thread streamed the
// default model's layers at ~60% of a plain read of the same bytes; 4-8 KB ahead reaches the read.
constexpr int64_t kStripPrefetchBytes = 4096;

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Strip s of W against MB rows of x (rows of y at ldy): y[m][16s .. 16s + 15].
template <typename T, int BITS, bool CODED, int MB>
void strip_rows(const QuantWeight& w, const StripX& x, int64_t s, T* y, int64_t ldy) {
  constexpr int64_t kChunkBytes = BITS == 4 ? 256 : 512;
  // One or two rows: two chains of vpdpbusd per row, so consecutive ones do not wait on each other.
  constexpr int kChains = MB <= 2 ? 2 : 1;
  const int64_t per_group = w.group / 32;
  const uint8_t* ws = w.data + s * x.chunks * kChunkBytes;
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[MB], zacc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = zacc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < x.groups; ++g) {
    const __m512 scale = strip_scales<CODED>(w, s, g);
    for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
      const uint8_t* wc = ws + c * kChunkBytes;
      for (int64_t line = 0; line < kChunkBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wc + kStripPrefetchBytes + line), _MM_HINT_T0);
      __m512i sum[kChains][MB];
      for (int i = 0; i < kChains; ++i)
        for (int m = 0; m < MB; ++m) sum[i][m] = _mm512_setzero_si512();
      if constexpr (BITS == 4) {
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(wc + 64 * j);
          const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          for (int m = 0; m < MB; ++m) {
            const int8_t* xm = x.q + m * x.k + 32 * c + 8 * j;
            sum[0][m] = _mm512_dpbusd_epi32(sum[0][m], lo, broadcast4(xm));
            sum[kChains - 1][m] = _mm512_dpbusd_epi32(sum[kChains - 1][m], hi, broadcast4(xm + 4));
          }
        }
      } else {
        for (int j = 0; j < 8; ++j) {
          const __m512i v = _mm512_loadu_si512(wc + 64 * j);
          for (int m = 0; m < MB; ++m)
            sum[j % kChains][m] = _mm512_dpbusd_epi32(sum[j % kChains][m], v, broadcast4(x.q + m * x.k + 32 * c + 4 * j));
        }
      }
      for (int m = 0; m < MB; ++m) {
        __m512i d = kChains == 2 ? _mm512_add_epi32(sum[0][m], sum[kChains - 1][m]) : sum[0][m];
        if constexpr (BITS == 8) d = _mm512_sub_epi32(d, _mm512_set1_epi32(x.qsum[m * x.chunks + c]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(scale, _mm512_set1_ps(x.step[m * x.chunks + c])), acc[m]);
      }
    }
    if (w.zeros) {
      const __m512 zero = strip_zeros<CODED>(w, s, g);
      for (int m = 0; m < MB; ++m) zacc[m] = _mm512_fmadd_ps(zero, _mm512_set1_ps(x.xsum[m * x.groups + g]), zacc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    __m512 out;
    if (CODED) {
      const float* f = w.factors + s * 32;  // the strip's 16 scale steps, then its 16 zero steps
      out = _mm512_fmadd_ps(acc[m], _mm512_loadu_ps(f), _mm512_mul_ps(zacc[m], _mm512_loadu_ps(f + 16)));
    } else {
      out = _mm512_add_ps(acc[m], zacc[m]);
    }
    store16(y + m * ldy + 16 * s, out);
  }
}

template <typename T, int BITS, bool CODED>
at::Tensor strip_fused(const QuantWeight& w, const at::Tensor& x) {
  const int64_t m = x.size(0), chunks = w.k / 32, groups = w.groups(), strips = w.n / 16;
  // One scratch buffer per calling thread, reused across calls: x's bytes, steps, offsets and sums.
  thread_local std::vector<__m512i> scratch;
  const int64_t q_vecs = (m * w.k + 63) / 64, s_vecs = (m * chunks + 15) / 16, g_vecs = (m * groups + 15) / 16;
  scratch.resize(q_vecs + 2 * s_vecs + g_vecs);
  int8_t* q = reinterpret_cast<int8_t*>(scratch.data());
  float* step = reinterpret_cast<float*>(scratch.data() + q_vecs);
  int32_t* qsum = reinterpret_cast<int32_t*>(scratch.data() + q_vecs + s_vecs);
  float* xsum = reinterpret_cast<float*>(scratch.data() + q_vecs + 2 * s_vecs);
  const T* xp = x.data_ptr<T>();
  for (int64_t r = 0; r < m; ++r)
    quantize_strip_x(xp + r * w.k, w.k, w.group, q + r * w.k, step + r * chunks, qsum + r * chunks, xsum + r * groups);
  at::Tensor y = at::empty({m, w.n}, x.options());
  T* yp = y.data_ptr<T>();
  // Pieces of ~16 KB of W, and every thread takes part: inside a decode step the threads are awake,
  // and the default model's smallest projection (576 x 576, 166 KB as int4) still gains from both.
  const int64_t strip_bytes = chunks * (BITS == 4 ? 256 : 512);
  parallel_for_streams(strips, std::max<int64_t>(1, (int64_t{1} << 14) / strip_bytes), [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s)
      for (int64_t m0 = 0; m0 < m; m0 += kVnniRows) {
        const StripX xs{q + m0 * w.k, step + m0 * chunks, qsum + m0 * chunks, xsum + m0 * groups, w.k, chunks, groups};
        with_few_rows<kVnniRows>(std::min<int64_t>(kVnniRows, m - m0), [&](auto mb) {
          strip_rows<T, BITS, CODED, decltype(mb)::value>(w, xs, s, yp + m0 * w.n, w.n);
        });
      }
  });
  return y;
}

template <typename T>
at::Tensor strip_fused_any(const QuantWeight& w, const at::Tensor& x, int64_t bits) {
  if (bits == 8) return strip_fused<T, 8, false>(w, x);
  return w.factors ? strip_fused<T, 4, true>(w, x) : strip_fused<T, 4, false>(w, x);
}

// Strips [s0, s1) dequantized and transposed: out[k][16 (s - s0) + l] = W[16 s + l][k], ld columns.
template <typename T, int BITS>
void dequant_strips_t(const QuantWeight& w, int64_t s0, int64_t s1, T* out, int64_t ld) {
  constexpr int64_t kChunkBytes = BITS == 4 ? 256 : 512;
  const int64_t chunks = w.k / 32, per_group = w.group / 32;
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* ws = w.data + s * chunks * kChunkBytes;
    T* col = out + 16 * (s - s0);
    const __m512 fs = w.factors ? _mm512_loadu_ps(w.factors + 32 * s) : _mm512_set1_ps(1.f);
    const __m512 fz = w.factors ? _mm512_loadu_ps(w.factors + 32 * s + 16) : _mm512_set1_ps(1.f);
    for (int64_t g = 0; g < w.groups(); ++g) {
      // scale * q + zero, with the scale and zero as row_params computes them (code * step)
      const __m512 scale = w.factors ? _mm512_mul_ps(strip_scales<true>(w, s, g), fs) : strip_scales<false>(w, s, g);
      const __m512 zero = !w.zeros ? _mm512_setzero_ps()
                          : w.factors ? _mm512_mul_ps(strip_zeros<true>(w, s, g), fz) : strip_zeros<false>(w, s, g);
      for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
        const uint8_t* wc = ws + c * kChunkBytes;
        for (int j = 0; j < (BITS == 4 ? 4 : 8); ++j) {
          const __m512i v = _mm512_loadu_si512(wc + 64 * j);
          for (int b = 0; b < 4; ++b) {
            const __m512i byte = _mm512_and_si512(_mm512_srli_epi32(v, 8 * b), _mm512_set1_epi32(255));
            if (BITS == 4) {
              const __m512i lo = _mm512_and_si512(byte, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(byte, 4);
              store16(col + (32 * c + 8 * j + b) * ld, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), scale, zero));
              store16(col + (32 * c + 8 * j + 4 + b) * ld, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), scale, zero));
            } else {
              const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(byte, _mm512_set1_epi32(128)));
              store16(col + (32 * c + 4 * j + b) * ld, _mm512_fmadd_ps(q, scale, zero));
            }
          }
        }
      }
    }
  }
}

// Many rows of x (prefill, decode batches), or float32 x: L2-sized tiles of W^T dequantized from the
// strips, each multiplied by at::mm.
template <typename T>
at::Tensor strip_tiled(const QuantWeight& w, const at::Tensor& x, int64_t bits, int64_t tile_bytes) {
  const int64_t m = x.size(0), strips = w.n / 16;
  const int64_t tile = std::min(strips, std::max<int64_t>(1, tile_bytes / (16 * w.k * static_cast<int64_t>(sizeof(T)))));
  at::Tensor buf = at::empty({tile * 16 * w.k}, x.options());
  at::Tensor y = tile == strips ? at::Tensor() : at::empty({m, w.n}, x.options());
  for (int64_t s0 = 0; s0 < strips; s0 += tile) {
    const int64_t count = std::min(tile, strips - s0), cols = 16 * count;
    at::Tensor wt = buf.narrow(0, 0, w.k * cols).view({w.k, cols});
    T* bp = wt.data_ptr<T>();
    at::parallel_for(0, count, 1, [&](int64_t a, int64_t b) {
      if (bits == 4) dequant_strips_t<T, 4>(w, s0 + a, s0 + b, bp + 16 * a, cols);
      else dequant_strips_t<T, 8>(w, s0 + a, s0 + b, bp + 16 * a, cols);
    });
    at::Tensor part = at::mm(x, wt);
    if (tile == strips) return part;
    y.narrow(1, 16 * s0, cols).copy_(part);
  }
  return y;
}

at::Tensor strip_linear(const QuantWeight& w, const at::Tensor& x, int64_t bits, int64_t max_fused_rows,
                        int64_t tile_bytes) {
  if (x.size(0) <= max_fused_rows && x.scalar_type() == at::kBFloat16) return strip_fused_any<c10::BFloat16>(w, x, bits);
  if (x.size(0) <= max_fused_rows && x.scalar_type() == at::kHalf) return strip_fused_any<c10::Half>(w, x, bits);
#if !defined(KVSERVE_BF16)  // no bf16 arithmetic: float32 tiles and sgemm (tiled_any)
  if (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf)
    return strip_tiled<float>(w, x.to(at::kFloat), bits, tile_bytes).to(x.scalar_type());
#endif
  switch (x.scalar_type()) {
    case at::kFloat: return strip_tiled<float>(w, x, bits, tile_bytes);
    case at::kBFloat16: return strip_tiled<c10::BFloat16>(w, x, bits, tile_bytes);
    case at::kHalf: return strip_tiled<c10::Half>(w, x, bits, tile_bytes);
    default: TORCH_CHECK(false, "quant_linear: x must be float32, bfloat16 or float16");
  }
}
#endif

#if !defined(__AVX512F__) && defined(KVSERVE_AVX2)
// ---- AVX2: a batch of rows of x against float32 panels of W ------------------------------------------
// Past a few rows the fused loop loses to its own overheads: it dequantizes W again for every
// kFusedRows rows of x and loads x for every FMA. Here each strip of 16 rows of W is dequantized once
// per call into a float32 panel (16 x K, in L2), and all rows of x meet it in a register-blocked dot
// product: 3 rows of x by 4 rows of W, 12 accumulators, 7 loads and 12 FMAs per 8 inputs; the four
// channels' sums are reduced together (hadd) and stored as one vector. On AVX2 this beats the fused
// loop from ~8 rows and the dequantized tiles + MKL's sgemm up to prefill sizes.
constexpr int kPanelRows = 16;  // rows of W per panel (one parallel task)
constexpr int64_t kPanelBlockRows = 48;  // rows of x that pass over 4 rows of a panel before the next 4

// The sums of a, b, c, d (lanes 0, 1, 2, 3).
inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// y[m][0..3] = rows m < MR of x against 4 rows of the panel (each k floats), k a multiple of 8.
template <int MR>
inline void panel_dot(const float* x, int64_t ldx, const float* p, int64_t k, float* y, int64_t ldy) {
  __m256 acc[MR * 4];
#pragma GCC unroll 16
  for (int i = 0; i < MR * 4; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; kk += 8) {
    __m256 xv[MR];
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + kk);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 wv = _mm256_load_ps(p + j * k + kk);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) acc[m * 4 + j] = _mm256_fmadd_ps(xv[m], wv, acc[m * 4 + j]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
    _mm_storeu_ps(y + m * ldy, reduce4(acc[m * 4], acc[m * 4 + 1], acc[m * 4 + 2], acc[m * 4 + 3]));
}

// y = x W^T through panels (w.k a multiple of 32), float32 x.
template <int BITS>
at::Tensor panel_linear(const QuantWeight& w, const at::Tensor& x) {
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const int64_t m = x32.size(0), k = w.k, strips = (w.n + kPanelRows - 1) / kPanelRows;
  at::Tensor y = at::empty({m, w.n}, x32.options());
  const float* xp = x32.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  parallel_for_dynamic(0, strips, 1, [&](int64_t s0, int64_t s1) {
    simd::aligned_vector<float> panel(kPanelRows * k), tail;
    for (int64_t s = s0; s < s1; ++s) {
      // A partial strip leaves the panel's last rows as they were: their sums land in channels past
      // W's rows, which are dropped (each accumulator holds one channel).
      const int64_t n0 = s * kPanelRows, rows = std::min<int64_t>(kPanelRows, w.n - n0);
      dequant_rows<float, BITS>(w, n0, n0 + rows, panel.data());
      // A strip past the end of W's rows is written to `tail` first, then its real channels to y.
      float* dst = yp + n0;
      int64_t ldy = w.n;
      if (rows < kPanelRows) {
        tail.assign(m * kPanelRows, 0.f);
        dst = tail.data(), ldy = kPanelRows;
      }
      for (int64_t r0 = 0; r0 < m; r0 += kPanelBlockRows)
        for (int64_t j = 0; j < rows; j += 4)
          for (int64_t r = r0; r < std::min(m, r0 + kPanelBlockRows); r += 3) {
            const float* xr = xp + r * k;
            const float* p = panel.data() + j * k;
            float* yr = dst + r * ldy + j;
            switch (std::min<int64_t>(3, m - r)) {
              case 3: panel_dot<3>(xr, k, p, k, yr, ldy); break;
              case 2: panel_dot<2>(xr, k, p, k, yr, ldy); break;
              default: panel_dot<1>(xr, k, p, k, yr, ldy); break;
            }
          }
      if (rows < kPanelRows)
        for (int64_t r = 0; r < m; ++r) std::copy(tail.data() + r * kPanelRows, tail.data() + r * kPanelRows + rows, yp + r * w.n + n0);
    }
  });
  return y.to(x.scalar_type());
}
#endif

template <typename T, int BITS>
at::Tensor tiled(const QuantWeight& w, const at::Tensor& x, int64_t tile_bytes) {
  const int64_t m = x.size(0);
  const int64_t tile = std::min(w.n, std::max<int64_t>(16, tile_bytes / (w.k * static_cast<int64_t>(sizeof(T)))));
  at::Tensor buf = at::empty({tile, w.k}, x.options());
  T* bp = buf.data_ptr<T>();
  at::Tensor y = tile == w.n ? at::Tensor() : at::empty({m, w.n}, x.options());
  for (int64_t n0 = 0; n0 < w.n; n0 += tile) {
    const int64_t rows = std::min(tile, w.n - n0);
    at::parallel_for(0, rows, 8, [&](int64_t a, int64_t b) { dequant_rows<T, BITS>(w, n0 + a, n0 + b, bp + a * w.k); });
    at::Tensor part = at::mm(x, buf.narrow(0, 0, rows).t());
    if (tile == w.n) return part;
    y.narrow(1, n0, rows).copy_(part);
  }
  return y;
}

// A CPU without bf16 arithmetic (no AVX512-BF16) multiplies 16-bit x in float32: W's tiles
// dequantized to float32 and MKL's sgemm, since oneDNN's bf16 matmul emulates bf16 there and runs an
// order of magnitude slower than sgemm.
template <int BITS>
at::Tensor tiled_any(const QuantWeight& w, const at::Tensor& x, int64_t tile_bytes) {
#if !defined(KVSERVE_BF16)
  if (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf)
    return tiled<float, BITS>(w, x.to(at::kFloat), tile_bytes).to(x.scalar_type());
#endif
  switch (x.scalar_type()) {
    case at::kFloat: return tiled<float, BITS>(w, x, tile_bytes);
    case at::kBFloat16: return tiled<c10::BFloat16, BITS>(w, x, tile_bytes);
    case at::kHalf: return tiled<c10::Half, BITS>(w, x, tile_bytes);
    default: TORCH_CHECK(false, "quant_linear: x must be float32, bfloat16 or float16");
  }
}


// ---- AMX (bf16 tiles): y^T = W x^T, 16 output channels x 16 rows of x per C tile -----------------
// W is the A operand: 16 rows x 32 inputs, dequantized in registers and stored row-major (no copy of
// W beyond one 16-channel strip, no per-call weight reordering, which dominates at::mm for few rows).
// x^T is the B operand (VNNI pairs), built once per call: x is small. Two strips of W against one or
// two blocks of 16 rows of x at a time (simd::amx_2x2, C[2 * strip + block]). A dense bf16 W has its
// own kernel (layers/csrc/packed_linear.cpp), on W stored as B tiles at load.
#if defined(KVSERVE_AMX)
using simd::amx_ready;
using simd::configure_tiles;
using simd::transpose16;

// x^T as B tiles: tile (block b of 16 rows, chunk c of 32 inputs), row r = inputs 2r, 2r + 1 of each row;
// rows past m are zero. Written into `out`, a buffer the calling thread keeps: allocating and zeroing
// it per call (up to 200 KB, fresh pages each time) cost as much as the transposes.
void x_tiles(const at::Tensor& x, simd::aligned_vector<uint16_t>& out) {
  const int64_t m = x.size(0), blocks = (m + 15) / 16, k = x.size(1);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  if (out.size() < static_cast<size_t>(blocks * (k / 32) * 512)) out.resize(blocks * (k / 32) * 512);
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t c = 0; c < k / 32; ++c) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = b * 16 + i < m ? _mm512_loadu_si512(xp + (b * 16 + i) * k + c * 32) : _mm512_setzero_si512();
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out.data() + (b * (k / 32) + c) * 512 + i * 32, r[i]);
    }
}

// Rows n0 .. n0 + 15 of W as bf16 A tiles, one per chunk of 32 inputs (missing rows are zero).
// ``group_of[2c]``, ``group_of[2c + 1]``: the groups of the two halves of chunk c.
template <int BITS>
void w_tiles(const QuantWeight& w, int64_t n0, const int32_t* group_of, float* params, uint16_t* tiles) {
  const int64_t groups = w.groups(), rows = std::min<int64_t>(16, w.n - n0), chunks = w.k / 32;
  for (int64_t i = 0; i < 16; ++i) {
    uint16_t* dst = tiles + i * 32;
    if (i >= rows) {
      for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_si512(dst + c * 512, _mm512_setzero_si512());
      continue;
    }
    if (BITS != 16) row_params(w, n0 + i, params);
    const uint8_t* row = w.data + (n0 + i) * w.row_bytes(BITS);
    for (int64_t c = 0; c < chunks; ++c) {
      __m512 lo, hi;
      dequant_chunk<BITS>(row, c, params, groups, group_of[2 * c], group_of[2 * c + 1], lo, hi);
      _mm512_storeu_si512(dst + c * 512, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
}

// C tiles hold y^T (16 channels x 16 rows): transpose back and store rows of y as bf16.
void store_ct(const float* c, int64_t rows, int64_t cols, c10::BFloat16* y, int64_t ldy) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(c + i * 16);
  transpose16(r);
  for (int64_t m = 0; m < rows; ++m) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_castsi512_ps(r[m]));
    if (cols == 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy), reinterpret_cast<__m256i>(v));
    else for (int64_t j = 0; j < cols; ++j) y[m * ldy + j] = static_cast<c10::BFloat16>(_mm512_castsi512_ps(r[m])[j]);
  }
}

template <int BITS>  // 4 or 8
at::Tensor amx_linear(const QuantWeight& w, const at::Tensor& x) {
  const int64_t m = x.size(0), m_pad = (m + 15) / 16 * 16, chunks = w.k / 32, strips = (w.n + 15) / 16;
  thread_local simd::aligned_vector<uint16_t> x_buffer;  // this (calling) thread's; the workers get a pointer
  x_tiles(x, x_buffer);
  const uint16_t* xt = x_buffer.data();
  const std::vector<int32_t> group_of = half_chunk_groups(w);
  at::Tensor y = at::empty({m, w.n}, x.options());
  c10::BFloat16* yptr = y.data_ptr<c10::BFloat16>();
  parallel_for_dynamic(0, (strips + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    configure_tiles();
    thread_local simd::aligned_vector<uint16_t> wt;  // the pair's dequantized strips
    std::vector<float> params(2 * w.groups());
    alignas(64) float cbuf[4 * 256];
    for (int64_t pair = p0; pair < p1; ++pair) {
      const int64_t n0 = pair * 32, pair_strips = std::min<int64_t>(2, strips - 2 * pair);
      if (wt.size() < static_cast<size_t>(2 * chunks * 512)) wt.resize(2 * chunks * 512);
      const uint16_t* ws[2] = {wt.data(), wt.data() + chunks * 512};
      for (int64_t s = 0; s < pair_strips; ++s)
        w_tiles<BITS>(w, n0 + 16 * s, group_of.data(), params.data(), wt.data() + s * chunks * 512);
      for (int64_t m0 = 0; m0 < m_pad; m0 += 32) {
        const int64_t blocks = std::min<int64_t>(2, (m_pad - m0) / 16);
        const uint16_t* xb[2] = {xt + (m0 / 16) * chunks * 512, xt + (m0 / 16 + 1) * chunks * 512};
        simd::amx_2x2(ws, 512, 64, static_cast<int>(pair_strips), xb, static_cast<int>(blocks), chunks, cbuf);
        for (int64_t s = 0; s < pair_strips; ++s)
          for (int64_t b = 0; b < blocks; ++b)
            store_ct(cbuf + (2 * s + b) * 256, std::min<int64_t>(16, m - m0 - 16 * b),
                     std::min<int64_t>(16, w.n - n0 - 16 * s), yptr + (m0 + 16 * b) * w.n + n0 + 16 * s, w.n);
      }
    }
    _tile_release();
  });
  return y;
}
#endif

QuantWeight check_weight(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                         const c10::optional<at::Tensor>& factors, int64_t group, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous(), "qweight and scales must be contiguous");
  const bool coded = factors.has_value() && factors->defined();
  TORCH_CHECK(scales.scalar_type() == (coded ? at::kByte : at::kHalf),
              coded ? "coded scales must be uint8" : "scales must be float16");
  const int64_t n = qweight.size(0), k = bits == 4 ? qweight.size(1) * 2 : qweight.size(1);
  TORCH_CHECK(group > 0 && k % group == 0 && scales.size(0) == n && scales.size(1) == k / group, "bad group layout");
  TORCH_CHECK(bits == 8 || group % 16 == 0, "int4 groups must be multiples of 16");
  TORCH_CHECK(bits == 8 || k % 32 == 0, "int4 rows must be whole chunks of 32 values");
  const void* zp = nullptr;
  if (zeros.has_value() && zeros->defined()) {
    TORCH_CHECK(zeros->is_contiguous() && zeros->scalar_type() == (coded ? at::kChar : at::kHalf) &&
                zeros->sizes() == scales.sizes(), coded ? "coded zeros must be int8 shaped like scales"
                                                        : "zeros must be float16 shaped like scales");
    zp = zeros->data_ptr();
  }
  const float* fp = nullptr;
  if (coded) {
    TORCH_CHECK(factors->is_contiguous() && factors->scalar_type() == at::kFloat && factors->dim() == 2 &&
                factors->size(0) == n && factors->size(1) == 2, "factors must be float32 [N, 2]");
    fp = factors->data_ptr<float>();
  }
  return QuantWeight{{qweight.data_ptr<uint8_t>(), scales.data_ptr(), zp, fp, n, k, group}};
}

// A weight repacked as strips (qweight [S, C, 256 or 512], scales and zeros [S, G, 16], factors
// [S, 2, 16]; see the strips' section above).
QuantWeight check_strips(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                         const c10::optional<at::Tensor>& factors, int64_t group, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(qweight.is_contiguous() && qweight.size(2) == (bits == 4 ? 256 : 512), "strips: qweight must be [S, C, ",
              bits == 4 ? 256 : 512, "]");
  const int64_t n = qweight.size(0) * 16, k = qweight.size(1) * 32;
  const bool coded = factors.has_value() && factors->defined();
  TORCH_CHECK(group % 32 == 0 && k % group == 0, "strips: groups must be whole chunks of 32 inputs");
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == n / 16 && scales.size(1) == k / group &&
                  scales.size(2) == 16 && scales.scalar_type() == (coded ? at::kByte : at::kHalf),
              "strips: scales must be [S, G, 16], uint8 codes or float16");
  const void* zp = nullptr;
  if (zeros.has_value() && zeros->defined()) {
    TORCH_CHECK(zeros->is_contiguous() && zeros->sizes() == scales.sizes() &&
                    zeros->scalar_type() == (coded ? at::kChar : at::kHalf), "strips: zeros must be shaped like scales");
    zp = zeros->data_ptr();
  }
  const float* fp = nullptr;
  if (coded) {
    TORCH_CHECK(bits == 4 && factors->is_contiguous() && factors->scalar_type() == at::kFloat &&
                    factors->numel() == n * 2, "strips: factors must be float32 [S, 2, 16]");
    fp = factors->data_ptr<float>();
  }
  return QuantWeight{{qweight.data_ptr<uint8_t>(), scales.data_ptr(), zp, fp, n, k, group}};
}

// The kernel for few rows of x (up to max_fused_rows) against a row-major W of k inputs in groups
// of `group` (coded: scales as 8-bit codes): x quantized to int8 where asked for and a kernel takes
// this layout, else the float dequantize-and-FMA loop. quant_linear runs it; quant_strips runs its
// strips form where it has one; int8_x_serves tells quant/methods.py.
enum class FewRows { kInt4Vnni, kInt8Vnni, kIntAvx2, kFloat };

FewRows few_rows_kernel(int64_t bits, int64_t group, int64_t k, bool coded, bool quantize_x) {
  if (!quantize_x) return FewRows::kFloat;
#if defined(KVSERVE_VNNI)
  if (bits == 4) return FewRows::kInt4Vnni;
  if (bits == 8 && !coded && k % 32 == 0) return FewRows::kInt8Vnni;
#endif
  const QuantWeightRef shape{nullptr, nullptr, nullptr, nullptr, 0, k, group};
  return int_linear_avx2_supported(shape, bits) ? FewRows::kIntAvx2 : FewRows::kFloat;
}

FewRows few_rows_kernel(const QuantWeight& w, int64_t bits, bool quantize_x) {
  return few_rows_kernel(bits, w.group, w.k, w.factors != nullptr, quantize_x);
}

}  // namespace

// x: [M, K] float32/bfloat16/float16, contiguous. Returns [M, N] in x's dtype. quantize_x: up to
// max_fused_rows rows, x may be quantized to int8 per 32 inputs (the integer kernels above, and
// quant_linear_avx2.cpp on AVX2); otherwise few rows of x stay float (dequantize-and-FMA).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& factors,
                        int64_t group, int64_t bits, int64_t max_fused_rows, int64_t max_mid_rows,
                        int64_t tile_bytes, bool quantize_x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] matrix");
  const at::Tensor q = qweight.scalar_type() == at::kChar ? qweight.view(at::kByte) : qweight;
  if (q.dim() == 3) {  // repacked as strips at load (VNNI without AMX; AVX2)
    const QuantWeight w = check_strips(q, scales, zeros, factors, group, bits);
    TORCH_CHECK(x.size(1) == w.k, "x has ", x.size(1), " features, the weight ", w.k);
#if defined(KVSERVE_VNNI)
    return strip_linear(w, x, bits, quantize_x ? max_fused_rows : 0, tile_bytes);
#else
    TORCH_CHECK(quantize_x && strip_linear_avx2_supported(bits),
                "quant_linear: a weight packed as strips needs AVX512-VNNI, or AVX2 with int4 or int8 W and int8 x");
    return strip_linear_avx2(w, bits, x);
#endif
  }
  const QuantWeight w = check_weight(q, scales, zeros, factors, group, bits);
  TORCH_CHECK(x.size(1) == w.k, "x has ", x.size(1), " features, the weight ", w.k);
  if (x.size(0) <= max_fused_rows) {
    [[maybe_unused]] const at::ScalarType t = x.scalar_type();
    switch (few_rows_kernel(w, bits, quantize_x)) {
#if defined(KVSERVE_VNNI)
      case FewRows::kInt4Vnni:
        if (t == at::kBFloat16) return int4_fused_any<c10::BFloat16>(w, x);
        if (t == at::kHalf) return int4_fused_any<c10::Half>(w, x);
        if (t == at::kFloat) return int4_fused_any<float>(w, x);
        break;
      case FewRows::kInt8Vnni:
        if (t == at::kBFloat16) return int8_fused<c10::BFloat16>(w, x);
        if (t == at::kHalf) return int8_fused<c10::Half>(w, x);
        if (t == at::kFloat) return int8_fused<float>(w, x);
        break;
#endif
      case FewRows::kIntAvx2: return int_linear_avx2(w, bits, x);
      default: break;
    }
    return bits == 4 ? fused<4>(w, x) : fused<8>(w, x);
  }
#if defined(KVSERVE_AMX)
  if (x.scalar_type() == at::kBFloat16 && x.size(0) <= max_mid_rows && w.k % 32 == 0 && w.group % 16 == 0 && amx_ready())
    return bits == 4 ? amx_linear<4>(w, x) : amx_linear<8>(w, x);
#endif
#if !defined(__AVX512F__) && defined(KVSERVE_AVX2)
  if (x.size(0) <= max_mid_rows && w.k % 32 == 0 && w.group % 16 == 0)
    return bits == 4 ? panel_linear<4>(w, x) : panel_linear<8>(w, x);
#endif
  return bits == 4 ? tiled_any<4>(w, x, tile_bytes) : tiled_any<8>(w, x, tile_bytes);
}

// y = x W^T with W [N, K] bf16 on a CPU without bf16 arithmetic: W converted to float32 a tile of
// rows at a time (tile_bytes of float32, which stay in L2 while at::mm reads them) and multiplied in
// float32: oneDNN's bf16 matmul on an AVX2 CPU is emulated and several times slower than MKL's sgemm.
at::Tensor dense_tiled(const at::Tensor& x, const at::Tensor& weight, int64_t tile_bytes) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const at::Tensor x32 = x.to(at::kFloat);
  const int64_t tile = std::min(n, std::max<int64_t>(16, tile_bytes / (k * 4)));
  at::Tensor buf = at::empty({tile, k}, x32.options());
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  for (int64_t n0 = 0; n0 < n; n0 += tile) {
    const int64_t rows = std::min(tile, n - n0);
    at::Tensor w32 = buf.narrow(0, 0, rows);
    w32.copy_(weight.narrow(0, n0, rows));
    y.narrow(1, n0, rows).copy_(at::mm(x32, w32.t()));
  }
  return y;
}

// y = x W^T for a dense bf16 W [N, K] (K a multiple of 32) where the packed copy is not available (a
// CPU with neither AVX512-BF16 nor AVX2, e.g. AVX-512 without BF16; layers/csrc/packed_linear.cpp): up to
// max_fused_rows rows of x the fused loop (W read once per kFusedRows rows), beyond that float32
// tiles of W and at::mm.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, int64_t max_fused_rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] matrix");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16,
              "weight must be a contiguous bfloat16 [N, K] matrix");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.size(1) == k && k % 32 == 0, "x has ", x.size(1), " features, the weight ", k, " (a multiple of 32)");
  const QuantWeight w{{static_cast<const uint8_t*>(weight.data_ptr()), nullptr, nullptr, nullptr, n, k, k}};
  if (x.size(0) <= max_fused_rows) return fused<16>(w, x);
  return dense_tiled(x, weight, kDenseTileBytes);
}

// The dense [N, K] weight in `dtype` (tests and the embedding lookup use it).
at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                      const c10::optional<at::Tensor>& factors, int64_t group, int64_t bits, at::ScalarType dtype) {
  const at::Tensor q = qweight.scalar_type() == at::kChar ? qweight.view(at::kByte) : qweight;
  const QuantWeight w = check_weight(q, scales, zeros, factors, group, bits);
  at::Tensor out = at::empty({w.n, w.k}, qweight.options().dtype(dtype));
  at::parallel_for(0, w.n, 16, [&](int64_t a, int64_t b) {
    if (dtype == at::kFloat) bits == 4 ? dequant_rows<float, 4>(w, a, b, out.data_ptr<float>() + a * w.k)
                                       : dequant_rows<float, 8>(w, a, b, out.data_ptr<float>() + a * w.k);
    else if (dtype == at::kBFloat16) bits == 4 ? dequant_rows<c10::BFloat16, 4>(w, a, b, out.data_ptr<c10::BFloat16>() + a * w.k)
                                               : dequant_rows<c10::BFloat16, 8>(w, a, b, out.data_ptr<c10::BFloat16>() + a * w.k);
    else bits == 4 ? dequant_rows<c10::Half, 4>(w, a, b, out.data_ptr<c10::Half>() + a * w.k)
                   : dequant_rows<c10::Half, 8>(w, a, b, out.data_ptr<c10::Half>() + a * w.k);
  });
  return out;
}

int64_t vector_bits() {
#if defined(__AVX512F__)
  return 512;
#elif defined(KVSERVE_AVX2)
  return 256;
#else
  return 0;
#endif
}

bool int8_x_serves(int64_t bits, int64_t group, int64_t k, bool coded) {
  return few_rows_kernel(bits, group, k, coded, true) != FewRows::kFloat;
}

bool has_int8_activations() {
#if defined(KVSERVE_VNNI) || defined(KVSERVE_AVX2)
  return true;
#else
  return false;
#endif
}

bool has_amx() {
#if defined(KVSERVE_AMX)
  return amx_ready();
#else
  return false;
#endif
}

// ---- one expert's projection in units of W's rows (ExpertStrips, for layers/csrc/moe.cpp) ----------
// quant_linear's few-row paths with x prepared once, as the whole-layer calls above prepare it, and
// W's rows cut into units of kStripRows that threads compute apart. Each row of W is summed in the
// same order whatever unit it falls in (the VNNI kernels take 4 rows of W per pass from the unit's
// start, as from the start of a parallel piece), so every channel is bitwise quant_linear's.
namespace {

constexpr int64_t kStripRows = 16;

// Sizes `s` for a weight of n rows taking `bytes` in all (every row the same share).
void set_units(ExpertStrips& s, int64_t n, int64_t bytes) {
  s.units = (n + kStripRows - 1) / kStripRows;
  s.unit_bytes = bytes / n * kStripRows;
  s.weight_bytes = bytes;
}

int64_t tensor_bytes(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->nbytes() : 0;
}

// The fused dequantize + dot loop (fused<BITS>): float32 x, float32 sums, rounded to y's dtype at the end.
template <int BITS>
class FusedStrips final : public ExpertStrips {
 public:
  FusedStrips(const QuantWeight& w, const at::Tensor& x, const at::Tensor& y)
      : w_(w), x32_(x.to(at::kFloat).contiguous()), y_(y), group_of_(half_chunk_groups(w)) {
    y32_ = y.scalar_type() == at::kFloat ? y : at::empty({x.size(0), w.n}, x32_.options());
  }
  void run(int64_t u0, int64_t u1) const override {
    const int64_t m = x32_.size(0), n0 = u0 * kStripRows, n1 = std::min(w_.n, u1 * kStripRows);
    const float* xp = x32_.data_ptr<float>();
    float* yp = y32_.data_ptr<float>();
    for (int64_t m0 = 0; m0 < m; m0 += kFusedRows)
      fused_block<BITS>(w_, group_of_.data(), xp + m0 * w_.k, w_.k, std::min<int64_t>(kFusedRows, m - m0), n0, n1,
                        yp + m0 * w_.n, w_.n);
  }
  void finish() override {
    if (!y32_.is_same(y_)) y_.copy_(y32_);
  }

 private:
  QuantWeight w_;
  at::Tensor x32_, y_, y32_;
  std::vector<int32_t> group_of_;
};

#if defined(KVSERVE_VNNI)
// int4_fused: x quantized to int8 blocks once, as int4_fused does.
template <typename T, bool CODED, bool SPLIT>
class Int4Strips final : public ExpertStrips {
 public:
  Int4Strips(const QuantWeight& w, const at::Tensor& x, const at::Tensor& y)
      : w_(w), m_(x.size(0)), blocks_((w.k / 32 + 3) / 4), gpad_((w.groups() + 15) / 16 * 16),
        y_(y.data_ptr<T>()) {
    const int64_t lane_vecs = blocks_ * sizeof(BlockLanes) / 64, x_vecs = m_ * blocks_ * sizeof(QBlock) / 64;
    scratch_.resize(lane_vecs + x_vecs + m_ * gpad_ / 16);
    lanes_ = reinterpret_cast<BlockLanes*>(scratch_.data());
    xq_ = reinterpret_cast<QBlock*>(scratch_.data() + lane_vecs);
    xsum_ = reinterpret_cast<float*>(scratch_.data() + lane_vecs + x_vecs);
    block_lanes(w, lanes_, blocks_);
    const T* xp = x.data_ptr<T>();
    for (int64_t r = 0; r < m_; ++r)
      quantize_x(xp + r * w.k, w.k, w.group, blocks_, xq_ + r * blocks_, xsum_ + r * gpad_, gpad_);
  }
  void run(int64_t u0, int64_t u1) const override {
    const int64_t n0 = u0 * kStripRows, n1 = std::min(w_.n, u1 * kStripRows);
    for (int64_t m0 = 0; m0 < m_; m0 += kVnniRows)
      with_few_rows<kVnniRows>(std::min<int64_t>(kVnniRows, m_ - m0), [&](auto mb) {
        int4_block<T, CODED, SPLIT, decltype(mb)::value>(w_, lanes_, blocks_, xq_ + m0 * blocks_, xsum_ + m0 * gpad_,
                                                         gpad_, n0, n1, y_ + m0 * w_.n, w_.n);
      });
  }

 private:
  QuantWeight w_;
  int64_t m_, blocks_, gpad_;
  T* y_;
  std::vector<__m512i> scratch_;
  BlockLanes* lanes_;
  QBlock* xq_;
  float* xsum_;
};

template <typename T>
std::unique_ptr<ExpertStrips> int4_strips(const QuantWeight& w, const at::Tensor& x, const at::Tensor& y) {
  const bool split = w.group % 32 != 0;
  if (w.factors) {
    if (split) return std::make_unique<Int4Strips<T, true, true>>(w, x, y);
    return std::make_unique<Int4Strips<T, true, false>>(w, x, y);
  }
  if (split) return std::make_unique<Int4Strips<T, false, true>>(w, x, y);
  return std::make_unique<Int4Strips<T, false, false>>(w, x, y);
}

// int8_fused: its lane table and x offset by 128, built as int8_fused builds them.
template <typename T>
class Int8Strips final : public ExpertStrips {
 public:
  Int8Strips(const QuantWeight& w, const at::Tensor& x, const at::Tensor& y)
      : w_(w), m_(x.size(0)), blocks_((w.k + 63) / 64), gpad_((w.groups() + 15) / 16 * 16), y_(y.data_ptr<T>()),
        xq_(m_) {
    const int64_t lane_vecs = blocks_ * sizeof(Int8Block) / 64;
    scratch_.resize(lane_vecs + m_ * 2 * blocks_ + m_ * gpad_ / 16);
    lanes_ = reinterpret_cast<Int8Block*>(scratch_.data());
    xsum_ = reinterpret_cast<float*>(scratch_.data() + lane_vecs + m_ * 2 * blocks_);
    for (int64_t b = 0; b < blocks_; ++b) {
      Int8Block& L = lanes_[b];
      L.g0 = static_cast<int32_t>(64 * b / w.group);
      const int64_t end = std::min(w.groups(), (std::min(64 * b + 64, w.k) - 1) / w.group + 1);
      L.pmask = static_cast<__mmask8>((1u << (end - L.g0)) - 1);
      const int64_t bytes = std::min<int64_t>(64, w.k - 64 * b);
      L.wmask = bytes == 64 ? ~0ull : (1ull << bytes) - 1;
      for (int i = 0; i < 16; ++i)
        L.group[i] = 64 * b + 4 * i < w.k ? static_cast<int32_t>((64 * b + 4 * i) / w.group - L.g0) : 0;
    }
    const T* xp = x.data_ptr<T>();
    for (int64_t r = 0; r < m_; ++r) {
      __m512i* row = scratch_.data() + lane_vecs + r * 2 * blocks_;
      xq_[r] = Int8X{reinterpret_cast<uint8_t*>(row), reinterpret_cast<float*>(row + blocks_)};
      quantize_x_u8(xp + r * w.k, w.k, w.group, blocks_, xq_[r], xsum_ + r * gpad_, gpad_);
    }
  }
  void run(int64_t u0, int64_t u1) const override {
    const int64_t n0 = u0 * kStripRows, n1 = std::min(w_.n, u1 * kStripRows), n4 = n0 + (n1 - n0) / 4 * 4;
    for (int64_t m0 = 0; m0 < m_; m0 += kVnniRows)
      with_few_rows<kVnniRows>(std::min<int64_t>(kVnniRows, m_ - m0), [&](auto mb) {
        constexpr int MB = decltype(mb)::value;
        const Int8X* xm = xq_.data() + m0;
        const float* sm = xsum_ + m0 * gpad_;
        int8_rows<T, MB, vnni_w_rows(MB)>(w_, lanes_, blocks_, xm, sm, gpad_, n0, n4, y_ + m0 * w_.n, w_.n);
        int8_rows<T, MB, 1>(w_, lanes_, blocks_, xm, sm, gpad_, n4, n1, y_ + m0 * w_.n, w_.n);
      });
  }

 private:
  QuantWeight w_;
  int64_t m_, blocks_, gpad_;
  T* y_;
  std::vector<__m512i> scratch_;
  Int8Block* lanes_;
  float* xsum_;
  std::vector<Int8X> xq_;
};
#endif

}  // namespace

// The kernel quant_linear runs for few rows (few_rows_kernel, x.size(0) <= max_fused_rows) in its
// strips form. Kernels without one (float32 x on VNNI, AVX2's integers) return nullptr: the expert
// then runs alone.
std::unique_ptr<ExpertStrips> quant_strips(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                           const c10::optional<at::Tensor>& zeros,
                                           const c10::optional<at::Tensor>& factors, int64_t group, int64_t bits,
                                           int64_t max_fused_rows, bool quantize_x, const at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] matrix");
  const at::Tensor q = qweight.scalar_type() == at::kChar ? qweight.view(at::kByte) : qweight;
  if (q.dim() == 3) return nullptr;  // W repacked as strips: quant_linear's strip kernels, alone
  const QuantWeight w = check_weight(q, scales, zeros, factors, group, bits);
  TORCH_CHECK(x.size(1) == w.k, "x has ", x.size(1), " features, the weight ", w.k);
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == x.scalar_type() && y.size(0) == x.size(0) && y.size(1) == w.n,
              "y must be a contiguous [M, N] matrix of x's dtype");
  if (x.size(0) == 0 || x.size(0) > max_fused_rows) return nullptr;
  std::unique_ptr<ExpertStrips> out;
  [[maybe_unused]] const at::ScalarType t = x.scalar_type();
  switch (few_rows_kernel(w, bits, quantize_x)) {
#if defined(KVSERVE_VNNI)
    case FewRows::kInt4Vnni:
      if (t == at::kBFloat16) out = int4_strips<c10::BFloat16>(w, x, y);
      else if (t == at::kHalf) out = int4_strips<c10::Half>(w, x, y);
      else return nullptr;  // float32 x in integers
      break;
    case FewRows::kInt8Vnni:
      if (t == at::kBFloat16) out = std::make_unique<Int8Strips<c10::BFloat16>>(w, x, y);
      else if (t == at::kHalf) out = std::make_unique<Int8Strips<c10::Half>>(w, x, y);
      else return nullptr;
      break;
#endif
    case FewRows::kIntAvx2: return nullptr;
    default:
      if (bits == 4) out = std::make_unique<FusedStrips<4>>(w, x, y);
      else out = std::make_unique<FusedStrips<8>>(w, x, y);
  }
  set_units(*out, w.n, q.nbytes() + scales.nbytes() + tensor_bytes(zeros) + tensor_bytes(factors));
  return out;
}

// dense_linear's fused loop (x.size(0) <= max_fused_rows).
std::unique_ptr<ExpertStrips> dense_strips(const at::Tensor& x, const at::Tensor& weight, int64_t max_fused_rows,
                                           const at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] matrix");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16,
              "weight must be a contiguous bfloat16 [N, K] matrix");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.size(1) == k && k % 32 == 0, "x has ", x.size(1), " features, the weight ", k, " (a multiple of 32)");
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == x.scalar_type() && y.size(0) == x.size(0) && y.size(1) == n,
              "y must be a contiguous [M, N] matrix of x's dtype");
  if (x.size(0) == 0 || x.size(0) > max_fused_rows) return nullptr;
  const QuantWeight w{{static_cast<const uint8_t*>(weight.data_ptr()), nullptr, nullptr, nullptr, n, k, k}};
  auto out = std::make_unique<FusedStrips<16>>(w, x, y);
  set_units(*out, n, weight.nbytes());
  return out;
}
