// A quantized W's per-group scales and zero points as floats, one row at a time: what the kernels of
// quant/csrc (quant_linear.cpp, and quant_linear_avx2.cpp on AVX2) apply to each group of a row.
#pragma once

#include "kernels.h"
#include "simd.h"

#include <c10/util/Half.h>

#include <algorithm>

// fp16 -> float for one row's scales or zeros (c10::Half's own conversion is bit-twiddling in software).
inline void half_to_float(const c10::Half* src, int64_t count, float* dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= count; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif defined(KVSERVE_AVX2)
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(dst + i, simd::load8(src + i));
#endif
  for (; i < count; ++i) dst[i] = static_cast<float>(src[i]);
}

// One row's scales into scales[0, groups) and zero points into zeros[0, groups) (0 without them):
// the row's groups sit `stride` elements apart from element `at` of the stored scales and zeros (1 in
// a row-major table, 16 in a strip's lane); codes are multiplied by the row's steps fs and fz.
inline void scales_zeros_at(const QuantWeightRef& w, int64_t at, int64_t stride, float fs, float fz, float* scales,
                            float* zeros) {
  const int64_t g = w.k / w.group;
  if (w.factors) {
    const uint8_t* sc = static_cast<const uint8_t*>(w.scales) + at;
    for (int64_t i = 0; i < g; ++i) scales[i] = sc[i * stride] * fs;
    if (w.zeros) {
      const int8_t* zc = static_cast<const int8_t*>(w.zeros) + at;
      for (int64_t i = 0; i < g; ++i) zeros[i] = zc[i * stride] * fz;
    } else {
      std::fill(zeros, zeros + g, 0.f);
    }
    return;
  }
  const auto to_float = [&](const void* stored, float* dst) {
    const c10::Half* src = static_cast<const c10::Half*>(stored) + at;
    if (stride == 1) half_to_float(src, g, dst);
    else for (int64_t i = 0; i < g; ++i) dst[i] = static_cast<float>(src[i * stride]);
  };
  to_float(w.scales, scales);
  if (w.zeros) to_float(w.zeros, zeros);
  else std::fill(zeros, zeros + g, 0.f);
}

// Row n of a row-major W: its groups side by side, its code steps at factors[2n], factors[2n + 1].
inline void row_scales_zeros(const QuantWeightRef& w, int64_t n, float* scales, float* zeros) {
  const bool coded = w.factors != nullptr;
  scales_zeros_at(w, n * (w.k / w.group), 1, coded ? w.factors[2 * n] : 0.f, coded ? w.factors[2 * n + 1] : 0.f,
                  scales, zeros);
}
