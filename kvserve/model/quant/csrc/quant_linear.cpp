// Weight-only quantized matmul for the CPU: y = x W^T, with W stored as int8 or packed int4 values
// plus fp16 scales (and optional fp16 zero points) per group of `group` inputs:
//     w[n][k] = q[n][k] * scale[n][k / group] + zero[n][k / group]
//
// int8: qweight int8 [N, K].
// int4: qweight uint8 [N, K / 2]. Each row is cut into chunks of 32 values; chunk c is bytes
//       16c .. 16c + 15, byte 16c + j holding value 32c + j in its low nibble and 32c + 16 + j in
//       its high nibble (llama.cpp's Q4_0 order, so GGUF Q4 blocks copy straight in).
//
// Few rows of x (decode): a fused kernel dequantizes each weight once, in registers, and uses it for
// up to kFusedRows rows of x; memory traffic is the packed weight only.
// Many rows (prefill): dequantize a tile of W into x's dtype and hand it to at::mm (oneDNN; AMX
// for bf16), so the dequantization is amortised over every row of x.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kFusedRows = 4;  // rows of x that share one pass over the weights

struct QuantWeight {
  const uint8_t* data;
  const c10::Half* scales;
  const c10::Half* zeros;  // nullptr: no zero points
  int64_t n, k, group;
  int64_t row_bytes(int bits) const { return bits == 4 ? k / 2 : k; }
  int64_t groups() const { return k / group; }
};

// fp16 -> float for one row's scales or zeros (c10::Half's own conversion is bit-twiddling in software).
inline void half_to_float(const c10::Half* src, int64_t count, float* dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= count; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
  for (; i < count; ++i) dst[i] = static_cast<float>(src[i]);
}

// Float scales and zeros of row n, converted once per row into `buf` (2 * groups floats).
inline void row_params(const QuantWeight& w, int64_t n, float* buf) {
  const int64_t g = w.groups();
  half_to_float(w.scales + n * g, g, buf);
  if (w.zeros) half_to_float(w.zeros + n * g, g, buf + g);
  else std::fill(buf + g, buf + 2 * g, 0.f);
}

// ---- fused dequantize + dot, rows [n0, n1) of W against MB rows of x (float32) ----------------------
#if defined(__AVX512F__)
template <int BITS, int MB>
void fused_rows(const QuantWeight& w, const float* x, int64_t ldx, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t num_groups = w.groups();
  const __m512i low_nibble = _mm512_set1_epi32(15);
  std::vector<float> params(2 * num_groups);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.data + n * w.row_bytes(BITS);
    row_params(w, n, params.data());
    __m512 acc0[MB], acc1[MB];
    for (int m = 0; m < MB; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < num_groups; ++g) {
      const __m512 s = _mm512_set1_ps(params[g]);
      const __m512 z = _mm512_set1_ps(params[num_groups + g]);
      const int64_t k_end = (g + 1) * w.group;
      int64_t k = g * w.group;
      for (; k + 32 <= k_end; k += 32) {
        __m512 lo, hi;
        if (BITS == 4) {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)));
          lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low_nibble)), s, z);
          hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s, z);
        } else {
          const __m512i v0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)));
          const __m512i v1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + 16)));
          lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v0), s, z);
          hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v1), s, z);
        }
        for (int m = 0; m < MB; ++m) {
          acc0[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + m * ldx + k), acc0[m]);
          acc1[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + m * ldx + k + 16), acc1[m]);
        }
      }
      if (k < k_end) {  // int8 groups of 16 (GGUF Q6_K)
        const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)));
        const __m512 wv = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s, z);
        for (int m = 0; m < MB; ++m) acc0[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * ldx + k), acc0[m]);
      }
    }
    for (int m = 0; m < MB; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
  }
}
#endif

// Value k of row `row` as an integer (int4 values are 0..15, int8 values -128..127).
template <int BITS>
inline int value_at(const uint8_t* row, int64_t k) {
  if (BITS == 8) return static_cast<int8_t>(row[k]);
  const int64_t chunk = k / 32, j = k % 32;
  const uint8_t byte = row[chunk * 16 + (j % 16)];
  return j < 16 ? (byte & 15) : (byte >> 4);
}

template <int BITS>
void fused_rows_scalar(const QuantWeight& w, const float* x, int64_t ldx, int64_t mb, int64_t n0, int64_t n1,
                       float* y, int64_t ldy) {
  const int64_t num_groups = w.groups();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.data + n * w.row_bytes(BITS);
    for (int64_t m = 0; m < mb; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < num_groups; ++g) {
        const float s = w.scales[n * num_groups + g], z = w.zeros ? float(w.zeros[n * num_groups + g]) : 0.f;
        for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k) acc += (value_at<BITS>(row, k) * s + z) * x[m * ldx + k];
      }
      y[m * ldy + n] = acc;
    }
  }
}

template <int BITS>
void fused_block(const QuantWeight& w, const float* x, int64_t ldx, int64_t mb, int64_t n0, int64_t n1, float* y,
                 int64_t ldy) {
#if defined(__AVX512F__)
  if (w.group % 16 == 0 && (BITS == 8 || w.group % 32 == 0)) {
    switch (mb) {
      case 1: return fused_rows<BITS, 1>(w, x, ldx, n0, n1, y, ldy);
      case 2: return fused_rows<BITS, 2>(w, x, ldx, n0, n1, y, ldy);
      case 3: return fused_rows<BITS, 3>(w, x, ldx, n0, n1, y, ldy);
      default: return fused_rows<BITS, 4>(w, x, ldx, n0, n1, y, ldy);
    }
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
  at::parallel_for(0, w.n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < m; m0 += kFusedRows)
      fused_block<BITS>(w, xp + m0 * w.k, w.k, std::min<int64_t>(kFusedRows, m - m0), n0, n1, yp + m0 * w.n, w.n);
  });
  return y.to(x.scalar_type());
}

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
      for (; k + 32 <= k_end; k += 32) {
        if (BITS == 4) {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)));
          store16(dst + k, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), sv, zv));
          store16(dst + k + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), sv, zv));
        } else {
          for (int h = 0; h < 32; h += 16) {
            const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + h)));
            store16(dst + k + h, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), sv, zv));
          }
        }
      }
#endif
      for (; k < k_end; ++k) dst[k] = static_cast<T>(value_at<BITS>(row, k) * s + z);
    }
  }
}

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

template <int BITS>
at::Tensor tiled_any(const QuantWeight& w, const at::Tensor& x, int64_t tile_bytes) {
  switch (x.scalar_type()) {
    case at::kFloat: return tiled<float, BITS>(w, x, tile_bytes);
    case at::kBFloat16: return tiled<c10::BFloat16, BITS>(w, x, tile_bytes);
    case at::kHalf: return tiled<c10::Half, BITS>(w, x, tile_bytes);
    default: TORCH_CHECK(false, "quant_linear: x must be float32, bfloat16 or float16");
  }
}

QuantWeight check_weight(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                         int64_t group, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous(), "qweight and scales must be contiguous");
  TORCH_CHECK(scales.scalar_type() == at::kHalf, "scales must be float16");
  const int64_t n = qweight.size(0), k = bits == 4 ? qweight.size(1) * 2 : qweight.size(1);
  TORCH_CHECK(group > 0 && k % group == 0 && scales.size(0) == n && scales.size(1) == k / group, "bad group layout");
  TORCH_CHECK(bits == 8 || group % 32 == 0, "int4 groups must be multiples of 32");
  const c10::Half* zp = nullptr;
  if (zeros.has_value() && zeros->defined()) {
    TORCH_CHECK(zeros->is_contiguous() && zeros->scalar_type() == at::kHalf && zeros->sizes() == scales.sizes(),
                "zeros must be float16 shaped like scales");
    zp = zeros->data_ptr<c10::Half>();
  }
  return QuantWeight{qweight.data_ptr<uint8_t>(), scales.data_ptr<c10::Half>(), zp, n, k, group};
}

}  // namespace

// x: [M, K] float32/bfloat16/float16, contiguous. Returns [M, N] in x's dtype.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& zeros, int64_t group, int64_t bits, int64_t max_fused_rows,
                        int64_t tile_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] matrix");
  const at::Tensor q = qweight.scalar_type() == at::kChar ? qweight.view(at::kByte) : qweight;
  const QuantWeight w = check_weight(q, scales, zeros, group, bits);
  TORCH_CHECK(x.size(1) == w.k, "x has ", x.size(1), " features, the weight ", w.k);
  if (x.size(0) <= max_fused_rows) return bits == 4 ? fused<4>(w, x) : fused<8>(w, x);
  return bits == 4 ? tiled_any<4>(w, x, tile_bytes) : tiled_any<8>(w, x, tile_bytes);
}

// The dense [N, K] weight in `dtype` (tests and the embedding lookup use it).
at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                      int64_t group, int64_t bits, at::ScalarType dtype) {
  const at::Tensor q = qweight.scalar_type() == at::kChar ? qweight.view(at::kByte) : qweight;
  const QuantWeight w = check_weight(q, scales, zeros, group, bits);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "weight-only int8/int4 linear (CPU)");
  m.def("dequantize", &dequantize, "dequantize an int8/int4 weight (CPU)");
}
