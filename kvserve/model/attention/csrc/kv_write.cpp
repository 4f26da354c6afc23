// Writing a step's new keys and values into the paged KV cache, for the eager backend and the fused
// decoder alike: the cache is [2 (K, V), num_blocks, block_size, Hkv, D] in the model dtype (kind 0),
// or uint8 rows of D values and a float16 scale for int8 (1) / fp8 e4m3 (2).
#include "kernels.h"
#include "simd.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// x / step for n values, as IEEE divisions: under -ffast-math the compiler may turn divisions by one
// value into multiplications by its reciprocal, which round differently on ties (x / step = k + 0.5
// exactly is common), so the divisor is laundered through an empty asm statement before each use.
void divide(const float* x, float step, int64_t n, float* out) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= n; d += 16) {
    __m512 s = _mm512_set1_ps(step);
    __asm__("" : "+v"(s));
    _mm512_storeu_ps(out + d, _mm512_div_ps(_mm512_loadu_ps(x + d), s));
  }
#endif
  for (; d < n; ++d) {
    float s = step;
    __asm__("" : "+x"(s));
    out[d] = x[d] / s;
  }
}

// n values, `stride` apart, as float32.
template <typename T>
void to_float(const T* in, int64_t stride, int64_t n, float* out) {
  int64_t d = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>)
    if (stride == 1)
      for (; d + 16 <= n; d += 16) _mm512_storeu_ps(out + d, simd::load16(in + d));
#endif
  for (; d < n; ++d) out[d] = static_cast<float>(in[d * stride]);
}

// One row of n floats -> n int8 (kind 1) or e4m3 (kind 2) bytes and the float16 scale after them.
void quantize_row(const float* x, float* q, int64_t n, float max, int64_t kind, uint8_t* row) {
  float amax = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  amax = _mm512_reduce_max_ps(m);
#endif
  for (; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const c10::Half scale(std::max(amax / max, std::ldexp(1.f, -24)));
  divide(x, static_cast<float>(scale), n, q);
  int64_t d = 0;
  if (kind == 1) {
#if defined(__AVX512F__)
    for (; d + 16 <= n; d += 16) {
      const __m512 r = _mm512_roundscale_ps(_mm512_loadu_ps(q + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 c = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row + d), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c)));
    }
#endif
    for (; d < n; ++d)
      row[d] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::nearbyint(q[d]), -127.f, 127.f)));
  } else {
    for (; d < n; ++d) row[d] = c10::Float8_e4m3fn(std::clamp(q[d], -448.f, 448.f)).x;
  }
  std::memcpy(row + n, &scale.x, 2);
}

}  // namespace

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache, const at::Tensor& slots,
                    int64_t kv_kind) {
  TORCH_CHECK(kv_kind >= 0 && kv_kind <= 2, "unknown KV cache kind ", kv_kind);
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && cache.dim() == 5 && cache.size(0) == 2 &&
                  cache.size(3) == k.size(1) && cache.size(4) == k.size(2) + (kv_kind == 0 ? 0 : 2),
              "k, v [T, Hkv, D] do not match the cache [2, blocks, block_size, Hkv, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "one int64 slot per token");
  TORCH_CHECK(cache.is_contiguous(), "the KV cache must be contiguous");
  const int64_t tokens = k.size(0), num_kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t num_slots = cache.size(1) * cache.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " is outside the KV cache (", num_slots, ")");
  if (kv_kind == 0) {  // a row copy per token: k and v may be views into the qkv output, rows of Hkv * D
    TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(),
                "the KV cache must be in the dtype of k and v");
    TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == head_dim && v.stride(2) == 1 && v.stride(1) == head_dim,
                "each token's k and v heads must be contiguous");
    const int64_t row_bytes = num_kv_heads * head_dim * k.element_size();
    auto* base = static_cast<char*>(cache.data_ptr());
    const auto* k_base = static_cast<const char*>(k.data_ptr());
    const auto* v_base = static_cast<const char*>(v.data_ptr());
    const int64_t half_bytes = num_slots * row_bytes, k_step = k.stride(0) * k.element_size(),
                  v_step = v.stride(0) * v.element_size();
    // Two threads for a prefill's rows (a decode step's few rows are not worth the wake-up).
    parallel_for_dynamic(0, tokens, 256, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        std::memcpy(base + slot[t] * row_bytes, k_base + t * k_step, row_bytes);
        std::memcpy(base + half_bytes + slot[t] * row_bytes, v_base + t * v_step, row_bytes);
      }
    });
    return;
  }
  // int8 / fp8 rows: D one-byte values and a float16 scale per (token, head), computed exactly as
  // KVQuantFormat.quantize does (float32 max|x| / max, float16 scale, x / scale rounded half to even
  // or converted to e4m3), so both write the same bytes; here one pass per row, 16 values at a
  // time, instead of ~10 tensor ops per call, which cost a noticeable share of a batched decode step.
  TORCH_CHECK(cache.scalar_type() == at::kByte, "an int8 / fp8 KV cache holds uint8 rows");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v must have one dtype");
  const float max = kv_kind == 1 ? 127.f : 448.f;
  const int64_t row_bytes = head_dim + 2, half_rows = num_slots * num_kv_heads;
  auto* base = cache.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_cache", [&] {
    std::vector<float> x(head_dim), q(head_dim);
    for (int64_t half = 0; half < 2; ++half) {
      const at::Tensor& src = half ? v : k;
      const auto* sp = src.data_ptr<scalar_t>();
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const scalar_t* in = sp + t * src.stride(0) + h * src.stride(1);
          to_float(in, src.stride(2), head_dim, x.data());
          uint8_t* row = base + ((half * half_rows) + slot[t] * num_kv_heads + h) * row_bytes;
          quantize_row(x.data(), q.data(), head_dim, max, kv_kind, row);
        }
    }
  });
}
