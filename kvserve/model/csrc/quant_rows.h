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

// Row n's scales into scales[0, groups) and zero points into zeros[0, groups) (0 without them).
inline void row_scales_zeros(const QuantWeightRef& w, int64_t n, float* scales, float* zeros) {
  const int64_t g = w.k / w.group;
  if (w.factors) {
    const uint8_t* sc = static_cast<const uint8_t*>(w.scales) + n * g;
    const float fs = w.factors[2 * n], fz = w.factors[2 * n + 1];
    for (int64_t i = 0; i < g; ++i) scales[i] = sc[i] * fs;
    if (w.zeros) {
      const int8_t* zc = static_cast<const int8_t*>(w.zeros) + n * g;
      for (int64_t i = 0; i < g; ++i) zeros[i] = zc[i] * fz;
    } else {
      std::fill(zeros, zeros + g, 0.f);
    }
    return;
  }
  half_to_float(static_cast<const c10::Half*>(w.scales) + n * g, g, scales);
  if (w.zeros) half_to_float(static_cast<const c10::Half*>(w.zeros) + n * g, g, zeros);
  else std::fill(zeros, zeros + g, 0.f);
}
