// SIMD and AMX helpers shared by the kernels (elementwise, quant_linear, kv_write, paged_decode, paged_prefill).
#pragma once
#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// AVX2 + FMA + F16C without AVX-512 (AMD Zen 1-3, Intel before Skylake-SP): 8-lane versions of the
// hot loops. A CPU with AVX-512 takes the 16-lane code instead.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define KVSERVE_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KVSERVE_BF16 1  // bf16 dot products in vector registers (vdpbf16ps)
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVSERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace simd {

// A std::vector whose data starts on a cache line. AMX tile loads and stores from a buffer that is
// not 64-byte aligned split every tile row over two lines and ran 2-3x slower here (a tile multiply
// with its operands loaded from malloc's 16-byte-aligned memory: 40 cycles, aligned: 14-19).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using aligned_vector = std::vector<T, CacheLineAllocator<T>>;

#if defined(__AVX512F__)
// 2^x for x <= 0, ~2e-7 relative error: 2^x = 2^n * 2^f, n = round(x), |f| <= 1/2, 2^f by its
// degree-6 Taylor polynomial. x is clamped at -200 first, so -inf gives 0 rather than NaN.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-200.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);                   // ln2^6 / 6!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));   // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));   // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));   // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));   // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));   // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 16 values as float32, whatever the dtype in memory (bf16: the high half of a float32).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// float32 -> bf16 (round to nearest even) in the high halves; finite values only, which activations are.
inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}

// exp(x) for x <= 0 to about 2e-7 relative: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], the
// polynomial of elementwise.cpp's scalar exp_nonpositive, 2^n applied by scalef.
inline __m512 exp16_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// x / (1 + exp(-x)) for 16 values, with exp only of non-positive arguments (no overflow).
inline __m512 silu16(__m512 x) {
  const __m512 e = exp16_nonpositive(_mm512_min_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), x)));  // exp(-|x|)
  const __m512 num = _mm512_mask_mul_ps(x, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LE_OQ), x, e);
  // num / d by a 14-bit reciprocal and one Newton step (~2^-28 relative error, below float32's
  // rounding): a 16-wide division costs ~16 cycles, a sixth of a 2,048-token SiLU * up.
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e), r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(num, _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f))));
}

// silu_mul's bf16 arithmetic for 16 values of gate and of up (bf16 values as float32): SiLU(gate)
// rounded to bf16, times up, rounded to bf16. Inline: the packed kernels' epilogues call it per 16
// values (a call across translation units was 6-7% of a prefill step's samples).
inline __m256i silu_mul16_bf16(__m512 gate, __m512 up) {
  const __m512 g = _mm512_castsi512_ps(_mm512_and_si512(bf16_bits(silu16(gate)), _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(_mm512_mul_ps(g, up)), 16));
}

// 16 int8 cache values as float32.
inline __m512 int8x16_to_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// 16 float8 e4m3 cache values as float32 times 2^-8: e4m3 (bias 7) -> float16 (bias 15) by moving the
// exponent and mantissa bits into place, exact for normal and subnormal inputs alike.
inline __m512 fp8x16_to_ps_div256(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return _mm512_cvtph_ps(h);
}

// 16 x 16 transpose of 32-bit elements: r[i] holds row i, afterwards r[j] holds column j.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  for (int i = 0; i < 16; i += 4) {  // r[i + c], lane L = rows i..i+3 at column 4L + c
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // 4 x 4 transpose of 128-bit lanes across r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44), y1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(x0, y0, 0x88), t[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88), t[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif

#if defined(KVSERVE_AVX2)
// 8 values as float32, whatever the dtype in memory (bf16: the high half of a float32).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// float32 -> bf16 bits (round to nearest even) in the high halves; finite values only.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
}
// v rounded to bf16, as float32.
inline __m256 round8_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_and_si256(bf16_bits8(v), _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u))));
}
// 8 values stored in the dtype (bf16 and float16 rounded to nearest even).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  // NaN is stored as torch stores it (0x7fc0): rounding its bits could carry into the sign
  const __m256i rounded = _mm256_blendv_epi8(bf16_bits8(v), _mm256_set1_epi32(0x7fc00000),
                                             _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i h = _mm256_srli_epi32(rounded, 16);  // 0..65535 in each int32 lane
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 to about 2e-7 relative (elementwise.cpp's exp_nonpositive, 8 lanes): 2^n * p(r).
inline __m256 exp8_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// 2^x for -126 <= x <= 0 (exp2_ps's polynomial, 8 lanes): 2^n by the exponent bits, n = round(x).
inline __m256 exp2_8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.5403530e-4f);
  for (const float c : {1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.f})
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// x / (1 + exp(-x)) for 8 values, exp only of non-positive arguments (no overflow); a true division.
inline __m256 silu8(__m256 x) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 e = exp8_nonpositive(_mm256_min_ps(x, _mm256_sub_ps(zero, x)));  // exp(-|x|)
  const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), _mm256_cmp_ps(x, zero, _CMP_LE_OQ));
  return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
// silu_mul's bf16 arithmetic for 8 values of gate and up (bf16 values as float32): SiLU(gate) rounded
// to bf16, times up (then rounded by the store).
inline __m256 silu_mul8_bf16(__m256 gate, __m256 up) { return _mm256_mul_ps(round8_bf16(silu8(gate)), up); }
#endif  // KVSERVE_AVX2

#if defined(KVSERVE_AMX)
inline bool amx_ready() {  // Linux hands out the AMX register state only on request (once per process)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes: a C tile of 16 x 16 float32, an A tile of 16 rows x 32 bf16, or a
// B tile of 16 VNNI rows (pairs of bf16) x 16 columns. Per thread, before its first tile op.
// The config is a static, built once: GCC does not treat ldtilecfg as reading its operand, and
// scheduled it ahead of a stack copy's initialisation when inlined (a #GP on reserved bytes).
inline void configure_tiles() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    return c;
  }();
  _tile_loadconfig(&cfg);
}

// Nothing to do between the chunks of amx_2x2.
struct NoChunkWork {
  void operator()(int64_t) const {}
};

// The 2 x 2 bf16 tile multiply over `chunks` steps of 32 inputs: C[2 i + j] = sum_c A_i(c) B_j(c) for
// i < na A tiles (tile c of A_i at a[i] + c * a_step values, its 16 rows `a_stride` bytes apart)
// and j < nb B tiles (VNNI, tile c of B_j the 1 KB at b[j] + c * 512). Four independent
// accumulators (tiles 0-3; A in 4, 5, B in 6, 7), so the multiplies overlap; each C tile (16 x 16
// float32) is stored at cbuf + (2 i + j) * 256. The tiles must be configured (configure_tiles).
// B0 is loaded first and A1 before B1 (the last multiply's operands last): with B from L2 this
// order ran 13% faster than A0, B0, B1, A1. `each_chunk(c)` runs after chunk c's multiplies are
// issued: vector work placed there (the previous result's conversion, say) overlaps the tile unit's.
template <typename F = NoChunkWork>
inline void amx_2x2(const uint16_t* const a[2], int64_t a_step, int64_t a_stride, int na, const uint16_t* const b[2],
                    int nb, int64_t chunks, float* cbuf, const F& each_chunk = {}) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(6, b[0] + c * 512, 64);
    _tile_loadd(4, a[0] + c * a_step, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    if (na > 1) { _tile_loadd(5, a[1] + c * a_step, a_stride); _tile_dpbf16ps(2, 5, 6); }
    if (nb > 1) {
      _tile_loadd(7, b[1] + c * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (na > 1) _tile_dpbf16ps(3, 5, 7);
    }
    each_chunk(c);
  }
  _tile_stored(0, cbuf, 64);
  if (nb > 1) _tile_stored(1, cbuf + 256, 64);
  if (na > 1) _tile_stored(2, cbuf + 512, 64);
  if (na > 1 && nb > 1) _tile_stored(3, cbuf + 768, 64);
}
#endif

}  // namespace simd
